"""dpzero_jax.spmd on 8 virtual CPU devices: under a ZeRO-3 GSPMD layout (weights split over ``fsdp``), the scanned
GPT-2's activations stay split over the batch when the step is traced in ``spmd.batch_sharded`` -- no collective of
the compiled program carries a sequence-long (activation) array -- and the clipped gradient sum is still the
reference's (``vmap(grad)`` per-example gradients, clipped and summed in numpy)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx

import dpzero_jax as dz
from dpzero_jax import sharding, spmd
from dpzero_jax.engine import clipped_grad_sum

B, T = 16, 12          # T = 12 appears in no weight's shape: a collective with a 12 in its shape moves activations
_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")


def _model(remat):
    config = dz.models.GPT2Config(vocab_size=64, n_positions=24, n_embd=32, n_layer=2, n_head=2, scan_layers=True,
                                  remat=remat)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: dz.models.GPT2(config, rngs=nnx.Rngs(3))))
    state = ref.jit(lambda: nnx.split(dz.models.GPT2(config, rngs=nnx.Rngs(3)))[1])()
    params, loss_fn = dz.models.lm_objective(nnx.merge(graphdef, state))
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 64, (B, T)), jnp.int32)
    return params, loss_fn, {"input_ids": ids}


def _activation_collectives(hlo: str) -> list[str]:
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match and re.search(rf"[\[,]{T}[\],]", match.group(1)):
            found.append(f"{match.group(2)} {match.group(1)}")
    return found


def _compile(gradient, params, batch, rules, hint: bool):
    def fn(p, b):
        if hint:
            with spmd.batch_sharded(rules.mesh):
                out = gradient(p, b)
        else:
            out = gradient(p, b)
        return jax.lax.with_sharding_constraint(out, rules.grads(p))
    p_sh, b_sh = rules.params(params), rules.batch(batch)
    compiled = jax.jit(fn, in_shardings=(p_sh, b_sh), out_shardings=rules.grads(params)).lower(
        params, batch).compile()
    return compiled, jax.device_put(params, p_sh), jax.device_put(batch, b_sh)


@pytest.mark.parametrize("mode, remat", [("bk", "none"), ("ghost", "block")])
def test_clipped_sum_keeps_activations_batch_split_and_equals_the_reference(mode, remat):
    params, loss_fn, batch = _model(remat)
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(data=2, fsdp=4)), zero=3)
    assert sharding.weight_spec(params["h"]["attn"]["c_attn"]["kernel"].shape, 4) != sharding.weight_spec((), 4)
    grads = ref.per_example_grads(loss_fn, params, batch)
    threshold = ref.split_threshold(ref.group_norms(grads, {p: "all" for p in grads}, ["all"]))
    expected, _, _ = ref.private_grads(grads, "all-layer", "abadi", max_grad_norm=threshold, divisor=1.0)
    cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=threshold, mode=mode)
    clipped = clipped_grad_sum(loss_fn, cfg)

    compiled, p, b = _compile(lambda p, b: clipped(p, b)[1], params, batch, rules, hint=True)
    assert _activation_collectives(compiled.as_text()) == []
    actual = ref.flat(compiled(p, b))
    for path, value in expected.items():
        np.testing.assert_allclose(actual[path], value, rtol=2e-4, atol=1e-6 * max(1.0, np.max(np.abs(value))),
                                   err_msg=path)

    # without the hint the partitioner moves activations between devices (what spmd.py is for)
    unhinted, _, _ = _compile(lambda p, b: clipped(p, b)[1], params, batch, rules, hint=False)
    assert _activation_collectives(unhinted.as_text()), "expected activation-sized collectives without the hint"


def test_non_private_gradient_under_the_hint():
    params, loss_fn, batch = _model("none")
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(data=2, fsdp=4)), zero=3)
    expected = {k: v.sum(0) for k, v in ref.per_example_grads(loss_fn, params, batch).items()}
    compiled, p, b = _compile(jax.grad(lambda p, b: jnp.sum(loss_fn(p, b))), params, batch, rules, hint=True)
    assert _activation_collectives(compiled.as_text()) == []
    actual = ref.flat(compiled(p, b))
    for path, value in expected.items():
        np.testing.assert_allclose(actual[path], value, rtol=2e-4, atol=1e-5, err_msg=path)


def test_constrain_batch_is_the_identity_outside_and_checks_axes():
    x = jnp.arange(16.0).reshape(8, 2)
    assert spmd.constrain_batch(x) is x and spmd.batch_axes() is None
    mesh = sharding.make_mesh(sharding.MeshShape(data=2, fsdp=4))
    with spmd.batch_sharded(mesh):
        assert spmd.batch_axes() == ("data", "fsdp")
        y = jax.jit(spmd.constrain_batch)(x)
        assert spmd.batch_axes(8) == ("data", "fsdp") and spmd.batch_axes(4) is None   # a micro-batch of 4
        assert spmd.examples_per_device(24) == 3 and spmd.examples_per_device(4) == 4
        odd = jnp.ones((4, 2))
        assert spmd.constrain_batch(odd) is odd          # not divisible: left to the partitioner
    assert y.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_array_equal(y, x)
    assert spmd.batch_axes() is None and spmd.examples_per_device(24) == 24
    with pytest.raises(ValueError, match="'model'"):
        with spmd.batch_sharded(mesh, ("data", "model")):
            pass


@pytest.mark.parametrize("hinted", [True, pytest.param(False, marks=pytest.mark.slow)])   # ~20 s each
def test_trainer_gspmd_step_of_a_scanned_gpt2_keeps_activations_split(tmp_path, monkeypatch, hinted):
    """The trainer's own GSPMD step (``dpzero train --mesh data=2,fsdp=4 --scan-layers``, DP, ZeRO-3) traces its
    gradient in ``spmd.batch_sharded``: its compiled program moves no activation; with the hint switched off, it
    does (so this test can fail)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import contextlib

    import hf_helpers

    from dpzero_jax.train import TrainConfig, Trainer

    if not hinted:
        monkeypatch.setattr(spmd, "batch_sharded", lambda *args, **kwargs: contextlib.nullcontext())
    ckpt = tmp_path / "gpt2"
    hf_helpers.gpt2(ckpt, n_positions=24, n_layer=2)   # d 32, vocab 320: no weight has a 12 or 11 in its shape;
    # wpe [24, 32] is replicated (under 1024 elements): its lookup of T rows is no collective
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(20_000)))
    trainer = Trainer(TrainConfig(model=f"hf:{ckpt}", task="causal-lm", data=str(corpus), max_length=T,
                                  scan_layers=True, mesh="data=2,fsdp=4", zero=3, steps=2, batch_size=16,
                                  noise_multiplier=1.0, accountant="rdp", out=str(tmp_path / "run"),
                                  checkpoint_every=0, progress=False, plot=False))
    hlo = trainer.lower_step().compile().as_text()
    moved = [line for line in hlo.splitlines() if _COLLECTIVE.search(line)
             and re.search(rf"[\[,]({T}|{T - 1})[\],]", _COLLECTIVE.search(line).group(1))]
    assert (moved == []) == hinted, moved[:3]
