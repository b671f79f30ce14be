"""The torch-free ``.bin`` reader on untrusted input: real ``torch.save`` files load exactly (compared with torch's
own tensors); damaged or crafted files are refused with a ``CheckpointFormatError`` naming the file, the tensor and
the problem; a seeded fuzz proves it never reads outside a storage and never runs code from the file."""

from __future__ import annotations

import json
import os
import pickle
import random
import struct
import zipfile

import numpy as np
import pytest
from numpy.lib.array_utils import byte_bounds

from dpzero_jax import hf
from dpzero_jax.hf import CheckpointFormatError

ITEMSIZE = {"FloatStorage": 4, "DoubleStorage": 8, "HalfStorage": 2, "LongStorage": 8, "IntStorage": 4,
            "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1}
NUMPY = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16, "LongStorage": np.int64,
         "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
         "BoolStorage": np.bool_}


# ---------------------------------------------------------------- a tiny pickle writer (protocol 2 opcodes)
class Raw(bytes):
    """Opcodes embedded as they are."""


def op(value) -> bytes:
    if isinstance(value, Raw):
        return bytes(value)
    if value is None:
        return b"N"
    if value is True or value is False:
        return b"\x88" if value else b"\x89"
    if isinstance(value, int):
        return b"I" + str(value).encode() + b"\n"      # INT: any size, any sign
    if isinstance(value, float):
        return b"F" + repr(value).encode() + b"\n"
    if isinstance(value, str):
        data = value.encode()
        return b"X" + struct.pack("<I", len(data)) + data
    if isinstance(value, tuple):
        return b"(" + b"".join(op(v) for v in value) + b"t"
    if isinstance(value, list):
        return b"(" + b"".join(op(v) for v in value) + b"l"
    if isinstance(value, dict):
        return b"}(" + b"".join(op(k) + op(v) for k, v in value.items()) + b"u"
    raise TypeError(value)


def glob(module: str, name: str) -> Raw:
    return Raw(b"c" + module.encode() + b"\n" + name.encode() + b"\n")


def call(func: bytes, *args) -> Raw:
    return Raw(func + op(tuple(args)) + b"R")


def storage(key, numel, kind="FloatStorage") -> Raw:
    return Raw(op(("storage", glob("torch", kind), key, "cpu", numel)) + b"Q")


def tensor(store: bytes, offset, shape, strides) -> Raw:
    return call(glob("torch._utils", "_rebuild_tensor_v2"), Raw(store), offset, shape, strides, False,
                call(glob("collections", "OrderedDict")))


def state_pickle(entries: dict) -> bytes:
    return b"\x80\x02" + op(entries) + b"."


def write_zip(path, data_pkl: bytes, storages: dict[str, bytes], *, prefix="archive", byteorder=b"little",
              extra: list[tuple[str, bytes]] = ()) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{prefix}/data.pkl", data_pkl)
        archive.writestr(f"{prefix}/byteorder", byteorder)
        for key, data in storages.items():
            archive.writestr(f"{prefix}/data/{key}", data)
        for name, data in extra:
            archive.writestr(name, data)


def gather(values: np.ndarray, offset: int, shape, strides) -> np.ndarray:
    """The tensor element by element, with every index checked: the independent reference."""
    out = np.empty(shape, values.dtype)
    if out.size == 0:                      # (np.ndindex would materialise every range of an empty shape)
        return out
    for index in np.ndindex(*shape):
        flat = offset + sum(i * s for i, s in zip(index, strides))
        assert 0 <= flat < len(values), "the reference itself went out of bounds"
        out[index] = values[flat]
    return out


@pytest.fixture
def bounds_checked(monkeypatch):
    """Wraps ``as_strided``: every view the reader makes must lie inside the array it views (its storage from the
    offset to the end); violations and calls are recorded."""
    real, log = np.lib.stride_tricks.as_strided, {"calls": 0, "violations": []}

    def checked(x, shape=None, strides=None, **kwargs):
        view = real(x, shape=shape, strides=strides, **kwargs)
        log["calls"] += 1
        if view.size:
            low, high = byte_bounds(view)
            base_low, base_high = byte_bounds(x)
            if low < base_low or high > base_high:
                log["violations"].append((x.shape, shape, strides))
        return view

    monkeypatch.setattr(np.lib.stride_tricks, "as_strided", checked)
    return log


# ---------------------------------------------------------------- real torch.save files
def torch_layouts(torch):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tied = torch.randn(5, 3)
    linear = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return {
        "transposed": base.t(),                               # non-contiguous
        "window": base[2:5, 3:9:2],                           # offset and strides into a shared storage
        "row": base[4],                                       # offset, same storage again
        "tied.a": tied, "tied.b": tied,                       # one storage, two names
        "expanded": torch.arange(4).expand(3, 4),             # zero stride (HF's position_ids)
        "bf16": torch.randn(4, 6).to(torch.bfloat16)[:, 1:5],
        "fp16": torch.randn(7).half()[2:],
        "f64": torch.randn(2, 3, dtype=torch.float64).t(),
        "int8": torch.tensor([-128, 5, 127], dtype=torch.int8),
        "uint8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "int16": torch.tensor([[-3, 4], [5, -6]], dtype=torch.int16).t(),
        "int32": torch.tensor([1, -2, 3], dtype=torch.int32),
        "bool": torch.tensor([[True, False, True]]).t(),
        "scalar": torch.tensor(2.5),
        "scalar_view": base[3, 7],                            # a 0-d tensor at an offset
        "empty": torch.zeros(0, 4),
        "empty_view": base[:, 10:],
        "parameter": torch.nn.Parameter(torch.randn(2, 2)),  # _rebuild_parameter
        **{f"module.{k}": v for k, v in linear.state_dict().items()},
    }


def same(ours: np.ndarray, theirs, torch) -> bool:
    if theirs.dtype == torch.bfloat16:
        return ours.dtype.name == "bfloat16" and np.array_equal(ours.view(np.int16), theirs.view(torch.int16).numpy())
    expected = theirs.detach().numpy()
    return ours.dtype == expected.dtype and ours.shape == expected.shape and np.array_equal(ours, expected)


def test_torch_save_layouts_load_exactly(tmp_path, bounds_checked):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    path = tmp_path / "layouts.bin"
    torch.save(torch_layouts(torch), path)
    expected = torch.load(path, weights_only=True)
    ours = hf.read_torch_file(path)
    assert list(ours) == list(expected)
    for name, value in expected.items():
        assert same(ours[name], value, torch), name
        assert ours[name].flags.c_contiguous and ours[name].flags.writeable
    assert ours["tied.a"] is not ours["tied.b"]                          # copies, not aliases
    assert bounds_checked["calls"] > 10 and not bounds_checked["violations"]


def test_module_state_dict_with_metadata_and_legacy_format(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11))
    model[1].weight = model[0].weight                                   # tied, like a language model's head
    state = model.state_dict()
    assert hasattr(state, "_metadata")                                  # pickled with BUILD
    torch.save(state, tmp_path / "zip.bin")
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    for name in ("zip.bin", "legacy.bin"):
        ours = hf.read_torch_file(tmp_path / name)
        assert list(ours) == list(state)
        for key, value in state.items():
            assert same(ours[key], value, torch), (name, key)


# ---------------------------------------------------------------- the hand-written format: control, big-endian
def test_handwritten_checkpoint_loads_and_big_endian_is_swapped(tmp_path, bounds_checked):
    values = np.arange(12, dtype=np.float32) * 1.5
    data = state_pickle({"a": tensor(storage("0", 12), 1, (2, 3), (4, 1)),
                         "b": tensor(storage("0", 12), 0, (3,), (0,))})
    write_zip(tmp_path / "little.bin", data, {"0": values.tobytes()})
    write_zip(tmp_path / "big.bin", data, {"0": values.astype(">f4").tobytes()}, byteorder=b"big")
    for name in ("little.bin", "big.bin"):
        out = hf.read_torch_file(tmp_path / name)
        np.testing.assert_array_equal(out["a"], gather(values, 1, (2, 3), (4, 1)))
        np.testing.assert_array_equal(out["b"], [0.0, 0.0, 0.0])
        assert out["a"].dtype == np.float32
    assert not bounds_checked["violations"]


# ---------------------------------------------------------------- refusals, one by one
def patch_sizes(path, entry: str, size: int) -> None:
    """Rewrite the uncompressed size of ``entry`` in its local and central headers (a lying archive)."""
    blob = bytearray(path.read_bytes())
    name = entry.encode()
    def header(signature, name_at):
        return next(i for i in range(len(blob))
                    if blob.startswith(signature, i) and blob[i + name_at:i + name_at + len(name)] == name)

    local, central = header(b"PK\x03\x04", 30), header(b"PK\x01\x02", 46)
    struct.pack_into("<I", blob, local + 22, size)
    struct.pack_into("<I", blob, central + 24, size)
    path.write_bytes(bytes(blob))


def refusal_cases():
    ok = {"0": np.zeros(4, np.float32).tobytes()}
    good = tensor(storage("0", 4), 0, (2, 2), (2, 1))
    return {
        "out of bounds": (state_pickle({"w": tensor(storage("0", 4), 1, (2, 2), (2, 1))}), ok, "w", "out of bounds"),
        "offset past end": (state_pickle({"w": tensor(storage("0", 4), 4, (1,), (1,))}), ok, "w", "out of bounds"),
        "negative offset": (state_pickle({"w": tensor(storage("0", 4), -1, (2,), (1,))}), ok, "w", "offset"),
        "negative size": (state_pickle({"w": tensor(storage("0", 4), 0, (-1, 2), (2, 1))}), ok, "w", "shape"),
        "negative stride": (state_pickle({"w": tensor(storage("0", 4), 3, (2,), (-1,))}), ok, "w", "strides"),
        "huge stride": (state_pickle({"w": tensor(storage("0", 4), 0, (2,), (2**61,))}), ok, "w", "out of bounds"),
        "overflowing shape": (state_pickle({"w": tensor(storage("0", 4), 0, (2**40, 2**40), (0, 0))}), ok, "w",
                              "absurdly large"),
        "bool as size": (state_pickle({"w": tensor(storage("0", 4), 0, (True,), (1,))}), ok, "w", "shape"),
        "rank mismatch": (state_pickle({"w": tensor(storage("0", 4), 0, (2, 2), (1,))}), ok, "w", "differ in length"),
        "expansion bomb": (state_pickle({"w": tensor(storage("0", 4), 0, (2**20, 2**20), (0, 0))}), ok, "w",
                           "16 times"),
        "missing storage": (state_pickle({"w": good}), {}, "w", "no entry 'archive/data/0'"),
        "short storage": (state_pickle({"w": good}), {"0": b"\0" * 12}, "w", "holds 12 bytes where its storage "
                                                                             "declares 16"),
        "dtype not allowed": (state_pickle({"w": tensor(storage("0", 4, "ComplexFloatStorage"), 0, (1,), (1,))}), ok,
                              None, "asks for torch.ComplexFloatStorage"),
        "duplicate name": (b"\x80\x02}(" + op("w") + good + op("w") + good + b"u.", ok, "w", "appears twice"),
        "not a tensor": (state_pickle({"w": 3}), ok, "w", "not a tensor"),
        "a bare tensor": (b"\x80\x02" + good + b".", ok, None, "got a single tensor"),
        "storage redeclared": (state_pickle({"w": good, "v": tensor(storage("0", 4, "IntStorage"), 0, (1,), (1,))}),
                               ok, None, "declared as"),
        "os.system": (b"\x80\x02" + call(glob("os", "system"), "true") + b".", ok, None, "asks for os.system"),
    }


@pytest.mark.parametrize("case", sorted(refusal_cases()))
def test_refusals_name_file_tensor_and_problem(tmp_path, case):
    data, storages, name, problem = refusal_cases()[case]
    path = tmp_path / "bad.bin"
    write_zip(path, data, storages)
    with pytest.raises(CheckpointFormatError) as caught:
        hf.read_torch_file(path)
    error = caught.value
    assert isinstance(error, ValueError) and error.file == str(path) and error.tensor == name
    assert str(error).startswith(f"{path}:") and problem in str(error), str(error)
    if name is not None:
        assert f"tensor {name!r}" in str(error)


def test_archive_level_refusals(tmp_path):
    values = {"0": np.ones(4, np.float32).tobytes()}
    data = state_pickle({"w": tensor(storage("0", 4), 0, (4,), (1,))})
    path = tmp_path / "dup.bin"
    with pytest.warns(UserWarning, match="Duplicate name"):
        write_zip(path, data, values, extra=[("archive/data/0", np.zeros(4, np.float32).tobytes())])
    with pytest.raises(CheckpointFormatError, match="several entries named 'archive/data/0'"):
        hf.read_torch_file(path)

    path = tmp_path / "bomb.bin"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", data)
        archive.writestr("archive/data/0", values["0"])
    patch_sizes(path, "archive/data/0", 2**31)
    with pytest.raises(CheckpointFormatError, match="zip bomb"):
        hf.read_torch_file(path)

    path = tmp_path / "byteorder.bin"
    write_zip(path, data, values, byteorder=b"middle")
    with pytest.raises(CheckpointFormatError, match="neither 'little' nor 'big'"):
        hf.read_torch_file(path)

    path = tmp_path / "two.bin"
    write_zip(path, data, values, extra=[("other/data.pkl", data)])
    with pytest.raises(CheckpointFormatError, match="no single <name>/data.pkl"):
        hf.read_torch_file(path)

    (tmp_path / "text.bin").write_text("hello")
    with pytest.raises(CheckpointFormatError, match="not a PyTorch checkpoint"):
        hf.read_torch_file(tmp_path / "text.bin")


# ---------------------------------------------------------------- malicious pickles and the canary
def payloads(canary: str) -> dict[str, bytes]:
    """Pickles that would create ``canary`` (or run a shell command that does) if any of their code ran."""
    shell = f"touch {canary}"
    open_it = call(glob("builtins", "open"), canary, "w")

    class Evil:
        def __reduce__(self):
            return (open, (canary, "w"))

    class EvilShell:
        def __reduce__(self):
            return (os.system, (shell,))

    ok_tensor = tensor(storage("0", 4), 0, (4,), (1,))
    stack_global = Raw(op("builtins") + op("open") + b"\x93")
    return {
        "os.system": b"\x80\x02" + call(glob("os", "system"), shell) + b".",
        "posix.system": b"\x80\x02" + call(glob("posix", "system"), shell) + b".",
        "builtins.eval": b"\x80\x02" + call(glob("builtins", "eval"), f"open({canary!r}, 'w')") + b".",
        "builtins.exec": b"\x80\x02" + call(glob("builtins", "exec"), f"open({canary!r}, 'w')") + b".",
        "builtins.open": b"\x80\x02" + open_it + b".",
        "__builtin__.open": b"\x80\x02" + call(glob("__builtin__", "open"), canary, "w") + b".",
        "subprocess": b"\x80\x02" + call(glob("subprocess", "check_call"), ["touch", canary]) + b".",
        "value in state dict": state_pickle({"w": ok_tensor, "x": open_it}),
        "key in state dict": b"\x80\x02}(" + open_it + ok_tensor + b"u.",
        "in persistent id": state_pickle({"w": tensor(Raw(op(("storage", open_it, "0", "cpu", 4)) + b"Q"), 0, (4,),
                                                      (1,))}),
        "as offset": state_pickle({"w": tensor(storage("0", 4), open_it, (4,), (1,))}),
        "as backward hook": state_pickle({"w": call(glob("torch._utils", "_rebuild_tensor_v2"), storage("0", 4), 0,
                                                    (4,), (1,), False, {"h": open_it})}),
        "BUILD state": b"\x80\x02" + call(glob("collections", "OrderedDict")) + op({"_metadata": open_it}) + b"b.",
        "BUILD on a record": state_pickle({"w": Raw(ok_tensor + op({"args": (canary,)}) + b"b")}),
        "SETITEM on a record": state_pickle({"w": Raw(ok_tensor + op("args") + op((canary,)) + b"s")}),
        "APPENDS on a function": b"\x80\x02" + glob("torch._utils", "_rebuild_parameter") + b"(" + op(canary)
                                 + b"e.",
        "STACK_GLOBAL": b"\x80\x04" + stack_global + op((canary, "w")) + b"R.",
        "INST": b"\x80\x02(" + op(canary) + op("w") + b"ibuiltins\nopen\n.",
        "OBJ": b"\x80\x02(" + glob("builtins", "open") + op(canary) + op("w") + b"o.",
        "NEWOBJ": b"\x80\x02" + glob("pathlib", "Path") + op((canary,)) + b"\x81.",
        "EXT1": b"\x80\x02\x82\x01" + op((canary, "w")) + b"R.",
        "reduce on whitelisted with args": b"\x80\x02" + call(glob("collections", "OrderedDict"),
                                                              [(canary, open_it)]) + b".",
        "call a string": b"\x80\x02" + call(op("open")) + b".",
        "torch.load": b"\x80\x02" + call(glob("torch", "load"), canary) + b".",
        "torch._utils other": b"\x80\x02" + call(glob("torch._utils", "_rebuild_device_tensor_from_numpy"),
                                                 open_it) + b".",
        **{f"pickle.dumps(Evil) protocol {p}": pickle.dumps(Evil(), protocol=p) for p in range(6)},
        **{f"pickle.dumps(EvilShell) protocol {p}": pickle.dumps(EvilShell(), protocol=p) for p in (0, 2, 5)},
        "nested Evil": pickle.dumps({"w": [1, (2, Evil())]}, protocol=2),
    }


def test_payloads_are_live(tmp_path):
    """The control: unpickled by plain ``pickle``, the canary payloads do create the file."""
    canary = tmp_path / "canary"
    for name in ("builtins.open", "pickle.dumps(Evil) protocol 2", "os.system"):
        result = pickle.loads(payloads(str(canary))[name])
        if hasattr(result, "close"):
            result.close()
        assert canary.exists(), name
        canary.unlink()


# ---------------------------------------------------------------- the fuzz
def random_int(rng: random.Random, small: int, hostile: float):
    """Mostly a small valid-looking integer; with probability ``hostile`` something hostile."""
    if rng.random() >= hostile:
        return rng.randrange(small + 1)
    return rng.choice([-1, -2, -2**31, -2**63, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 + 3, 10**30, True, False, 1.0,
                       None, "2", (1,), [2]])


def expected_valid(kind, numel_declared, entry_bytes, offset, shape, strides) -> bool:
    """The specification, written out independently: is this tensor inside its storage and sane?"""
    if kind not in ITEMSIZE or type(numel_declared) is not int or numel_declared < 0:
        return False
    if entry_bytes is None or entry_bytes != numel_declared * ITEMSIZE[kind]:
        return False
    if type(offset) is not int or offset < 0:
        return False
    if not all(type(v) is int and 0 <= v <= 2**62 for v in (*shape, *strides)) or len(shape) != len(strides):
        return False
    count, span = 1, 1
    for size in shape:
        count, span = count * size, span * max(size, 1)
    if span * ITEMSIZE[kind] > 2**62:                                  # absurd even when empty
        return False
    if count == 0:
        return offset <= numel_declared
    if (count + numel_declared) * ITEMSIZE[kind] > 2**26:              # the allocation budget of a small file
        return False
    return offset + sum((n - 1) * s for n, s in zip(shape, strides)) < numel_declared


def layout_case(rng: random.Random):
    kind = rng.choice([*ITEMSIZE] * 4 + ["ComplexFloatStorage", "UntypedStorage", "Float8_e4m3fnStorage"])
    hostile = rng.choice([0.0, 0.0, 0.05, 0.3])                         # half the cases: plausible numbers only
    numel = rng.randrange(0, 40)
    declared = numel if rng.random() < 0.9 else random_int(rng, 50, 0.5)
    ndim = rng.randrange(0, 5)
    shape = [random_int(rng, 4, hostile) for _ in range(ndim)]
    strides = [random_int(rng, 6, hostile) for _ in range(ndim if rng.random() < 0.95 else ndim + 1)]
    if rng.random() < 0.05:                                             # a broadcast bomb
        shape, strides = [2**20, 2**20], [0, 0]
    offset = random_int(rng, numel // 2, hostile)
    entry = None if rng.random() < 0.03 else numel * ITEMSIZE.get(kind, 4)
    return kind, numel, declared, entry, offset, shape, strides


def test_fuzz_reader_never_reads_out_of_bounds_nor_runs_code(tmp_path, bounds_checked):
    rng = random.Random(20261123)
    canary = tmp_path / "canary"
    path = tmp_path / "fuzz.bin"
    outcomes = {"loaded": 0, "refused": 0}
    layouts = {"valid": 0, "invalid": 0}

    def attempt(expect=None):
        try:
            result = hf.read_torch_file(path)
        except CheckpointFormatError as error:
            assert error.file == str(path) and str(error).startswith(str(path))
            outcomes["refused"] += 1
            assert expect is not True, f"refused a valid case: {error}"
            return error
        outcomes["loaded"] += 1
        assert expect is not False, "loaded an invalid case"
        assert isinstance(result, dict) and all(isinstance(v, np.ndarray) for v in result.values())
        return result

    # 1. random layouts against random storages: accepted exactly when the specification says so, equal to the
    #    element-by-element reference when accepted
    for _ in range(300):
        kind, numel, declared, entry, offset, shape, strides = layout_case(rng)
        dtype = NUMPY.get(kind, np.float32)
        values = (np.arange(numel) * 7 % 251).astype(dtype)
        store = storage("0", declared, kind)
        write_zip(path, state_pickle({"t": tensor(store, offset, tuple(shape), tuple(strides))}),
                  {} if entry is None else {"0": values.tobytes()})
        valid = expected_valid(kind, declared, entry, offset, shape, strides)
        layouts["valid" if valid else "invalid"] += 1
        result = attempt(valid)
        if valid:
            np.testing.assert_array_equal(result["t"], gather(values, offset, tuple(shape), tuple(strides)))
            assert result["t"].dtype == dtype
        else:
            assert isinstance(result, CheckpointFormatError)

    # 2. a valid checkpoint, damaged: truncated anywhere, bytes flipped anywhere, its pickle mutated (re-zipped so
    #    the CRC holds) -- refused, or (flips the format does not depend on) loaded unchanged
    base = np.arange(24, dtype=np.float32)
    good_pickle = state_pickle({"a": tensor(storage("0", 24), 2, (3, 4), (1, 5)),
                                "b": tensor(storage("0", 24), 0, (2, 2), (0, 1)),
                                "c": tensor(storage("1", 3, "LongStorage"), 1, (), ())})
    storages = {"0": base.tobytes(), "1": np.array([5, 6, 7], np.int64).tobytes()}
    write_zip(path, good_pickle, storages)
    original = path.read_bytes()
    reference = attempt(True)
    for cut in rng.sample(range(len(original)), 60):
        path.write_bytes(original[:cut])
        attempt(False)
    for _ in range(100):
        blob = bytearray(original)
        for _ in range(rng.randrange(1, 9)):
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(blob))
        result = attempt()
        if isinstance(result, dict):
            assert result.keys() == reference.keys()
            for name in result:
                np.testing.assert_array_equal(result[name], reference[name])
    opcodes = b"()tlud}]RQbcXIKJN\x81\x82\x85\x86\x87\x88\x89\x93\x94hjqr.0s"
    for _ in range(150):
        mutated = bytearray(good_pickle)
        for _ in range(rng.randrange(1, 4)):
            where = rng.randrange(len(mutated))
            action = rng.randrange(4)
            if action == 0:
                mutated[where] = rng.randrange(256)
            elif action == 1:
                mutated[where:where] = bytes([rng.choice(opcodes)])
            elif action == 2:
                del mutated[where:where + rng.randrange(1, 6)]
            else:
                mutated = mutated[:where]
        write_zip(path, bytes(mutated), storages)
        attempt()

    # 3. pickles that try to import or call anything: refused, and the canary never appears
    for name, payload in payloads(str(canary)).items():
        write_zip(path, payload, {"0": np.zeros(4, np.float32).tobytes()})
        assert isinstance(attempt(False), CheckpointFormatError), name
        assert not canary.exists(), name
    try:                                         # the legacy format goes to torch.load(weights_only=True)
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        for name, payload in list(payloads(str(canary)).items())[:8]:
            path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + payload)
            assert isinstance(attempt(False), CheckpointFormatError), name
            assert not canary.exists(), name

    assert not canary.exists()
    assert not bounds_checked["violations"], bounds_checked["violations"][:5]
    print(f"fuzz: {sum(outcomes.values())} cases, {outcomes}, layouts {layouts}, {bounds_checked['calls']} views")
    assert bounds_checked["calls"] > 50                   # the bounds check was exercised (empty tensors skip it)
    assert layouts["valid"] > 60 and layouts["invalid"] > 100, layouts
    assert outcomes["loaded"] > 100 and outcomes["refused"] > 300, outcomes


def test_shard_index_cannot_leave_the_directory_or_repeat_a_tensor(tmp_path):
    one = state_pickle({"w": tensor(storage("0", 2), 0, (2,), (1,))})
    write_zip(tmp_path / "a.bin", one, {"0": np.ones(2, np.float32).tobytes()})
    write_zip(tmp_path / "b.bin", one, {"0": np.zeros(2, np.float32).tobytes()})
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    outside.write_bytes((tmp_path / "a.bin").read_bytes())
    index = tmp_path / "pytorch_model.bin.index.json"
    for weight_map, problem, name in (({"w": f"../{outside.name}"}, "not a file name in the checkpoint", None),
                                      ({"w": str(outside)}, "not a file name in the checkpoint", None),
                                      ({"w": 3}, "weight_map is not a mapping", None),
                                      ({"w": "a.bin", "v": "b.bin"}, "also in an earlier shard", "w")):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointFormatError, match=problem) as caught:
            hf.read_state_dict(tmp_path)
        assert caught.value.tensor == name
    index.write_text(json.dumps({"weight_map": {"w": "a.bin"}}))
    np.testing.assert_array_equal(hf.read_state_dict(tmp_path)["w"], [1.0, 1.0])
