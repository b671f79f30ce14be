"""ZeRO-3 layer-by-layer gathering (``strategy="explicit"``) on the traced program, the steps around the private
sums: the non-private mean gradient and the forward of the flax.linen decoder of ``zero3_linen.py``, of the bundled
GPT-2 with scanned ``dz.layers`` layers, and the trainer on the bundled CNN, on 8 virtual devices.

References are independent of the engine: ``jax.grad`` of the mean loss, the model's own forward, the same training
run on one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from zero3_linen import BATCH, SEQ, assert_sums_close, setup
from zero3_linen import rules as make_rules

from dpzero_jax import sharding
from dpzero_jax.program import interpret
from dpzero_jax.train import TrainConfig, Trainer


@pytest.mark.parametrize("scan", [False, True])
def test_non_private_gradient_and_forward_on_shards(scan):
    model, params, batch, loss_fn = setup(scan, remat=scan)
    rules = make_rules()
    mask = jnp.ones((BATCH,), bool).at[0].set(False)
    gradient = sharding.explicit_mean_gradient(loss_fn, rules, params)
    step = jax.jit(lambda p, b, m: gradient(p, b, None, m), in_shardings=(rules.params(params), rules.batch(batch),
                                                                          rules.batch(0)))
    losses, grads = step(params, batch, mask)
    expected = jax.grad(lambda p: jnp.sum(jnp.where(mask, loss_fn(p, batch), 0.0)) / jnp.sum(mask))(params)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(loss_fn(params, batch)), rtol=1e-5, atol=1e-6)
    assert_sums_close(grads, expected)

    apply = sharding.explicit_apply(lambda p, ids: model.apply({"params": p}, ids), rules, params)
    logits = jax.jit(apply, in_shardings=(rules.params(params), rules.batch(batch["ids"])))(params, batch["ids"])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.apply({"params": params}, batch["ids"])),
                               rtol=1e-5, atol=1e-5)


def test_trainer_explicit_strategy_on_standard_flax_layers(tmp_path, monkeypatch):
    """The bundled CNN (``nnx.Conv`` / ``nnx.GroupNorm`` / ``nnx.Linear``) under ``strategy="explicit"`` on
    ``fsdp=8`` takes the one-device steps, private and not."""
    base = dict(model="cnn", steps=2, batch_size=64, log_every=1, progress=False, plot=False, checkpoint_every=0,
                optimizer="sgd", lr=0.1, epsilon=3.0)
    for name, extra in (("dp", {}), ("nodp", {"no_dp": True}), ("bf16", {"precision": "bf16"})):
        one = Trainer(TrainConfig(out=str(tmp_path / f"1{name}"), **base, **extra)).run()
        trainer = Trainer(TrainConfig(out=str(tmp_path / f"8{name}"), mesh="fsdp=8", strategy="explicit", **base,
                                      **extra))
        eight = trainer.run()
        assert any(leaf.sharding.spec != P() for leaf in jax.tree.leaves(eight.params))
        # bf16 compute: the clipped sums are float32 on every device and across them (docs/privacy.md), so one
        # device and eight agree to float32's precision, as in float32 (3e-5 when each device's sum was bf16)
        for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    # bf16 compute: each sharded kernel is cast to bf16 before its gather (the layer casts it anyway). Read from the
    # lowered program: XLA:CPU widens bf16 collectives when it compiles.
    gathered = re.findall(r"all_gather.*?-> tensor<[\dx]*x(\w+)>", trainer.lower_step().as_text())
    assert gathered and set(gathered) == {"bf16"}
    # ghost mode differentiates the weights through their gathers: the gradient is reduce-scattered in float32. Its
    # weight paths take float32 views of the weights (the sum never rounded to bf16), gathered in float32 in the
    # lowered program: only their transposes are used, so the compiled step has no more gathers than with the
    # weight paths on the bf16 views
    ghost = Trainer(TrainConfig(out=str(tmp_path / "ghost"), mesh="fsdp=8", strategy="explicit", mode="ghost",
                                precision="bf16", **base))
    lowered = ghost.lower_step()
    gathered = re.findall(r"all_gather.*?-> tensor<[\dx]*x(\w+)>", lowered.as_text())
    scattered = re.findall(r"reduce_scatter.{0,400}?\}\) : \(tensor<[\dx]*x(\w+)>", lowered.as_text(), re.S)
    assert "bf16" in gathered and scattered and set(scattered) == {"f32"}
    with monkeypatch.context() as patch:   # a new trainer: its step is traced anew, with the views in bf16
        patch.setattr(interpret, "_float32_deferred", lambda *_: None)
        narrow_trainer = Trainer(TrainConfig(out=str(tmp_path / "narrow"), mesh="fsdp=8", strategy="explicit",
                                             mode="ghost", precision="bf16", **base))
        narrow_lowered = narrow_trainer.lower_step()
        assert "f32" not in re.findall(r"all_gather.*?-> tensor<[\dx]*x(\w+)>", narrow_lowered.as_text())
        narrow = narrow_lowered.compile().as_text()
    assert len(re.findall(r" all-gather\(", lowered.compile().as_text())) == len(re.findall(r" all-gather\(", narrow))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_non_private_gradient_of_scanned_dpzero_layers_on_shards(dtype):
    """The bundled GPT-2 with ``scan_layers`` (``dz.layers`` layers inside ``lax.scan``: the traced-program front-end)
    under the explicit strategy's non-private step: ``jax.grad`` of the mean loss. (Differentiating the gathers'
    data dependency inside a linearised scan failed before it got its own derivative; with bf16 compute, a bias
    cast to bf16 and then broadcast inside the scan was gathered in float32 before the cast was carried along the
    chain.)"""
    from flax import nnx

    import dpzero_jax as dz

    config = dz.models.GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, scan_layers=True)
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(0), dtype=dtype))
    batch = {"input_ids": jnp.asarray(np.random.default_rng(1).integers(0, 128, (BATCH, SEQ)), jnp.int32)}
    rules = make_rules()
    gradient = sharding.explicit_mean_gradient(loss_fn, rules, params)
    mask = jnp.ones((BATCH,), bool)
    _, grads = jax.jit(lambda p, b, m: gradient(p, b, None, m),
                       in_shardings=(rules.params(params), rules.batch(batch), rules.batch(0)))(params, batch, mask)
    assert_sums_close(grads, jax.grad(lambda p: jnp.mean(loss_fn(p, batch)))(params),
                       rtol=1e-4 if dtype is None else 2e-2)   # bf16: the shards' sums add in another order
