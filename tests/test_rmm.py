"""RMM linear layers (paper 002): the randomized weight gradient is unbiased (Monte Carlo), its variance is the
exact formula (and not the paper's eq. 11), full-rate orthogonal sketches are exact, the residual shrinks by rho;
under DP the engine's per-example norms and clipped sums are those of the per-example estimates
``a_i^T S S^T g_i`` written out here, in every mode, and examples never mix; model conversion and per-step keys.
The trainer with RMM layers: ``test_rmm_train.py``."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from flax import nnx
from helpers import Setup, build, check_private

import dpzero_jax as dz
from dpzero_jax import rmm
from dpzero_jax import rmm_diagnostics as rd
from dpzero_jax.program import mode as program_mode
from dpzero_jax.sketch import SKETCHES, RMMConfig, sketch_matrix

B, T, F, P = 3, 8, 4, 3
DRAWS = 20000
RATE = 0.25          # rows: k = 6 of n = 24; tokens: k = 2 of T = 8


def layer_data(seed=0, correlated=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, F))
    g = rng.normal(size=(B, T, P)) + (x[..., :P] if correlated else 0.0)   # X^T Y far from zero
    kernel = rng.normal(size=(F, P))
    return (jnp.asarray(v, jnp.float32) for v in (x, g, kernel))


def rmm_grads(config: RMMConfig, key, x, g, kernel, bias):
    """``(dx, dkernel, dbias)`` of ``sum(y * g)`` through the RMM layer: the layer's backward applied to ``g``."""
    spec = rmm.RMMSpec(config)

    def loss(x, kernel, bias, key):
        return jnp.sum(rmm.randomized_dense(x, kernel, bias, key, spec) * g)

    return jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias, key)


@functools.cache
def estimates(sketch: str, projection: str) -> tuple[np.ndarray, np.ndarray]:
    """``DRAWS`` weight-gradient estimates ``[R, F, P]`` (fresh key each) and the exact ``X^T Y [F, P]``."""
    x, g, kernel = layer_data()
    config = RMMConfig(sketch=sketch, rate=RATE, projection=projection)
    keys = jax.random.split(jax.random.key(42), DRAWS)
    draws = ref.jit(jax.vmap(lambda key: rmm_grads(config, key, x, g, kernel, jnp.zeros(P))[1]))(keys)
    exact = np.einsum("btf,btp->fp", np.asarray(x, np.float64), np.asarray(g, np.float64))
    return np.asarray(draws, np.float64), exact


CASES = [(s, p) for s in SKETCHES for p in ("rows", "tokens")]


@pytest.mark.parametrize("sketch,projection", CASES)
def test_weight_gradient_is_unbiased(sketch, projection):
    draws, exact = estimates(sketch, projection)
    mean, stderr = draws.mean(0), draws.std(0) / math.sqrt(DRAWS)
    z = np.abs(mean - exact) / stderr
    assert z.max() < 5, z.max()
    assert np.all(stderr > 1e-4), "the estimate is random at this rate"


@pytest.mark.parametrize("sketch,projection", CASES)
def test_variance_is_the_exact_formula(sketch, projection):
    """Monte Carlo ``E ||estimate - X^T Y||^2`` within 5 standard errors of ``rmm_variance``."""
    draws, exact = estimates(sketch, projection)
    errors = np.sum(np.square(draws - exact), axis=(1, 2))
    mc, stderr = errors.mean(), errors.std() / math.sqrt(DRAWS)
    x, g, _ = layer_data()
    if projection == "rows":
        formula = rd.rmm_variance(x.reshape(-1, F), g.reshape(-1, P), 6, sketch)
    else:
        formula = rd.rmm_variance(x, g, 2, sketch)
    assert abs(mc - float(formula)) < 5 * stderr, (mc, float(formula), stderr)


def test_paper_eq11_is_not_the_gaussian_variance():
    """Eq. (11) ``(||X||^2 ||Y||^2 - ||X^T Y||^2) / k`` is rejected by Monte Carlo; the Gaussian variance is
    ``(||X||^2 ||Y||^2 + ||X^T Y||^2) / k``."""
    draws, exact = estimates("gaussian", "rows")
    errors = np.sum(np.square(draws - exact), axis=(1, 2))
    mc, stderr = errors.mean(), errors.std() / math.sqrt(DRAWS)
    x, g, _ = layer_data()
    x, y = np.asarray(x, np.float64).reshape(-1, F), np.asarray(g, np.float64).reshape(-1, P)
    frob = np.sum(x**2) * np.sum(y**2)
    cross = np.sum((x.T @ y) ** 2)
    np.testing.assert_allclose(rd.d2_rmm(x, y, 6), (frob - cross) / 6, rtol=1e-5)
    np.testing.assert_allclose(rd.rmm_variance(x, y, 6, "gaussian"), (frob + cross) / 6, rtol=1e-5)
    assert abs(mc - (frob + cross) / 6) < 5 * stderr
    assert abs(mc - (frob - cross) / 6) > 20 * stderr


@pytest.mark.parametrize("sketch", ["dct", "dft"])
@pytest.mark.parametrize("projection", ["rows", "tokens"])
def test_full_rate_orthogonal_sketch_is_exact(sketch, projection):
    x, g, kernel = layer_data()
    config = RMMConfig(sketch=sketch, rate=1.0, projection=projection)
    _, dkernel, _ = ref.jit(functools.partial(rmm_grads, config))(jax.random.key(1), x, g, kernel, jnp.zeros(P))
    np.testing.assert_allclose(dkernel, np.einsum("btf,btp->fp", x, g), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("projection", ["rows", "tokens"])
def test_input_and_bias_gradients_are_exact(projection):
    x, g, kernel = layer_data()
    config = RMMConfig(rate=RATE, projection=projection)
    dx, _, dbias = ref.jit(functools.partial(rmm_grads, config))(jax.random.key(1), x, g, kernel, jnp.zeros(P))
    np.testing.assert_allclose(dx, np.einsum("btp,fp->btf", g, kernel), rtol=1e-6)
    np.testing.assert_allclose(dbias, np.sum(g, axis=(0, 1)), rtol=1e-6)


def test_forward_is_exact_and_raw_keys_work():
    x, _, kernel = layer_data()
    bias = jnp.arange(P, dtype=jnp.float32)
    y = rmm.rmm_dense(x, kernel, bias, jax.random.key_data(jax.random.key(0)), config=RMMConfig(rate=0.5))
    np.testing.assert_allclose(y, np.einsum("btf,fp->btp", x, kernel) + np.arange(P), rtol=1e-6)


def residual_bytes(fn, *args) -> int:
    """Bytes of the floating-point residuals a ``jax.vjp`` pullback holds, the kernel excluded."""
    _, pullback = jax.vjp(fn, *args)
    leaves = [leaf for leaf in jax.tree.leaves(pullback) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves if leaf.shape != args[1].shape)


@pytest.mark.parametrize("projection,rate,kept", [("rows", 0.5, 0.5), ("rows", 0.1, 0.1), ("tokens", 0.25, 0.25)])
def test_residual_is_rho_times_smaller(projection, rate, kept):
    x = jnp.ones((4, 40, 32))
    kernel = jnp.ones((32, 16))
    exact = residual_bytes(lambda x, w: x @ w, x, kernel)
    spec = rmm.RMMSpec(RMMConfig(rate=rate, projection=projection))
    randomized = residual_bytes(lambda x, w: rmm.randomized_dense(x, w, None, jax.random.key(0), spec), x, kernel)
    assert exact == x.size * 4
    assert randomized == round(kept * x.size) * 4, (randomized, exact)


def test_compiled_backward_memory_scales_with_rho():
    """A chain of 6 linear layers: XLA's temporary memory of the jitted gradient shrinks with the kept rows."""
    layers, width, rows = 6, 256, 512
    kernels = [jnp.full((width, width), 0.01) for _ in range(layers)]
    x = jnp.ones((rows, width))

    def temp_bytes(layer):
        def loss(kernels):
            h = x
            for j, kernel in enumerate(kernels):
                h = layer(h, kernel, j)
            return jnp.sum(h * h)
        return jax.jit(jax.grad(loss)).lower(kernels).compile().memory_analysis().temp_size_in_bytes

    exact = temp_bytes(lambda h, kernel, j: h @ kernel)

    def rmm_layer(rate):
        spec = rmm.RMMSpec(RMMConfig(sketch="rademacher", rate=rate, projection="rows"))
        return lambda h, kernel, j: rmm.randomized_dense(h, kernel, None, jax.random.key(j), spec)

    activations = layers * rows * width * 4
    quarter = temp_bytes(rmm_layer(0.25))
    assert exact >= activations
    assert exact - quarter > 0.6 * activations, (exact, quarter, activations)


class Chain(nnx.Module):
    """Six ``[B, T, 128] -> [B, T, 128]`` linear layers, RMM (``config``) or exact (``None``)."""

    def __init__(self, config: RMMConfig | None, *, rngs: nnx.Rngs):
        def layer():
            return rmm.RMMDense.create(128, 128, config, rngs=rngs) if config else dz.layers.Linear(128, 128, rngs=rngs)

        self.layers = nnx.List([layer() for _ in range(6)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_dp_step_memory_scales_with_rho():
    """Under the DP engine (ghost mode) the kept inputs shrink too: XLA's temporary memory of the jitted private
    gradient of a chain of RMM layers (tokens, rho = 1/4) is far below the exact chain's."""
    batch = {"x": jnp.ones((8, 64, 128))}
    activations = 6 * batch["x"].size * 4

    def temp_bytes(config):
        graphdef, params, rest = nnx.split(Chain(config, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss_fn(params, batch):
            return jnp.sum(nnx.merge(graphdef, params, rest)(batch["x"]) ** 2, axis=(1, 2))

        private = dz.private_value_and_grad(loss_fn, dz.DPConfig(noise_multiplier=0.0, mode="ghost"))
        compiled = jax.jit(private).lower(params, batch, jax.random.key(0)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    exact, quarter = temp_bytes(None), temp_bytes(RMMConfig(sketch="rademacher", rate=0.25))
    assert exact - quarter > 0.6 * activations, (exact, quarter, activations)


# ----------------------------------------------------------------------------------------------------------------
# DP: the engine on RMM layers against per-example estimates written out here.

class TwoLayers(nnx.Module):
    def __init__(self, config: RMMConfig, *, rngs: nnx.Rngs):
        self.l1 = rmm.RMMDense.create(F, 6, config, rngs=rngs)
        self.l2 = rmm.RMMDense.create(6, P, config, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def two_layer_setup(sketch: str, batch_size: int = 5, seed: int = 0) -> tuple[Setup, TwoLayers]:
    model = TwoLayers(RMMConfig(sketch=sketch, rate=0.4), rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        y = nnx.merge(graphdef, params, rest)(batch["x"])
        return jnp.sum(jnp.sin(y) * batch["w"] + 0.1 * jnp.square(y), axis=(1, 2))

    rng = np.random.default_rng(seed + 1)
    batch = {"x": jnp.asarray(rng.normal(size=(batch_size, T, F)), jnp.float32),
             "w": jnp.asarray(rng.normal(size=(batch_size, T, P)), jnp.float32)}
    setup = Setup(f"rmm-{sketch}", params, loss_fn, batch, ("l1", "l2"))
    setup.__dict__["grads"] = explicit_estimates(model, batch, sketch)
    return setup, model


def explicit_estimates(model: TwoLayers, batch, sketch: str) -> dict[str, np.ndarray]:
    """Per-example RMM gradients from their definition: exact forward, exact output gradients, kernels
    ``a_i^T S S^T g_i`` with each layer's ``S [T, k]`` from its key, exact biases."""
    def value(v):
        return np.asarray(v[...], np.float64)

    w1, b1, w2, b2 = value(model.l1.kernel), value(model.l1.bias), value(model.l2.kernel), value(model.l2.bias)
    x, w = np.asarray(batch["x"], np.float64), np.asarray(batch["w"], np.float64)
    h = np.tanh(x @ w1 + b1)
    y = h @ w2 + b2
    g2 = np.cos(y) * w + 0.2 * y
    g1 = (g2 @ w2.T) * (1 - h**2)
    k = RMMConfig(rate=0.4).projected_size(T)
    s1 = np.asarray(sketch_matrix(model.l1.key[...], T, k, sketch), np.float64)
    s2 = np.asarray(sketch_matrix(model.l2.key[...], T, k, sketch), np.float64)
    return {"l1/bias": g1.sum(1), "l1/kernel": np.einsum("btf,tk,sk,bsp->bfp", x, s1, s1, g1),   # flatten order
            "l2/bias": g2.sum(1), "l2/kernel": np.einsum("btf,tk,sk,bsp->bfp", h, s2, s2, g2)}


@pytest.mark.parametrize("mode,norm_method,groups,extra", [
    ("bk", "mixed", "all-layer", {}),
    ("bk", "ghost", "all-layer", {"microbatch_size": 2}),
    ("bk", "instantiate", "param-wise", {}),
    ("ghost", "mixed", "all-layer", {}),
    ("ghost", "instantiate", "layer-wise", {}),
    ("fused", "ghost", "layer-wise", {}),
    ("vmap", "mixed", "all-layer", {"microbatch_size": 2}),
])
def test_engine_clips_the_per_example_estimates(mode, norm_method, groups, extra):
    setup, _ = two_layer_setup("gaussian")
    check_private(setup, clip_fn="abadi", groups=groups, mode=mode, norm_method=norm_method, **extra)


@pytest.mark.parametrize("mode,groups", [("bk", "all-layer"), ("ghost", "layer-wise"), ("fused", "layer-wise")])
def test_engine_clips_the_per_example_estimates_with_pallas_kernels(mode, groups):
    """The norms and clipped sums of the ``Outer(S^T a, S^T g)`` estimates through ``dpzero_jax_kernels.ghost_norm``
    (interpreted on CPU) equal the written-out estimates' too."""
    setup, _ = two_layer_setup("gaussian")
    check_private(setup, clip_fn="abadi", groups=groups, mode=mode, norm_kernel="pallas")


@pytest.mark.parametrize("mode", ["bk", "ghost", "fused"])
def test_bias_only_training_of_rmm_layers(mode):
    """Only the biases trainable (BiTFiT-style; the kernels and the sketch keys are constants): book-keeping keeps
    nothing of the inputs (``input_free``), and the clipped bias gradients are the exact per-example ``sum_t g``."""
    full, model = two_layer_setup("gaussian")
    graphdef, biases, rest = nnx.split(model, lambda path, v: isinstance(v, nnx.Param) and path[-1] == "bias", ...)

    def loss_fn(params, batch):
        y = nnx.merge(graphdef, params, rest)(batch["x"])
        return jnp.sum(jnp.sin(y) * batch["w"] + 0.1 * jnp.square(y), axis=(1, 2))

    setup = Setup("rmm-bias", biases, loss_fn, full.batch, ("l1", "l2"))
    setup.__dict__["grads"] = {path: v for path, v in full.grads.items() if path.endswith("bias")}
    assert sorted(setup.grads) == ["l1/bias", "l2/bias"] and ref.paths(biases) == ["l1/bias", "l2/bias"]
    check_private(setup, clip_fn="abadi", groups="layer-wise", mode=mode)
    if mode == "bk":
        plan = dz.make_plan(loss_fn, dz.DPConfig(mode="bk"), biases, full.batch)
        leaf_ids = dz.engine._leaf_ids(biases)
        _, _, calls = dz.engine.bk_forward(loss_fn, plan, biases, leaf_ids, full.batch)
        assert len(calls) == 2 and all(saved is None for saved, _ in calls.values())


@pytest.mark.parametrize("mode,groups,sketch", [("bk", "all-layer", "gaussian"), ("ghost", "layer-wise", "dct"),
                                                 ("fused", "param-wise", "rademacher"), ("auto", "all-layer", "dft")])
def test_program_front_end_clips_the_per_example_estimates(mode, groups, sketch):
    """The traced-program front-end (any JAX model) sees an RMM layer as its rule's program form: the written-out
    per-example estimates, in every mode it computes."""
    setup, _ = two_layer_setup(sketch, seed=1)
    check_private(setup, clip_fn="abadi", groups=groups, mode=mode, front_end="program")


class FlaxTokenModel(nnx.Module):
    """Flax's own layers only: a LayerNorm, a LinearGeneral over two trailing axes, a Linear head."""

    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.norm = nnx.LayerNorm(F, rngs=rngs)
        self.up = nnx.Linear(F, 6, dtype=dtype, rngs=rngs)
        self.mix = nnx.LinearGeneral((2, 3), (5,), axis=(-2, -1), dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(5, P, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.up(self.norm(x)))
        return self.head(jnp.tanh(self.mix(h.reshape(h.shape[:-1] + (2, 3)))))


def _token_loss(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        y = nnx.merge(graphdef, params, rest)(batch["x"])
        return jnp.sum(jnp.sin(y) * batch["w"], axis=(1, 2))
    return params, loss_fn


def test_flax_dense_layers_convert_and_clip_by_the_program_front_end():
    """``convert_to_rmm`` takes ``nnx.Linear`` / ``nnx.LinearGeneral`` (same outputs, same parameter paths); the
    model then mixes RMM layers with a Flax LayerNorm, which the traced-program front-end plans: the RMM kernels are
    ``dot`` sites that keep ``S^T a`` (``[k, F]`` per example, not the input), and the clipped gradients equal
    those of ``vmap(grad)`` through the RMM layers' own backward (the estimates; not the exact gradients)."""
    model = FlaxTokenModel(nnx.Rngs(0))
    rng = np.random.default_rng(4)
    batch = {"x": jnp.asarray(rng.normal(size=(5, T, F)), jnp.float32),
             "w": jnp.asarray(rng.normal(size=(5, T, P)), jnp.float32)}
    exact_params, exact_loss = _token_loss(model)
    before = exact_loss(exact_params, batch)
    rmm.convert_to_rmm(model, RMMConfig(sketch="gaussian", rate=0.5), where=lambda path, _: path != "head")
    assert sorted(rmm.rmm_layers(model)) == ["mix", "up"]
    params, loss_fn = _token_loss(model)
    assert ref.paths(params) == ref.paths(exact_params)
    np.testing.assert_allclose(loss_fn(params, batch), before, rtol=1e-5)
    setup = Setup("rmm-flax", params, loss_fn, batch, ("norm", "up", "mix", "head"))
    exact = ref.per_example_grads(exact_loss, exact_params, batch)["up/kernel"]
    assert np.linalg.norm(setup.grads["up/kernel"] - exact) > 0.1 * np.linalg.norm(exact)
    for mode, groups in (("bk", "all-layer"), ("ghost", "layer-wise"), ("auto", "param-wise")):
        check_private(setup, clip_fn="abadi", groups=groups, mode=mode)
    plan = dz.explain_plan(loss_fn, dz.DPConfig(noise_multiplier=1.0, expected_batch_size=5), params, batch)
    assert plan.front_end == "program"
    rows = {row["path"]: row for row in plan.rows}
    assert rows["up/kernel"]["rule"] == "dot" and rows["mix/kernel"]["rule"] == "dot"
    k = RMMConfig(sketch="gaussian", rate=0.5).projected_size(T)
    # the kept operand of each RMM kernel's site is S^T a [k, F] (one example), not the input a [T, F]
    planned = program_mode.plan_program(loss_fn, dz.DPConfig(), params, batch, ref.paths(params), 5)
    kept = {planned.paths[site.view.leaf]: [site.eqn.invars[i].aval.shape for i in site.recorded]
            for site in planned.analysis.sites.values() if site.kind == "dot"}
    assert kept["up/kernel"] == [(1, k, F)] and kept["mix/kernel"] == [(1, k, 6)], kept


def test_converted_flax_layers_keep_their_compute_dtype_and_refuse_what_rmm_does_not_reproduce():
    model = FlaxTokenModel(nnx.Rngs(0), dtype=jnp.bfloat16)
    x = jnp.ones((2, T, F))
    rmm.convert_to_rmm(model, RMMConfig(sketch="dct", rate=0.5), where=lambda path, _: path != "head")
    assert model.up.dtype == "bfloat16" and model.up(x).dtype == jnp.bfloat16
    odd = nnx.LinearGeneral((T,), (3,), axis=(-2,), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"contracts axes \(-2,\).*trailing axes \(-1,\) only"):
        rmm.convert_to_rmm(odd, RMMConfig(rate=0.5))
    precise = nnx.Linear(F, 3, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="it sets precision="):
        rmm.convert_to_rmm(precise, RMMConfig(rate=0.5))


def test_per_example_estimates_are_not_the_exact_gradients():
    """The reference above is the RMM estimate, not the exact gradient; ``vmap(grad)`` through the layer's own
    backward gives the same estimates (the engine's vmap mode relies on it)."""
    setup, model = two_layer_setup("gaussian")
    x, w = (np.asarray(setup.batch[k], np.float64) for k in ("x", "w"))
    w1, b1 = np.asarray(model.l1.kernel[...], np.float64), np.asarray(model.l1.bias[...], np.float64)
    w2, b2 = np.asarray(model.l2.kernel[...], np.float64), np.asarray(model.l2.bias[...], np.float64)
    h = np.tanh(x @ w1 + b1)
    y = h @ w2 + b2
    exact_l2 = np.einsum("btf,btp->bfp", h, np.cos(y) * w + 0.2 * y)
    assert np.linalg.norm(setup.grads["l2/kernel"] - exact_l2) > 0.1 * np.linalg.norm(exact_l2)
    by_vmap = ref.per_example_grads(setup.loss_fn, setup.params, setup.batch)
    for path, expected in setup.grads.items():
        np.testing.assert_allclose(by_vmap[path], expected, rtol=1e-4, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("sketch", ["rademacher", "dct", "dft"])
def test_engine_clips_the_per_example_estimates_other_sketches(sketch):
    setup, _ = two_layer_setup(sketch, seed=3)
    check_private(setup, clip_fn="automatic", groups="all-layer", mode="bk")


def test_examples_never_mix():
    """Example 0 replaced by NaNs and masked out: the other examples' norms and the clipped sum are unchanged
    (with one shared sketch, example i's estimate depends on example i only)."""
    setup, _ = two_layer_setup("gaussian")
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="ghost")
    fn = ref.jit(dz.private_value_and_grad(setup.loss_fn, cfg))
    mask = jnp.asarray([False, True, True, True, True])
    _, grads, stats = fn(setup.params, setup.batch, jax.random.key(0), mask)
    poisoned = dict(setup.batch, x=setup.batch["x"].at[0].set(jnp.nan))
    _, grads_p, stats_p = fn(setup.params, poisoned, jax.random.key(0), mask)
    np.testing.assert_array_equal(np.asarray(stats.norms)[1:], np.asarray(stats_p.norms)[1:])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p)):
        np.testing.assert_array_equal(a, b)


def test_rows_projection_is_refused_under_dp():
    model = TwoLayers(RMMConfig(rate=0.5, projection="rows"), rngs=nnx.Rngs(0))
    params, loss_fn = dz.models.classification_objective(model, input_key="x")
    batch = {"x": jnp.ones((2, T, F)), "label": jnp.zeros((2, T), jnp.int32)}
    with pytest.raises(ValueError, match="projection='rows' mixes the examples"):
        dz.private_value_and_grad(lambda p, b: loss_fn(p, b).mean(1), dz.DPConfig(mode="bk"))(
            params, batch, jax.random.key(0))


# ----------------------------------------------------------------------------------------------------------------
# Conversion and per-step keys.

def tiny_gpt2():
    config = dz.models.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                  tie_word_embeddings=False)
    return build(dz.models.GPT2, config, 0)


def forward(model, inputs):
    graphdef, state = nnx.split(model)
    return ref.jit(lambda state, inputs: nnx.merge(graphdef, state)(inputs))(state, inputs)


def test_convert_to_rmm_keeps_parameters_and_outputs():
    model = tiny_gpt2()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, 8)), jnp.int32)
    before = forward(model, ids)
    params_before = nnx.state(model, nnx.Param)
    rmm.convert_to_rmm(model, sketch="dct", rate=0.5, private=True, where=lambda path, _: path != "lm_head")
    converted = rmm.rmm_layers(model)
    assert sorted(converted) == ["h/0/attn/c_attn", "h/0/attn/c_proj", "h/0/mlp/c_fc", "h/0/mlp/c_proj"]
    assert all(layer.n_in == 1 for layer in converted.values())
    assert all(layer.config.projection == "tokens" for layer in converted.values())
    assert isinstance(model.lm_head, nnx.Linear)
    params_after = nnx.state(model, nnx.Param)
    assert ref.paths(params_before) == ref.paths(params_after)
    for a, b in zip(jax.tree.leaves(params_before), jax.tree.leaves(params_after)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(forward(model, ids), before, rtol=1e-6)


def test_convert_to_rmm_keeps_multi_axis_projections():
    """Dense layers contracting two axes (an attention output over ``[H, Dh]``): ``dz.layers.DenseGeneral`` and
    ``nnx.LinearGeneral`` convert with ``n_in == 2`` and the same outputs."""
    class HeadsOut(nnx.Module):
        def __init__(self, rngs):
            self.ours = dz.layers.DenseGeneral((2, 4), (8,), rngs=rngs)
            self.flax = nnx.LinearGeneral((2, 4), (8,), axis=(-2, -1), rngs=rngs)

        def __call__(self, x):                  # [B, T, 2, 4] -> [B, T, 8]
            return self.ours(x) + self.flax(x)

    model = HeadsOut(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 2, 4)), jnp.float32)
    before = forward(model, x)
    rmm.convert_to_rmm(model, sketch="dct", rate=0.5, private=True)
    converted = rmm.rmm_layers(model)
    assert sorted(converted) == ["flax", "ours"] and all(layer.n_in == 2 for layer in converted.values())
    np.testing.assert_allclose(forward(model, x), before, rtol=1e-6)


def test_convert_to_rmm_errors():
    model = tiny_gpt2()   # every error is raised before the model is touched
    with pytest.raises(ValueError, match="needs config"):
        rmm.convert_to_rmm(model, sketch="gaussian")
    with pytest.raises(ValueError, match="not both"):
        rmm.convert_to_rmm(model, RMMConfig(rate=0.5), rate=0.5)
    with pytest.raises(ValueError, match="unknown sketch"):
        rmm.convert_to_rmm(model, sketch="fft", rate=0.5, private=False)
    with pytest.raises(ValueError, match=r"rate must be a compression rate in \(0, 1\]"):
        rmm.convert_to_rmm(model, sketch="dct", rate=2.0, private=False)
    assert not rmm.rmm_layers(model)
    layer = rmm.RMMDense.create(4, 3, RMMConfig(rate=0.5), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="does not end in the kernel's input shape"):
        layer(jnp.ones((2, 5, 5)))


def test_keyed_objective_in_a_training_step():
    """A jitted DP step with ``fold_in(root, step)`` as the sketch key: the same step key gives the same update,
    another step's key another sketch (another gradient); the forward loss is the exact model's."""
    model = build(dz.models.MLP, dz.models.MLPConfig(in_features=6, hidden=(5,), num_classes=3), 1)
    exact_params, exact_loss = dz.models.classification_objective(model, input_key="x")
    rmm.convert_to_rmm(model, RMMConfig(sketch="gaussian", rate=0.5))
    params, loss_for_key = rmm.keyed_objective(dz.models.classification_objective, model, input_key="x")
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk")
    tx = optax.sgd(0.1)
    root = jax.random.key(7)

    @ref.jit
    def step(params, opt_state, batch, step_index):
        private = dz.private_value_and_grad(loss_for_key(jax.random.fold_in(root, step_index)), cfg)
        losses, grads, _ = private(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses, grads

    rng = np.random.default_rng(1)
    batch = {"x": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32), "label": jnp.asarray([0, 1, 2, 0])}
    opt_state = tx.init(params)
    _, _, losses, grads0 = step(params, opt_state, batch, 0)
    _, _, _, grads0_again = step(params, opt_state, batch, 0)
    _, _, _, grads1 = step(params, opt_state, batch, 1)
    np.testing.assert_allclose(losses, ref.jit(exact_loss)(exact_params, batch), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads0_again)):
        np.testing.assert_array_equal(a, b)
    kernel0, kernel1 = (np.asarray(g["layers"][0]["kernel"][...]) for g in (grads0, grads1))
    assert not np.allclose(kernel0, kernel1)


@pytest.mark.slow
def test_encoder_with_rmm_layers_under_dp():
    """The BERT-style encoder (feature tokens) with RMM blocks: every parameter is in a supported layer, and the
    book-keeping norms equal the per-example (vmap) norms through the layers' own backward."""
    config = dz.models.EncoderConfig(vocab_size=None, token_features=4, max_length=6, hidden_size=8, num_layers=1,
                                     num_heads=2, intermediate_size=16, num_classes=3)
    model = build(dz.models.Encoder, config, 0)
    with pytest.raises(ValueError, match=r"tokens must be \[B, T, 4\]"):
        model(jnp.ones((2, 6, 5)))
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        dz.models.EncoderConfig(vocab_size=5, token_features=4)
    rmm.convert_to_rmm(model, sketch="rademacher", rate=0.5, private=True, where=lambda path, _: path != "head")
    params, loss_fn = dz.models.classification_objective(model, input_key="tokens")
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.normal(size=(3, 6, 4)), jnp.float32), "label": jnp.asarray([0, 1, 2])}
    bk = dz.per_example_grad_norms(loss_fn, params, batch, mode="bk")
    np.testing.assert_allclose(bk, dz.per_example_grad_norms(loss_fn, params, batch, mode="vmap"), rtol=1e-4)
