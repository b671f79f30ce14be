"""Mosaic TPU (Pallas) kernels for per-example gradient norms and the clipped sum, O(tile^2) memory per example.

Shapes: ``left [B, T, rows]`` (or int ``ids [B, T]``), ``right [B, T, cols]``; per example ``i`` the gradient is
``G_i = left_i^T right_i`` (``[rows, cols]``). No kernel ever holds a ``[T, T]`` or ``[rows, cols]`` array per
example: the Gram form accumulates ``<A_I A_J^T, R_I R_J^T>`` over ``[block_t, block_t]`` tiles, the instantiation
form ``||L^T R||^2`` over ``[block_rows, block_cols]`` tiles, both in float32 VMEM scratch, whatever the input dtype.

Grids (the batch axis and the output tile axis are ``parallel``, reductions ``arbitrary`` and innermost):

* Gram, self term: ``(B, nI, nC, nK)``. Tile pairs ``(I, J)`` are visited in circulant order ``J = (I + c) mod nI``
  for ``c = 0 .. nI // 2``: every unordered pair once (twice for ``c = nI / 2`` with ``nI`` even), so each off-diagonal
  product is counted with weight 2 (1 on the diagonal and on ``c = nI / 2``) -- half the work of the full square.
  ``k`` runs over feature chunks of both factors (``nK = max(chunks of rows, chunks of cols)``; a factor with fewer
  chunks re-uses its last block index, which Pallas does not re-fetch, and skips its matmul).
* Gram, cross term between two uses ``u, v`` of one weight (tied weights): ``(B, nI, nJ, nK)``, the full rectangle.
* Embedding: the left Gram is the equality test of the ids tiles (no one-hot, no matmul).
* Instantiation: ``(B, nR, nC, nT)``; ``acc[tR, tC] += L[T-chunk, R-tile]^T R[T-chunk, C-tile]``, squared and summed
  at the last ``T`` chunk.
* Weighted sum: ``(nR, nC, B, nT)`` with the coefficients ``[B]`` in SMEM (scalar prefetch); an example whose
  coefficient is 0 is skipped entirely (NaN-safe), the output block ``[tR, tC]`` float32 is the accumulator.

Ragged sizes: blocks may overhang the arrays (``pl.cdiv`` grids); the overhanging rows / columns of every loaded block
are replaced by zeros with ``jnp.where`` (never multiplied: the out-of-bounds contents are unspecified, NaN in the
interpreter), only when the static shapes are not multiples of the block.

Outputs of the norm kernels are ``[B, n_tiles, 1, 128]`` partial sums (lane 0 read, tile axis summed by XLA) so that
the tile axis can be ``parallel`` (both TensorCores of a megacore chip busy even with one example per shard).

These kernels lower with Mosaic on TPU and run anywhere with ``interpret=True`` (the Pallas HLO interpreter) or
``interpret=pltpu.InterpretParams()`` (the TPU simulator). Block sizes must respect Mosaic's tiling: the minor block
dimension a multiple of 128 or the full dimension, the second-minor a multiple of 8 (16 for bfloat16) or the full
dimension; :func:`_block` clamps a requested size to the full dimension when the array is smaller.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Array = jax.Array

LANES = 128
DEFAULT_BLOCK_T = 256       # positions per Gram tile
DEFAULT_BLOCK_K = 512       # features per chunk in the Gram form
DEFAULT_BLOCK_OUT = 256     # rows / cols per output tile of the instantiation form and the weighted sum
DEFAULT_BLOCK_REDUCE = 512  # positions per chunk of the instantiation form and the weighted sum


def _block(requested: int, size: int) -> int:
    """The block size along a dimension of ``size``: ``requested``, or the full dimension if that is smaller."""
    return size if size <= requested else requested


def _position_block(block_t: int, t_u: int, t_v: int, multiple: int) -> int:
    """Positions per Gram tile for two uses of ``t_u`` and ``t_v`` positions: ``block_t``, or (both shorter) the full
    length when they are equal, else the longer one rounded up to a multiple of ``multiple``."""
    longest = max(t_u, t_v)
    if longest > block_t:
        return block_t
    if t_u == t_v:
        return longest
    return -(-longest // multiple) * multiple


def _valid(block: int, index, size: int, axis: int, shape: tuple[int, int]):
    """Boolean ``shape`` mask: element ``index * block + position < size`` along ``axis``."""
    positions = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return positions + index * block < size


def _zero_outside(x: Array, block: int, index, size: int, axis: int) -> Array:
    """``x`` with its elements past ``size`` along ``axis`` (a ragged last block) replaced by zeros."""
    if size % block == 0:
        return x
    return jnp.where(_valid(block, index, size, axis, x.shape), x, jnp.zeros((), x.dtype))


def _dot_nt(x: Array, y: Array) -> Array:
    """``x [m, k] . y [n, k]^T -> [m, n]`` float32."""
    return jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(x: Array, y: Array) -> Array:
    """``x [k, m]^T . y [k, n] -> [m, n]`` float32."""
    return jax.lax.dot_general(x, y, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _total(x: Array) -> Array:
    """Sum of a 2-D array as a ``[1, 1]`` array (two single-axis reductions, which Mosaic lowers everywhere)."""
    return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)


def out_struct(shape: tuple[int, ...], like: Array) -> jax.ShapeDtypeStruct:
    """A float32 output type that varies over the same manual mesh axes as the input ``like`` (inside
    ``jax.shard_map`` with ``check_vma``, pallas_call needs to be told; elsewhere this is the plain struct)."""
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=manual)


def _params(*semantics: str) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _partials_to_norms(partials: Array) -> Array:
    """``[B, n, 1, LANES]`` partial sums (the value broadcast over lanes) -> ``[B]``."""
    return jnp.sum(partials[:, :, 0, 0], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# Gram (ghost) form, dense or ids left factor.

def _gram_kernel(*refs, left_is_ids: bool, symmetric: bool, n_i: int, n_left_chunks: int, n_right_chunks: int,
                 n_chunks: int, block_t: int, block_kl: int, block_kr: int, t_u: int, t_v: int, rows: int,
                 cols: int):
    if left_is_ids:
        lu_ref, lv_ref, ru_ref, rv_ref, out_ref, right_gram = refs
        left_gram = None
    else:
        lu_ref, lv_ref, ru_ref, rv_ref, out_ref, left_gram, right_gram = refs
    i, c, k = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    j = jax.lax.rem(i + c, n_i) if symmetric else c

    @pl.when(jnp.logical_and(c == 0, k == 0))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(k == 0)
    def _():
        right_gram[...] = jnp.zeros_like(right_gram)
        if left_gram is not None:
            left_gram[...] = jnp.zeros_like(left_gram)

    def tile(ref, position_block, feature_chunk, positions, features, block_k):
        x = _zero_outside(ref[...], block_t, position_block, positions, 0)
        return _zero_outside(x, block_k, feature_chunk, features, 1)

    if left_gram is not None:
        @pl.when(k < n_left_chunks)
        def _():
            left_gram[...] += _dot_nt(tile(lu_ref, i, k, t_u, rows, block_kl), tile(lv_ref, j, k, t_v, rows, block_kl))

    @pl.when(k < n_right_chunks)
    def _():
        right_gram[...] += _dot_nt(tile(ru_ref, i, k, t_u, cols, block_kr), tile(rv_ref, j, k, t_v, cols, block_kr))

    @pl.when(k == n_chunks - 1)
    def _():
        if left_is_ids:
            # ids blocks: [block_t, 1] (rows of the tile) and [1, block_t] (columns); overhanging ids are garbage but
            # the matching right rows / columns are zero, so the selected Gram entries are zero there.
            product = jnp.where(lu_ref[...] == lv_ref[...], right_gram[...], 0.0)
        else:
            product = left_gram[...] * right_gram[...]
        total = _total(product)
        if symmetric:
            weight = jnp.where(jnp.logical_or(c == 0, 2 * c == n_i), 1.0, 2.0).astype(jnp.float32)
            total = total * weight
        out_ref[...] += jnp.broadcast_to(total, out_ref.shape)


def gram_sq_norm(left_u: Array, right_u: Array, left_v: Array | None = None, right_v: Array | None = None, *,
                 left_is_ids: bool = False, block_t: int = DEFAULT_BLOCK_T, block_k: int = DEFAULT_BLOCK_K,
                 interpret=False) -> Array:
    """``[B]`` float32: ``sum_{t,s} <left_u[t], left_v[s]> <right_u[t], right_v[s]>`` without any ``[T, S]`` array.

    left_u ``[B, T, rows]`` (or int ids ``[B, T]`` with ``left_is_ids``: ``<onehot(a), onehot(b)> = 1{a == b}``),
    right_u ``[B, T, cols]``; ``left_v [B, S, ...]``, ``right_v [B, S, cols]`` (default: the ``u`` pair, and then
    only half of the tile pairs are computed). float32 or bfloat16 inputs, float32 accumulation.
    """
    symmetric = left_v is None and right_v is None
    if symmetric:
        left_v, right_v = left_u, right_u
    elif left_v is None or right_v is None:
        raise ValueError("gram_sq_norm: give both left_v and right_v, or neither")
    batch, t_u, cols = right_u.shape
    t_v = right_v.shape[1]
    rows = 0 if left_is_ids else left_u.shape[2]
    multiple = 16 if any(x.dtype.itemsize < 4 for x in (right_u, right_v)) else 8
    if block_t % multiple or block_k % LANES:
        raise ValueError(f"block_t must be a multiple of {multiple} and block_k of {LANES}; got {block_t}, {block_k}")
    tile_t = _position_block(block_t, t_u, t_v, multiple)
    n_i, n_j = pl.cdiv(t_u, tile_t), pl.cdiv(t_v, tile_t)
    n_c = n_i // 2 + 1 if symmetric else n_j
    block_kr = _block(block_k, cols)
    n_right_chunks = pl.cdiv(cols, block_kr)
    if left_is_ids:
        block_kl, n_left_chunks = 0, 0
    else:
        block_kl = _block(block_k, rows)
        n_left_chunks = pl.cdiv(rows, block_kl)
    n_chunks = max(n_left_chunks, n_right_chunks)

    def other(i, c):
        return jax.lax.rem(i + c, n_i) if symmetric else c

    def chunk(k, n):
        return jnp.minimum(k, n - 1)

    right_specs = [pl.BlockSpec((None, tile_t, block_kr), lambda b, i, c, k: (b, i, chunk(k, n_right_chunks))),
                   pl.BlockSpec((None, tile_t, block_kr),
                                lambda b, i, c, k: (b, other(i, c), chunk(k, n_right_chunks)))]
    if left_is_ids:
        left_args = (left_u.astype(jnp.int32)[:, :, None], left_v.astype(jnp.int32)[:, None, :])
        left_specs = [pl.BlockSpec((None, tile_t, 1), lambda b, i, c, k: (b, i, 0)),
                      pl.BlockSpec((None, 1, tile_t), lambda b, i, c, k: (b, 0, other(i, c)))]
        scratch = [pltpu.VMEM((tile_t, tile_t), jnp.float32)]
    else:
        left_args = (left_u, left_v)
        left_specs = [pl.BlockSpec((None, tile_t, block_kl), lambda b, i, c, k: (b, i, chunk(k, n_left_chunks))),
                      pl.BlockSpec((None, tile_t, block_kl),
                                   lambda b, i, c, k: (b, other(i, c), chunk(k, n_left_chunks)))]
        scratch = [pltpu.VMEM((tile_t, tile_t), jnp.float32), pltpu.VMEM((tile_t, tile_t), jnp.float32)]
    kernel = functools.partial(
        _gram_kernel, left_is_ids=left_is_ids, symmetric=symmetric, n_i=n_i, n_left_chunks=n_left_chunks,
        n_right_chunks=n_right_chunks, n_chunks=n_chunks, block_t=tile_t, block_kl=block_kl, block_kr=block_kr,
        t_u=t_u, t_v=t_v, rows=rows, cols=cols)
    partials = pl.pallas_call(
        kernel,
        out_shape=out_struct((batch, n_i, 1, LANES), right_u),
        grid=(batch, n_i, n_c, n_chunks),
        in_specs=left_specs + right_specs,
        out_specs=pl.BlockSpec((None, None, 1, LANES), lambda b, i, c, k: (b, i, 0, 0)),
        scratch_shapes=scratch,
        compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        name="ghost_gram_sq_norm",
    )(*left_args, right_u, right_v)
    return _partials_to_norms(partials)


# ---------------------------------------------------------------------------------------------------------------
# Instantiation form.

def _instantiated_kernel(left_ref, right_ref, out_ref, acc, *, n_t: int, block_t: int, block_r: int, block_c: int,
                         positions: int, rows: int, cols: int):
    c, t = pl.program_id(2), pl.program_id(3)
    r = pl.program_id(1)

    @pl.when(jnp.logical_and(c == 0, t == 0))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(t == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)

    left = _zero_outside(_zero_outside(left_ref[...], block_t, t, positions, 0), block_r, r, rows, 1)
    right = _zero_outside(_zero_outside(right_ref[...], block_t, t, positions, 0), block_c, c, cols, 1)
    acc[...] += _dot_tn(left, right)

    @pl.when(t == n_t - 1)
    def _():
        out_ref[...] += jnp.broadcast_to(_total(jnp.square(acc[...])), out_ref.shape)


def instantiated_sq_norm(left: Array, right: Array, *, block_rows: int = DEFAULT_BLOCK_OUT,
                         block_cols: int = DEFAULT_BLOCK_OUT, block_t: int = DEFAULT_BLOCK_REDUCE,
                         interpret=False) -> Array:
    """``[B]`` float32: ``||left_i^T right_i||_F^2`` accumulated over ``[block_rows, block_cols]`` tiles of ``G_i``.

    left ``[B, T, rows]``, right ``[B, T, cols]``; float32 or bfloat16, float32 accumulation.
    """
    batch, positions, rows = left.shape
    cols = right.shape[2]
    block_r, block_c, block_p = _block(block_rows, rows), _block(block_cols, cols), _block(block_t, positions)
    n_r, n_c, n_t = pl.cdiv(rows, block_r), pl.cdiv(cols, block_c), pl.cdiv(positions, block_p)
    kernel = functools.partial(_instantiated_kernel, n_t=n_t, block_t=block_p, block_r=block_r, block_c=block_c,
                               positions=positions, rows=rows, cols=cols)
    partials = pl.pallas_call(
        kernel,
        out_shape=out_struct((batch, n_r, 1, LANES), right),
        grid=(batch, n_r, n_c, n_t),
        in_specs=[pl.BlockSpec((None, block_p, block_r), lambda b, r, c, t: (b, t, r)),
                  pl.BlockSpec((None, block_p, block_c), lambda b, r, c, t: (b, t, c))],
        out_specs=pl.BlockSpec((None, None, 1, LANES), lambda b, r, c, t: (b, r, 0, 0)),
        scratch_shapes=[pltpu.VMEM((block_r, block_c), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        name="instantiated_sq_norm",
    )(left, right)
    return _partials_to_norms(partials)


# ---------------------------------------------------------------------------------------------------------------
# Clipped sum sum_i c_i left_i^T right_i.

def _weighted_sum_kernel(coef_ref, left_ref, right_ref, out_ref, *, n_t: int, block_t: int, positions: int):
    b, t = pl.program_id(2), pl.program_id(3)

    @pl.when(jnp.logical_and(b == 0, t == 0))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    coef = coef_ref[b]

    @pl.when(coef != 0)
    def _():
        left = _zero_outside(left_ref[...], block_t, t, positions, 0)
        right = _zero_outside(right_ref[...], block_t, t, positions, 0)
        out_ref[...] += coef * _dot_tn(left, right)


def weighted_sum(left: Array, right: Array, coef: Array, *, block_rows: int = DEFAULT_BLOCK_OUT,
                 block_cols: int = DEFAULT_BLOCK_OUT, block_t: int = DEFAULT_BLOCK_REDUCE, interpret=False) -> Array:
    """``[rows, cols]`` float32: ``sum_i coef_i left_i^T right_i``; examples with ``coef_i == 0`` are skipped (their
    activations may be NaN or infinite and still contribute exactly zero).

    left ``[B, T, rows]``, right ``[B, T, cols]``, coef ``[B]``.
    """
    batch, positions, rows = left.shape
    cols = right.shape[2]
    block_r, block_c, block_p = _block(block_rows, rows), _block(block_cols, cols), _block(block_t, positions)
    n_r, n_c, n_t = pl.cdiv(rows, block_r), pl.cdiv(cols, block_c), pl.cdiv(positions, block_p)
    kernel = functools.partial(_weighted_sum_kernel, n_t=n_t, block_t=block_p, positions=positions)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n_r, n_c, batch, n_t),
        in_specs=[pl.BlockSpec((None, block_p, block_r), lambda r, c, b, t, coef: (b, t, r)),
                  pl.BlockSpec((None, block_p, block_c), lambda r, c, b, t, coef: (b, t, c))],
        out_specs=pl.BlockSpec((block_r, block_c), lambda r, c, b, t, coef: (r, c)),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((rows, cols), right),
        grid_spec=grid_spec,
        compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        name="weighted_sum",
    )(coef.astype(jnp.float32), left, right)
