"""``DPConfig(instantiated_dtype="bfloat16")``: book-keeping keeps the per-example gradients it instantiates in
bfloat16 and clips what it keeps. References: ``vmap(grad)`` per-example gradients, clipped (all-layer,
``min(1, R / ||g||)``) and summed here in float64; the norm of one example's clipped contribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import gpt2, mlp

import dpzero_jax as dz


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


def _private(setup, r: float, dtype: str, mask=None):
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=r, mode="bk", norm_method="instantiate",
                      expected_batch_size=1.0, instantiated_dtype=dtype)
    _, grads, stats = ref.jit(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                             jax.random.key(0), mask)
    return ref.flat(grads), np.asarray(stats.norms).reshape(-1)


@pytest.mark.parametrize("name", ["mlp", "gpt2", "flax"])
def test_bfloat16_instantiated_gradients_are_clipped_as_kept(name):
    """Layers front-end (the MLP, a tied GPT-2) and program front-end (Flax layers).

    * What is summed is what is clipped: one example alone (a one-hot mask) under a threshold that clips it
      contributes a gradient whose norm, measured here in float64, is the threshold to float32 accuracy -- a norm
      taken before rounding misses it by up to 2^-9;
    * the clipped sum and the norms are those of ``vmap(grad)``'s float32 gradients to bfloat16 accuracy, and differ
      measurably from the float32 run's (the rounding is seen)."""
    setup = {"mlp": mlp, "gpt2": gpt2, "flax": flax_setup}[name]()
    exact = ref.per_example_grads(setup.loss_fn, setup.params, setup.batch)
    norms = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(g.shape[0], -1) ** 2, axis=1) for g in exact.values()))
    small = float(np.min(norms)) / 4
    size = len(norms)
    for i in range(min(size, 3)):
        alone, _ = _private(setup, small, "bfloat16", jnp.arange(size) == i)
        total = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in alone.values()))
        assert abs(total / small - 1) < 2e-6, (i, total / small - 1)
    r = float(np.median(norms))       # clips about half the examples
    coef = np.minimum(1.0, r / norms)
    expected = {path: np.einsum("b...,b->...", np.asarray(g, np.float64), coef) for path, g in exact.items()}
    bound = {path: np.einsum("b...,b->...", np.abs(np.asarray(g, np.float64)), coef) for path, g in exact.items()}
    rounded, rounded_norms = _private(setup, r, "bfloat16")
    full, _ = _private(setup, r, "float32")
    np.testing.assert_allclose(rounded_norms, norms, rtol=2**-7)
    for path, value in expected.items():   # within a few bfloat16 steps of each example's entries
        assert np.all(np.abs(rounded[path] - value) <= 2**-6 * bound[path] + 1e-7 * np.max(np.abs(value))), path
    gaps = [np.max(np.abs(full[p] - rounded[p])) / np.max(np.abs(v)) for p, v in expected.items()]
    assert max(gaps) > 1e-4   # the float32 run is not the rounded one


def test_vmap_refuses_it():
    with pytest.raises(ValueError, match="instantiated_dtype='bfloat16'.*mode='vmap' keeps none"):
        dz.DPConfig(mode="vmap", instantiated_dtype="bfloat16")
    with pytest.raises(ValueError, match="instantiated_dtype"):
        dz.DPConfig(instantiated_dtype="float16")


def remat_tied_gpt2():
    """A scanned, remat'd GPT-2 with a tied table (Flax layers): ``auto`` resolves to ghost on the program
    front-end, which book-keeps the position table (a lookup at constant indices) and, at these shapes, the tied
    table (a lookup and the head: two sites; summing it by the weight path would hold more), and taps the rest."""
    config = dz.models.GPT2Config(vocab_size=23, n_positions=12, n_embd=16, n_layer=2, n_head=2,
                                  tie_word_embeddings=True, scan_layers=True, remat="block")
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(4)))
    ids = jnp.asarray(np.random.default_rng(12).integers(0, config.vocab_size, (4, 10)), jnp.int32)
    return type("RematSetup", (), {"params": params, "loss_fn": staticmethod(loss_fn), "batch": {"input_ids": ids}})


def test_auto_resolving_to_ghost_keeps_the_book_kept_table_in_bfloat16():
    """``auto`` with ``instantiated_dtype="bfloat16"`` on a remat'd model (it resolves to ghost: this used to be a
    ValueError from the resolved config). The position table and the tied table are book-kept in bfloat16: one
    example alone under a clipping threshold contributes exactly the threshold (each leaf normed as it is summed:
    after rounding where it is kept), the position table's clipped sum is ``vmap(grad)``'s to bfloat16 accuracy and
    differs from the float32 run's (the other leaves move only with the coefficients, whose norms include the
    rounded table)."""
    setup = remat_tied_gpt2()
    plan = dz.explain_plan(setup.loss_fn, dz.DPConfig(mode="auto"), setup.params, setup.batch)
    assert "front end: program, mode: ghost" in str(plan)
    exact = ref.per_example_grads(setup.loss_fn, setup.params, setup.batch)
    norms = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(g.shape[0], -1) ** 2, axis=1) for g in exact.values()))

    def private(r, dtype, mask=None):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=r, mode="auto", norm_method="instantiate",
                          expected_batch_size=1.0, instantiated_dtype=dtype)
        _, grads, stats = ref.jit(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                                 jax.random.key(0), mask)
        return ref.flat(grads), np.asarray(stats.norms).reshape(-1)

    small = float(np.min(norms)) / 4
    alone, _ = private(small, "bfloat16", jnp.arange(len(norms)) == 1)
    total = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in alone.values()))
    assert abs(total / small - 1) < 2e-6, total / small - 1
    r = float(np.median(norms))
    coef = np.minimum(1.0, r / norms)
    rounded, rounded_norms = private(r, "bfloat16")
    full, _ = private(r, "float32")
    np.testing.assert_allclose(rounded_norms, norms, rtol=2**-7)
    table = next(p for p in exact if "wpe" in p)
    for path, g in exact.items():
        value = np.einsum("b...,b->...", np.asarray(g, np.float64), coef)
        bound = np.einsum("b...,b->...", np.abs(np.asarray(g, np.float64)), coef)
        assert np.all(np.abs(rounded[path] - value) <= 2**-6 * bound + 1e-7 * np.max(np.abs(value))), path
    assert np.max(np.abs(full[table] - rounded[table])) / np.max(np.abs(full[table])) > 1e-4


def test_training_option():
    """``dpzero train --instantiated-dtype bfloat16`` reaches the runtime DPConfig; with vmap it is refused."""
    from dpzero_jax import cli
    from dpzero_jax.config import ClippingOptions
    from dpzero_jax.train import TrainConfig

    values, _ = cli._train_values(vars(cli.build_parser().parse_args(["train", "--instantiated-dtype", "bfloat16"])))
    cfg = TrainConfig.from_dict(values)
    assert cfg.clipping_options.dp_config(1.0).instantiated_dtype == "bfloat16"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"ClippingOptions.instantiated_dtype='bfloat16'.*mode='vmap' keeps none"):
        ClippingOptions(instantiated_dtype="bfloat16", mode="vmap")


def test_layer_front_end_ghost_keeps_none_so_the_option_changes_nothing():
    """The layer front-end's ghost keeps no per-example gradient: with ``instantiated_dtype="bfloat16"`` its clipped
    sum is bit for bit the float32 run's (a tied GPT-2 from ``dz.layers`` layers)."""
    setup = gpt2(dz_nn=True)
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=0.05, mode="ghost", expected_batch_size=1.0,
                          instantiated_dtype=dtype)
        _, grads, _ = ref.jit(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                             jax.random.key(0))
        out[dtype] = ref.flat(grads)
    assert "front end: layers" in str(dz.explain_plan(setup.loss_fn, dz.DPConfig(mode="ghost"), setup.params,
                                                       setup.batch))
    for path, value in out["float32"].items():
        np.testing.assert_array_equal(out["bfloat16"][path], value, err_msg=path)
