"""The Gaussian mechanism: noise std ``sigma * ||(R_1..R_M)|| / expected_batch_size`` on every coordinate, drawn from
the caller's key, reproducible, and independent across leaves."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import B, Setup, build, experiment_module, mlp_batch, private_fn

import dpzero_jax as dz
from dpzero_jax.noise import MAX_SEPARATE_SMALL, NOISE_BLOCK, SMALL_LEAF, SMALL_NOISE_BLOCK, SWITCH_GROUP

hlo_text = experiment_module("hlo_text")   # the benchmarks' reader of compiled programs (plain text parsing)


@functools.cache
def wide_mlp() -> Setup:
    """An MLP with two [64, 64] kernels (4096 coordinates each) for the statistics."""
    model = build(dz.models.MLP, dz.models.MLPConfig(in_features=64, hidden=(64, 64), num_classes=4), 5)
    params, loss_fn = dz.models.classification_objective(model, input_key="x")
    return Setup("wide-mlp", params, loss_fn, mlp_batch(21, in_features=64, num_classes=4), ("layers/0", "layers/1",
                                                                                            "head"))


def noise_of(cfg, *, key=0, mask=None, subtract=False):
    """``{path: noise}``: the private gradient with everything masked (zero clipped sum), or minus the noiseless
    gradient of the same batch."""
    setup = wide_mlp()
    fn = private_fn(setup.loss_fn, cfg)
    if mask is None and not subtract:
        mask = jnp.zeros((B,), bool)
    _, grads, stats = fn(setup.params, setup.batch, jax.random.key(key), mask)
    noise = ref.flat(grads)
    if subtract:
        _, clean, _ = private_fn(setup.loss_fn, cfg.replace(noise_multiplier=0.0))(setup.params, setup.batch,
                                                                                 jax.random.key(key), mask)
        noise = {p: v - ref.flat(clean)[p] for p, v in noise.items()}
    return noise, stats


def check_gaussian(noise: dict[str, np.ndarray], std: float):
    """Zero mean, the given std (pooled and per large leaf), and Gaussian-looking mass within one std."""
    pooled = np.concatenate([v.ravel() for v in noise.values()])
    n = pooled.size
    assert abs(pooled.mean()) < 4 * std / np.sqrt(n)
    # the sample std of n normal draws has relative standard error ~ 1/sqrt(2n)
    assert abs(pooled.std() / std - 1) < 4 / np.sqrt(2 * n), (pooled.std(), std)
    for path, v in noise.items():
        if v.size >= 4096:
            assert abs(v.std() / std - 1) < 4 / np.sqrt(2 * v.size), (path, v.std(), std)
    within = np.mean(np.abs(pooled) < std)
    assert abs(within - 0.6827) < 4 * np.sqrt(0.6827 * 0.3173 / n)


@pytest.mark.parametrize("mode", ["bk", "ghost", "fused", "vmap"])
def test_noise_std_with_group_thresholds(mode):
    thresholds = (0.5, 1.5, 2.0)
    cfg = dz.DPConfig(noise_multiplier=2.0, groups="layer-wise", group_thresholds=thresholds, mode=mode,
                      expected_batch_size=7.0)
    noise, stats = noise_of(cfg)
    assert int(stats.num_included) == 0
    check_gaussian(noise, 2.0 * np.sqrt(np.sum(np.square(thresholds))) / 7.0)


def test_noise_std_default_thresholds():
    """M groups with R_m = R / sqrt(M): the noise std is sigma * R / B whatever M is."""
    cfg = dz.DPConfig(noise_multiplier=0.7, max_grad_norm=3.0, groups="param-wise", mode="bk")
    noise, _ = noise_of(cfg)
    assert len(noise) == 6
    check_gaussian(noise, 0.7 * 3.0 / B)


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_noise_by_subtracting_the_noiseless_gradient(mode):
    cfg = dz.DPConfig(noise_multiplier=1.5, max_grad_norm=0.8, clip_fn="automatic", groups="all-layer", mode=mode,
                      microbatch_size=2)
    noise, stats = noise_of(cfg, subtract=True)
    assert int(stats.num_included) == B
    check_gaussian(noise, 1.5 * 0.8 / B)


def test_same_key_same_noise_different_keys_differ():
    cfg = dz.DPConfig(noise_multiplier=1.0, groups="all-layer", mode="bk")
    setup = wide_mlp()
    fn = private_fn(setup.loss_fn, cfg)
    first = ref.flat(fn(setup.params, setup.batch, jax.random.key(7))[1])
    again = ref.flat(fn(setup.params, setup.batch, jax.random.key(7))[1])
    other = ref.flat(fn(setup.params, setup.batch, jax.random.key(8))[1])
    legacy = ref.flat(fn(setup.params, setup.batch, jax.random.PRNGKey(7))[1])   # raw uint32 keys work too
    for path in first:
        np.testing.assert_array_equal(first[path], again[path])
        assert np.all(first[path] != other[path]), path
        assert np.all(np.isfinite(legacy[path]))
    a = first["layers/0/kernel"].ravel() - first["layers/0/kernel"].mean()
    b = other["layers/0/kernel"].ravel() - other["layers/0/kernel"].mean()
    assert abs(np.corrcoef(a, b)[0, 1]) < 4 / np.sqrt(a.size)


def test_noise_independent_across_leaves():
    cfg = dz.DPConfig(noise_multiplier=1.0, groups="all-layer", mode="vmap")
    noise, _ = noise_of(cfg, key=11)
    k0, k1 = noise["layers/0/kernel"].ravel(), noise["layers/1/kernel"].ravel()
    assert abs(np.corrcoef(k0, k1)[0, 1]) < 4 / np.sqrt(k0.size)
    # leaves of the same shape, and a leaf against a prefix of another, draw different numbers
    assert np.all(noise["layers/0/bias"] != noise["layers/1/bias"])
    assert np.all(noise["layers/0/bias"] != k0[:64]) and np.all(noise["layers/0/bias"] != k1[:64])
    assert np.all(noise["head/bias"] != noise["head/kernel"].ravel()[:4])


def test_noise_is_added_to_the_clipped_sum_once():
    """With data, the gradient is (clipped sum + noise) / divisor: check mean/std against the exact clipped part."""
    setup = wide_mlp()
    norms = setup.group_norms("all-layer")
    r = float(ref.split_threshold(norms))
    cfg = dz.DPConfig(noise_multiplier=0.5, max_grad_norm=r, mode="bk", expected_batch_size=9.0)
    _, grads, _ = private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(5))
    expected, _, _ = setup.reference("all-layer", "abadi", max_grad_norm=r, divisor=9.0)
    noise = {p: v - expected[p] for p, v in ref.flat(grads).items()}
    check_gaussian(noise, 0.5 * r / 9.0)


def test_threefry_is_jax_threefry_and_normal_at_is_jax_random_normal():
    """The blocked generator's pieces against JAX's own: ``threefry_2x32`` word for word against
    ``jax.extend.random.threefry_2x32`` (random keys and counters), ``fold_in_words`` against the key data of
    ``jax.random.fold_in``, and ``normal_at`` at every position of a draw
    against ``jax.random.normal`` of that key and shape (partitionable Threefry, JAX's default), bit for bit."""
    from jax.extend.random import threefry_2x32 as jax_threefry

    from dpzero_jax import noise
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(6,), dtype=np.uint32)
    counters = rng.integers(0, 2**32, size=(2, 1000), dtype=np.uint32)
    expected = np.asarray(jax_threefry(jnp.asarray(words[:2]), jnp.asarray(counters.reshape(-1))))
    y0, y1 = jax.jit(noise.threefry_2x32)(*[jnp.uint32(w) for w in words[:2]], *jnp.asarray(counters))
    np.testing.assert_array_equal(np.concatenate([np.asarray(y0), np.asarray(y1)]), expected)
    key = jax.random.key(9)
    data = jnp.arange(6, dtype=jnp.uint32)
    folded = jax.jit(noise.fold_in_words)(tuple(jax.random.key_data(key).astype(jnp.uint32)), data)
    np.testing.assert_array_equal(np.stack([np.asarray(w) for w in folded], axis=1),
                                  np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(key, int(d))))
                                            for d in data]))
    for seed, shape in [(0, (7,)), (3, (37, 41)), (5, (2, 3, 70_001))]:
        key = jax.random.key(seed)
        size = int(np.prod(shape))
        words = jax.random.key_data(key).astype(jnp.uint32)
        got = jax.jit(lambda w, size=size: noise.normal_at((w[0], w[1]), jnp.arange(size, dtype=jnp.uint32)))(words)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.random.normal(key, shape)).reshape(-1))


@pytest.mark.parametrize("shapes", [
    [(3,), (2, NOISE_BLOCK + 5), (5,), (3 * NOISE_BLOCK,)],      # small and large leaves, a partial last block
    [(6 * NOISE_BLOCK + 3,), (5,), (SMALL_LEAF,), (2, 3)],       # a few small leaves beside more: one loop
    [(3,), (2 * NOISE_BLOCK,), (5,), (64,)],                     # three small leaves, too many draws: two loops
    [(3,), (5,)],                                                # small leaves only
    [(NOISE_BLOCK // 2 + 1,)] * 3,                               # small leaves, more than a block together
    [(100,)] * 40,                                               # many small leaves, fewer than a block
    [(0,), (7,), (NOISE_BLOCK + 1,), (0, 3)],                    # empty leaves
    [(NOISE_BLOCK,), (2 * NOISE_BLOCK,)],                        # whole blocks only
    [(SMALL_LEAF,), (SMALL_LEAF + 1,), (SMALL_NOISE_BLOCK + 1,), (3,)],   # either side of the small leaves' bound
    [(2 * SMALL_NOISE_BLOCK + 7,)] + [(5 + j,) for j in range(2 * SWITCH_GROUP + 1)],   # three groups of small leaves
    [(NOISE_BLOCK + 5,), (SMALL_LEAF + 1,)] + [(7 + j,) for j in range(MAX_SEPARATE_SMALL + 1)],   # packed, and large
    [(20 + j,) for j in range(MAX_SEPARATE_SMALL + 2)],          # packed only, fewer than a block together
])
def test_blocked_noise_is_jax_random_normal_of_each_leaf(shapes):
    """Whatever the mix of leaf sizes, the blocked loop draws leaf ``j``'s noise as ``jax.random.normal(fold_in(key,
    j), leaf.shape)`` -- the reference draws each leaf here -- bit for bit: the same noise as the partitionable
    generator's and a GPU's or TPU's."""
    from dpzero_jax import noise
    key = jax.random.key(11)
    leaves = [jnp.zeros(s, jnp.float32) for s in shapes]
    blocked = jax.jit(lambda ls: noise.add_noise_and_normalise(ls, key, 2.0, 4.0, "blocked"))(leaves)
    partitionable = jax.jit(lambda ls: noise.add_noise_and_normalise(ls, key, 2.0, 4.0, "partitionable"))(leaves)
    for j, (shape, got, other) in enumerate(zip(shapes, blocked, partitionable)):
        expected = 0.5 * np.asarray(jax.random.normal(jax.random.fold_in(key, j), shape, jnp.float32))
        assert got.shape == shape
        np.testing.assert_array_equal(np.asarray(got), expected)
        np.testing.assert_array_equal(np.asarray(other), expected)


def test_blocked_noise_needs_no_gradient_sized_or_per_position_buffers():
    """The loops noise every leaf in place: their compiled temporaries are at most a block of each loop, and the
    packed vector when the small leaves are many (the key words and positions stay inside the generator's fusion; an
    iota captured from outside the loop, or per-position key tables built before it, once added up to three
    block-sized buffers), not a copy of a leaf."""
    from dpzero_jax import noise
    leaves = [jnp.zeros((3 * NOISE_BLOCK + 5,), jnp.float32), jnp.zeros((4 * NOISE_BLOCK,), jnp.float32)] + \
        [jnp.zeros((100 + j,), jnp.float32) for j in range(20)]
    compiled = jax.jit(lambda ls, k: noise.add_noise_and_normalise(ls, k, 1.0, 2.0, "blocked")).lower(
        leaves, jax.random.key(0)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * NOISE_BLOCK + 4 * SMALL_NOISE_BLOCK + 16384
    # with more small leaves than MAX_SEPARATE_SMALL: one packed vector of them besides the block
    small = [jnp.zeros((100 + j,), jnp.float32) for j in range(MAX_SEPARATE_SMALL + 4)]
    compiled = jax.jit(lambda ls, k: noise.add_noise_and_normalise(ls, k, 1.0, 2.0, "blocked")).lower(
        leaves[:2] + small, jax.random.key(0)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * sum(x.size for x in small) + 4 * NOISE_BLOCK + 16384


def test_blocked_noise_compiles_leaves_of_one_shape_once():
    """Up to ``MAX_SEPARATE_SMALL`` small leaves, each is updated by kernels that depend on its shape, not on where
    it sits among the leaves, so the compiled program does not grow a kernel per leaf: 48 leaves of a few shapes
    (like the biases and norm scales of a model's layers) compile to at most two more distinct fusions than 8 do.
    The conditionals' predicates compare with loop-carried group numbers, not constants, so they are one kernel for
    every group (with constants: one per group of ``SWITCH_GROUP`` small leaves, 17 against 10 fusions). (Packed
    into one vector and read back at their offsets, as more small leaves are, every leaf adds a kernel, and so does
    each of its optimiser's updates.)"""
    from dpzero_jax import noise
    counts = []
    for n in (SWITCH_GROUP, MAX_SEPARATE_SMALL):
        leaves = [jnp.zeros((64 * (1 + j % 3),), jnp.float32) for j in range(n)]
        text = jax.jit(lambda ls, k: noise.add_noise_and_normalise(ls, k, 1.0, 2.0, "blocked")).lower(
            leaves, jax.random.key(0)).compile().as_text()
        counts.append(hlo_text.distinct_fusions(text))
    # + the group index and the groups' predicate (one group needs neither)
    assert counts[1] - counts[0] <= 2, counts


def test_blocked_noise_keeps_dtypes_and_takes_any_key():
    """A bfloat16 leaf comes back bfloat16 (noised in float32, then cast); a raw ``uint32`` key (``PRNGKey``) is
    Threefry's and drawn by the loop; a key of another implementation (``rbg``) is drawn by ``jax.random.normal``."""
    from dpzero_jax import noise
    leaves = [jnp.ones((NOISE_BLOCK + 3,), jnp.bfloat16), jnp.ones((10,), jnp.float32)]
    for key in (jax.random.PRNGKey(3), jax.random.key(3, impl="rbg")):
        out = jax.jit(lambda ls, k: noise.add_noise_and_normalise(ls, k, 1.0, 1.0, "blocked"))(leaves, key)
        for j, (leaf, got) in enumerate(zip(leaves, out)):
            expected = (1.0 + jax.random.normal(jax.random.fold_in(key, j), leaf.shape)).astype(leaf.dtype)
            assert got.dtype == leaf.dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_auto_generator_is_blocked_on_cpu_and_partitionable_on_accelerators():
    """``noise_rng="auto"`` (the default) resolves by the step's target: the blocked loop on a CPU, the
    partitionable generator on a GPU or TPU, where the blocked loop runs block after block
    (``docs/benchmarks/gpu.md``). Through the private gradient, with ``target="gpu"`` and on this CPU alike, leaf
    ``j``'s noise is ``jax.random.normal(fold_in(key, j))`` (the reference draws it here)."""
    from dpzero_jax import noise
    assert noise.resolve_rng("auto", "cpu") == "blocked"
    assert noise.resolve_rng("auto", "gpu") == noise.resolve_rng("auto", "tpu") == "partitionable"
    assert noise.resolve_rng("auto") == "blocked"            # this suite runs on XLA:CPU
    assert noise.resolve_rng("blocked", "gpu") == "blocked"
    with pytest.raises(ValueError, match="noise rng must be one of"):
        noise.resolve_rng("fastest")
    with pytest.raises(ValueError, match="noise_rng"):
        dz.DPConfig(noise_rng="fastest")
    setup = wide_mlp()
    key = jax.random.key(5)
    cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0)

    def noise_leaves(c):     # everything masked: the clipped sum is zero, the gradient is the noise / 4
        _, grads, _ = private_fn(setup.loss_fn, c)(setup.params, setup.batch, key, jnp.zeros((B,), bool))
        return [np.asarray(g) for g in jax.tree.leaves(grads)]

    on_gpu = noise_leaves(cfg.replace(target="gpu"))
    for j, leaf in enumerate(on_gpu):
        expected = np.asarray(jax.random.normal(jax.random.fold_in(key, j), leaf.shape, jnp.float32)) / 4.0
        np.testing.assert_allclose(leaf, expected, rtol=1e-5, atol=1e-7)
    on_cpu = noise_leaves(cfg)
    for got, expected in zip(on_cpu, on_gpu):   # the same normals; the step's arithmetic is fused differently
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_partitionable_noise_draws_each_shape_once_and_each_leaf_as_jax_random_normal():
    """The partitionable generator derives the leaves' keys in one call and draws the leaves of one shape in one:
    lowered for CUDA (where JAX writes every Threefry call out in full), 40 leaves of two shapes hold three Threefry
    calls (the keys, and one per shape) instead of two per leaf; and leaf ``j`` is still exactly
    ``jax.random.normal(fold_in(key, j), leaf.shape)`` -- a repeated shape's rows in their leaves' order -- for a
    Threefry key, a raw ``uint32`` key and a key of another implementation (``rbg``, drawn leaf by leaf: mapped over
    keys its draws differ), in each leaf's dtype."""
    from dpzero_jax import noise
    lowered_size = experiment_module("lowered_size")
    shapes = [(3, 5) if j % 3 else (7,) for j in range(40)]
    leaves = [jnp.ones(s, jnp.bfloat16 if j == 4 else jnp.float32) for j, s in enumerate(shapes)]
    text = jax.jit(lambda ls, k: noise.add_noise_and_normalise(ls, k, 2.0, 4.0, "partitionable")).trace(
        leaves, jax.random.key(0)).lower(lowering_platforms=("cuda",)).as_text()
    operations, in_threefry, calls = lowered_size.inlined_size(text)
    assert calls == 3, calls
    assert 0 < in_threefry < operations
    for key in (jax.random.key(7), jax.random.PRNGKey(7), jax.random.key(7, impl="rbg")):
        out = jax.jit(lambda ls, k: noise.add_noise_and_normalise(ls, k, 2.0, 4.0, "partitionable"))(leaves, key)
        for j, (leaf, got) in enumerate(zip(leaves, out)):
            expected = ((1.0 + 2.0 * jax.random.normal(jax.random.fold_in(key, j), leaf.shape, jnp.float32)) / 4.0
                        ).astype(leaf.dtype)
            assert got.dtype == leaf.dtype and got.shape == leaf.shape
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_lowered_size_counts_every_inlined_call():
    """``experiments/lowered_size.py``'s count against a hand-made module: ``main`` calls ``f`` twice and ``g``
    once, ``g`` calls ``threefry`` three times; the dialect operations of the bodies (not calls or returns) times
    their calls."""
    lowered_size = experiment_module("lowered_size")
    text = """module @m {
  func.func public @main(%arg0: tensor<2xui32>) -> tensor<2xui32> {
    %0 = call @f(%arg0) : (tensor<2xui32>) -> tensor<2xui32>
    %1 = call @f(%0) : (tensor<2xui32>) -> tensor<2xui32>
    %2 = call @g(%1) : (tensor<2xui32>) -> tensor<2xui32>
    return %2 : tensor<2xui32>
  }
  func.func private @f(%arg0: tensor<2xui32>) -> tensor<2xui32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<2xui32>
    return %0 : tensor<2xui32>
  }
  func.func private @g(%arg0: tensor<2xui32>) -> tensor<2xui32> {
    %0 = call @threefry2x32(%arg0) : (tensor<2xui32>) -> tensor<2xui32>
    %1 = call @threefry2x32(%0) : (tensor<2xui32>) -> tensor<2xui32>
    %2 = call @threefry2x32(%1) : (tensor<2xui32>) -> tensor<2xui32>
    return %2 : tensor<2xui32>
  }
  func.func private @threefry2x32(%arg0: tensor<2xui32>) -> tensor<2xui32> {
    %0 = stablehlo.xor %arg0, %arg0 : tensor<2xui32>
    %1 = stablehlo.add %0, %arg0 : tensor<2xui32>
    return %1 : tensor<2xui32>
  }
}
"""
    # main: none of its own; f: one, called twice; g: none, three calls of threefry's two
    assert lowered_size.inlined_size(text) == (2 * 1 + 3 * 2, 3 * 2, 3)
