"""PyTorch checkpoint files (``pytorch_model.bin``) read without torch: a restricted unpickler rebuilds each tensor
from its raw storage with numpy. Used by :func:`dpzero_jax.hf.read_state_dict`; the format and its checks are
described below."""

from __future__ import annotations

import collections
import io
import math
import pickle
import re
import reprlib
import sys
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["read_torch_file", "CheckpointFormatError"]

# ---------------------------------------------------------------- PyTorch's zip format, without torch
#
# ``torch.save`` writes a zip archive: ``<prefix>/data.pkl`` (a pickle whose tensors are calls of
# ``torch._utils._rebuild_tensor_v2(storage, offset, shape, strides, ...)`` on persistent ids
# ``("storage", torch.FloatStorage, key, location, numel)``), the raw storages ``<prefix>/data/<key>`` and
# ``<prefix>/byteorder``. Everything in it is untrusted: the pickle runs on the pure-Python unpickler with a whitelist
# of opcodes and of the three callables a state dict needs, nothing is read while unpickling, and every tensor's
# layout is checked against its storage (and the whole file's allocation against its size) before any byte is read.

class CheckpointFormatError(ValueError):
    """A PyTorch checkpoint that is damaged, malformed, or more than a plain state dict of tensors.

    Attributes ``file``, ``tensor`` (the state-dict name, or ``None`` when the problem is not one tensor's) and
    ``problem``; the message names all three.
    """

    def __init__(self, file, problem: str, tensor: str | None = None):
        self.file, self.tensor, self.problem = str(file), tensor, problem
        where = "" if tensor is None else f" tensor {_show(tensor)}:"
        super().__init__(f"{self.file}:{where} {problem}")


_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_, "BFloat16Storage": "bfloat16",
}
_MAX_PICKLE_BYTES = 1 << 28      # data.pkl holds names and layouts only: a few MB for the largest models
_MAX_NDIM = 64                   # numpy's limit
_MAX_INDEX = 1 << 62             # any size, stride, offset or byte count beyond this is absurd
_EXPANSION = 16                  # reading a file may allocate at most this many times its size ...
_MIN_BUDGET = 1 << 26            # ... or this many bytes, whichever is larger
_MAX_DEFLATE_RATIO = 1100        # deflate cannot exceed ~1032:1; an entry claiming more lies about its size
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")   # torch's pre-1.6 format starts with it
_STORAGE_KEY = re.compile(r"[0-9A-Za-z_]{1,64}")


def _show(value) -> str:
    """A short ``repr`` of an untrusted value (bounded length and depth)."""
    return reprlib.repr(value)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Problem(pickle.UnpicklingError):
    """A refusal inside the unpickler, about the tensor ``tensor`` when known."""

    def __init__(self, problem: str, tensor=None):
        super().__init__(problem)
        self.tensor = tensor if type(tensor) is str else None


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {_clip(str(error))}"


class _StorageType:
    """What ``torch.FloatStorage`` & co. unpickle to: the element type only."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str):
        dtype = _STORAGE_DTYPES[name]
        if dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        self.name, self.dtype = name, np.dtype(dtype)


class _StorageRef:
    """A storage named by the pickle (``data/<key>`` in the archive), not read yet."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: np.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRecord:
    """The unchecked arguments of one ``_rebuild_tensor_v2`` call."""

    __slots__ = ("args",)

    def __init__(self, args: tuple):
        self.args = args


class _Dict(dict):
    """Every mapping the unpickler builds (``OrderedDict`` included): a name set twice is refused."""

    def __init__(self):                      # no arguments: entries come in only through __setitem__
        super().__init__()

    def __setitem__(self, key, value):
        if key in self:
            raise _Problem(f"the name {_show(key)} appears twice", key)
        super().__setitem__(key, value)


def _rebuild_tensor(*args):
    return _TensorRecord(args)


def _rebuild_parameter(data, *args):
    return data


_GLOBALS = {("collections", "OrderedDict"): _Dict,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}
_CALLABLES = tuple(_GLOBALS.values())
_OPCODES = """PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4
    FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES
    SHORT_BINBYTES BINBYTES8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST APPEND APPENDS LIST EMPTY_DICT DICT
    SETITEM SETITEMS GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL REDUCE BUILD PERSID
    BINPERSID""".split()    # not INST OBJ NEWOBJ NEWOBJ_EX EXT1/2/4 (they create or look up objects), sets, buffers


def _refused_opcode(code: int):
    def load(self):
        raise pickle.UnpicklingError(f"pickle opcode {bytes([code])!r} is not allowed in a state dict")
    return load


class _StateDictUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcode table can be restricted
    """Unpickles ``data.pkl`` into records (no data is read): whitelisted opcodes, globals and calls only."""

    dispatch = {code: _refused_opcode(code) for code in range(256)}
    dispatch.update({getattr(pickle, name)[0]: pickle._Unpickler.dispatch[getattr(pickle, name)[0]]
                     for name in _OPCODES})

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, _StorageRef] = {}

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        raise pickle.UnpicklingError(f"the pickle asks for {_clip(f'{module}.{name}')}: only tensors, storages and "
                                     f"OrderedDict may appear (nothing is imported or called; convert other "
                                     f"checkpoints to safetensors with torch)")

    def persistent_load(self, pid):
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unsupported persistent id {_show(pid)}")
        _, storage_type, key, location, numel = pid
        if type(storage_type) is not _StorageType:
            raise pickle.UnpicklingError(f"storage type {_show(storage_type)} is not a torch storage type")
        if type(key) is not str or not _STORAGE_KEY.fullmatch(key) or type(location) is not str:
            raise pickle.UnpicklingError(f"malformed storage key or location in {_show(pid)}")
        if type(numel) is not int or not 0 <= numel <= _MAX_INDEX // storage_type.dtype.itemsize:
            raise pickle.UnpicklingError(f"storage {key!r} declares {_show(numel)} elements")
        ref = self.storages.setdefault(key, _StorageRef(key, storage_type.dtype, numel))
        if ref.dtype != storage_type.dtype or ref.numel != numel:
            raise pickle.UnpicklingError(f"storage {key!r} is declared as {ref.numel} x {ref.dtype} and as "
                                         f"{numel} x {storage_type.dtype}")
        return ref

    def load_empty_dictionary(self):
        self.append(_Dict())

    def load_dict(self):
        items, mapping = self.pop_mark(), _Dict()
        if len(items) % 2:
            raise pickle.UnpicklingError("DICT with an odd number of items")
        for i in range(0, len(items) - 1, 2):
            mapping[items[i]] = items[i + 1]
        self.append(mapping)

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is allowed for allowed in _CALLABLES) or type(args) is not tuple:
            raise pickle.UnpicklingError(f"the pickle calls {_show(func)}, which is not allowed")
        self.stack[-1] = func(*args)

    def load_build(self):
        state = self.stack.pop()
        if type(self.stack[-1]) is not _Dict or not (state is None or type(state) is _Dict):
            raise pickle.UnpicklingError(f"the pickle sets the state of {type(self.stack[-1]).__name__}, which is "
                                         f"not allowed")
        # an OrderedDict's attributes (a state dict's ``_metadata``): not needed, dropped

    def load_append(self):
        value = self.stack.pop()
        self._target(list, "APPEND").append(value)

    def load_appends(self):
        items = self.pop_mark()
        self._target(list, "APPENDS").extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(_Dict, "SETITEM")[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError("SETITEMS with an odd number of items")
        mapping = self._target(_Dict, "SETITEMS")
        for i in range(0, len(items), 2):
            mapping[items[i]] = items[i + 1]

    def _target(self, kind: type, opcode: str):
        """The object an APPEND/SETITEM modifies: only lists and our dicts (the generic unpickler would call
        ``append``/``extend``/``__setitem__`` of anything on the stack)."""
        target = self.stack[-1]
        if type(target) is not kind:
            raise pickle.UnpicklingError(f"{opcode} on {type(target).__name__} is not allowed")
        return target

    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.EMPTY_DICT[0]] = load_empty_dictionary
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build


def read_torch_file(file) -> dict[str, np.ndarray]:
    """A ``torch.save``'d state dict as ``{name: numpy array}``; the zip format is read without torch.

    Damaged or crafted files raise :class:`CheckpointFormatError` (a ``ValueError``) naming the file, the tensor and
    the problem; no code from the file runs and nothing is read outside a tensor's storage.
    """
    file = Path(file)
    with open(file, "rb") as stream:
        head = stream.read(32)
    if head.startswith(b"PK"):
        return _read_torch_zip(file)
    if _LEGACY_MAGIC in head:
        return _read_legacy_torch(file)
    raise CheckpointFormatError(file, "not a PyTorch checkpoint (neither torch.save's zip format nor its legacy "
                                      "format)")


def _read_torch_zip(file: Path) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(file)
    except Exception as error:  # noqa: BLE001 -- zipfile raises several types on damaged archives
        raise CheckpointFormatError(file, f"damaged or truncated zip archive ({_why(error)})") from None
    with archive:
        file_size = file.stat().st_size
        names = archive.namelist()
        if len(set(names)) != len(names):
            twice = sorted(name for name, count in collections.Counter(names).items() if count > 1)
            raise CheckpointFormatError(file, f"the archive holds several entries named {_show(twice[0])}")
        pickles = [name for name in names if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointFormatError(file, "not a PyTorch checkpoint (no single <name>/data.pkl in the archive)")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = "little"
        if f"{prefix}byteorder" in names:
            byteorder = _read_entry(archive, f"{prefix}byteorder", file, file_size, limit=16).decode("ascii",
                                                                                                   "replace").strip()
            if byteorder not in ("little", "big"):
                raise CheckpointFormatError(file, f"byteorder {_show(byteorder)} is neither 'little' nor 'big'")
        unpickler = _StateDictUnpickler(_read_entry(archive, pickles[0], file, file_size, limit=_MAX_PICKLE_BYTES))
        try:
            state = unpickler.load()
        except Exception as error:  # noqa: BLE001 -- any failure of a malformed pickle: one clear message
            raise CheckpointFormatError(file, f"malformed or disallowed pickle in {pickles[0]} ({_why(error)})",
                                        getattr(error, "tensor", None)) from None
        return _materialise(state, archive, prefix, byteorder, file, file_size)


def _read_entry(archive: zipfile.ZipFile, name: str, file: Path, file_size: int, *, size: int | None = None,
                limit: int | None = None, tensor: str | None = None) -> bytes:
    """One archive entry, after checking its declared sizes against the file and ``size``/``limit``."""
    def refuse(problem):
        return CheckpointFormatError(file, f"archive entry {name!r}: {problem}", tensor)

    try:
        info = archive.getinfo(name)
    except KeyError:
        raise CheckpointFormatError(file, f"the archive has no entry {name!r}", tensor) from None
    if info.flag_bits & 0x1:
        raise refuse("encrypted")
    if info.compress_type == zipfile.ZIP_STORED:
        if info.compress_size != info.file_size:
            raise refuse(f"stored uncompressed, yet declares {info.file_size} bytes in {info.compress_size}")
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        if info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 1024:
            raise refuse(f"declares {info.file_size} bytes from {info.compress_size} compressed (a zip bomb?)")
    else:
        raise refuse(f"unsupported compression method {info.compress_type}")
    if info.header_offset + info.compress_size > file_size:
        raise refuse(f"declares {info.compress_size} bytes at offset {info.header_offset}, beyond the end of the "
                     f"{file_size}-byte file (truncated?)")
    if size is not None and info.file_size != size:
        raise refuse(f"holds {info.file_size} bytes where its storage declares {size}")
    if limit is not None and info.file_size > limit:
        raise refuse(f"holds {info.file_size} bytes, more than the {limit} allowed")
    try:
        data = archive.read(info)
    except Exception as error:  # noqa: BLE001 -- bad CRC, truncated stream, bad local header, ...
        raise refuse(f"cannot be read ({_why(error)})") from None
    if len(data) != info.file_size:
        raise refuse(f"holds {len(data)} bytes, not the {info.file_size} declared")
    return data


def _layout(record: _TensorRecord, name: str, file: Path):
    """``(storage, offset, shape, strides in elements, element count)`` of a tensor, checked against its storage."""
    def refuse(problem):
        return CheckpointFormatError(file, problem, name)

    args = record.args
    if not 4 <= len(args) <= 7:
        raise refuse(f"_rebuild_tensor_v2 takes 4 to 7 arguments, got {len(args)}")
    storage, offset, shape, strides = args[:4]
    if type(storage) is not _StorageRef:
        raise refuse(f"its storage is {type(storage).__name__}, not a storage reference")
    if len(args) > 4 and type(args[4]) is not bool:
        raise refuse(f"requires_grad is {_show(args[4])}, not a bool")
    if len(args) > 5 and not (args[5] is None or (type(args[5]) is _Dict and not args[5])):
        raise refuse("it carries backward hooks, which are not supported")
    if len(args) > 6 and not (args[6] is None or type(args[6]) is _Dict):
        raise refuse(f"its metadata is {type(args[6]).__name__}, not a dict")
    if type(offset) is not int or not 0 <= offset <= _MAX_INDEX:
        raise refuse(f"storage offset {_show(offset)} is not an integer in [0, 2**62]")
    for what, values in (("shape", shape), ("strides", strides)):
        if (type(values) not in (tuple, list) or len(values) > _MAX_NDIM
                or not all(type(v) is int and 0 <= v <= _MAX_INDEX for v in values)):
            raise refuse(f"{what} {_show(values)} is not a sequence of at most {_MAX_NDIM} integers in [0, 2**62]")
    if len(shape) != len(strides):
        raise refuse(f"shape {_show(shape)} and strides {_show(strides)} differ in length")
    itemsize = storage.dtype.itemsize
    if math.prod(max(size, 1) for size in shape) * itemsize > _MAX_INDEX:
        raise refuse(f"shape {_show(shape)} is absurdly large")
    count = math.prod(shape)
    if count:
        last = offset + sum((size - 1) * stride for size, stride in zip(shape, strides))
        if last >= storage.numel:
            raise refuse(f"reads elements {offset} to {last} of storage {storage.key!r}, which holds {storage.numel} "
                         f"(out of bounds)")
    elif offset > storage.numel:
        raise refuse(f"storage offset {offset} is beyond storage {storage.key!r}, which holds {storage.numel}")
    element_strides = tuple(stride if size > 1 else 0 for size, stride in zip(shape, strides))
    return storage, offset, tuple(shape), element_strides, count


def _materialise(state, archive, prefix: str, byteorder: str, file: Path, file_size: int) -> dict[str, np.ndarray]:
    if type(state) is not _Dict:
        got = "a single tensor" if type(state) is _TensorRecord else type(state).__name__
        raise CheckpointFormatError(file, f"expected a state dict (names to tensors), got {got}")
    layouts = {}
    for name, value in state.items():
        if type(name) is not str:
            raise CheckpointFormatError(file, f"state-dict key {_show(name)} is not a string")
        if type(value) is not _TensorRecord:
            raise CheckpointFormatError(file, f"is {type(value).__name__}, not a tensor (only flat state dicts of "
                                              f"tensors are read)", name)
        layouts[name] = _layout(value, name, file)
    # Everything this file will make us allocate, from its declarations, before a byte of data is read.
    budget, total, storages = max(_EXPANSION * file_size, _MIN_BUDGET), 0, {}
    for name, (storage, _, _, _, count) in layouts.items():
        if storage.key not in storages:
            storages[storage.key] = (storage, [])
            total += storage.numel * storage.dtype.itemsize
        storages[storage.key][1].append(name)
        total += count * storage.dtype.itemsize
        if total > budget:
            raise CheckpointFormatError(file, f"the tensors up to this one declare {total} bytes, more than "
                                              f"{_EXPANSION} times the file's {file_size} (corrupt sizes or a zip "
                                              f"bomb?)", name)
    tensors = dict.fromkeys(layouts)
    for storage, names in storages.values():
        dtype = storage.dtype
        raw = _read_entry(archive, f"{prefix}data/{storage.key}", file, file_size,
                          size=storage.numel * dtype.itemsize, tensor=names[0])
        data = np.frombuffer(raw, dtype=np.uint8 if dtype == np.bool_ else dtype)
        if byteorder != sys.byteorder and dtype.itemsize > 1:
            data = data.byteswap()
        if dtype == np.bool_:
            data = data != 0
        for name in names:
            _, offset, shape, strides, count = layouts[name]
            if not count:
                tensors[name] = np.empty(shape, dtype)
                continue
            view = np.lib.stride_tricks.as_strided(data[offset:], shape=shape,
                                                   strides=tuple(s * dtype.itemsize for s in strides), writeable=False)
            tensors[name] = np.array(view, order="C")  # a C-contiguous copy
        del raw, data
    return tensors


def _read_legacy_torch(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointFormatError(file, "uses PyTorch's legacy (pre-1.6) serialisation, which needs torch to read; "
                                          "install torch or convert the checkpoint to safetensors") from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- torch's restricted unpickler raises several types
        raise CheckpointFormatError(file, f"torch cannot read this legacy checkpoint ({_why(error)})") from None
    if not isinstance(state, dict):
        raise CheckpointFormatError(file, f"expected a state dict, got {type(state).__name__}")
    tensors = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise CheckpointFormatError(file, f"state-dict key {_show(name)} is not a string")
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(file, f"is {type(value).__name__}, not a tensor", name)
        value = value.detach().cpu()
        tensors[name] = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
    return tensors
