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
from pathlib import Path

import numpy as np

from dpzero_jax.hf_torch import CheckpointFormatError, _show, read_torch_file

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

__all__ = ["read_config", "read_state_dict", "read_torch_file", "write_checkpoint", "checkpoint_dir",
           "CheckpointFormatError"]


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
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointFormatError(directory / index, "weight_map is not a mapping of names to shard files")
            tensors = {}
            for shard in sorted(set(weight_map.values())):
                if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
                    raise CheckpointFormatError(directory / index, f"shard {_show(shard)} is not a file name in the "
                                                                   f"checkpoint directory")
                if not (directory / shard).is_file():
                    raise FileNotFoundError(f"{directory / index} lists the shard {shard!r}, which is missing")
                part = reader(directory / shard)
                twice = sorted(tensors.keys() & part.keys())
                if twice:
                    raise CheckpointFormatError(directory / shard, "is also in an earlier shard", twice[0])
                tensors.update(part)
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


MAX_SHARD_BYTES = 5 << 30   # shards of at most 5 GiB (a tensor larger than that gets a shard of its own)


def write_checkpoint(path, config: dict, tensors: dict[str, np.ndarray], *,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (metadata ``format: pt``, as ``transformers`` expects), or,
    when the tensors pass ``max_shard_bytes``, shards ``model-00001-of-0000N.safetensors`` (tensors in order, each
    shard filled up to ``max_shard_bytes``) with ``model.safetensors.index.json``, as ``save_pretrained`` does. The
    other form's file, left by an earlier export to the same directory, is removed (it would shadow this one)."""
    from safetensors.numpy import save_file

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    total = sum(a.nbytes for a in arrays.values())
    if total <= max_shard_bytes:
        (directory / SAFETENSORS_INDEX).unlink(missing_ok=True)
        save_file(arrays, str(directory / SAFETENSORS), metadata={"format": "pt"})
    else:
        shards, size = [{}], 0
        for name, array in arrays.items():
            if shards[-1] and size + array.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = array
            size += array.nbytes
        (directory / SAFETENSORS).unlink(missing_ok=True)
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
