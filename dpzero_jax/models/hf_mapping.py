"""The vocabulary of checkpoint mappings: how one parameter of a model here is read from (and written back to) the
tensors of a Hugging Face checkpoint, and the record that describes one architecture.

An architecture is one :class:`Architecture` in :data:`dpzero_jax.models.pretrained.ARCHITECTURES` plus its model
file and its mapping module (``gpt2_hf``, ``llama_hf``, ``bert_hf``, ``vit_hf``), which build the entries from the
helpers below. Nothing here imports a model: the mapping modules import their model's config, and
:mod:`~dpzero_jax.models.pretrained` imports them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter (``path``, ``/``-joined) from one or more checkpoint tensors (``names``): ``to_ours(*tensors)
    -> array`` and ``to_hf(array) -> tensors``."""

    path: str
    names: tuple[str, ...]
    to_ours: Callable
    to_hf: Callable
    head: bool = False          # part of the task head: may be missing (initialised afresh)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How ``transformers`` checkpoints of some ``model_types`` map onto ``model`` (an NNX class).

    ``config(hf_config, model_type, scan_layers, num_labels)``: the model's config from ``config.json`` (refusing
    what the model does not compute exactly); ``entries(config, prefix)``: the :class:`Entry` table, ``prefix``
    being where the checkpoint keeps the backbone (one of ``prefixes(model_type)``, or none); ``hf_config(config)``:
    the ``config.json`` keys that describe the model on export; ``export_prefix(config)``: the backbone's prefix
    written on export. ``causal_lm``: a decoder (``--task causal-lm``), else a classifier with a task head
    (``num_labels(config)`` classes). ``takes_dtype``: the model has a compute ``dtype`` argument.
    """

    model_types: tuple[str, ...]
    model: type
    causal_lm: bool
    config: Callable
    entries: Callable
    hf_config: Callable
    prefixes: Callable
    export_prefix: Callable
    num_labels: Callable | None = None
    takes_dtype: bool = True


def refuse(config: dict, key: str, supported, what: str) -> None:
    """Raise naming ``key`` when ``config.json`` sets it to something else than ``supported``."""
    value = config.get(key, supported)
    if value != supported:
        raise ValueError(f"config.json: {key}={value!r} ({what}) is not supported; only {key}={supported!r}")


def same(path, name, head=False) -> Entry:
    """A tensor stored as the parameter is."""
    return Entry(path, (name,), lambda a: a, lambda w: (w,), head)


def transposed(path, name, head=False) -> Entry:
    """An ``nn.Linear`` weight ``[out, in]`` <-> a kernel ``[in, out]``."""
    return Entry(path, (name,), lambda w: w.T, lambda k: (np.ascontiguousarray(k.T),), head)


def dense(path, name, head=False) -> list[Entry]:
    """An ``nn.Linear`` with bias: kernel (transposed) and bias."""
    return [transposed(f"{path}/kernel", f"{name}.weight", head), same(f"{path}/bias", f"{name}.bias", head)]


def layer_norm(path, name) -> list[Entry]:
    """A LayerNorm: ``weight`` -> ``scale``, ``bias``."""
    return [same(f"{path}/scale", f"{name}.weight"), same(f"{path}/bias", f"{name}.bias")]


def fused_qkv(path, prefix, d) -> list[Entry]:
    """``query``, ``key``, ``value`` ``nn.Linear`` s -> one ``[d, 3d]`` kernel (their transposed weights side by side)
    and ``[3d]`` bias."""
    names = tuple(f"{prefix}.{n}" for n in ("query", "key", "value"))

    def kernel(q, k, v):
        return np.concatenate([q.T, k.T, v.T], axis=1)

    def kernel_hf(w):
        return tuple(np.ascontiguousarray(w[:, i * d:(i + 1) * d].T) for i in range(3))

    def bias(q, k, v):
        return np.concatenate([q, k, v])

    def bias_hf(b):
        return tuple(b[i * d:(i + 1) * d] for i in range(3))
    return [Entry(f"{path}/kernel", tuple(f"{n}.weight" for n in names), kernel, kernel_hf),
            Entry(f"{path}/bias", tuple(f"{n}.bias" for n in names), bias, bias_hf)]


def stacked(layers: list[list[Entry]]) -> list[Entry]:
    """Entries of stacked blocks from each layer's entries (same paths, same order): the parameter is the layers'
    values stacked on a new leading axis, read from (and written to) every layer's tensors."""
    out = []
    for same_path in zip(*layers):
        widths = np.cumsum([0] + [len(e.names) for e in same_path])

        def to_ours(*arrays, entries=same_path, widths=widths):
            return np.stack([e.to_ours(*arrays[a:b]) for e, a, b in zip(entries, widths[:-1], widths[1:])])

        def to_hf(w, entries=same_path):
            return tuple(t for e, w_layer in zip(entries, w) for t in e.to_hf(w_layer))
        out.append(Entry(same_path[0].path, tuple(n for e in same_path for n in e.names), to_ours, to_hf,
                         same_path[0].head))
    return out


def blocks(count: int, scan_layers: bool, hf_prefix: str, ours: str, block: Callable) -> list[Entry]:
    """``count`` blocks ``block(hf_name, our_path)``: checkpoint ``{hf_prefix}.{i}``, parameters ``{ours}/{i}``, or
    stacked under ``ours`` when the model scans its layers."""
    if scan_layers:
        return stacked([block(f"{hf_prefix}.{i}", ours) for i in range(count)])
    return [e for i in range(count) for e in block(f"{hf_prefix}.{i}", f"{ours}/{i}")]
