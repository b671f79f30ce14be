"""The traced-program front-end on programs users write that the other tests do not: layers in a ``fori_loop``
(static bounds: a scan), a ``jax.vmap`` over attention heads inside the model, a weight normalised before use
(weight norm: a parameter feeding a reduction and a division, then a matmul) and a parameter under a ``cumsum``.
Each mode's norms and clipped gradient against ``vmap(grad)`` per-example gradients (``tests/reference.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close
from reference import per_example_grads, private_grads

import dpzero_jax as dz

B, T, D = 4, 6, 8
_rng = np.random.default_rng(3)
BATCH = {"x": jnp.asarray(_rng.normal(size=(B, T, D)), jnp.float32), "y": jnp.asarray(_rng.integers(0, 3, (B,)))}


def _weights(*shape):
    return jnp.asarray(_rng.normal(size=shape) * 0.3, jnp.float32)


def _head(h, params, batch):
    logits = h.mean(axis=-2) @ params["out"]
    return -jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), batch["y"]]


def _fori(params, batch):
    h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ params["w"] + params["b"][i]), batch["x"])
    return _head(h, params, batch)


def _vmapped_heads(params, batch):
    per_head = jax.vmap(lambda w: batch["x"] @ w, out_axes=-2)(params["heads"])   # [B, T, H, D / H]
    return _head(per_head.reshape(batch["x"].shape), params, batch)


def _weight_norm(params, batch):
    w = params["v"] / jnp.linalg.norm(params["v"], axis=0, keepdims=True) * params["g"]
    return _head(jnp.tanh(batch["x"] @ w), params, batch)


def _cumsum(params, batch):
    return _head(jnp.cumsum(batch["x"] * params["w"], axis=1), params, batch)


PROGRAMS = {
    "fori_loop": (_fori, {"w": _weights(D, D), "b": _weights(2, D), "out": _weights(D, 3)}),
    "vmapped_heads": (_vmapped_heads, {"heads": _weights(2, D, D // 2), "out": _weights(D, 3)}),
    "weight_norm": (_weight_norm, {"v": _weights(D, D), "g": _weights(D), "out": _weights(D, 3)}),
    "cumsum": (_cumsum, {"w": _weights(D), "out": _weights(D, 3)}),
}


@pytest.mark.parametrize("mode", ["bk", "ghost", "fused"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_unusual_programs_match_vmap_grad(name, mode):
    loss_fn, params = PROGRAMS[name]
    grads = per_example_grads(loss_fn, params, BATCH)
    _, norms, _ = private_grads(grads, "all-layer", "abadi", max_grad_norm=1.0)
    threshold = float(np.median(norms))   # some examples clipped, some not
    expected, norms, coef = private_grads(grads, "all-layer", "abadi", max_grad_norm=threshold)
    assert 0 < np.sum(coef < 1) < B
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=threshold, mode=mode, front_end="program")
    _, clipped, stats = jax.jit(dz.private_value_and_grad(loss_fn, cfg))(params, BATCH, jax.random.key(0))
    np.testing.assert_allclose(stats.norms, norms[:, 0], rtol=1e-5)
    assert_grads_close(clipped, expected, rtol=1e-4)
