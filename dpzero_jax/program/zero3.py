"""ZeRO-3 shards on the traced program: each parameter gathered where the program uses it, never kept whole.

Under the ``explicit`` strategy at stage 3 (:mod:`dpzero_jax.sharding`) the traced-program front-end receives
this device's ``fsdp`` shards. The interpreter (:mod:`dpzero_jax.program.interpret`) then holds each sharded
leaf as a :class:`Deferred` value: the shard plus how to make the whole value from it. Equations that read only
deferred values and literals (the structural chain from a leaf to its use: casts, reshapes, transposes,
broadcasts) are deferred too; an equation that combines a deferred value with anything else -- the use -- runs
inside :func:`at_use`:

* the weight is all-gathered over ``fsdp`` just there, after the use's other operand exists (a data dependency
  that changes no value and that ``jax.vmap`` over the examples does not turn into one gather per example:
  :func:`_after`), then the chain is replayed on it;
* the use is a ``custom_vjp`` whose residuals are the shards, so the whole weight is not a residual of the
  step's pullback: the backward pass gathers it again once the use's output cotangent exists and differentiates
  the use there, one use at a time (the layer-by-layer schedule of paper 003);
* the cotangent of a differentiated shard (ghost and fused modes differentiate the weights) is the
  ``psum_scatter`` of the whole weight's: autodiff of the gather.

Inside ``lax.scan`` a leaf stacked over the iterations, sharded on another dimension, stays a shard: the scan
slices the shard -- a scanned input, or inside per-site inputs stacked over the iterations -- and each iteration
gathers its own slice (:func:`for_scan`). A chain applied to a stacked leaf
before the scan, or a leaf sharded along its stacking axis, is gathered whole before the scan (correct; not layer
by layer). A leading cast to a lower precision is applied to the shard before gathering (the same value at
fewer bytes, as the layers front-end does for bf16 compute); a differentiated weight's gradient is still
reduce-scattered in its stored precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from dpzero_jax import spmd
from dpzero_jax.shard_layout import piece_bounds
from dpzero_jax.sketch import finite_zero


@jax.tree_util.register_pytree_node_class
class Deferred:
    """A value computed from parameter shards alone, made whole only at its use.

    ``shards``: arrays (this device's parts); ``dims``: per shard, the dimension it is split on over ``fsdp``;
    ``fn(*wholes) -> value``: the chain from the whole values to this one (None: the single shard's whole value);
    ``casts``: per shard, a narrower float dtype it is gathered in (None: as stored).
    """

    def __init__(self, shards: tuple, dims: tuple, fn=None, casts: tuple | None = None):
        self.shards, self.dims, self.fn = tuple(shards), tuple(dims), fn
        self.casts = tuple(casts) if casts is not None else (None,) * len(self.shards)

    def tree_flatten(self):
        return self.shards, (self.dims, self.fn, self.casts)

    @classmethod
    def tree_unflatten(cls, aux, shards):
        return cls(shards, *aux)

    @property
    def is_leaf(self) -> bool:
        return self.fn is None and len(self.shards) == 1

    def whole(self, after=None):
        """The value, gathering each shard (after ``after`` exists, when given)."""
        wholes = [_gather(s, d, after, c) for s, d, c in zip(self.shards, self.dims, self.casts)]
        return wholes[0] if self.fn is None else self.fn(*wholes)


def leaf(shard, dim: int | None):
    """``shard`` as the interpreter holds it: a :class:`Deferred` when it is split over ``fsdp`` (``dim``)."""
    return shard if dim is None else Deferred((shard,), (dim,))


def _gather(shard, dim: int, after, cast=None):
    if after is not None:
        shard = _depend(shard, jax.lax.stop_gradient(after))
    if cast is None:
        return jax.lax.all_gather(shard, "fsdp", axis=dim, tiled=True)
    return _gather_cast(shard, dim, jnp.dtype(cast).name, jnp.dtype(shard.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_cast(shard, dim: int, dtype: str, stored: str):
    """All-gather ``shard`` in the narrower ``dtype`` (half the bytes in half precision); the gradient is
    reduce-scattered in the stored dtype (float32), not in the narrow one."""
    return jax.lax.all_gather(shard.astype(dtype), "fsdp", axis=dim, tiled=True)


def _gather_cast_forward(shard, dim, dtype, stored):
    return _gather_cast(shard, dim, dtype, stored), None


def _gather_cast_backward(dim, dtype, stored, _, cotangent):
    return (jax.lax.psum_scatter(cotangent.astype(stored), "fsdp", scatter_dimension=dim, tiled=True),)


_gather_cast.defvjp(_gather_cast_forward, _gather_cast_backward)


@jax.custom_vjp
def _depend(shard, after):
    """:func:`_after` with the identity as its derivative in ``shard`` (and none in ``after``): autodiff never enters
    the ``custom_vmap`` function (inside a linearised scan it cannot)."""
    return _after(shard, after)


def _depend_forward(shard, after):
    return _after(shard, after), None


def _depend_backward(_, cotangent):
    return cotangent, None


_depend.defvjp(_depend_forward, _depend_backward)


@custom_vmap
def _after(shard, after):
    """``shard`` unchanged, computed once ``after`` exists (:func:`dpzero_jax.sketch.finite_zero`)."""
    return shard + finite_zero(after).astype(shard.dtype)


@_after.def_vmap
def _after_batched(axis_size, in_batched, shard, after):
    # Over the examples the dependency is on one example's value: the weight stays one (unbatched) array, so the
    # gather is one collective, not one per example.
    shard_batched, after_batched = in_batched
    anchor = after[0] if after_batched else after
    return shard + finite_zero(anchor).astype(shard.dtype), shard_batched


def defer(eqn, invals, bind) -> list | None:
    """The outputs of ``eqn`` as deferred values when its inputs are deferred values and literals only (else None).
    A cast of a single leaf to a narrower float type is applied to the shard itself."""
    if any(not isinstance(v, Deferred) and not _is_literal(v) for v in invals):
        return None
    deferred = [v for v in invals if isinstance(v, Deferred)]
    if (eqn.primitive.name == "convert_element_type" and len(deferred) == 1 and deferred[0].is_leaf
            and len(eqn.outvars) == 1 and _narrower(deferred[0].shards[0].dtype, eqn.params["new_dtype"])):
        d = deferred[0]
        return [Deferred(d.shards, d.dims, casts=(eqn.params["new_dtype"],))]
    shards, dims, casts, spans = [], [], [], []
    for v in deferred:
        spans.append((len(shards), len(v.shards)))
        shards.extend(v.shards)
        dims.extend(v.dims)
        casts.extend(v.casts)

    def replay(*wholes, k):
        values, j = [], 0
        for v in invals:
            if isinstance(v, Deferred):
                start, n = spans[j]
                parts = wholes[start:start + n]
                values.append(parts[0] if v.fn is None else v.fn(*parts))
                j += 1
            else:
                values.append(v)
        return bind(eqn, values)[k]

    return [Deferred(shards, dims, functools.partial(replay, k=k), casts) for k in range(len(eqn.outvars))]


def at_use(fn, invals, *extra):
    """``fn(values, *extra)`` with every deferred value in ``invals`` and ``extra`` made whole just before the use.

    The whole weights enter a ``custom_vjp`` that keeps the shards, not them: its backward gathers again once the
    use's output cotangent exists and differentiates ``fn`` there (the forward's gather is an ordinary
    ``all_gather``, whose transpose brings a differentiated weight's cotangent to its owner). ``fn``'s outputs may
    be any pytree of arrays (a site handler's outputs and records)."""
    flat, treedef = jax.tree.flatten((list(invals), extra), is_leaf=lambda x: isinstance(x, Deferred))
    after = next((v for v in invals if _is_array(v)), None)
    positions = [i for i, v in enumerate(flat) if isinstance(v, Deferred)]
    deferred = [flat[i] for i in positions]
    arrays = [i for i, v in enumerate(flat) if _is_array(v)]
    floating = [_inexact(flat[i]) for i in arrays]

    def call(wholes, operands):
        values = list(flat)
        for i, v in zip(arrays, operands):
            values[i] = v
        for i, w in zip(positions, wholes):
            values[i] = w
        args, more = jax.tree.unflatten(treedef, values)
        return fn(args, *more)

    @jax.custom_vjp
    def use(wholes, shards, operands):
        return call(wholes, operands)

    def forward(wholes, shards, operands):
        return call(wholes, operands), (shards, operands)

    def backward(saved, cotangent):
        shards, operands = saved
        # every cotangent enters the dependency: ghost mode's two pullbacks share the output gradients and differ in
        # a record's (the clip coefficient's port); on the output gradient alone XLA would merge their gathers
        anchors = [finite_zero(c) for c in jax.tree.leaves(cotangent) if jnp.issubdtype(c.dtype, jnp.inexact)]
        anchor = sum(anchors[1:], anchors[0]) if anchors else None
        again = [Deferred(s, d.dims, d.fn, d.casts).whole(anchor) for s, d in zip(shards, deferred)]

        def of_floats(wholes, floats):
            it = iter(floats)
            return call(wholes, [next(it) if f else o for o, f in zip(operands, floating)])

        _, pullback = jax.vjp(of_floats, again, [o for o, f in zip(operands, floating) if f])
        whole_ct, float_ct = pullback(cotangent)
        it = iter(float_ct)
        return whole_ct, jax.tree.map(lambda _: None, shards), [next(it) if f else None for f in floating]

    use.defvjp(forward, backward)
    wholes = [d.whole(after) for d in deferred]
    return use(wholes, [d.shards for d in deferred], [flat[i] for i in arrays])


def holds_deferred(tree) -> bool:
    """Whether ``tree`` (operand values, a site input) contains a :class:`Deferred` value."""
    return any(isinstance(x, Deferred) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Deferred)))


def materialise(value, after=None):
    """A deferred value made whole (outside any use: outputs, scan carries); other values unchanged."""
    return value.whole(after) if isinstance(value, Deferred) else value


def for_scan(tree):
    """``(tree of arrays to scan over, rebuild(slices) -> per-iteration tree)`` for a scan's ``xs`` (or per-site
    inputs stacked over the iterations): each deferred leaf whose shard the scan can slice (:func:`scan_slices`)
    is scanned as its shard and rebuilt as a deferred slice per iteration; other deferred values are made whole."""
    flat, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, Deferred))
    sliced = [scan_slices(v) for v in flat]
    arrays = [materialise(v) if s is None else s[0] for v, s in zip(flat, sliced)]

    def rebuild(pieces):
        pieces = jax.tree.leaves(pieces) if pieces is not None else []
        out = [p if s is None else s[1](p) for p, s in zip(pieces, sliced)]
        return jax.tree.unflatten(treedef, out)

    return jax.tree.unflatten(treedef, arrays), rebuild


def scan_slices(value, stacked_axes: int = 1):
    """For a deferred ``xs`` input of a scan: ``(scanned array, rebuild(slice) -> per-iteration value)`` when the
    scan can slice the shard itself (a leaf, split on a dimension other than the stacking one); else None."""
    if not isinstance(value, Deferred) or not value.is_leaf or value.dims[0] < stacked_axes:
        return None
    dim = value.dims[0] - stacked_axes
    return value.shards[0], lambda piece: Deferred((piece,), (dim,), casts=value.casts)


def _is_array(v) -> bool:
    return not isinstance(v, Deferred) and (isinstance(v, jax.Array) or hasattr(v, "aval"))


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_literal(v) -> bool:
    return not isinstance(v, Deferred) and not _is_array(v)


def _narrower(dtype, new_dtype) -> bool:
    return (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(new_dtype, jnp.floating)
            and jnp.finfo(new_dtype).bits < jnp.finfo(dtype).bits)


def held(paths, leaves, layout) -> list:
    """The leaves as the interpreter holds them: each leaf ``layout`` splits as a :class:`Deferred` shard."""
    return [hold(path, x, layout) for path, x in zip(paths, leaves)]


def held_consts(consts, layout) -> list:
    """The traced program's constants as the interpreter holds them: the whole stand-in of a frozen variable the
    ``layout`` knows (:class:`dpzero_jax.frozen_shards.FrozenShards`) as a :class:`Deferred` shard, gathered at its uses
    like a parameter; other constants unchanged."""
    constant = getattr(layout, "constant", None)
    if constant is None:
        return list(consts)
    out = []
    for c in consts:
        found = constant(c)
        out.append(c if found is None else leaf(*found))
    return out


def hold(path: str, x, layout):
    """One leaf as the interpreter holds it (a :class:`Deferred` shard if ``layout`` splits it)."""
    return x if layout is None else leaf(x, layout.dim(path))


def whole(paths, leaves, layout, needs_value=frozenset(), after=None) -> list:
    """The whole leaves the per-example terms read after the pass: unsharded leaves as they are; a sharded leaf in
    ``needs_value`` gathered (after ``after[i]`` exists, when given), any other one as its whole shape only."""
    if layout is None:
        return list(leaves)
    out = []
    for i, (path, x) in enumerate(zip(paths, leaves)):
        dim = layout.dim(path)
        if dim is None:
            out.append(x)
        elif i in needs_value:
            out.append(_gather(x, dim, (after or {}).get(i)))
        else:
            out.append(layout.full(path))
    return out


def tables(paths, leaves, layout):
    """What decides whether a lookup table's clipped sum is formed in pieces (:func:`piece_bounds`): the ZeRO-3
    ``layout`` inside ``jax.shard_map`` (the ``explicit`` strategy), else, traced under a GSPMD hint that asks for it,
    the parameters' split as :func:`dpzero_jax.spmd.sum_layout` reads it from the whole ``leaves``; None: neither
    (every sum formed whole)."""
    return layout if layout is not None else spmd.sum_layout(paths, leaves)


def sharded_table(plan, site, layout) -> bool:
    """Whether ``site`` looks up rows of a 2-D table that ``layout`` splits and whose float32 clipped sum exceeds
    ``layout.sum_chunk_bytes`` (formed whole, its reduction to the owners is written beside it by the TPU compiler:
    two tables alive, ``docs/benchmarks/tpu_aot.md``)."""
    path = plan.paths[site.view.leaf]
    return (site.kind == "gather" and not site.lengths
            and piece_bounds(layout.full(path).shape, layout.dim(path), layout.sum_chunk_bytes) is not None)


class InChunks:
    """A whole sum formed and sent to its owners piece by piece: ``parts[k](after)`` gives piece ``k`` (float32),
    whole along the leaf's split dimension and cut along ``axis``, formed only once ``after`` exists."""

    def __init__(self, parts, axis: int):
        self.parts, self.axis = tuple(parts), axis


def owned(paths, leaves, sums: dict, layout, scattered=frozenset(), split=None) -> list:
    """The clipped sums in the leaves' layout: ``sums[i](after)`` gives leaf ``i``'s whole sum (float32), formed only
    once ``after`` exists; zeros where a leaf has none. With a ``layout`` each whole sum goes to its owner
    (``psum_scatter`` over ``fsdp``) before the next is formed -- one whole-size sum alive at a time -- except the
    leaves in ``scattered`` (already in the owner's layout: the gradient of a differentiated shard). A sum given
    :class:`InChunks` goes piece by piece, each piece formed once the previous one is scattered: one piece alive at a
    time, never the whole sum. Under GSPMD (no ``layout``), ``split`` (:func:`tables`) constrains each piece of such
    a sum to the leaf's split, the next piece formed once it exists; the other sums are left to the partitioner."""
    out, previous = [], None
    for i, (path, x) in enumerate(zip(paths, leaves)):
        if i not in sums:
            out.append(jnp.zeros(tuple(x.shape), jnp.float32))
            continue
        pieces = sums[i].parts if isinstance(sums[i], InChunks) else (sums[i],)
        chained = layout is None and split is not None and isinstance(sums[i], InChunks)
        done, piece = [], None
        for form in pieces:
            if chained:
                piece = split.scatter(path, form(piece))
                done.append(piece)
                continue
            value = form(previous if layout is not None else None)
            if layout is not None and i not in scattered:
                value = layout.scatter(path, value)
            previous = value
            done.append(value)
        out.append(jnp.concatenate(done, axis=sums[i].axis) if isinstance(sums[i], InChunks) else done[0])
    return out


def ready(value):
    """A sum already formed (by autodiff), as :func:`owned` takes it."""
    return lambda after: value.astype(jnp.float32)

