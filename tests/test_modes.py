"""Every engine mode against per-example gradients from ``vmap(grad)``: noiseless private gradients, norms and clip
factors for every clip function and grouping, on tiny GPT-2 (tied and untied), ViT and MLP models."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import SETUPS, B, check_private, gpt2, layers_mlp, mlp, vit

import dpzero_jax as dz
from dpzero_jax.models.transformer import DP_LAYERS

CLIP_FNS = ("abadi", "automatic", "global")
PRESETS = ("all-layer", "layer-wise", "param-wise", ("uniform", 2))
MICROBATCHES = (None, 1, 3)


def _matrix():
    """Every (mode, clip_fn, group preset) on the MLP; fused only with layer-local groups."""
    cases = []
    for mode, (c, clip_fn), groups in itertools.product(("bk", "ghost", "vmap", "auto"), enumerate(CLIP_FNS),
                                                        PRESETS):
        extra = {"microbatch_size": MICROBATCHES[c]} if mode == "vmap" else {}
        cases.append(pytest.param(mode, clip_fn, groups, extra, id=f"{mode}-{clip_fn}-{groups}-{extra}"))
    for clip_fn, groups in itertools.product(CLIP_FNS, ("layer-wise", "param-wise")):
        cases.append(pytest.param("fused", clip_fn, groups, {}, id=f"fused-{clip_fn}-{groups}"))
    return cases


@pytest.mark.parametrize("mode, clip_fn, groups, extra", _matrix())
def test_mlp_matrix(mode, clip_fn, groups, extra):
    check_private(mlp(), clip_fn=clip_fn, groups=groups, mode=mode, **extra)


# Transformers: every mode, clip function and group preset at least once per architecture family, plus the
# norm methods (all exact; they only change how weight norms are computed). GPT-2 on both front ends: the bundled
# model (Flax layers, the program front-end) and the same model from dz.layers layers (the layers front-end).
TRANSFORMER_CASES = [
    # model, mode, clip_fn, groups, extra config
    ("gpt2-tied", "bk", "abadi", "all-layer", {}),
    ("gpt2-dz-nn-tied", "bk", "automatic", "param-wise", {"norm_method": "ghost"}),
    ("gpt2-tied", "bk", "global", ("uniform", 3), {"norm_method": "instantiate"}),
    ("gpt2-dz-nn-tied", "ghost", "abadi", "layer-wise", {}),
    ("gpt2-tied", "ghost", "global", "all-layer", {"norm_method": "instantiate"}),
    ("gpt2-dz-nn-tied", "ghost", "automatic", ("uniform", 3), {"norm_method": "ghost"}),
    ("gpt2-tied", "vmap", "global", "param-wise", {"microbatch_size": 3}),
    ("gpt2-tied", "vmap", "automatic", "all-layer", {}),
    ("gpt2-dz-nn-tied", "auto", "abadi", "layer-wise", {}),
    ("gpt2-tied", "bk", "abadi", "all-layer", {"norm_method": "fastest"}),
    ("gpt2-tied", "auto", "automatic", "all-layer", {"target": "tpu"}),   # resolves as for a TPU, runs here
    ("gpt2-untied", "fused", "abadi", "layer-wise", {}),
    ("gpt2-dz-nn-untied", "fused", "global", "param-wise", {"norm_method": "ghost"}),
    ("gpt2-untied", "fused", "automatic", "layer-wise", {"norm_method": "instantiate"}),
    ("gpt2-dz-nn-untied", "bk", "automatic", "layer-wise", {}),
    ("gpt2-untied", "ghost", "abadi", "param-wise", {}),
    ("gpt2-untied", "vmap", "abadi", ("uniform", 4), {"microbatch_size": 1}),
    ("vit", "bk", "global", "layer-wise", {}),
    ("vit", "ghost", "automatic", "all-layer", {}),
    ("vit", "fused", "abadi", "param-wise", {}),
    ("vit", "vmap", "abadi", ("uniform", 3), {"microbatch_size": 3}),
    ("vit", "auto", "automatic", "param-wise", {}),
]


@pytest.mark.parametrize("model, mode, clip_fn, groups, extra", TRANSFORMER_CASES,
                         ids=[f"{m}-{mo}-{c}-{g}-{e}" for m, mo, c, g, e in TRANSFORMER_CASES])
def test_transformers(model, mode, clip_fn, groups, extra):
    check_private(SETUPS[model](), clip_fn=clip_fn, groups=groups, mode=mode, **extra)


def test_every_mode_clip_and_preset_is_covered():
    covered = {(p.values[0], p.values[1], str(p.values[2])) for p in _matrix()}
    for mode, clip_fn in itertools.product(("bk", "ghost", "vmap", "auto"), CLIP_FNS):
        for groups in PRESETS:
            assert (mode, clip_fn, str(groups)) in covered
    for clip_fn in CLIP_FNS:
        assert {("fused", clip_fn, "layer-wise"), ("fused", clip_fn, "param-wise")} <= covered
    families = {(m.split("-")[0], mo) for m, mo, *_ in TRANSFORMER_CASES}
    for family in ("gpt2", "vit"):
        for mode in ("bk", "ghost", "fused", "vmap"):
            assert (family, mode) in families


@pytest.mark.parametrize("mode, extra", [("bk", {}), ("ghost", {}), ("fused", {}), ("vmap", {"microbatch_size": 3})])
def test_expected_batch_size_divides(mode, extra):
    check_private(gpt2(False), clip_fn="abadi", groups="layer-wise", mode=mode, divisor=7.5, **extra)


def _mixed_mapping(paths):
    # Two groups that cut across layers: kernels of the hidden layers + the head bias vs the rest.
    return {p: ("A" if (p.startswith("layers") and p.endswith("kernel")) or p == "head/bias" else "B") for p in paths}


@pytest.mark.parametrize("mode", ["bk", "ghost", "vmap", "auto"])
def test_user_mapping_groups(mode):
    setup = mlp()
    mapping = _mixed_mapping(setup.grads)
    stats = check_private(setup, clip_fn="abadi", groups=mapping, mode=mode)
    assert stats.norms.shape == (B, 2)


@pytest.mark.parametrize("mode", ["bk", "ghost", "vmap"])
def test_callable_groups_on_gpt2(mode):
    def block_or_io(path):
        return "blocks" if path.startswith("h/") else "io"

    stats = check_private(gpt2(True), clip_fn="automatic", groups=block_or_io, mode=mode)
    assert stats.norms.shape == (B, 2)


def _per_group_thresholds(setup, groups):
    norms = setup.group_norms(groups)
    return [ref.split_threshold(norms[:, m]) for m in range(norms.shape[1])]


@pytest.mark.parametrize("mode", ["bk", "ghost", "vmap"])
def test_group_thresholds_mapping(mode):
    setup = mlp()
    mapping = _mixed_mapping(setup.grads)
    thresholds = _per_group_thresholds(setup, mapping)
    assert thresholds[0] != thresholds[1]
    check_private(setup, clip_fn="abadi", groups=mapping, mode=mode, thresholds=thresholds)


@pytest.mark.parametrize("mode", ["fused", "bk"])
def test_group_thresholds_param_wise_vit(mode):
    setup = vit()
    thresholds = _per_group_thresholds(setup, "param-wise")
    check_private(setup, clip_fn="global", groups="param-wise", mode=mode, thresholds=thresholds)


@pytest.mark.parametrize("model", ["gpt2-tied", "vit", "mlp"])
def test_per_example_grad_norms(model):
    setup = SETUPS[model]()
    expected = setup.group_norms("all-layer")[:, 0]

    def all_norms(params, batch):
        combos = [("bk", "mixed"), ("bk", "ghost"), ("bk", "instantiate"), ("ghost", "mixed"), ("vmap", "mixed")]
        return {(mode, method): dz.per_example_grad_norms(setup.loss_fn, params, batch, norm_method=method, mode=mode)
                for mode, method in combos}

    for (mode, method), norms in ref.jit(all_norms)(setup.params, setup.batch).items():
        assert norms.shape == (B,)
        np.testing.assert_allclose(norms, expected, rtol=1e-5, err_msg=f"{mode} {method}")


def test_parameter_paths_and_uniform_groups():
    """Paths look like ``h/0/attn/c_attn/kernel``; ``("uniform", k)`` chunks layers in forward order."""
    config = dz.models.GPT2Config(vocab_size=13, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    params, loss_fn = dz.models.lm_objective(nnx.eval_shape(lambda: dz.models.GPT2(config, rngs=nnx.Rngs(0),
                                                                                    layers=DP_LAYERS)))
    batch = {"input_ids": np.zeros((2, 8), np.int32)}
    plan = dz.make_plan(loss_fn, dz.DPConfig(groups=("uniform", 4)), params, batch)
    block = ["attn/c_attn/bias", "attn/c_attn/kernel", "attn/c_proj/bias", "attn/c_proj/kernel", "ln_1/bias",
             "ln_1/scale", "ln_2/bias", "ln_2/scale", "mlp/c_fc/bias", "mlp/c_fc/kernel", "mlp/c_proj/bias",
             "mlp/c_proj/kernel"]
    expected_paths = ([f"h/{i}/{p}" for i in range(2) for p in block] +
                      ["ln_f/bias", "ln_f/scale", "wpe/embedding", "wte/embedding"])
    assert list(plan.paths) == expected_paths
    # forward order: wte wpe | h0: ln_1 c_attn c_proj ln_2 c_fc c_proj | h1: same | ln_f -> 15 layers -> 4,4,4,3
    chunk = {"wte": 0, "wpe": 0, "h/0/ln_1": 0, "h/0/attn/c_attn": 0, "h/0/attn/c_proj": 1, "h/0/ln_2": 1,
             "h/0/mlp/c_fc": 1, "h/0/mlp/c_proj": 1, "h/1/ln_1": 2, "h/1/attn/c_attn": 2, "h/1/attn/c_proj": 2,
             "h/1/ln_2": 2, "h/1/mlp/c_fc": 3, "h/1/mlp/c_proj": 3, "ln_f": 3}
    for path in plan.paths:
        assert plan.group_names[plan.group_of[path]] == f"uniform-{chunk[ref.parent(path)]}", path
    assert len(plan.group_names) == 4
    np.testing.assert_allclose(plan.thresholds, [0.5] * 4)


def test_auto_memory_budget_applies_on_a_gpu_not_on_a_tpu(monkeypatch):
    """On the device itself, ``auto`` compares what book-keeping keeps with a quarter of a GPU's memory; on a TPU
    no budget applies (compiled for v5e, ghost is no smaller there: see ``choose_mode``)."""
    import jax

    from dpzero_jax import engine

    setup = layers_mlp()   # a layers-front-end plan
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="auto")
    plan = dz.make_plan(setup.loss_fn, cfg, setup.params, setup.batch)

    class TinyDevice:
        def memory_stats(self):
            return {"bytes_limit": 64}      # a quarter: 16 bytes, less than any output gradient

    monkeypatch.setattr(jax, "devices", lambda *a: [TinyDevice()])
    for backend, expected in (("gpu", "ghost"), ("tpu", "bk")):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert engine.choose_mode(cfg, plan).mode == expected
        assert engine.choose_mode(cfg.replace(target=backend), plan).mode == expected


def test_choose_mode_and_autotune_return_exact_concrete_modes():
    """auto resolves to a concrete mode (bk, or ghost over a memory budget); autotune times the candidates and
    returns one whose gradient matches the reference."""
    import jax

    setup = layers_mlp()   # a layers-front-end plan
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="auto")
    plan = dz.make_plan(setup.loss_fn, cfg, setup.params, setup.batch)
    assert dz.choose_mode(cfg, plan, backend="cpu").mode == "bk"
    assert dz.choose_mode(cfg, plan, backend="gpu", memory_budget_bytes=1).mode == "ghost"
    assert dz.choose_mode(cfg.replace(mode="fused"), plan).mode == "fused"
    tuned = dz.autotune(setup.loss_fn, cfg, setup.params, setup.batch, jax.random.key(0), repeats=1)
    assert tuned.mode in ("bk", "ghost", "vmap")      # fused cannot run all-layer groups and is skipped
    check_private(setup, clip_fn="abadi", groups="all-layer", mode=tuned.mode, microbatch_size=tuned.microbatch_size)


def test_auto_settings_resolve_for_the_target():
    resolve = dz.engine.resolve_target
    assert resolve(dz.DPConfig(target="tpu")).norm_method == "fastest"
    assert resolve(dz.DPConfig(target="cpu")).norm_method == "fastest"
    # the time rule counts an instantiated gradient as reused for the clipped sum (book-keeping: yes; ghost, fused: no)
    assert resolve(dz.DPConfig(target="cpu", mode="ghost")).norm_method == "mixed"
    assert resolve(dz.DPConfig(target="cpu"), "fused").norm_method == "mixed"
    assert resolve(dz.DPConfig(target="cpu", mode="ghost"), "bk").norm_method == "fastest"
    assert resolve(dz.DPConfig(target="tpu", mode="ghost")).norm_method == "fastest"
    assert resolve(dz.DPConfig(target="gpu")).norm_method == "mixed"
    assert resolve(dz.DPConfig(target="tpu", norm_method="ghost")).norm_method == "ghost"   # explicit: kept
    assert resolve(dz.DPConfig()).norm_method == ("mixed" if jax.default_backend() == "gpu" else "fastest")
    assert resolve(dz.DPConfig(target="tpu")).norm_kernel == "xla"
