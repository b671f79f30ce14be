"""Algebra of factored per-example gradients: norms and clipped sums without per-example gradients.

Every supported layer writes the per-example gradient of each of its parameters in one of two forms:

* :class:`Outer` -- a weight viewed as a ``[rows, cols]`` matrix whose per-example gradient is a sum of outer
  products over positions, ``G_i = sum_t left[i, t] (x) right[i, t]`` (a linear layer: ``a_i^T g_i``; an
  embedding: ``onehot(ids_i)^T g_i`` with the one-hot never built);
* :class:`Direct` -- the per-example gradient itself, ``[B, *shape]`` (biases and norm scales: cheap).

A parameter used by several layer calls (tied weights) has one entry per use; its per-example gradient is the sum
of the uses and its squared norm includes every cross term ``2 <G_u, G_v>``.

The squared Frobenius norm of an :class:`Outer` gradient is computed either by the ghost norm
``<L_i L_i^T, R_i R_i^T>`` (memory ``B*T*T``) or by instantiating ``G_i`` (memory ``B*rows*cols``); the *mixed*
rule picks ghost iff ``2 T^2 < rows * cols`` (paper 000, Appendix A), decided from static shapes at trace time.
All norms are accumulated in float32.

``kernel`` selects how the weight terms are computed: ``"xla"`` (the jnp forms below, which build the
``[B, T, T]`` Grams or the ``[B, rows, cols]`` gradients) or ``"pallas"`` (the tiled kernels of
:mod:`dpzero_jax_kernels.ghost_norm`, which build neither). With ``"pallas"`` both forms cost ``O(tile^2)`` memory, so
the mixed rule decides on operations alone (:func:`use_ghost`), and several uses of one weight are concatenated along
the positions (``sum_u L_u^T R_u = [L_1; L_2; ..]^T [R_1; R_2; ..]``) so that one kernel call covers every cross term.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

# the rules on shapes alone live in a module without JAX (the planner uses them); re-exported here
from dpzero_jax import norm_rules
from dpzero_jax.norm_rules import INSTANTIATION_COST, INSTANTIATION_MEMORY_BOUND, shape_rule, space_rule  # noqa: F401
from dpzero_jax_kernels import ghost_norm

Array = jax.Array

NORM_METHODS = ("mixed", "fastest", "ghost", "instantiate")
KERNELS = ("xla", "pallas")



@dataclasses.dataclass(frozen=True)
class Outer:
    """Per-example gradient ``G_i = sum_t left[i, t] (x) right[i, t]`` of a parameter of shape ``shape``.

    left:  ``[B, T, rows]`` floats, or int ids ``[B, T]`` (an implicit one-hot over ``rows``) when ``left_is_ids``.
    right: ``[B, T, cols]``.
    ``rows * cols == prod(shape)``; the parameter is ``G`` reshaped to ``shape``.
    """

    left: Array
    right: Array
    rows: int
    shape: tuple[int, ...]
    left_is_ids: bool = False

    @property
    def cols(self) -> int:
        return self.right.shape[-1]

    @property
    def positions(self) -> int:
        return self.right.shape[1]


@dataclasses.dataclass(frozen=True)
class Direct:
    """Per-example gradient given explicitly: ``value [B, *shape]``."""

    value: Array


PerExampleGrad = Outer | Direct


def _f32(x: Array) -> Array:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _gram(u: Outer, v: Outer, side: str) -> Array:
    """``[B, Tu, Tv]`` inner products between the position vectors of ``u`` and ``v`` on one side."""
    if side == "right":
        return jnp.einsum("btc,bsc->bts", u.right, v.right, preferred_element_type=jnp.float32)
    if u.left_is_ids and v.left_is_ids:
        return (u.left[:, :, None] == v.left[:, None, :]).astype(jnp.float32)
    if u.left_is_ids:  # <onehot(id_t), v_s> = v[s, id_t]: per example, the columns id_t of v.left [Tv, rows]
        # One batched gather. take_along_axis with a broadcast [B, Tv, Tu] index reads the same entries, but the
        # TPU compiler lowers it with copies of the whole [B, Tv, rows] operand (a tied LM head's output gradient:
        # +590 MiB temporaries and +6 GB accessed at B 4, T 512, V 50304, against +197 MiB / +0.5 GB for this form).
        gathered = jax.vmap(lambda rows, ids: jnp.take(rows, ids, axis=1))(v.left, u.left)   # [B, Tv, Tu]
        return jnp.swapaxes(_f32(gathered), 1, 2)
    if v.left_is_ids:
        return jnp.swapaxes(_gram(v, u, "left"), 1, 2)
    return jnp.einsum("btr,bsr->bts", u.left, v.left, preferred_element_type=jnp.float32)


def kept(value: Array) -> Array:
    """``value`` as one buffer that its consumers all read: an instantiated per-example gradient kept in bfloat16 is
    normed and summed as rounded only if the compiler cannot re-derive it inside each consumer from the float32
    contraction (and drop the rounding there: XLA removes ``f32 -> bf16 -> f32`` conversion pairs in some
    fusions). Float32 values are returned as they are."""
    return value if value.dtype == jnp.float32 else jax.lax.optimization_barrier(value)


def direct_sq_norm(value: Array, example_axis: int = 0) -> Array:
    """``[B]`` squared norms, accumulated in float32, of per-example gradients ``value [B, ...]`` (any float
    dtype: a gradient kept in bfloat16 is normed as kept). ``example_axis``: where the examples are (``1`` for
    blocks first, ``[K, B, ...]``)."""
    if example_axis == 0:
        return jnp.sum(jnp.square(_f32(value)).reshape(value.shape[0], -1), axis=1)
    return jnp.sum(jnp.square(_f32(value)), axis=tuple(a for a in range(value.ndim) if a != example_axis))


def param_shape(use: PerExampleGrad) -> tuple[int, ...]:
    """The shape of the parameter whose per-example gradient ``use`` describes."""
    return tuple(use.value.shape[1:]) if isinstance(use, Direct) else tuple(use.shape)


def instantiate(use: PerExampleGrad, dtype=jnp.float32, matrix: bool = False) -> Array:
    """The per-example gradient ``[B, *shape]`` in ``dtype`` (float32 by default; used by the instantiation branch
    and by tests). A dense use's contraction accumulates in float32 and writes ``dtype``; an embedding's rows are
    added in ``dtype``. ``matrix=True``: an :class:`Outer` use's gradient as ``[B, rows, cols]``, the contraction's
    own shape. A gradient kept for the clipped sum stays in that shape: reshaped to a parameter shape with short
    trailing dimensions (GPT-2's QKV kernel ``[d, 3, heads, head_dim]``), the TPU compiler lays it out anew, one
    more write and read of every per-example gradient."""
    if isinstance(use, Direct):
        return _f32(use.value).astype(dtype)
    batch = use.right.shape[0]
    if use.left_is_ids:
        rows = jnp.zeros((batch, use.rows, use.cols), dtype)
        example = jnp.broadcast_to(jnp.arange(batch)[:, None], use.left.shape)
        full = rows.at[example, use.left].add(_f32(use.right).astype(dtype))
    else:
        full = jnp.einsum("btr,btc->brc", use.left, use.right, preferred_element_type=jnp.float32).astype(dtype)
    return full if matrix else full.reshape((batch,) + tuple(use.shape))


def instantiate_sum(uses: Sequence[PerExampleGrad], dtype=jnp.float32) -> Array:
    """``sum_u G_u``, instantiated: ``[B, rows, cols]`` when every use factors the parameter the same way (see
    :func:`instantiate`'s ``matrix``), else ``[B, *shape]``. Reshape what is reduced from it with
    :func:`param_shape`."""
    matrix = all(isinstance(u, Outer) for u in uses) and len({(u.rows, u.cols) for u in uses}) == 1
    return sum(instantiate(u, dtype, matrix) for u in uses)


def kept_sum_and_sq_norm(uses: Sequence[PerExampleGrad], dtype=jnp.float32, shape: tuple[int, ...] | None = None,
                         example_axis: int = 0) -> tuple[Array, Array]:
    """``(G, sq)``: the instantiated ``G = sum_u G_u`` as kept for the clipped sum (see :func:`instantiate_sum`) and
    its ``[B]`` squared norms, taken of what is kept. In float32, ``G`` as computed. In a narrower ``dtype``, for
    dense uses: the float32 sum rounded once with ``lax.reduce_precision`` to ``dtype``'s precision, normed, and kept
    in ``dtype`` (an exact cast: the values are representable), so the norm can be computed in the fusion that
    writes ``G`` and still be the norm of what the clipped sum reads, whatever conversions the compiler merges. An
    embedding's rows are added in ``dtype`` (a float32 ``[B, V, d]`` scatter would undo the saving) and normed after
    :func:`kept`. ``shape``: ``G`` reshaped to it before it is normed and kept, the examples on its axis
    ``example_axis`` (first, or second after the blocks: ``[K, B, ...]``); the norms are over every other axis."""
    rounds = jnp.dtype(dtype) != jnp.float32 and all(isinstance(u, Outer) and not u.left_is_ids for u in uses)
    total = instantiate_sum(uses, jnp.float32 if rounds else dtype)
    if shape is not None:
        total = total.reshape(shape)
    if not rounds:
        value = kept(total)
        return value, direct_sq_norm(value, example_axis)
    info = jnp.finfo(dtype)
    rounded = jax.lax.reduce_precision(total, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return kept(rounded.astype(dtype)), direct_sq_norm(rounded, example_axis)


def use_ghost(uses: Sequence[PerExampleGrad], method: str, kernel: str = "xla", reuse: bool = True,
              kept_dtype=None) -> bool:
    """Ghost norm or instantiation for one parameter, from static shapes (and, with ``kept_dtype``, the dtypes).

    ``"mixed"``: the space rule of paper 000 (Appendix A), ghost iff ``2 T^2 < rows * cols``.
    ``"fastest"``: a time rule for engines that reuse an instantiated gradient for the clipped sum (book-keeping):
    ghost costs the right Grams of every pair of uses, ``T^2 cols`` multiply-adds per example (``T``: all uses'
    positions), plus the left Grams between dense uses, ``T_dense^2 rows``; instantiation with reuse about
    ``INSTANTIATION_COST`` multiply-add equivalents per gradient element (its extra memory passes); ghost iff cheaper,
    or iff the instantiated gradient, kept for the sum, would hold more than ``INSTANTIATION_MEMORY_BOUND`` (2) times
    the per-example operands the ghost norm keeps, ``T (rows + cols)`` (:func:`norm_rules.operand_elements`).
    An embedding's left Gram is an equality test (with another embedding) or a gather (with a dense use), not a
    contraction; a table used only by embeddings keeps the space rule. A tied table (embedding and head) at long
    sequences is thus instantiated: its ghost norm would contract the head's ``[T, V]`` output gradient with itself.
    ``reuse=False`` (the gradient is summed elsewhere: ghost mode's weighted leaves) adds the instantiation's own
    contraction, ``T_dense rows cols``, to its cost: GPT-2 XL's tied table at T 1024 is then ghost-normed (compiled
    for a v5e chip, also the form that holds less memory), GPT-2 small's (``d`` 768) still instantiated (fewer
    operations; in memory its ghost norm held less, 12.1 against 12.9 GiB at 8 sequences per chip, where ghost mode
    book-keeps that table anyway: ``docs/benchmarks/compiled.md``).

    With ``kernel="pallas"`` neither form needs a large buffer, so ``"mixed"`` and ``"fastest"`` compare operations
    for dense weights: the ghost kernel computes half of the ``T x T`` tile pairs, ``T^2 (rows + cols) / 2``
    multiply-adds, the instantiation kernel ``T rows cols``; ghost iff ``T (rows + cols) < 2 rows cols``. Embeddings
    keep the space rule (their instantiation is an XLA scatter).

    ``kept_dtype`` (the engine on the traced program, which knows the dtypes: ``DPConfig.instantiated_dtype``): the
    time rule's bound also in bytes -- a gradient the rule with reuse instantiates is normed by the ghost form
    instead, and summed from the uses' operands and output gradients (which book-keeping holds anyway), where kept
    in ``kept_dtype`` it would take more than ``INSTANTIATION_MEMORY_BOUND`` times those operands' bytes and the rule
    without reuse takes the ghost norm too (:func:`kept_outweighs_operands`). The bound in elements lets GPT-2 XL's
    tied table (``[50257, 1600]``, bfloat16 operands, one sequence of 1024 per TPU chip) be instantiated: 1.5x its
    operands' elements, but its float32 gradient is 322 MB against their 109 MB, kept on the chip together with the
    float32 clipped sum (the layer-wise step held 2.0x the non-private step's temporaries that way).
    """
    if any(isinstance(u, Direct) for u in uses):
        return False
    if method == "ghost":
        return True
    if method == "instantiate":
        return False
    if _kernels_decide(uses, kernel):
        return sum(u.positions for u in uses) * (uses[0].rows + uses[0].cols) < 2 * math.prod(uses[0].shape)
    if shape_rule(method, *_rule_shape(uses), reuse):
        return True
    return (method == "fastest" and reuse and kept_dtype is not None and kept_outweighs_operands(uses, kept_dtype)
            and shape_rule(method, *_rule_shape(uses), reuse=False))


def _operand_bytes(uses: Sequence[Outer]) -> int:
    """Per-example bytes of the factored uses' operands (``[T, rows]`` or ids, ``[T, cols]``) at their dtypes."""
    return sum(math.prod(u.left.shape[1:]) * jnp.dtype(u.left.dtype).itemsize
               + math.prod(u.right.shape[1:]) * jnp.dtype(u.right.dtype).itemsize for u in uses)


def _kept_over_operands(uses: Sequence[Outer], kept_dtype) -> float:
    """Bytes of a per-example gradient kept in ``kept_dtype`` over those of the uses' per-example operands."""
    return math.prod(uses[0].shape) * jnp.dtype(kept_dtype).itemsize / _operand_bytes(uses)


def kept_outweighs_operands(uses: Sequence[Outer], kept_dtype) -> bool:
    """Whether a per-example gradient kept in ``kept_dtype`` holds more than ``INSTANTIATION_MEMORY_BOUND`` times
    the bytes of the uses' per-example operands (the time rule's bound in bytes; see :func:`use_ghost`)."""
    return _kept_over_operands(uses, kept_dtype) > INSTANTIATION_MEMORY_BOUND


def use_note(uses: Sequence[PerExampleGrad], method: str, kernel: str = "xla", reuse: bool = True,
             kept_dtype=None) -> str:
    """Why :func:`use_ghost` picks the ghost norm where only the time rule's memory bound decides it (for
    ``explain_plan``); else ``""``."""
    if any(isinstance(u, Direct) for u in uses) or _kernels_decide(uses, kernel):
        return ""
    note = norm_rules.bound_note(method, *_rule_shape(uses), reuse)
    if note or shape_rule(method, *_rule_shape(uses), reuse) or not use_ghost(uses, method, kernel, reuse, kept_dtype):
        return note
    return (f"ghost by the time rule's memory bound in bytes: kept instantiated ({jnp.dtype(kept_dtype).name}) it "
            f"would hold {_kept_over_operands(uses, kept_dtype):.1f}x its operands' bytes (more than "
            f"{INSTANTIATION_MEMORY_BOUND}x); summed from them")


def _kernels_decide(uses: Sequence[Outer], kernel: str) -> bool:
    """Whether :func:`use_ghost` compares the Pallas kernels' operations (dense uses only) instead of applying the
    rules on shapes."""
    return kernel == "pallas" and not any(u.left_is_ids for u in uses)


def _rule_shape(uses: Sequence[Outer]) -> tuple[int, int, int, int]:
    """``(positions, dense positions, rows, cols)`` of a parameter's factored uses: the arguments of the rules on
    shapes (:mod:`dpzero_jax.norm_rules`)."""
    return (sum(u.positions for u in uses), sum(u.positions for u in uses if not u.left_is_ids), uses[0].rows,
            uses[0].cols)


def _concat_positions(arrays: Sequence[Array]) -> Array:
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=1)


def _pallas_sq_norm(uses: Sequence[Outer], ghost: bool) -> Array:
    """``[B]`` with the Pallas kernels: dense uses concatenated along positions (one call covers their cross terms),
    likewise the embedding uses; cross terms between an embedding use and a dense use stay in XLA (a gather)."""
    dense = [u for u in uses if not u.left_is_ids]
    ids = [u for u in uses if u.left_is_ids]
    result = 0.0
    if dense:
        left = _concat_positions([u.left for u in dense])
        right = _concat_positions([u.right for u in dense])
        if ghost:
            result = result + ghost_norm.gram_sq_norm(left, right)
        else:
            result = result + ghost_norm.instantiated_sq_norm(left, right)
    if ids:
        result = result + ghost_norm.gram_sq_norm(_concat_positions([u.left for u in ids]),
                                                  _concat_positions([u.right for u in ids]), left_is_ids=True)
    for u in ids:
        for v in dense:
            result = result + 2.0 * jnp.sum(_gram(u, v, "left") * _gram(u, v, "right"), axis=(1, 2))
    return result


def sq_norm(uses: Sequence[PerExampleGrad], method: str = "mixed", kernel: str = "xla", reuse: bool = True) -> Array:
    """``[B]`` squared L2 norm of the per-example gradient ``sum_u G_u`` of one parameter (float32).

    kernel: ``"xla"`` or ``"pallas"`` (see the module docstring). ``reuse``: as :func:`use_ghost` -- False where the
    caller forms the clipped sum by its own contraction (ghost and fused taps), so an instantiation is for the norm
    only and the time rule counts its contraction.
    """
    if not uses:
        raise ValueError("sq_norm needs at least one use of the parameter")
    kinds = {type(u) for u in uses}
    if len(kinds) > 1:
        raise TypeError("a parameter's uses must all be Outer or all be Direct")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    ghost = use_ghost(uses, method, kernel, reuse)
    if kernel == "pallas" and kinds == {Outer} and (ghost or not any(u.left_is_ids for u in uses)):
        return _pallas_sq_norm(uses, ghost)
    if not ghost:
        return direct_sq_norm(instantiate_sum(uses))
    result = 0.0
    for i, u in enumerate(uses):
        for j in range(i, len(uses)):
            v = uses[j]
            term = jnp.sum(_gram(u, v, "left") * _gram(u, v, "right"), axis=(1, 2))
            result = result + (term if i == j else 2.0 * term)
    return result


def _per_example(vector: Array, ndim: int) -> Array:
    """``vector [B]`` shaped to broadcast against an ``ndim``-dimensional array with examples first."""
    return vector.reshape((-1,) + (1,) * (ndim - 1))


def _zero_where_inactive(x: Array, active: Array) -> Array:
    """Zero the rows of examples with a zero coefficient (never multiply NaN by zero)."""
    return zero_inactive(x, active, 0)


def zero_inactive(x: Array, active: Array, example_axis: int) -> Array:
    """``x`` with the examples on ``example_axis`` whose ``active [B]`` is false set to zero: a select, never a
    multiply by zero (an example's NaN stays out)."""
    keep = jax.lax.broadcast_in_dim(active, x.shape, (example_axis,))
    return jax.lax.select(keep, x, jax.lax.full_like(x, 0))


SMALL_DIRECT = 4096   # elements per example up to which a direct clipped sum is a multiply-and-reduce


def _coef_weighted_rows(value: Array, coef: Array) -> Array:
    """``sum_i coef_i value_i``. Small leaves (biases, norm scales): a multiply and reduce -- XLA:CPU compiles each
    ``[B]``-vector contraction as its own elemental loop kernel (about 11 ms of compile time, one per leaf). Larger
    ones: the contraction, faster to run there (XLA:CPU's reduction over the example axis took 1.7 ms for
    ``[4, 49152]``), and its operand stays materialised (as a reduction's input, XLA may fuse the dots that produce
    the per-example gradients into the reduction's loop: 74 s a step for ``vmap`` on W1)."""
    if math.prod(value.shape[1:]) <= SMALL_DIRECT:
        return jnp.sum(value * _per_example(coef, value.ndim), axis=0)
    return jnp.einsum("b...,b->...", value, coef)


def scaled_rows(value: Array, coef: Array, example_axis: int) -> Array:
    """``coef_i value_i`` for the examples on ``example_axis`` (float32), zero -- by a select, never a multiply by
    zero -- where ``coef_i == 0``: one fused loop, whose reduction over the examples XLA:CPU hands to its library."""
    value = _f32(value)
    scaled = value * jax.lax.broadcast_in_dim(coef.astype(jnp.float32), value.shape, (example_axis,))
    return zero_inactive(scaled, coef != 0, example_axis)


def weighted_rows_at(value: Array, coef: Array, example_axis: int) -> Array:
    """``sum_i coef_i value_i`` over the examples on ``example_axis`` of ``value`` (the other axes kept, in order),
    float32; examples with ``coef == 0`` contribute exactly zero. For per-example gradients left where a scan put
    the examples (``[*lengths, B, ...]``): no transpose of ``value`` to examples-first; the select and the scaling
    one loop (:func:`scaled_rows`: the weights broadcast apart were one more kernel a leaf shape)."""
    if example_axis == 0:
        return _coef_weighted_rows(_zero_where_inactive(_f32(value), coef != 0), coef.astype(jnp.float32))
    return jnp.sum(scaled_rows(value, coef, example_axis), axis=example_axis)


REDUCED_BLOCKS = 16   # blocks from which weighted_blocks reduces the scaled rows instead of contracting them


def weighted_blocks(value: Array, coef: Array) -> Array:
    """``[K, ...]``: ``sum_i coef_i value[k, i]`` for per-example gradients kept blocks first, ``value [K, B,
    ...]`` (a scanned layer's, in the layout the scan leaves them), float32; examples with ``coef == 0`` contribute
    exactly zero; no transpose of ``value``. Fewer than ``REDUCED_BLOCKS`` blocks: one batched contraction over the
    examples (a matrix-vector product per block). From ``REDUCED_BLOCKS`` on (a deep scan), the scaled rows
    (:func:`scaled_rows`) reduced over the examples: XLA:CPU compiles each such contraction as a kernel of its own
    (~10 ms of compile time a leaf; 48 scanned layers: 10 of them), and hands the reduction to its library; that
    runs about 1% slower in the 48-layer step of ``experiments/bench_depth.py`` and up to 13x slower with 1 or 2
    blocks (``[1, 16, 262144]``: 14.7 against 1.1 ms), hence the threshold."""
    k, batch = value.shape[:2]
    rows = value.reshape(k, batch, -1)
    if k >= REDUCED_BLOCKS:
        return jnp.sum(scaled_rows(rows, coef, 1), axis=1).reshape((k,) + value.shape[2:])
    weights = jnp.broadcast_to(coef.astype(jnp.float32)[None, :], (k, batch))
    kept = zero_inactive(_f32(rows), coef != 0, 1)
    return jnp.einsum("kb,kbn->kn", weights, kept).reshape((k,) + value.shape[2:])


def weighted_sum(uses: Sequence[PerExampleGrad], coef: Array, kernel: str = "xla",
                 scatter_apart: bool = False) -> Array:
    """``sum_i coef_i * sum_u G_{u,i}`` with the parameter's shape, accumulated and returned in float32 (the
    privatized sum: rounded to half precision before the noise it would move by more than one example's clipped
    contribution when one example changes, see ``docs/privacy.md``). An ``Outer`` use's contraction takes its
    half-precision left factor (the records) as it is and the float32 ``coef_i``-scaled right factor unrounded (a
    mixed-precision contraction, float32 result).
    ``scatter_apart``: an embedding use's scatter-add is formed into zeros behind an ``optimization_barrier``, not
    folded into the other uses' sum (under GSPMD a tied table's ``d``-sharded sum was otherwise all-gathered again
    to scatter into: GPT-2 XL's layer-wise step on 256 TPU chips moved one more ``[V, d]`` gather a step).

    coef: ``[B]``. Examples with ``coef == 0`` contribute exactly zero even if their activations or output
    gradients are NaN or infinite. ``kernel="pallas"``: dense uses go through the weighted-sum kernel where the
    backend has one (TPU, and its interpreter on CPU), which skips inactive examples instead of masking copies.
    """
    active = coef != 0
    coef = coef.astype(jnp.float32)
    total = None
    for u in uses:
        if isinstance(u, Direct):
            value = _zero_where_inactive(_f32(u.value), active)
            part = _coef_weighted_rows(value, coef)
        else:
            right = _zero_where_inactive(_f32(u.right), active) * coef[:, None, None]
            if u.left_is_ids:
                flat = jnp.zeros((u.rows, u.cols), jnp.float32)
                part = flat.at[u.left.reshape(-1)].add(right.reshape(-1, u.cols)).reshape(u.shape)
                if scatter_apart and len(uses) > 1:
                    part = jax.lax.optimization_barrier(part)
            elif kernel == "pallas" and ghost_norm.has_kernel("weighted_sum", u.left, u.right):
                part = ghost_norm.weighted_sum(u.left, u.right, coef).reshape(u.shape)
            else:
                left = _zero_where_inactive(u.left, active)
                part = jax.lax.dot_general(left, right, (((0, 1), (0, 1)), ((), ())),
                                           preferred_element_type=jnp.float32).reshape(u.shape)
        total = part if total is None else total + part
    return total
