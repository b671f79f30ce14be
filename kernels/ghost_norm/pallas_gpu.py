"""Mosaic GPU (Pallas, Hopper WGMMA) kernels for per-example gradient norms, O(tile^2) memory per example.

Shapes: ``left [B, T, rows]`` (or int ``ids [B, T]``), ``right [B, T, cols]``; ``G_i = left_i^T right_i``.

Each CUDA block (one warpgroup) owns one output tile and loops over the reduction with ``plgpu.emit_pipeline``
(TMA copies GMEM -> SMEM, ``max_concurrent_steps`` stages), multiplying with ``plgpu.wgmma`` into float32
accumulators in registers:

* Gram form, grid ``(B, nI, nC)``: the block ``(b, i, c)`` computes the tile pair ``(I, J)`` with ``J = (i + c) mod nI``
  (circulant order over ``c = 0 .. nI // 2``: half the pairs, weight 2 off the diagonal; see ``pallas_tpu``), or
  ``J = c`` for a cross term between two uses. ``A_I A_J^T`` and ``R_I R_J^T`` are accumulated over feature chunks
  in two ``[block_t, block_t]`` WGMMA accumulators, multiplied elementwise and reduced over the columns; the block
  writes its ``[block_t]`` row sums.
* Embedding: the left Gram is the equality of the ids tiles, broadcast in the WGMMA layout.
* Instantiation, grid ``(B, nR, nC)``: ``acc[tR, tC] += L^T[R-tile, T-chunk] R[T-chunk, C-tile]`` over position chunks,
  then the row sums of ``acc^2``.

XLA sums the partial rows. Inputs must be 16-bit (bfloat16 / float16: WGMMA's float32 path is TF32 and needs both
operands K-major); ``api`` falls back to XLA for float32 on GPU.

Layout choices made so that the kernels run under Mosaic GPU's interpreter on CPU (jax 0.10): the interpreter supports
neither ``transpose_ref`` operands of ``wgmma`` nor non-trivial ``BlockSpec`` index maps of ``pallas_call``, so the
kernels use ``plgpu.kernel`` with in-kernel pipelines, and the right-hand operands are read from transposed copies
(``[B, features, T]``) made by XLA, padded to the tile multiples (zeros contribute nothing: the ragged-size handling).
These copies cost ``O(B T (rows + cols))`` extra memory -- the size of the inputs, never ``T^2`` or ``rows * cols``.
A native build could read the transposes through ``plgpu.transpose_ref`` instead.

Tested here under the interpreter (``interpret=True`` here means ``InterpretGPUParams()``); compiled and timed
natively on an H200 on 2026-11-27, op by op (``experiments/bench_kernels.py``: equal to the XLA forms, 1.05-1.37x
faster at T >= 2048; ``docs/benchmarks/gpu.md``). Not yet timed inside a step computing in 16 bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dpzero_jax_kernels.ghost_norm.pallas_tpu import out_struct

Array = jax.Array

BLOCK_T = 64        # positions per Gram tile (two 64x64 float32 accumulators per warpgroup)
BLOCK_K = 64        # features per chunk (128 bytes of bfloat16: one 128-byte swizzle row)
BLOCK_ROWS = 64     # instantiation: rows per output tile (one WGMMA M)
BLOCK_COLS = 128    # instantiation: cols per output tile
MAX_CONCURRENT_STEPS = 2


def _interpret_params(interpret):
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # no public export in jax 0.10

        return InterpretGPUParams()
    return interpret or False


def _transforms(minor_elements: int, dtype) -> tuple:
    swizzle = plgpu.find_swizzle(minor_elements * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad(x: Array, axis_sizes: dict[int, int], value=0) -> Array:
    widths = [(0, axis_sizes.get(axis, size) - size) for axis, size in enumerate(x.shape)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x


def _check_dtype(*arrays):
    for x in arrays:
        if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise TypeError(f"Mosaic GPU norm kernels take bfloat16 / float16 inputs, got {x.dtype}")


def _gram_tile(x_ref, xt_ref, b, i, j, n_chunks: int, dtype):
    """``x[b, I] . x_t[b, :, J]`` as a ``[BLOCK_T, BLOCK_T]`` float32 array, pipelined over feature chunks.

    x_ref ``[B, T, K]``, xt_ref ``[B, K, S]`` (GMEM)."""

    def scoped(acc_ref):
        def step(_, x_smem, xt_smem):
            plgpu.wgmma(acc_ref, x_smem, xt_smem)
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step, grid=(n_chunks,),
            in_specs=[plgpu.BlockSpec((BLOCK_T, BLOCK_K), lambda k: (i, k), transforms=_transforms(BLOCK_K, dtype)),
                      plgpu.BlockSpec((BLOCK_K, BLOCK_T), lambda k: (k, j), transforms=_transforms(BLOCK_T, dtype))],
            max_concurrent_steps=MAX_CONCURRENT_STEPS,
        )(x_ref.at[b], xt_ref.at[b])
        return acc_ref[...]

    return pl.run_scoped(scoped, plgpu.ACC((BLOCK_T, BLOCK_T), jnp.float32))


def _store_rows(rows: Array, out_ref, index):
    def scoped(rows_smem):
        rows_smem[...] = rows
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rows_smem, out_ref.at[index])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM(rows.shape, jnp.float32))


def _load_ids(ids_ref, b, tile, layout, interpreted: bool):
    """Ids ``[BLOCK_T]`` of one tile, in registers with ``layout``.

    ``plgpu.load(..., layout=)`` is the native way; Mosaic GPU's interpreter (jax 0.10) can run neither it nor
    ``layout_cast``, so under the interpreter the tile is read plainly (layouts mean nothing there)."""

    def scoped(ids_smem, barrier):
        plgpu.copy_gmem_to_smem(ids_ref.at[b, pl.ds(tile * BLOCK_T, BLOCK_T)], ids_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        if interpreted:
            return ids_smem[...]
        return plgpu.load(ids_smem, (), layout=layout)

    return pl.run_scoped(scoped, plgpu.SMEM((BLOCK_T,), jnp.int32), plgpu.Barrier(num_barriers=1))


def _gram_kernel(*refs, left_is_ids: bool, symmetric: bool, n_i: int, n_left_chunks: int, n_right_chunks: int,
                 dtype, interpreted: bool):
    lu_ref, lv_ref, ru_ref, rvt_ref, out_ref = refs
    b, i, c = lax.axis_index("b"), lax.axis_index("i"), lax.axis_index("c")
    j = lax.rem(i + c, n_i) if symmetric else c
    right = _gram_tile(ru_ref, rvt_ref, b, i, j, n_right_chunks, dtype)
    if left_is_ids:
        ids_rows = _load_ids(lu_ref, b, i, plgpu.Layout.WGMMA.reduce(1), interpreted)
        ids_cols = _load_ids(lv_ref, b, j, plgpu.Layout.WGMMA.reduce(0), interpreted)
        equal = (lax.broadcast_in_dim(ids_rows, (BLOCK_T, BLOCK_T), [0])
                 == lax.broadcast_in_dim(ids_cols, (BLOCK_T, BLOCK_T), [1]))
        product = jnp.where(equal, right, 0.0)
    else:
        product = _gram_tile(lu_ref, lv_ref, b, i, j, n_left_chunks, dtype) * right
    rows = jnp.sum(product, axis=1)
    if symmetric:
        rows = rows * jnp.where(jnp.logical_or(c == 0, 2 * c == n_i), 1.0, 2.0).astype(jnp.float32)
    _store_rows(rows, out_ref, (b, i, c))


def gram_sq_norm(left_u: Array, right_u: Array, left_v: Array | None = None, right_v: Array | None = None, *,
                 left_is_ids: bool = False, interpret=False) -> Array:
    """``[B]`` float32: ``sum_{t,s} <left_u[t], left_v[s]> <right_u[t], right_v[s]>`` (see ``pallas_tpu``).

    left ``[B, T, rows]`` or int ids ``[B, T]`` (``left_is_ids``), right ``[B, T, cols]``, bfloat16 / float16;
    the ``v`` pair defaults to the ``u`` pair (half the tile pairs). ``interpret=True`` runs Mosaic GPU's interpreter.
    """
    symmetric = left_v is None and right_v is None
    if symmetric:
        left_v, right_v = left_u, right_u
    elif left_v is None or right_v is None:
        raise ValueError("gram_sq_norm: give both left_v and right_v, or neither")
    _check_dtype(right_u, right_v, *(() if left_is_ids else (left_u, left_v)))
    dtype = right_u.dtype
    batch, t_u, cols = right_u.shape
    t_v = right_v.shape[1]
    pu, pv = _round_up(t_u, BLOCK_T), _round_up(t_v, BLOCK_T)
    cols_p = _round_up(cols, BLOCK_K)
    right_u_p = _pad(right_u, {1: pu, 2: cols_p})
    right_vt = jnp.swapaxes(_pad(right_v, {1: pv, 2: cols_p}), 1, 2)            # [B, cols_p, pv]
    if left_is_ids:
        left_args = (_pad(left_u.astype(jnp.int32), {1: pu}, -1), _pad(left_v.astype(jnp.int32), {1: pv}, -1))
        n_left_chunks = 0
    else:
        rows_p = _round_up(left_u.shape[2], BLOCK_K)
        left_args = (_pad(left_u, {1: pu, 2: rows_p}), jnp.swapaxes(_pad(left_v, {1: pv, 2: rows_p}), 1, 2))
        n_left_chunks = rows_p // BLOCK_K
    n_i, n_j = pu // BLOCK_T, pv // BLOCK_T
    n_c = n_i // 2 + 1 if symmetric else n_j
    kernel = functools.partial(_gram_kernel, left_is_ids=left_is_ids, symmetric=symmetric, n_i=n_i,
                               n_left_chunks=n_left_chunks, n_right_chunks=cols_p // BLOCK_K, dtype=dtype,
                               interpreted=bool(interpret))
    partials = plgpu.kernel(
        kernel,
        out_type=out_struct((batch, n_i, n_c, BLOCK_T), right_u),
        grid=(batch, n_i, n_c),
        grid_names=("b", "i", "c"),
        interpret=_interpret_params(interpret),
    )(*left_args, right_u_p, right_vt)
    return jnp.sum(partials, axis=(1, 2, 3))


def _instantiated_kernel(left_t_ref, right_ref, out_ref, *, n_chunks: int, dtype):
    b, r, c = lax.axis_index("b"), lax.axis_index("r"), lax.axis_index("c")

    def scoped(acc_ref):
        def step(_, left_smem, right_smem):
            plgpu.wgmma(acc_ref, left_smem, right_smem)
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step, grid=(n_chunks,),
            in_specs=[plgpu.BlockSpec((BLOCK_ROWS, BLOCK_K), lambda t: (r, t), transforms=_transforms(BLOCK_K, dtype)),
                      plgpu.BlockSpec((BLOCK_K, BLOCK_COLS), lambda t: (t, c),
                                      transforms=_transforms(BLOCK_COLS, dtype))],
            max_concurrent_steps=MAX_CONCURRENT_STEPS,
        )(left_t_ref.at[b], right_ref.at[b])
        return acc_ref[...]

    acc = pl.run_scoped(scoped, plgpu.ACC((BLOCK_ROWS, BLOCK_COLS), jnp.float32))
    _store_rows(jnp.sum(acc * acc, axis=1), out_ref, (b, r, c))


def instantiated_sq_norm(left: Array, right: Array, *, interpret=False) -> Array:
    """``[B]`` float32: ``||left_i^T right_i||_F^2`` over ``[BLOCK_ROWS, BLOCK_COLS]`` tiles of ``G_i``.

    left ``[B, T, rows]``, right ``[B, T, cols]``, bfloat16 / float16.
    """
    _check_dtype(left, right)
    batch, positions, rows = left.shape
    cols = right.shape[2]
    positions_p = _round_up(positions, BLOCK_K)
    rows_p, cols_p = _round_up(rows, BLOCK_ROWS), _round_up(cols, BLOCK_COLS)
    left_t = jnp.swapaxes(_pad(left, {1: positions_p, 2: rows_p}), 1, 2)     # [B, rows_p, positions_p]
    right_p = _pad(right, {1: positions_p, 2: cols_p})
    n_r, n_c = rows_p // BLOCK_ROWS, cols_p // BLOCK_COLS
    kernel = functools.partial(_instantiated_kernel, n_chunks=positions_p // BLOCK_K, dtype=left.dtype)
    partials = plgpu.kernel(
        kernel,
        out_type=out_struct((batch, n_r, n_c, BLOCK_ROWS), right),
        grid=(batch, n_r, n_c),
        grid_names=("b", "r", "c"),
        interpret=_interpret_params(interpret),
    )(left_t, right_p)
    return jnp.sum(partials, axis=(1, 2, 3))
