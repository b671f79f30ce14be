"""dpzero_jax layers called where the layer tapes cannot compute them: on an input whose leading axis is not the
batch, inside ``jax.checkpoint`` / ``lax.scan`` / the user's own ``vmap``. The front-end ``auto`` leaves those calls
to the traced-program front-end (exact, against ``vmap(grad)``); ``front_end="layers"`` refuses them by name; an
integer loss is refused. Before this was checked, a time-major ``[T, B, d]`` input with ``T == B`` gave wrong norms
and gradients silently, and a layer under ``jax.checkpoint`` got a zero gradient in ghost mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import B, Setup, check_private

import dpzero_jax as dz

WIDTH, CLASSES = 6, 3


class Placed(nnx.Module):
    """Two dz.layers layers; the first applied as ``how`` says to ``x [B, T, WIDTH]``."""

    def __init__(self, how: str, rngs: nnx.Rngs):
        self.how = how
        self.inner = dz.layers.Linear(WIDTH, WIDTH, rngs=rngs)
        self.head = dz.layers.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x):
        if self.how == "time-major":       # the layer on [T, B, d]
            h = jnp.swapaxes(jnp.tanh(self.inner(jnp.swapaxes(x, 0, 1))), 0, 1)
        elif self.how == "checkpoint":
            h = jax.checkpoint(lambda v: jnp.tanh(self.inner(v)))(x)
        elif self.how == "scan":            # over positions, the layer on [B, d] inside the body
            def body(carry, v):
                return carry, jnp.tanh(self.inner(v + carry))
            _, h = jax.lax.scan(body, jnp.zeros((x.shape[0], WIDTH)), jnp.swapaxes(x, 0, 1))
            h = jnp.swapaxes(h, 0, 1)
        elif self.how == "user-vmap":       # written for one example, mapped by the user
            h = jax.vmap(lambda v: jnp.tanh(self.inner(v)))(x)
        else:                               # "batch-leading": the supported placement
            h = jnp.tanh(self.inner(x))
        return self.head(h.mean(axis=1))


def setup(how: str, length: int) -> Setup:
    graphdef, params = nnx.split(Placed(how, nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(1)
    batch = {"x": jnp.asarray(rng.normal(size=(B, length, WIDTH)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, CLASSES, B), jnp.int32)}

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    return Setup(f"{how}-T{length}", params, loss_fn, batch, ("inner", "head"))


def front_end(s: Setup, **cfg) -> str:
    """The front-end ``explain_plan`` reports; its table names a misplaced call's reason."""
    report = dz.explain_plan(s.loss_fn, dz.DPConfig(max_grad_norm=1.0, **cfg), s.params, s.batch)
    assert bool(report.misplaced) == (report.front_end == "program")
    assert all(f"cannot compute: {note}" in report.table() for note in report.misplaced)
    return report.front_end


@pytest.mark.parametrize("how, length", [("time-major", B), ("time-major", B + 2), ("checkpoint", 4),
                                         ("scan", 4), ("user-vmap", B)])
@pytest.mark.parametrize("mode", ["auto", "bk", "ghost"])
def test_misplaced_layer_calls_are_exact(how, length, mode):
    """``length == B`` for the time-major layer: the input's leading axis has the batch's size and is not it."""
    s = setup(how, length)
    assert front_end(s) == "program"
    check_private(s, clip_fn="abadi", groups="all-layer", mode=mode)


@pytest.mark.parametrize("how, words", [("time-major", "leading axis did not follow the batch"),
                                        ("checkpoint", "inside a transformation")])
def test_layers_front_end_names_the_misplaced_call(how, words):
    s = setup(how, B if how == "time-major" else 4)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk", front_end="layers")
    with pytest.raises(dz.UnsupportedParameterError, match=words) as error:
        dz.private_value_and_grad(s.loss_fn, cfg)(s.params, s.batch, jax.random.key(0))
    assert "linear layer call on ['inner/kernel', 'inner/bias']" in str(error.value)


def test_batch_leading_calls_stay_on_the_layers_front_end():
    """An input ``[B, T, d]`` with ``T == B`` is traced once more with ``B + 1`` examples and kept: the layer tapes."""
    s = setup("batch-leading", B)
    assert front_end(s) == "layers"
    check_private(s, clip_fn="abadi", groups="all-layer", mode="bk")


def test_integer_losses_are_refused():
    s = setup("batch-leading", 4)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk")

    def int_loss(params, batch):
        return s.loss_fn(params, batch).astype(jnp.int32)

    with pytest.raises(TypeError, match="floating-point per-example losses; got dtype int32"):
        dz.private_value_and_grad(int_loss, cfg)(s.params, s.batch, jax.random.key(0))
