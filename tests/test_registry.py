"""The registry's per-rule ``sq_norm(a, g)`` and ``clipped_grad(a, g, c)`` on raw arrays, against per-example
gradients written out from their definitions (``a_i^T g_i``, one-hot scatter, ``sum_t g * xhat``,
``a_i^T S S^T g_i``)."""

import jax
import numpy as np
import pytest

from dpzero_jax import rules
from dpzero_jax.rules.linear import LinearSpec
from dpzero_jax.rules.norm import NormSpec
from dpzero_jax.rules.rmm import RMMSpec
from dpzero_jax.sketch import SKETCHES, RMMConfig, sketch_matrix

RNG = np.random.default_rng(0)
B, T, D, P, V = 3, 5, 4, 6, 7


def check(rule, params, x, g, spec, per_example):
    coef = RNG.uniform(0.1, 1.0, B).astype(np.float32)
    for method in ("ghost", "instantiate", "mixed"):
        sq = rules.sq_norms(rule, params, x, g, spec, method)
        for name, expected in per_example.items():
            np.testing.assert_allclose(sq[name], np.sum(expected.reshape(B, -1) ** 2, 1), rtol=1e-5)
    clipped = rules.clipped_grads(rule, params, x, g, spec, {name: coef for name in per_example})
    for name, expected in per_example.items():
        np.testing.assert_allclose(clipped[name], np.tensordot(coef, expected, axes=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transpose", [False, True])
def test_linear(transpose):
    x = RNG.normal(size=(B, T, D)).astype(np.float32)
    g = RNG.normal(size=(B, T, P)).astype(np.float32)
    kernel = np.zeros((P, D) if transpose else (D, P), np.float32)
    per_example = {"kernel": np.einsum("btp,btd->bpd", g, x) if transpose else np.einsum("btd,btp->bdp", x, g),
                   "bias": g.sum(1)}
    check(rules.RULES["linear"], {"kernel": kernel, "bias": np.zeros(P, np.float32)}, x, g,
          LinearSpec(transpose=transpose), per_example)


def test_embed():
    ids = RNG.integers(0, V, size=(B, T)).astype(np.int32)
    g = RNG.normal(size=(B, T, D)).astype(np.float32)
    per_example = np.zeros((B, V, D), np.float32)
    for i in range(B):
        for t in range(T):
            per_example[i, ids[i, t]] += g[i, t]
    check(rules.RULES["embed"], {"table": np.zeros((V, D), np.float32)}, ids, g, None, {"table": per_example})


@pytest.mark.parametrize("rms", [False, True])
def test_norm(rms):
    x = RNG.normal(size=(B, T, D)).astype(np.float32)
    g = RNG.normal(size=(B, T, D)).astype(np.float32)
    centred = x if rms else x - x.mean(-1, keepdims=True)
    xhat = centred / np.sqrt(np.mean(centred ** 2, -1, keepdims=True) + 1e-5)
    params = {"scale": np.ones(D, np.float32), "bias": None if rms else np.zeros(D, np.float32)}
    per_example = {"scale": np.sum(g * xhat, 1)}
    if not rms:
        per_example["bias"] = g.sum(1)
    check(rules.RULES["norm"], params, x, g, NormSpec(eps=1e-5, rms=rms), per_example)


@pytest.mark.parametrize("sketch", SKETCHES)
def test_rmm_linear(sketch):
    """The RMM rule keeps ``S^T a [B, k, F]`` and its per-example kernel gradient is ``a_i^T S S^T g_i`` with one
    ``S [T, k]`` for the batch; the bias gradient is exact."""
    x = RNG.normal(size=(B, T, D)).astype(np.float32)
    g = RNG.normal(size=(B, T, P)).astype(np.float32)
    key = jax.random.key(5)
    spec = RMMSpec(RMMConfig(sketch=sketch, rate=0.6))
    params = {"kernel": np.zeros((D, P), np.float32), "bias": np.zeros(P, np.float32), "key": key}
    s = np.asarray(sketch_matrix(key, T, 3, sketch), np.float64)
    assert rules.stored_input(rules.RULES["rmm_linear"], params, x, spec).shape == (B, 3, D)
    per_example = {"kernel": np.einsum("btd,tk,sk,bsp->bdp", x, s, s, g), "bias": g.sum(1)}
    check(rules.RULES["rmm_linear"], params, x, g, spec, per_example)


def test_every_rule_subclasses_the_base_and_the_defaults_are_the_input_and_its_vjp():
    """The built-in rules are ``LayerRule``s; the default hooks keep ``x`` and give ``dL/dx`` as the VJP of
    ``apply`` (written out here for a linear layer: ``g W^T``); only the RMM rule keeps a residual."""
    assert set(rules.RULES) == {"linear", "embed", "norm", "rmm_linear"}
    assert all(isinstance(rule, rules.LayerRule) for rule in rules.RULES.values())
    assert {name for name, rule in rules.RULES.items() if rule.keeps_residual} == {"rmm_linear"}
    linear = rules.RULES["linear"]
    x = RNG.normal(size=(B, T, D)).astype(np.float32)
    g = RNG.normal(size=(B, T, P)).astype(np.float32)
    kernel = RNG.normal(size=(D, P)).astype(np.float32)
    params = {"kernel": kernel, "bias": None}
    assert rules.stored_input(linear, params, x, LinearSpec()) is x
    np.testing.assert_allclose(rules.input_grad(linear, params, x, g, LinearSpec()), g @ kernel.T, rtol=1e-5,
                               atol=1e-5)
    ids = RNG.integers(0, V, size=(B, T)).astype(np.int32)
    assert rules.input_grad(rules.RULES["embed"], {"table": np.zeros((V, D), np.float32)}, ids,
                            RNG.normal(size=(B, T, D)).astype(np.float32), None) is None
    assert rules.gather_dtype(rules.RULES["norm"], "scale", np.float32, np.float16) is None   # not cast in apply
    assert rules.gather_dtype(linear, "kernel", np.float32, np.float16) == np.float16


class _Scale(rules.LayerRule):
    """``y = x * w`` (``w [d]``) with its per-example gradient instantiated."""

    name = "scale"

    def apply(self, params, x, spec):
        return x * params["w"]

    def per_example_grads(self, params, x, g, spec):
        from dpzero_jax.pergrad import Direct

        return {"w": Direct((x * g).reshape(x.shape[0], -1, x.shape[-1]).sum(1))}


def test_the_registry_checks_the_contract():
    class NoGrads(rules.LayerRule):
        name = "no_grads"

        def apply(self, params, x, spec):
            return x

    with pytest.raises(TypeError, match="per_example_grads"):
        NoGrads()
    with pytest.raises(TypeError, match="LayerRule subclass, got dict"):
        rules.registry([{"name": "linear"}])
    with pytest.raises(ValueError, match="two layer rules are named 'linear'"):
        rules.registry([rules.RULES["linear"], type("Other", (_Scale,), {"name": "linear"})()])
    with pytest.raises(ValueError, match="needs a non-empty string `name`"):
        rules.registry([type("Nameless", (_Scale,), {"name": ""})()])
    with pytest.raises(TypeError, match="`input_free` must be a frozenset"):
        rules.registry([type("Listy", (_Scale,), {"input_free": ["w"]})()])
    scale = _Scale()
    assert rules.registry([scale]) == {"scale": scale} and not scale.keeps_residual
    x = RNG.normal(size=(B, T, D)).astype(np.float32)
    g = RNG.normal(size=(B, T, D)).astype(np.float32)
    check(scale, {"w": np.ones(D, np.float32)}, x, g, None, {"w": np.sum(x * g, 1)})
