"""Hugging Face checkpoint directories without torch or transformers: config, weights, tokenizer.

A directory written by ``transformers``' ``save_pretrained`` holds ``config.json`` and the weights as
``model.safetensors`` (or shards listed in ``model.safetensors.index.json``) or, in older checkpoints,
``pytorch_model.bin`` (or shards listed in ``pytorch_model.bin.index.json``). This module reads and writes them as
numpy arrays:

* safetensors through the ``safetensors`` package's numpy API;
* PyTorch's zip serialisation (``torch.save`` since torch 1.6) by a restricted unpickler that rebuilds each tensor
  from its raw storage with numpy -- it accepts only the few globals a state dict needs (no code runs), and torch is
  not imported. Only the pre-1.6 legacy format needs torch (``torch.load(weights_only=True)``), if it is installed.

The architectures (names and layouts of the weights) are mapped in :mod:`dpzero_jax.models.pretrained`.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import numpy as np

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

__all__ = ["read_config", "read_state_dict", "read_torch_file", "write_checkpoint", "checkpoint_dir"]


def checkpoint_dir(path) -> Path:
    """``path`` as a directory that exists, else ``FileNotFoundError`` naming it."""
    directory = Path(path).expanduser()
    if not directory.exists():
        raise FileNotFoundError(f"no such checkpoint directory: {str(path)!r}")
    if not directory.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory (expected a save_pretrained directory holding "
                                f"{CONFIG} and the weights)")
    return directory


def read_config(path) -> dict:
    """The parsed ``config.json`` of a checkpoint directory."""
    file = checkpoint_dir(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no {CONFIG}: not a save_pretrained directory")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def read_state_dict(path) -> dict[str, np.ndarray]:
    """All weights of a checkpoint directory as ``{name: numpy array}`` (safetensors preferred, else PyTorch)."""
    directory = checkpoint_dir(path)
    for single, index, reader in ((SAFETENSORS, SAFETENSORS_INDEX, _read_safetensors),
                                  (TORCH_BIN, TORCH_BIN_INDEX, read_torch_file)):
        if (directory / single).is_file():
            return reader(directory / single)
        if (directory / index).is_file():
            try:
                weight_map = json.loads((directory / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{directory / index}: not a valid shard index ({error})") from None
            tensors = {}
            for shard in sorted(set(weight_map.values())):
                if not (directory / shard).is_file():
                    raise FileNotFoundError(f"{directory / index} lists the shard {shard!r}, which is missing")
                tensors.update(reader(directory / shard))
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise ValueError(f"{directory / index}: tensors {missing[:5]} are not in their shards")
            return tensors
    raise FileNotFoundError(f"{str(path)!r} holds no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                            f"{TORCH_BIN} or {TORCH_BIN_INDEX}")


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return dict(load_file(str(file)))
    except Exception as error:  # noqa: BLE001 -- the library raises several types; one clear message
        raise ValueError(f"{file}: cannot read safetensors ({type(error).__name__}: {error})") from None


def write_checkpoint(path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (metadata ``format: pt``, as ``transformers`` expects)."""
    from safetensors.numpy import save_file

    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    save_file(arrays, str(directory / SAFETENSORS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


# ---------------------------------------------------------------- PyTorch's zip format, without torch
_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_, "BFloat16Storage": "bfloat16",
}


class _StorageType:
    def __init__(self, name: str):
        dtype = _STORAGE_DTYPES[name]
        if dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage, storage_offset, size, stride, *args):
    size, stride = tuple(size), tuple(stride)
    if not size:
        return np.array(storage[storage_offset])
    item = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(storage[storage_offset:], shape=size,
                                           strides=tuple(s * item for s in stride))
    return np.array(view)  # a contiguous copy


def _rebuild_parameter(data, *args):
    return data


class _StateDictUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save``'d state dict into numpy arrays; any other global is refused."""

    ALLOWED = {("collections", "OrderedDict"): lambda: __import__("collections").OrderedDict,
               ("torch._utils", "_rebuild_tensor_v2"): lambda: _rebuild_tensor,
               ("torch._utils", "_rebuild_parameter"): lambda: _rebuild_parameter}

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, byteorder: str):
        super().__init__(file)
        self.archive, self.prefix, self.byteorder = archive, prefix, byteorder
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[(module, name)]()
        raise pickle.UnpicklingError(f"unsupported object {module}.{name} in a PyTorch checkpoint (only plain "
                                     f"tensors are read without torch; convert it to safetensors)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r} in a PyTorch checkpoint")
        _, storage_type, key, _location, _numel = pid
        if key not in self.storages:
            dtype = storage_type.dtype.newbyteorder("<" if self.byteorder == "little" else ">")
            raw = self.archive.read(f"{self.prefix}data/{key}")
            self.storages[key] = np.frombuffer(raw, dtype=dtype).astype(storage_type.dtype, copy=False)
        return self.storages[key]


def read_torch_file(file) -> dict[str, np.ndarray]:
    """A ``torch.save``'d state dict (zip format) as ``{name: numpy array}``, without importing torch."""
    file = Path(file)
    if not zipfile.is_zipfile(file):
        return _read_legacy_torch(file)
    with zipfile.ZipFile(file) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{file}: not a PyTorch checkpoint (no single data.pkl in the archive)")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = "little"
        if f"{prefix}byteorder" in archive.namelist():
            byteorder = archive.read(f"{prefix}byteorder").decode().strip()
        import io

        try:
            state = _StateDictUnpickler(io.BytesIO(archive.read(pickles[0])), archive, prefix, byteorder).load()
        except pickle.UnpicklingError as error:
            raise ValueError(f"{file}: {error}") from None
    return _check_state_dict(state, file)


def _read_legacy_torch(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{file} uses PyTorch's legacy (pre-1.6) serialisation, which needs torch to read; install "
                         f"torch or convert the checkpoint to safetensors") from None
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{file}: expected a state dict, got {type(state).__name__}")
    return _check_state_dict({k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                              for k, v in state.items()}, file)


def _check_state_dict(state, file) -> dict[str, np.ndarray]:
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise ValueError(f"{file}: expected a state dict of tensors")
    return dict(state)
