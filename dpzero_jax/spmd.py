"""Activations split over the batch under GSPMD: the one hint a ZeRO-3 step needs besides its parameter layout.

Under the ``gspmd`` strategy the parameters are split over ``fsdp`` (:mod:`dpzero_jax.sharding`) and the batch over
``("data", "fsdp")``. Left to itself, XLA's SPMD partitioner resolves a matmul of a batch-split activation with an
``fsdp``-split weight by splitting the *activation's features* like the weight (tensor parallelism) and gathering the
batch instead: measured on GPT-2 XL over 256 TPU v5e chips (``experiments/tpu_aot.py``), every device held its whole
``data`` group's batch (logits ``[64, 1024, 50257]`` all-gathered, attention scores all-reduced), 13.9 GiB of
temporaries for one example per chip. ZeRO-3 means the opposite: gather each weight where its layer runs, keep the
activations split over the batch.

:func:`constrain_batch` states that: inside :func:`batch_sharded` (the trainer's GSPMD step traces its gradient in
it) an activation ``x [B, ...]`` is constrained to ``B`` over the batch axes and its other dimensions whole on the
device; outside, it is the identity (no mesh, one device, or the ``explicit`` strategy, whose ``shard_map`` body
holds per-device arrays). The scanned GPT-2 and Llama models call it on their layers' carry.

The program front-end traces a *single-example* program (a batch of one) and runs it under ``jax.vmap`` over the
examples: there ``x`` is ``[1, ...]``, the constraint keeps its dimensions whole, and the front-end's ``vmap`` is
given ``spmd_axis_name`` = :func:`batch_axes`, which puts the example axis it adds over the batch axes. No values
change anywhere: only where the partitioner places them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["batch_axes", "batch_sharded", "constrain_batch"]

_BATCH: contextvars.ContextVar[tuple[Mesh, tuple[str, ...]] | None] = contextvars.ContextVar(
    "dpzero_batch_sharded", default=None)


@contextlib.contextmanager
def batch_sharded(mesh: Mesh, axes: tuple[str, ...] = ("data", "fsdp")):
    """Within the block, :func:`constrain_batch` splits activations' leading axis over ``axes`` of ``mesh``."""
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"batch axes {missing} are not axes of the mesh {tuple(mesh.axis_names)}")
    token = _BATCH.set((mesh, tuple(axes)))
    try:
        yield
    finally:
        _BATCH.reset(token)


def _devices(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def batch_axes(size: int | None = None) -> tuple[str, ...] | None:
    """The batch axes of the enclosing :func:`batch_sharded` (``vmap``'s ``spmd_axis_name`` over ``size``
    examples), or ``None``: outside it, or when they do not divide ``size`` (a micro-batch smaller than the mesh)."""
    current = _BATCH.get()
    if current is None or (size is not None and size % _devices(*current)):
        return None
    return current[1]


def examples_per_device(size: int) -> int:
    """How many of ``size`` examples one device holds under the enclosing :func:`batch_sharded` (``size`` outside
    it, or when its batch axes do not divide ``size``)."""
    current = _BATCH.get()
    return size // _devices(*current) if batch_axes(size) else size


def constrain_batch(x: jax.Array) -> jax.Array:
    """``x [B, ...]`` with ``B`` split over the batch axes and its other dimensions whole (identity outside
    :func:`batch_sharded`). A batch of one (the program front-end's single-example program) is kept whole: the
    example axis its ``vmap`` adds carries the split. Another batch the axes do not divide is left to the partitioner
    (unchanged)."""
    current = _BATCH.get()
    if current is None or x.ndim == 0:
        return x
    mesh, axes = current
    if x.shape[0] % _devices(mesh, axes) == 0:
        lead = axes
    elif x.shape[0] == 1:
        lead = None
    else:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(lead, *([None] * (x.ndim - 1)))))
