"""DP-specific layers: the ones whose behaviour a standard layer does not have.

* :class:`RMMDense` -- a dense layer whose backward multiplies by a random sketch (randomized matrix
  multiplication, paper 002): less activation memory, a noisier gradient (:mod:`dpzero_jax.rmm`;
  ``rmm.convert_to_rmm`` swaps a model's dense layers for it);
* :class:`LoRA` -- low-rank adapters ``x A B`` beside a frozen dense layer (:mod:`dpzero_jax.peft`; ``peft.apply``
  installs them by name).

Every other layer a model needs is a standard one -- ``flax.nnx``, ``flax.linen``, plain JAX: the traced-program
front-end gives it exact per-example gradients in every mode. The layers front-end's own dense, embedding and norm
classes, which were ``dpzero_jax.nn.Linear`` and so on until 2026-11-30, are in :mod:`dpzero_jax.layers`.
"""

from __future__ import annotations

from dpzero_jax.peft import LoRA
from dpzero_jax.rmm import RMMDense

__all__ = ["LoRA", "RMMDense"]

_MOVED = ("Linear", "DenseGeneral", "Embed", "LayerNorm", "RMSNorm", "PatchEmbed", "dense_shapes", "stacked_axes")


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(
            f"dpzero_jax.nn.{name} moved to dpzero_jax.layers.{name} (the layers front-end's classes). A model needs "
            f"none of them: standard Flax layers (flax.nnx.Linear, nnx.Embed, nnx.LayerNorm, ...) get the same exact "
            f"private gradients from the traced-program front-end; dpzero_jax.nn keeps the DP-specific layers only "
            f"({', '.join(__all__)}).")
    raise AttributeError(f"module 'dpzero_jax.nn' has no attribute {name!r}")
