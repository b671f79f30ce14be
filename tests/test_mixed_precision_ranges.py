"""experiments/mixed_precision_ranges.py: its over/underflow counts against IEEE fp16 limits, and its captured layer
inputs and output gradients against per-example gradients from ``jax.vmap(jax.grad)``."""

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

import dpzero_jax as dz
from dpzero_jax.models.transformer import DP_LAYERS

_PATH = pathlib.Path(__file__).parents[1] / "experiments" / "mixed_precision_ranges.py"
_SPEC = importlib.util.spec_from_file_location("mixed_precision_ranges", _PATH)
mpr = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mpr)


def test_fp16_overflow_and_underflow_follow_ieee_half_limits():
    """fp16: largest finite 65504 (values from 65520 round to inf), smallest subnormal 2^-24 ~ 5.96e-8 (values
    below half of it round to 0), smallest normal 2^-14 ~ 6.1e-5. bf16 has fp32's exponent range."""
    values = np.array([0.0, 1e5, 7e4, 6e4, 1.0, 1e-5, 1e-8, 2e-8], np.float32)
    s = mpr.stats([values])
    assert s["count"] == 7
    assert np.isclose(s["fp16_inf"], 2 / 7) and np.isclose(s["fp16_zero"], 2 / 7)
    assert np.isclose(s["fp16_subnormal"], 1 / 7)                       # 1e-5
    assert s["bf16_inf"] == 0 and s["bf16_zero"] == 0
    assert np.isclose(s["log10_max"], 5) and np.isclose(s["log10_min"], -8)


def test_captured_factors_give_the_per_example_kernel_norms():
    """<vec(a_i a_i^T), vec(g_i g_i^T)> of each captured linear layer is the squared norm of that layer's
    per-example kernel gradient (paper 000, eq. 3); the reference is vmap(grad)."""
    config = dz.models.GPT2Config(vocab_size=31, n_positions=6, n_embd=8, n_layer=1, n_head=2,
                                  tie_word_embeddings=False)
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(3), layers=DP_LAYERS))
    batch = {"input_ids": jnp.asarray(np.random.default_rng(0).integers(0, 31, (3, 6)), jnp.int32)}
    layers = mpr.capture(loss_fn, params, batch)
    ghost = sorted(np.asarray(jnp.einsum("bts,bts->b", jnp.einsum("btd,bsd->bts", a, a),
                                         jnp.einsum("btp,bsp->bts", g, g))).round(6).tolist() for a, g in layers)
    grads = mpr.per_example_grads(loss_fn, params, batch)
    paths = dz.engine.leaf_paths(params)
    kernels = [g for g, p in zip(grads, paths) if p.endswith("kernel")]
    reference = sorted(np.asarray(jnp.sum(jnp.square(g).reshape(3, -1), axis=1)).round(6).tolist() for g in kernels)
    assert len(layers) == len(kernels) == 5                  # c_attn, c_proj, c_fc, mlp c_proj, lm_head
    np.testing.assert_allclose(np.array(ghost), np.array(reference), rtol=1e-4, atol=1e-7)


def test_scaling_cancels_in_clipped_dp_gradients():
    """Automatic clipping of the scaled gradient: C(S n) S = S / (S n + gamma) -> 1/n, so the unscaled DP gradient
    barely moves with S while the scaled-down one shrinks by S (the paper's argument against loss scaling)."""
    config = dz.models.GPT2Config(vocab_size=31, n_positions=6, n_embd=8, n_layer=1, n_head=2)
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(4), layers=DP_LAYERS))
    batch = {"input_ids": jnp.asarray(np.random.default_rng(1).integers(0, 31, (3, 6)), jnp.int32)}
    rows = mpr.measure(loss_fn, params, batch, 2.0**10, "automatic")
    plain, scaled = rows["DP w/o scaling"], rows["DP w/ scaling"]
    key = "param grad (not scaled down)"
    assert abs(scaled[key]["log10_max"] - plain[key]["log10_max"]) < 0.05
    assert np.isclose(scaled["param grad (scaled down)"]["log10_max"], scaled[key]["log10_max"] - 10 * np.log10(2))
    assert np.isclose(scaled["vec(BB^T)"]["log10_max"], plain["vec(BB^T)"]["log10_max"] + 20 * np.log10(2), atol=1e-5)
    assert rows["standard w/o scaling"]["clip factor"] is None
