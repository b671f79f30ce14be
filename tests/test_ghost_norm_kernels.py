"""The per-example norm kernels of ``dpzero_jax_kernels.ghost_norm`` against per-example gradients written out in
float64 numpy.

Per example ``i`` the gradient is ``G_i = left_i^T right_i`` (``onehot(ids_i)^T right_i`` for embeddings, the one-hot
built explicitly here); the expected squared norm is ``sum(G_i^2)``, the cross term ``sum(G_{u,i} * G_{v,i})``, the
clipped sum ``sum_i c_i G_i``. Inputs are rounded to their dtype first, so bfloat16 cases check the float32
accumulation of the kernels, not bfloat16 rounding of the data.

Mosaic TPU kernels run in Pallas' interpreter (``interpret=True``; a few cases in the TPU simulator,
``pltpu.InterpretParams``), Mosaic GPU kernels in Mosaic GPU's interpreter; both natively when the backend is theirs.
Block sizes are small so that every case has several tiles along every axis and ragged last tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from dpzero_jax_kernels import ghost_norm
from dpzero_jax_kernels.ghost_norm import pallas_gpu, pallas_tpu

BACKEND = jax.default_backend()
TPU_INTERPRET = BACKEND != "tpu"
GPU_INTERPRET = BACKEND != "gpu"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-4, jnp.float16: 1e-4}
# Small TPU blocks (multiples of 16 positions and 128 features: legal Mosaic tiles for float32 and bfloat16).
TPU_BLOCKS = {"block_t": 16}
TPU_OUT_BLOCKS = {"block_rows": 128, "block_cols": 128, "block_t": 16}


def _inputs(seed: int, batch: int, positions: int, features: int, dtype) -> tuple[jax.Array, np.ndarray]:
    """A ``[batch, positions, features]`` array of ``dtype`` and its float64 copy."""
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((batch, positions, features)), dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def _ids(seed: int, batch: int, positions: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, positions)).astype(np.int32)


def _grads(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``[B, rows, cols]`` per-example gradients ``left_i^T right_i``."""
    return np.einsum("btr,btc->brc", left, right)


def _onehot(ids: np.ndarray, vocab: int) -> np.ndarray:
    return np.eye(vocab)[ids]


def _check(actual, expected: np.ndarray, dtype, scale: np.ndarray | None = None):
    """``|a - e| <= tol * scale`` per example (``scale`` defaults to ``|e|``: norms are sums of squares)."""
    actual = np.asarray(actual, np.float64)
    scale = np.abs(expected) if scale is None else scale
    assert actual.shape == expected.shape
    assert np.all(np.isfinite(actual))
    np.testing.assert_array_less(np.abs(actual - expected), TOL[dtype] * scale + 1e-12)


# (batch, positions, rows, cols): ragged positions / rows / cols, shorter than a block, several tiles.
SHAPES = [(2, 40, 300, 130), (3, 16, 128, 256), (1, 7, 5, 3), (2, 33, 200, 64)]
DTYPES = [jnp.float32, jnp.bfloat16]
CASES = [pytest.param(s, d, id=f"{s}-{jnp.dtype(d).name}") for s in SHAPES for d in DTYPES]


# ---------------------------------------------------------------------------------------------------------------
# Mosaic TPU kernels.

@pytest.mark.parametrize("shape, dtype", CASES)
def test_tpu_gram(shape, dtype):
    batch, positions, rows, cols = shape
    left, left64 = _inputs(0, batch, positions, rows, dtype)
    right, right64 = _inputs(1, batch, positions, cols, dtype)
    expected = np.sum(_grads(left64, right64) ** 2, axis=(1, 2))
    _check(pallas_tpu.gram_sq_norm(left, right, block_k=128, interpret=TPU_INTERPRET, **TPU_BLOCKS), expected, dtype)


@pytest.mark.parametrize("shape, dtype", CASES)
def test_tpu_instantiated(shape, dtype):
    batch, positions, rows, cols = shape
    left, left64 = _inputs(2, batch, positions, rows, dtype)
    right, right64 = _inputs(3, batch, positions, cols, dtype)
    expected = np.sum(_grads(left64, right64) ** 2, axis=(1, 2))
    _check(pallas_tpu.instantiated_sq_norm(left, right, interpret=TPU_INTERPRET, **TPU_OUT_BLOCKS), expected, dtype)


@pytest.mark.parametrize("shape, dtype", CASES)
def test_tpu_embedding(shape, dtype):
    batch, positions, vocab, cols = shape
    vocab = min(vocab, 11)  # few distinct ids: many equal pairs across tiles
    ids = _ids(4, batch, positions, vocab)
    right, right64 = _inputs(5, batch, positions, cols, dtype)
    expected = np.sum(_grads(_onehot(ids, vocab), right64) ** 2, axis=(1, 2))
    actual = pallas_tpu.gram_sq_norm(jnp.asarray(ids), right, left_is_ids=True, block_k=128,
                                     interpret=TPU_INTERPRET, **TPU_BLOCKS)
    _check(actual, expected, dtype)


@pytest.mark.parametrize("positions_v", [9, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tpu_cross_terms(positions_v, dtype):
    """``<G_u, G_v>`` of two uses of one weight (tied weights), different position counts; dense and ids."""
    batch, positions_u, rows, cols = 2, 23, 130, 40
    lu, lu64 = _inputs(6, batch, positions_u, rows, dtype)
    ru, ru64 = _inputs(7, batch, positions_u, cols, dtype)
    lv, lv64 = _inputs(8, batch, positions_v, rows, dtype)
    rv, rv64 = _inputs(9, batch, positions_v, cols, dtype)
    gu, gv = _grads(lu64, ru64), _grads(lv64, rv64)
    scale = np.sqrt(np.sum(gu ** 2, axis=(1, 2)) * np.sum(gv ** 2, axis=(1, 2)))
    actual = pallas_tpu.gram_sq_norm(lu, ru, lv, rv, block_k=128, interpret=TPU_INTERPRET, **TPU_BLOCKS)
    _check(actual, np.sum(gu * gv, axis=(1, 2)), dtype, scale)

    vocab = 7
    ids_u, ids_v = _ids(10, batch, positions_u, vocab), _ids(11, batch, positions_v, vocab)
    gu, gv = _grads(_onehot(ids_u, vocab), ru64), _grads(_onehot(ids_v, vocab), rv64)
    scale = np.sqrt(np.sum(gu ** 2, axis=(1, 2)) * np.sum(gv ** 2, axis=(1, 2)))
    actual = pallas_tpu.gram_sq_norm(jnp.asarray(ids_u), ru, jnp.asarray(ids_v), rv, left_is_ids=True, block_k=128,
                                     interpret=TPU_INTERPRET, **TPU_BLOCKS)
    _check(actual, np.sum(gu * gv, axis=(1, 2)), dtype, scale)


@pytest.mark.parametrize("shape, dtype", CASES)
def test_tpu_weighted_sum(shape, dtype):
    batch, positions, rows, cols = shape
    left, left64 = _inputs(12, batch, positions, rows, dtype)
    right, right64 = _inputs(13, batch, positions, cols, dtype)
    coef = np.random.default_rng(14).uniform(0.1, 1.0, batch).astype(np.float32)
    coef[0] = 0.0
    left = left.at[0, 0, 0].set(jnp.nan)  # the example with coefficient 0 contributes exactly zero
    grads, magnitudes = _grads(left64, right64), _grads(np.abs(left64), np.abs(right64))
    grads[0], magnitudes[0] = 0.0, 0.0
    expected = np.tensordot(coef.astype(np.float64), grads, axes=1)
    scale = np.tensordot(coef.astype(np.float64), magnitudes, axes=1)  # sum of |terms|: rounding is relative to it
    actual = pallas_tpu.weighted_sum(left, right, jnp.asarray(coef), interpret=TPU_INTERPRET, **TPU_OUT_BLOCKS)
    _check(actual, expected, dtype, scale)


def test_tpu_default_blocks_single_tile():
    """The default (production) block sizes on shapes smaller than one block: full-dimension blocks."""
    left, left64 = _inputs(15, 2, 50, 96, jnp.float32)
    right, right64 = _inputs(16, 2, 50, 72, jnp.float32)
    expected = np.sum(_grads(left64, right64) ** 2, axis=(1, 2))
    _check(pallas_tpu.gram_sq_norm(left, right, interpret=TPU_INTERPRET), expected, jnp.float32)
    _check(pallas_tpu.instantiated_sq_norm(left, right, interpret=TPU_INTERPRET), expected, jnp.float32)


@pytest.mark.skipif(BACKEND == "tpu", reason="the TPU simulator is for machines without a TPU")
def test_tpu_simulator_with_race_detection():
    """The Mosaic TPU kernels under the TPU simulator (DMAs, semaphores, VMEM) with its race detector."""
    params = pltpu.InterpretParams(detect_races=True)
    left, left64 = _inputs(17, 2, 40, 300, jnp.bfloat16)
    right, right64 = _inputs(18, 2, 40, 130, jnp.bfloat16)
    expected = np.sum(_grads(left64, right64) ** 2, axis=(1, 2))
    _check(pallas_tpu.gram_sq_norm(left, right, block_k=128, interpret=params, **TPU_BLOCKS), expected, jnp.bfloat16)
    _check(pallas_tpu.instantiated_sq_norm(left, right, interpret=params, **TPU_OUT_BLOCKS), expected, jnp.bfloat16)
    ids = _ids(19, 2, 40, 6)
    _check(pallas_tpu.gram_sq_norm(jnp.asarray(ids), right, left_is_ids=True, block_k=128, interpret=params,
                                   **TPU_BLOCKS),
           np.sum(_grads(_onehot(ids, 6), right64) ** 2, axis=(1, 2)), jnp.bfloat16)
    coef = jnp.asarray([0.5, 2.0])
    _check(pallas_tpu.weighted_sum(left, right, coef, interpret=params, **TPU_OUT_BLOCKS),
           np.tensordot(np.asarray(coef, np.float64), _grads(left64, right64), axes=1), jnp.bfloat16,
           np.tensordot(np.asarray(coef, np.float64), _grads(np.abs(left64), np.abs(right64)), axes=1))
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the simulator's race flag: no public API

    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found


# ---------------------------------------------------------------------------------------------------------------
# Mosaic GPU kernels (16-bit inputs only; the interpreter runs one CUDA block at a time: small shapes).

GPU_CASES = [pytest.param((2, 100, 80, 40), jnp.bfloat16, id="ragged-bf16"),
             pytest.param((1, 128, 64, 192), jnp.float16, id="aligned-f16")]


@pytest.mark.parametrize("shape, dtype", GPU_CASES)
def test_gpu_gram_and_instantiated(shape, dtype):
    batch, positions, rows, cols = shape
    left, left64 = _inputs(20, batch, positions, rows, dtype)
    right, right64 = _inputs(21, batch, positions, cols, dtype)
    expected = np.sum(_grads(left64, right64) ** 2, axis=(1, 2))
    _check(pallas_gpu.gram_sq_norm(left, right, interpret=GPU_INTERPRET), expected, dtype)
    _check(pallas_gpu.instantiated_sq_norm(left, right, interpret=GPU_INTERPRET), expected, dtype)


def test_gpu_embedding_and_cross_terms():
    batch, vocab, cols = 2, 9, 40
    ids = _ids(22, batch, 100, vocab)
    right, right64 = _inputs(23, batch, 100, cols, jnp.bfloat16)
    expected = np.sum(_grads(_onehot(ids, vocab), right64) ** 2, axis=(1, 2))
    actual = pallas_gpu.gram_sq_norm(jnp.asarray(ids), right, left_is_ids=True, interpret=GPU_INTERPRET)
    _check(actual, expected, jnp.bfloat16)

    lu, lu64 = _inputs(24, batch, 100, 72, jnp.bfloat16)
    lv, lv64 = _inputs(25, batch, 30, 72, jnp.bfloat16)
    rv, rv64 = _inputs(26, batch, 30, cols, jnp.bfloat16)
    gu, gv = _grads(lu64, right64), _grads(lv64, rv64)
    scale = np.sqrt(np.sum(gu ** 2, axis=(1, 2)) * np.sum(gv ** 2, axis=(1, 2)))
    actual = pallas_gpu.gram_sq_norm(lu, right, lv, rv, interpret=GPU_INTERPRET)
    _check(actual, np.sum(gu * gv, axis=(1, 2)), jnp.bfloat16, scale)


def test_gpu_rejects_float32():
    x = jnp.zeros((1, 8, 8), jnp.float32)
    with pytest.raises(TypeError, match="bfloat16"):
        pallas_gpu.gram_sq_norm(x, x)


# ---------------------------------------------------------------------------------------------------------------
# api: dispatch, custom_vjp, jit, shard_map.

def test_resolve_and_dispatch():
    assert ghost_norm.resolve("auto", "cpu") == "xla"
    assert ghost_norm.resolve("auto", "gpu") == "xla"
    assert ghost_norm.resolve("pallas", "cpu") == "pallas"
    with pytest.raises(ValueError, match="norm_kernel"):
        ghost_norm.resolve("triton")
    f32, bf16 = jnp.zeros((1, 2, 3), jnp.float32), jnp.zeros((1, 2, 3), jnp.bfloat16)
    assert ghost_norm.has_kernel("gram", f32, backend="tpu")
    assert ghost_norm.has_kernel("gram", f32, backend="cpu")           # the TPU kernels, interpreted
    with pytest.warns(UserWarning, match="take 16-bit .* these are float32, so this per-example norm is computed "
                      "by XLA"):
        assert not ghost_norm.has_kernel("gram", f32, backend="gpu")   # WGMMA kernels take 16-bit inputs
    assert ghost_norm.has_kernel("instantiated", bf16, backend="gpu")
    assert not ghost_norm.has_kernel("weighted_sum", bf16, backend="gpu")
    assert not ghost_norm.has_kernel("gram", f32, implementation="xla", backend="tpu")
    with pytest.raises(ValueError, match="implementation"):
        ghost_norm.gram_sq_norm(f32, f32, implementation="cuda")


def test_api_uses_a_kernel_and_differentiates_through_the_reference():
    """``jax.grad`` through the kernels (custom_vjp; pallas_call itself has no transpose) under jit."""
    left, _ = _inputs(30, 2, 20, 24, jnp.float32)
    right, _ = _inputs(31, 2, 20, 40, jnp.float32)
    coef = jnp.asarray([0.3, 1.5])
    # The TPU kernels (interpreted off TPU): on a GPU, float32 inputs would fall back to XLA.
    blocks = {"block_t": 16, "implementation": "pallas_tpu"}
    ops = {
        "gram": (functools.partial(ghost_norm.gram_sq_norm, **blocks), ghost_norm.reference.gram_sq_norm),
        "instantiated": (functools.partial(ghost_norm.instantiated_sq_norm, **blocks),
                         ghost_norm.reference.instantiated_sq_norm),
        "weighted_sum": (lambda a, b: ghost_norm.weighted_sum(a, b, coef, **blocks),
                         lambda a, b: ghost_norm.reference.weighted_sum(a, b, coef)),
    }
    rng = np.random.default_rng(36)
    for name, (kernel_fn, ref_fn) in ops.items():
        weights = jnp.asarray(rng.standard_normal(jax.eval_shape(ref_fn, left, right).shape), jnp.float32)

        def loss(fn, weights=weights):
            return lambda a, b: jnp.vdot(weights, fn(a, b))

        assert "pallas_call" in str(jax.make_jaxpr(kernel_fn)(left, right)), name
        value, grads = jax.jit(jax.value_and_grad(loss(kernel_fn), argnums=(0, 1)))(left, right)
        ref_value, ref_grads = jax.value_and_grad(loss(ref_fn), argnums=(0, 1))(left, right)
        scale = float(jnp.vdot(jnp.abs(weights), jnp.abs(ref_fn(left, right))))  # the sum cancels: absolute scale
        np.testing.assert_allclose(value, ref_value, rtol=0, atol=1e-5 * scale, err_msg=name)
        for g, e in zip(grads, ref_grads):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(e))), err_msg=name)
    ids = jnp.asarray(_ids(32, 2, 20, 5))
    grad = jax.grad(lambda r: jnp.sum(ghost_norm.gram_sq_norm(ids, r, left_is_ids=True, **blocks)))(right)
    expected = jax.grad(lambda r: jnp.sum(ghost_norm.reference.embed_gram_sq_norm(ids, r)))(right)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


def test_kernels_inside_shard_map_with_the_batch_sharded():
    """pallas_call has no partitioning rule: the kernels run per shard, on the local examples, in shard_map."""
    devices = jax.devices()
    assert len(devices) == 8, "tests/conftest.py sets up 8 virtual CPU devices"
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    spec = jax.sharding.PartitionSpec("data")
    left, left64 = _inputs(33, 16, 20, 24, jnp.float32)
    right, right64 = _inputs(34, 16, 20, 40, jnp.float32)
    ids = jnp.asarray(_ids(35, 16, 20, 6))

    def local(left, right, ids):
        return (ghost_norm.gram_sq_norm(left, right, block_t=16),
                ghost_norm.instantiated_sq_norm(left, right, block_t=16),
                ghost_norm.gram_sq_norm(ids, right, left_is_ids=True, block_t=16))

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec)))
    inputs = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in (left, right, ids)]
    gram, inst, embed = sharded(*inputs)
    assert gram.sharding.spec == spec
    expected = np.sum(_grads(left64, right64) ** 2, axis=(1, 2))
    _check(gram, expected, jnp.float32)
    _check(inst, expected, jnp.float32)
    _check(embed, np.sum(_grads(_onehot(np.asarray(ids), 6), right64) ** 2, axis=(1, 2)), jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# Native lowering, without the hardware.

@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernels_lower_for_their_platform(platform):
    """``jax.export`` runs the Pallas -> Mosaic TPU / Mosaic GPU lowering on this machine: every kernel, with its
    default (production) blocks and ragged shapes, lowers for the real backend. What it cannot check: the Mosaic
    compiler passes that run later, on the device (TPU layouts, ptxas), and of course speed."""
    shape = jax.ShapeDtypeStruct
    left, right = shape((2, 300, 384), jnp.bfloat16), shape((2, 300, 200), jnp.bfloat16)
    ids, coef = shape((2, 300), jnp.int32), shape((2,), jnp.float32)
    if platform == "tpu":
        cases = [(pallas_tpu.gram_sq_norm, (left, right)),
                 (lambda a, g: pallas_tpu.gram_sq_norm(a, g, a[:, :100], g[:, :100]), (left, right)),
                 (functools.partial(pallas_tpu.gram_sq_norm, left_is_ids=True), (ids, right)),
                 (pallas_tpu.instantiated_sq_norm, (left, right)),
                 (pallas_tpu.weighted_sum, (left, right, coef))]
    else:
        cases = [(pallas_gpu.gram_sq_norm, (left, right)),
                 (lambda a, g: pallas_gpu.gram_sq_norm(a, g, a[:, :100], g[:, :100]), (left, right)),
                 (functools.partial(pallas_gpu.gram_sq_norm, left_is_ids=True), (ids, right)),
                 (pallas_gpu.instantiated_sq_norm, (left, right))]
    for fn, args in cases:
        module = jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
        assert ("tpu_custom_call" if platform == "tpu" else "mosaic_gpu") in module
