"""``DPConfig(instantiated_dtype="bfloat16")``: book-keeping keeps the per-example gradients it instantiates in
bfloat16 and clips what it keeps. Reference: ``vmap(grad)`` per-example gradients rounded to bfloat16 here, normed
(all-layer) and clipped with ``min(1, R / ||g||)``, summed in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import gpt2, mlp

import dpzero_jax as dz


def rounded_reference(setup, max_grad_norm: float):
    """``(clipped sum {path: array}, norms [B], one-step bound {path: array})`` of the bf16-rounded per-example
    gradients; the bound is ``sum_i c_i |g_i| 2^-8``: every example's entry one bfloat16 step away."""
    grads = {path: np.asarray(jnp.asarray(g, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
             for path, g in ref.per_example_grads(setup.loss_fn, setup.params, setup.batch).items()}
    norms = np.sqrt(sum(np.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in grads.values()))
    coef = np.minimum(1.0, max_grad_norm / norms)
    return ({path: np.einsum("b...,b->...", g, coef) for path, g in grads.items()}, norms,
            {path: np.einsum("b...,b->...", np.abs(g), coef) * 2**-8 for path, g in grads.items()})


def flax_setup():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(6, rngs=rngs)
            self.hidden = nnx.Linear(6, 16, rngs=rngs)
            self.out = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(self.norm(x)))).mean(1)

    graphdef, params = nnx.split(Net(nnx.Rngs(3)), nnx.Param)

    def loss_fn(p, b):
        logits = nnx.merge(graphdef, p)(b["x"])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]

    rng = np.random.default_rng(2)
    batch = {"x": jnp.asarray(rng.standard_normal((6, 5, 6)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 4, 6), jnp.int32)}
    return type("FlaxSetup", (), {"params": params, "loss_fn": staticmethod(loss_fn), "batch": batch})


@pytest.mark.parametrize("name", ["mlp", "gpt2", "flax"])
def test_bfloat16_instantiated_gradients_are_clipped_as_kept(name):
    """Layers front-end (the MLP, a tied GPT-2) and program front-end (Flax layers): norms and clipped sum equal the
    reference on the rounded gradients, and differ measurably from the float32 run (so the rounding is seen)."""
    setup = {"mlp": mlp, "gpt2": gpt2, "flax": flax_setup}[name]()
    _, exact_norms, _ = rounded_reference(setup, 1.0)
    r = float(np.median(exact_norms))       # clips about half the examples
    expected, norms, step = rounded_reference(setup, r)
    results = {}
    for dtype in ("bfloat16", "float32"):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=r, mode="bk", norm_method="instantiate",
                          expected_batch_size=1.0, instantiated_dtype=dtype)
        _, grads, stats = ref.jit(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                                 jax.random.key(0))
        results[dtype] = ref.flat(grads)
        if dtype == "bfloat16":
            np.testing.assert_allclose(np.asarray(stats.norms).reshape(-1), norms, rtol=1e-5)
    for path, value in expected.items():
        # The engine's and the reference's float32 per-example gradients differ in the last bits; an entry on a
        # bfloat16 rounding boundary may then round the other way: one bfloat16 step (2^-8 relative) of one
        # example's entry. Every entry is within that; nearly all are equal to float32 accuracy.
        actual, scale = results["bfloat16"][path], np.max(np.abs(value))
        assert np.all(np.abs(actual - value) <= step[path] + 1e-6 * scale), path
        exact = np.isclose(actual, value, rtol=1e-5, atol=1e-6 * scale)
        assert exact.mean() > 0.99, (path, exact.mean())
    gaps = [np.max(np.abs(results["float32"][p] - v)) / np.max(np.abs(v)) for p, v in expected.items()]
    assert max(gaps) > 1e-4   # the float32 run is not the rounded one


def test_modes_that_keep_no_per_example_gradient_refuse_it():
    for mode in ("ghost", "vmap"):
        with pytest.raises(ValueError, match=f"instantiated_dtype='bfloat16'.*mode='{mode}' keeps none"):
            dz.DPConfig(mode=mode, instantiated_dtype="bfloat16")
    with pytest.raises(ValueError, match="instantiated_dtype"):
        dz.DPConfig(instantiated_dtype="float16")


def test_training_option():
    """``dpzero train --instantiated-dtype bfloat16`` reaches the runtime DPConfig; with ghost it is refused."""
    from dpzero_jax import cli
    from dpzero_jax.config import ClippingOptions
    from dpzero_jax.train import TrainConfig

    values, _ = cli._train_values(vars(cli.build_parser().parse_args(["train", "--instantiated-dtype", "bfloat16"])))
    cfg = TrainConfig.from_dict(values)
    assert cfg.clipping_options.dp_config(1.0).instantiated_dtype == "bfloat16"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"ClippingOptions.instantiated_dtype='bfloat16'.*mode='ghost' keeps none"):
        ClippingOptions(instantiated_dtype="bfloat16", mode="ghost")
