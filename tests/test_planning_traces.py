"""How often planning traces the user's loss: once for a model without ``dpzero_jax`` layers (the program front-end's
single-example trace settles the front-end; the layer tapes' whole-batch discovery trace is skipped), and the layer
front-end still chosen, and exact, for a ``dpzero_jax`` model whose loss only traces on the whole batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpzero_jax as dz

B, D, K = 4, 5, 3


def _data():
    rng = np.random.default_rng(0)
    return {"x": jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, K, B), jnp.int32)}


def _plain_params():
    rng = np.random.default_rng(1)
    return {"w": jnp.asarray(rng.normal(size=(D, K)), jnp.float32), "scale": jnp.ones((D,), jnp.float32)}


def _counted(loss_fn):
    calls = []

    def counted(params, batch):
        calls.append(jax.tree.leaves(batch)[0].shape[0])
        return loss_fn(params, batch)
    return counted, calls


def _plain_loss(params, batch):
    logits = (batch["x"] * params["scale"]) @ params["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


@pytest.mark.parametrize("front_end", ["auto", "program"])
def test_a_standard_model_is_traced_once_to_plan(front_end):
    """Tracing the jitted private step calls the loss once (on one example) to plan, then interprets its jaxpr: no
    second, whole-batch trace for the layer tapes. The gradient is the clipped per-example one."""
    loss_fn, calls = _counted(_plain_loss)
    params, batch = _plain_params(), _data()
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=0.5, mode="bk", front_end=front_end)
    _, grads, _ = jax.jit(dz.private_value_and_grad(loss_fn, cfg))(params, batch, jax.random.key(0))
    assert calls == [1]
    per_example = jax.vmap(jax.grad(lambda p, x, y: _plain_loss(p, {"x": x[None], "y": y[None]})[0]),
                           in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(B, -1) ** 2, axis=1) for g in jax.tree.leaves(per_example)))
    scale = jnp.minimum(1.0, 0.5 / norms)
    expected = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1) / B, per_example)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_loss_that_is_not_per_example_is_refused_by_the_single_example_trace():
    loss_fn, calls = _counted(lambda p, b: jnp.mean(_plain_loss(p, b)))
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk", front_end="program")
    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\] = \(4,\); got \[\(\)\] for a batch of 1"):
        dz.private_value_and_grad(loss_fn, cfg)(_plain_params(), _data(), jax.random.key(0))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.inner = dz.layers.Linear(D, D, rngs=rngs)
        self.head = dz.layers.Linear(D, K, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.inner(x)))


def test_layers_model_whose_loss_needs_the_whole_batch_keeps_the_layer_front_end():
    """The loss reshapes with the batch size written in (it cannot be traced on one example): the program trace
    fails, the engine plans with the layer tapes as before, and the gradient matches ``vmap(grad)`` clipped."""
    graphdef, params = nnx.split(_Net(nnx.Rngs(0)), nnx.Param)
    batch = _data()

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"].reshape(B, D))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    def one(params, x, y):
        logits = nnx.merge(graphdef, params)(x[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[None])[0]

    counted, calls = _counted(loss_fn)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=0.3, mode="bk")
    _, grads, stats = dz.private_value_and_grad(counted, cfg)(params, batch, jax.random.key(0))
    assert 1 in calls and B in calls   # tried on one example, then planned on the batch
    per_example = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(B, -1) ** 2, axis=1) for g in jax.tree.leaves(per_example)))
    np.testing.assert_allclose(stats.norms, norms, rtol=1e-5)
    scale = jnp.minimum(1.0, 0.3 / norms)
    expected = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1) / B, per_example)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
