"""RMM variance diagnostics (paper 002, Section 2.3): eq. (9) against its Appendix A.1 form, eq. (13), the
Theorem 2.3 counterexample, and ``diagnostics_fn`` against diagnostics of layer inputs and output gradients
computed here. (The exact variances are checked against Monte Carlo in ``test_rmm.py``.)"""

import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx

from dpzero_jax import layers as nn
from dpzero_jax import rmm
from dpzero_jax import rmm_diagnostics as rd
from dpzero_jax.sketch import RMMConfig

RNG = np.random.default_rng(0)


def test_d2_sgd_is_the_variance_of_the_batch_mean():
    """Eq. (9) for ``[B, N]`` rows, and its per-example generalisation for sequences, equal
    ``1/(B(B-1)) sum_i ||B G_i - sum_j G_j||^2`` (Appendix A.1) with ``G_i = a_i^T g_i``."""
    for shape_x, shape_g in (((6, 4), (6, 3)), ((6, 5, 4), (6, 5, 3))):
        a, g = RNG.normal(size=shape_x), RNG.normal(size=shape_g)
        per_example = np.einsum("bn,bm->bnm", a, g) if a.ndim == 2 else np.einsum("btn,btm->bnm", a, g)
        batch = a.shape[0]
        total = per_example.sum(0)
        expected = np.sum((batch * per_example - total) ** 2) / (batch * (batch - 1))
        np.testing.assert_allclose(rd.d2_sgd(a, g), expected, rtol=1e-4)
    x, y = RNG.normal(size=(6, 4)), RNG.normal(size=(6, 3))
    eq9 = 6 / 5 * np.sum(np.sum(x**2, 1) * np.sum(y**2, 1)) - np.sum((x.T @ y) ** 2) / 5
    np.testing.assert_allclose(rd.d2_sgd(x, y), eq9, rtol=1e-4)
    np.testing.assert_allclose(rd.alpha(x, y), np.sum((x.T @ y) ** 2) / (np.sum(x**2) * np.sum(y**2)), rtol=1e-5)


def test_theorem_2_3_bound_fails_on_a_counterexample():
    """``x_k = c_k u``, ``y_k = v / c_k``: every ``x_k y_k^T`` equals ``u v^T``, so ``D2_SGD = 0`` while
    ``alpha > 0`` and ``D2_RMM > 0``: the left side of eq. (12) is unbounded, its right side finite."""
    u, v = np.array([1.0, 2.0]), np.array([1.0, -1.0, 2.0])
    x, y = np.stack([u, 2 * u]), np.stack([v, v / 2])
    diag = rd.layer_diagnostics(x, y, RMMConfig(sketch="gaussian", rate=0.5, projection="rows"))
    assert float(diag.d2_sgd) == 0.0
    assert 0 < float(diag.alpha) < 1 and np.isfinite(float(diag.bound))
    assert float(diag.d2_rmm) > 0 and float(diag.variance) > 0
    assert not float(diag.ratio) <= float(diag.bound)


def test_errors():
    with pytest.raises(ValueError, match="unknown sketch"):
        rd.rmm_variance(np.ones((4, 2)), np.ones((4, 3)), 2, "hadamard")
    with pytest.raises(ValueError, match=r"k=5 must be in \[1, T=4\]"):
        rd.rmm_variance(np.ones((4, 2)), np.ones((4, 3)), 5, "gaussian")
    with pytest.raises(ValueError, match="same rows"):
        rd.d2_rmm(np.ones((4, 2)), np.ones((5, 3)), 2)
    with pytest.raises(ValueError, match="expected a"):
        rd.d2_sgd(np.ones((4, 2)), np.ones((4, 2, 3)))


class Net(nnx.Module):
    """An RMM layer (tokens), a tanh, a plain linear layer; ``x [B, T, 4] -> [B, T, 3]``."""

    def __init__(self, rngs):
        self.first = rmm.RMMDense.create(4, 5, RMMConfig(sketch="rademacher", rate=0.5), rngs=rngs)
        self.second = nn.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def test_diagnostics_fn_uses_the_layer_inputs_and_mean_loss_gradients():
    model = Net(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {"x": jnp.asarray(RNG.normal(size=(4, 6, 4)), jnp.float32),
             "w": jnp.asarray(RNG.normal(size=(4, 6, 3)), jnp.float32)}

    def loss_fn(params, batch):
        y = nnx.merge(graphdef, params, rest)(batch["x"])
        return jnp.sum(jnp.sin(y) * batch["w"], axis=(1, 2))

    mask = np.array([True, True, False, True])
    plain = RMMConfig(sketch="dct", rate=0.5, projection="rows")
    diags = ref.jit(rd.diagnostics_fn(loss_fn, config=plain))(params, batch, jnp.asarray(mask))
    assert sorted(diags) == ["first", "second"]
    # inputs and output gradients of the mean loss over the 3 unmasked examples, written out
    x, w = np.asarray(batch["x"], np.float64), np.asarray(batch["w"], np.float64)
    w1, b1 = np.asarray(model.first.kernel[...], np.float64), np.asarray(model.first.bias[...], np.float64)
    w2, b2 = np.asarray(model.second.kernel[...], np.float64), np.asarray(model.second.bias[...], np.float64)
    h = np.tanh(x @ w1 + b1)
    g2 = np.cos(h @ w2 + b2) * w * (mask / 3.0)[:, None, None]
    g1 = (g2 @ w2.T) * (1 - h**2)
    # the tokens layer ("first") sees only the unmasked examples' inputs; the rows layer all rows
    x_kept = x * mask[:, None, None]
    assert model.first.config.projection == "tokens"
    for path, (inputs, grads, config) in {"first": (x_kept, g1, model.first.config),
                                          "second": (h, g2, plain)}.items():
        expected = rd.layer_diagnostics(inputs, grads, config, count=3)
        for field, value in expected._asdict().items():
            np.testing.assert_allclose(getattr(diags[path], field), value, rtol=2e-4, err_msg=f"{path} {field}")
    assert float(diags["first"].variance) > 0 and float(diags["second"].variance) > 0
