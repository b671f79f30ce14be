"""``DPConfig(scan_groups="per-iteration")``: each iteration's slice of a scanned, stacked parameter is a clipping
group of its own, computed by ``mode="fused"`` in one backward pass inside the scan, against ``vmap(grad)``.

The reference splits every stacked leaf ``[L, ...]`` of the per-example gradients into ``L`` parameters
``path[i]`` and clips them with the usual noiseless reference (``reference.private_grads``): param-wise groups
``path[i]``, layer-wise groups ``parent[i]``. Models: a plain-JAX decoder of ``jax.checkpoint`` blocks under
``lax.scan``, a flax.linen ``nn.scan`` of ``nn.remat`` blocks, the project's GPT-2 with scanned, rematerialised
blocks, and a plain-JAX stack of float layers (masks and a NaN example). Norms rtol 1e-5, gradients rtol 1e-4.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import Setup, assert_grads_close, check_private
from test_program_fused import LinenScanned, class_loss, decoder, token_batch

import dpzero_jax as dz


def split_stacked(grads: dict, stacked: dict) -> dict:
    """``{path: [B, ...]}`` with each stacked leaf (``stacked[path]`` = its number of iterations) replaced by its
    per-iteration slices ``path[i]``, in flatten order."""
    out = {}
    for path, g in grads.items():
        if path in stacked:
            out.update({f"{path}[{i}]": g[:, i] for i in range(stacked[path])})
        else:
            out[path] = g
    return out


def group_name(groups: str):
    def name(pseudo: str) -> str:
        path, _, index = pseudo.partition("[")
        base = path if groups == "param-wise" else ref.parent(path)
        return base + ("[" + index if index else "")
    return name


def per_iteration_reference(loss_fn, params, batch, stacked: dict, groups: str, clip_fn: str, max_grad_norm: float,
                            include=None):
    """``(grads {path: array}, norms [B, M], coef [B, M])`` with the stacked leaves' slices as parameters."""
    per_example = split_stacked(ref.per_example_grads(loss_fn, params, batch), stacked)
    grads, norms, coef = ref.private_grads(per_example, group_name(groups), clip_fn,
                                           max_grad_norm=max_grad_norm, include=include)
    whole = {}
    for path in ref.paths(params):
        whole[path] = (np.stack([grads[f"{path}[{i}]"] for i in range(stacked[path])]) if path in stacked
                       else grads[path])
    return whole, norms, coef


def check(loss_fn, params, batch, stacked: dict, groups: str, clip_fn: str = "abadi", mode: str = "fused",
          mask=None, include=None, nonfinite: int = 0, rtol: float = 1e-4, norm_rtol: float = 1e-5,
          reference_batch=None, **cfg_kwargs):
    """The engine on ``batch`` against the reference on ``reference_batch`` (default ``batch``; a NaN example's
    values zeroed there, since the reference excludes it through ``include``)."""
    reference_batch = batch if reference_batch is None else reference_batch
    _, norms, _ = per_iteration_reference(loss_fn, params, reference_batch, stacked, groups, "abadi", 1.0, include)
    keep = np.ones(norms.shape[0], bool) if include is None else np.asarray(include, bool)
    r = ref.split_threshold(norms[keep]) * np.sqrt(norms.shape[1])   # clips some (example, group) pairs only
    expected, ref_norms, ref_coef = per_iteration_reference(loss_fn, params, reference_batch, stacked, groups,
                                                            clip_fn, r, include)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=float(r), clip_fn=clip_fn, groups=groups, mode=mode,
                      scan_groups="per-iteration", **cfg_kwargs)
    _, grads, stats = ref.jit(dz.private_value_and_grad(loss_fn, cfg))(params, batch, jax.random.key(0), mask)
    assert stats.norms.shape == ref_norms.shape
    np.testing.assert_allclose(np.asarray(stats.norms)[keep], ref_norms[keep], rtol=norm_rtol)
    np.testing.assert_allclose(stats.clip_factors, ref_coef, rtol=norm_rtol, atol=1e-7)
    assert_grads_close(grads, expected, rtol=rtol, floor=1e-6 if rtol <= 1e-4 else rtol)
    assert int(stats.num_nonfinite) == nonfinite
    return stats


def stacked_leaves(params, prefix: str) -> dict:
    return {p: int(x.shape[0]) for p, x in ref.flat(params).items() if p.startswith(prefix)}


def test_scanned_remat_decoder():
    """Param-wise (split per iteration, a block's layer-wise group of four matrices has no one site to clip it)."""
    setup = decoder(layers=3, stacked=True)
    stats = check(setup.loss_fn, setup.params, setup.batch, stacked_leaves(setup.params, "blocks/"), "param-wise")
    assert stats.norms.shape[1] == 3 * 7 + 3


@pytest.mark.parametrize("clip_fn", ["abadi", "automatic", "global"])
def test_linen_scan_of_remat_blocks(clip_fn):
    model = LinenScanned()
    batch = token_batch(3)
    params = ref.jit(model.init)(jax.random.key(1), batch["ids"])["params"]

    def loss_fn(p, b):
        return class_loss(model.apply({"params": p}, b["ids"]), b["y"])
    stats = check(loss_fn, params, batch, stacked_leaves(params, "ScanCheckpointBlock_0/"), "layer-wise", clip_fn)
    assert stats.norms.shape[1] == 3 + 2   # three layers of the stack, the embedding, the head


@pytest.mark.parametrize("tied", [False, True])
def test_bundled_gpt2_scanned_and_rematerialised(tied):
    """The project's GPT-2 with stacked, scanned blocks under ``remat='block'``; ``mode="auto"`` runs fused for
    per-iteration groups. Tied, the table's group (the lookup and the head: not local to one site) is book-kept in
    the same pass."""
    config = dz.models.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=3, n_head=2,
                                  tie_word_embeddings=tied, scan_layers=True, remat="block")
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(0)))
    batch = {"input_ids": jnp.asarray(np.random.default_rng(5).integers(0, 32, (4, 8)), jnp.int32)}
    stats = check(loss_fn, params, batch, stacked_leaves(params, "h/"), "layer-wise", mode="auto")
    # per block: ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj; then wte, wpe, ln_f (and lm_head untied)
    assert stats.norms.shape[1] == 3 * 6 + 3 + (not tied)


def float_stack(layers: int = 3, d: int = 6, batch_size: int = 6, dtype=None):
    keys = jax.random.split(jax.random.key(7), 5)
    params = {"layers": {"w": jax.random.normal(keys[0], (layers, d, d)) / np.sqrt(d),
                         "b": 0.1 * jax.random.normal(keys[1], (layers, d)),
                         "scale": 1.0 + 0.1 * jax.random.normal(keys[2], (layers, d))},
              "head": jax.random.normal(keys[3], (d, 3)) / np.sqrt(d)}
    batch = {"x": jax.random.normal(keys[4], (batch_size, 5, d)),
             "y": jnp.asarray(np.random.default_rng(8).integers(0, 3, batch_size), jnp.int32)}

    def loss_fn(p, b):
        def body(h, lp):
            if dtype is not None:   # computed in half precision from float32 weights: casts in the views' chains
                h, lp = h.astype(dtype), jax.tree.map(lambda x: x.astype(dtype), lp)
            return (jnp.tanh(h @ lp["w"] + lp["b"]) * lp["scale"]).astype(jnp.float32), None
        h, _ = jax.lax.scan(body, b["x"], p["layers"])
        return class_loss(h.mean(1) @ p["head"], b["y"])
    return params, loss_fn, batch


@pytest.mark.parametrize("groups", ["param-wise", "layer-wise"])
def test_masks_and_a_nan_example(groups):
    params, loss_fn, batch = float_stack()
    stacked = stacked_leaves(params, "layers/")
    mask = jnp.asarray([True, False, True, True, True, True])
    check(loss_fn, params, batch, stacked, groups, mask=mask, include=np.asarray(mask))
    poisoned = {**batch, "x": batch["x"].at[3, 2, 1].set(jnp.nan)}
    include = np.asarray(mask).copy()
    include[3] = False
    clean = {k: v.at[3].set(0) for k, v in poisoned.items()}   # the reference never sees the NaN example's values
    stats = check(loss_fn, params, poisoned, stacked, groups, mask=mask, include=include, nonfinite=1,
                  reference_batch=clean)
    assert np.all(np.asarray(stats.clip_factors)[~include] == 0)
    assert int(stats.num_included) == int(include.sum())


def test_bf16_compute_and_microbatches():
    """float32 weights, bfloat16 layers inside the scan (the casts are part of each view's chain; the reference is
    vmap(grad) of the same program), and microbatches of 2."""
    params, loss_fn, batch = float_stack(dtype=jnp.bfloat16)
    check(loss_fn, params, batch, stacked_leaves(params, "layers/"), "layer-wise", rtol=3e-2, norm_rtol=2e-2)

    def cast_before_the_scan(p, b):   # the stacked leaves cast whole, then sliced: the chain starts at the leaf
        def body(h, lp):
            return (jnp.tanh(h.astype(jnp.bfloat16) @ lp["w"] + lp["b"]) * lp["scale"]).astype(jnp.float32), None
        h, _ = jax.lax.scan(body, b["x"], jax.tree.map(lambda x: x.astype(jnp.bfloat16), p["layers"]))
        return class_loss(h.mean(1) @ p["head"], b["y"])
    check(cast_before_the_scan, params, batch, stacked_leaves(params, "layers/"), "layer-wise", rtol=3e-2,
          norm_rtol=2e-2)
    params, loss_fn, batch = float_stack()
    check(loss_fn, params, batch, stacked_leaves(params, "layers/"), "layer-wise", microbatch_size=2)


def test_noise_is_calibrated_to_all_the_groups():
    """``M`` grows with the stack's depth; each threshold is ``R / sqrt(M)``, so the noise std stays ``sigma R``."""
    params, loss_fn, batch = float_stack()
    sigma, r = 2.0, 0.5
    cfg = dz.DPConfig(noise_multiplier=sigma, max_grad_norm=r, groups="layer-wise", mode="fused",
                      scan_groups="per-iteration", expected_batch_size=1.0)
    fn = ref.jit(dz.private_value_and_grad(loss_fn, cfg))
    _, noisy, stats = fn(params, batch, jax.random.key(3))
    _, clean, _ = ref.jit(dz.private_value_and_grad(loss_fn, cfg.replace(noise_multiplier=0.0)))(
        params, batch, jax.random.key(3))
    noise = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree.leaves(noisy), jax.tree.leaves(clean))])
    assert stats.norms.shape[1] == 3 + 1
    assert abs(np.std(noise) / (sigma * r) - 1) < 0.1, np.std(noise)


def test_refusals_name_the_option():
    params, loss_fn, batch = float_stack()
    for mode in ("bk", "ghost", "vmap"):
        with pytest.raises(ValueError, match="scan_groups='per-iteration' is computed by mode='fused'"):
            dz.private_value_and_grad(loss_fn, dz.DPConfig(mode=mode, scan_groups="per-iteration"))(
                params, batch, jax.random.key(0))
    with pytest.raises(ValueError, match="group 'all' mixes parameters stacked differently or not at all"):
        dz.private_value_and_grad(loss_fn, dz.DPConfig(mode="fused", scan_groups="per-iteration"))(
            params, batch, jax.random.key(0))
    with pytest.raises(ValueError, match="traced-program front-end"):
        dz.private_value_and_grad(loss_fn, dz.DPConfig(mode="fused", groups="layer-wise", front_end="layers",
                                                       scan_groups="per-iteration"))(params, batch, jax.random.key(0))
    with pytest.raises(ValueError, match="scan_groups must be one of"):
        dz.DPConfig(scan_groups="layers")
    # split per iteration, a block's layer-wise group of several matrices has no one site to clip it
    blocks = decoder(layers=2, stacked=True)
    with pytest.raises(ValueError, match=r"group 'blocks\[0\]' has 4 dot / conv / gather sites.*no one site can"):
        dz.private_value_and_grad(blocks.loss_fn, dz.DPConfig(mode="fused", groups="layer-wise",
                                                              scan_groups="per-iteration"))(
            blocks.params, blocks.batch, jax.random.key(0))
    # without the option the stacked leaf stays one group, which fused book-keeps, pointing at the option; the
    # clipped gradient is vmap(grad)'s with the stacked leaves whole
    whole = dz.DPConfig(mode="fused", groups="layer-wise", front_end="program", noise_multiplier=0.0)
    report = dz.explain_plan(loss_fn, whole, params, batch)
    assert "scan_groups='per-iteration'" in " ".join(row["why"] for row in report.rows)
    params5, loss5, batch5 = float_stack(batch_size=5)   # the helpers' reference batch size
    check_private(Setup("float-stack", params5, loss5, batch5, ()), clip_fn="abadi", groups="layer-wise",
                  mode="fused", front_end="program")


def test_unscanned_models_are_unchanged():
    """Without a scan nothing is split: the same result as scan_groups='whole'."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(5)(x)))
    model = Net()
    x = jax.random.normal(jax.random.key(2), (4, 6))
    params = model.init(jax.random.key(1), x)["params"]
    batch = {"x": x, "y": jnp.asarray([0, 1, 2, 1], jnp.int32)}

    def loss_fn(p, b):
        return class_loss(model.apply({"params": p}, b["x"]), b["y"])
    results = [dz.private_value_and_grad(loss_fn, dz.DPConfig(noise_multiplier=0.0, groups="layer-wise", mode="fused",
                                                              front_end="program", scan_groups=s))(
        params, batch, jax.random.key(0)) for s in ("whole", "per-iteration")]
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_array_equal(a, b)


def test_explain_shows_the_split_groups():
    params, loss_fn, batch = float_stack()
    report = dz.explain_plan(loss_fn, dz.DPConfig(groups="layer-wise", scan_groups="per-iteration"), params, batch)
    assert report.mode == "fused" and report.front_end == "program"
    groups = {row["path"]: row["group"] for row in report.rows}
    assert groups == {"head": "head", "layers/b": "layers[0..2]", "layers/scale": "layers[0..2]",
                      "layers/w": "layers[0..2]"}


def test_the_trainer_with_per_iteration_groups(tmp_path):
    """``dpzero train --groups layer-wise --scan-groups per-iteration`` on a tiny Llama (layers scanned and
    rematerialised): fused clipping, one group per layer of the stack, and the held-out loss goes down."""
    import hf_helpers

    from dpzero_jax.cli import main

    ckpt = tmp_path / "llama"
    hf_helpers.llama(ckpt, "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(20_000)))
    assert main(["train", "--model", f"hf:{ckpt}", "--task", "causal-lm", "--data", str(corpus), "--max-length", "16",
                 "--remat", "block", "--groups", "layer-wise", "--scan-groups", "per-iteration", "--steps", "8",
                 "--batch-size", "32", "--lr", "3e-3", "--epsilon", "8", "--eval-every", "8", "--log-every", "1",
                 "--out", str(tmp_path / "run"), "--accountant", "rdp", "--checkpoint-every", "0",
                 "--no-progress"]) == 0
    import json
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 < summary["epsilon"] <= 8
    losses = [r["loss"] for r in rows if "loss" in r]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    # the option reaches the engine: all-layer groups cannot be split per iteration
    from dpzero_jax.train import TrainConfig, Trainer
    cfg = TrainConfig(model=f"hf:{ckpt}", task="causal-lm", data=str(corpus), max_length=16, steps=1, batch_size=8,
                      out=str(tmp_path / "run2"), progress=False, accountant="rdp", scan_groups="per-iteration")
    assert cfg.dp_config(1.0).scan_groups == "per-iteration"
    with pytest.raises(ValueError, match="group 'all' mixes parameters"):
        Trainer(cfg).run()
