"""The Gaussian mechanism: noise std ``sigma * ||(R_1..R_M)|| / expected_batch_size`` on every coordinate, drawn from
the caller's key, reproducible, and independent across leaves."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import B, Setup, build, mlp_batch, private_fn

import dpzero_jax as dz


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


def test_blocked_noise_follows_its_documented_definition():
    """With leaves above ``NOISE_BLOCK``: block ``c`` of large leaf ``j`` is ``standard_normal(fold_in(fold_in(key,
    j), c))`` and the small leaves, concatenated, are block 0 of ``fold_in(key, number of leaves)``; without large
    leaves the small ones are one draw from ``fold_in(key, number of leaves)``, or blocks of it when they hold more
    than ``NOISE_BLOCK`` elements together. The reference draws each block here, one by one."""
    from dpzero_jax import noise
    block = noise.NOISE_BLOCK
    key = jax.random.key(11)

    def blocks(k, size):
        count = -(-size // block)
        return np.concatenate([np.asarray(noise.standard_normal(jax.random.fold_in(k, c), (block,)))
                               for c in range(count)])[:size]

    leaves = [jnp.zeros(s, jnp.float32) for s in [(3,), (2, block + 5), (5,), (3 * block,)]]
    out = jax.jit(lambda ls: noise.add_noise_and_normalise(ls, key, 2.0, 4.0))(leaves)
    for j in (1, 3):
        np.testing.assert_allclose(np.asarray(out[j]).reshape(-1), 0.5 * blocks(jax.random.fold_in(key, j),
                                                                                 leaves[j].size), atol=1e-6)
    np.testing.assert_allclose(np.concatenate([np.asarray(out[0]), np.asarray(out[2])]),
                               0.5 * blocks(jax.random.fold_in(key, 4), 8), atol=1e-6)
    small = jax.jit(lambda ls: noise.add_noise_and_normalise(ls, key, 2.0, 4.0))([leaves[0], leaves[2]])
    np.testing.assert_allclose(np.concatenate([np.asarray(v) for v in small]),
                               0.5 * np.asarray(noise.standard_normal(jax.random.fold_in(key, 2), (8,))), atol=1e-6)
    # many small leaves, more than NOISE_BLOCK elements together: their vector is drawn by block, in place
    many = [jnp.zeros((block // 2 + 1,), jnp.float32)] * 3
    out = jax.jit(lambda ls: noise.add_noise_and_normalise(ls, key, 2.0, 4.0))(many)
    np.testing.assert_allclose(np.concatenate([np.asarray(v) for v in out]),
                               0.5 * blocks(jax.random.fold_in(key, 3), 3 * (block // 2 + 1)), atol=1e-6)


def test_auto_generator_is_blocked_on_cpu_and_partitionable_on_accelerators():
    """``noise_rng="auto"`` (the default) resolves by the step's target: the blocked generator on a CPU, the
    partitionable one on a GPU or TPU, where the blocked generator's loop runs block after block
    (``docs/benchmarks/gpu.md``). Through the private gradient with ``target="gpu"``, leaf ``j``'s noise is
    ``jax.random.normal(fold_in(key, j))`` (the reference draws it here), and on the CPU it is the blocked draw."""
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
    expected_cpu = noise.add_noise_and_normalise([jnp.zeros(x.shape, jnp.float32) for x in on_cpu], key, 1.0, 4.0,
                                                 "blocked")
    for got, expected in zip(on_cpu, expected_cpu):
        np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-5, atol=1e-7)
    assert not np.allclose(on_cpu[0], on_gpu[0])
