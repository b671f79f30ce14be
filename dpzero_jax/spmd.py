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

Given :class:`TableSums` (the trainer's ZeRO-3 step: :meth:`dpzero_jax.sharding.ShardingRules.gspmd_hint`),
:func:`sum_layout` also tells the private gradient how the parameters are split (:class:`SumLayout`), so that a
book-kept lookup table's float32 clipped sum is formed in pieces, each constrained to the table's split before the
next (:func:`dpzero_jax.program.zero3.owned`), as the ``explicit`` strategy reduce-scatters it. The values are the
same sums.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpzero_jax.shard_layout import DEFAULT_MIN_SHARD_ELEMENTS, shard_axis

__all__ = ["SumLayout", "TableSums", "batch_axes", "batch_sharded", "constrain_batch", "sum_layout"]


@dataclasses.dataclass(frozen=True)
class TableSums:
    """How a ZeRO-3 GSPMD step forms a large lookup table's clipped sum: in pieces of at most ``chunk_bytes`` (float32)
    along the dimension the layout does not split, each constrained to the table's ``fsdp`` split before the next
    is formed -- as the ``explicit`` strategy reduce-scatters it (:func:`dpzero_jax.program.zero3.owned`). Left whole,
    the TPU compiler forms the whole float32 table on every device and all-reduces it whole beside it (GPT-2 XL on
    256 v5e chips, layer-wise groups: 1.79 GiB of temporaries against the non-private step's 0.78; 0.80 in pieces).
    ``min_shard_elements``: the weight layout's (:func:`dpzero_jax.shard_layout.shard_axis`)."""

    chunk_bytes: int
    min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS


@dataclasses.dataclass(frozen=True)
class _Hint:
    mesh: Mesh
    axes: tuple[str, ...]
    tables: TableSums | None

    @property
    def devices(self) -> int:
        """How many devices the batch axes span."""
        return math.prod(self.mesh.shape[a] for a in self.axes)


_BATCH: contextvars.ContextVar[_Hint | None] = contextvars.ContextVar("dpzero_batch_sharded", default=None)


@contextlib.contextmanager
def batch_sharded(mesh: Mesh, axes: tuple[str, ...] = ("data", "fsdp"), tables: TableSums | None = None):
    """Within the block, :func:`constrain_batch` splits activations' leading axis over ``axes`` of ``mesh``; with
    ``tables``, the private gradient sums large lookup tables in pieces (:func:`sum_layout`; the parameters split
    over the mesh's ``fsdp`` axis)."""
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"batch axes {missing} are not axes of the mesh {tuple(mesh.axis_names)}")
    if tables is not None and "fsdp" not in mesh.axis_names:
        raise ValueError(f"tables summed in pieces need the parameters' 'fsdp' axis; the mesh has "
                         f"{tuple(mesh.axis_names)}")
    token = _BATCH.set(_Hint(mesh, tuple(axes), tables))
    try:
        yield
    finally:
        _BATCH.reset(token)


def batch_axes(size: int | None = None) -> tuple[str, ...] | None:
    """The batch axes of the enclosing :func:`batch_sharded` (``vmap``'s ``spmd_axis_name`` over ``size``
    examples), or ``None``: outside it, or when they do not divide ``size`` (a micro-batch smaller than the mesh)."""
    current = _BATCH.get()
    if current is None or (size is not None and size % current.devices):
        return None
    return current.axes


def examples_per_device(size: int) -> int:
    """How many of ``size`` examples one device holds under the enclosing :func:`batch_sharded` (``size`` outside
    it, or when its batch axes do not divide ``size``)."""
    current = _BATCH.get()
    return size // current.devices if batch_axes(size) else size


def constrain_batch(x: jax.Array) -> jax.Array:
    """``x [B, ...]`` with ``B`` split over the batch axes and its other dimensions whole (identity outside
    :func:`batch_sharded`). A batch of one (the program front-end's single-example program) is kept whole: the
    example axis its ``vmap`` adds carries the split. Another batch the axes do not divide is left to the partitioner
    (unchanged)."""
    current = _BATCH.get()
    if current is None or x.ndim == 0:
        return x
    if x.shape[0] % current.devices == 0:
        lead = current.axes
    elif x.shape[0] == 1:
        lead = None
    else:
        return x
    spec = PartitionSpec(lead, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(current.mesh, spec))


class SumLayout:
    """The parameters' ZeRO-3 split under GSPMD, as the clipped sums need it (the interface of
    :class:`dpzero_jax.sharding.ShardLayout` that :func:`dpzero_jax.shard_layout.piece_bounds` and the modes' table
    pieces read): ``dim(path)`` (the dimension split over ``fsdp``, or None), ``full(path)`` (the whole leaf),
    ``sum_chunk_bytes``, and ``scatter(path, value)``: a piece of a leaf's sum (whole along the split dimension)
    constrained to that split, where the partitioner reduces it to its owners."""

    def __init__(self, mesh: Mesh, tables: TableSums, paths, leaves):
        fsdp = mesh.shape["fsdp"]
        self._mesh, self.sum_chunk_bytes = mesh, tables.chunk_bytes
        self._full = {path: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for path, x in zip(paths, leaves)}
        dims = {path: shard_axis(struct.shape, fsdp, tables.min_shard_elements) for path, struct in self._full.items()}
        self._dims = {path: dim for path, dim in dims.items() if dim is not None}

    def dim(self, path: str) -> int | None:
        return self._dims.get(path)

    def full(self, path: str) -> jax.ShapeDtypeStruct:
        return self._full[path]

    def scatter(self, path: str, value: jax.Array) -> jax.Array:
        spec = [None] * value.ndim
        spec[self._dims[path]] = "fsdp"
        return jax.lax.with_sharding_constraint(value, NamedSharding(self._mesh, PartitionSpec(*spec)))


def sum_layout(paths, leaves) -> SumLayout | None:
    """The :class:`SumLayout` of the parameters ``leaves`` (whole arrays, named by ``paths``) inside a
    :func:`batch_sharded` block given ``tables``; None elsewhere (no GSPMD hint, or the sums left to the
    partitioner)."""
    current = _BATCH.get()
    if current is None or current.tables is None:
        return None
    return SumLayout(current.mesh, current.tables, paths, leaves)
