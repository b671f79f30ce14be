"""PEFT (LoRA, BiTFiT, linear probing) against per-example gradients of the same PEFT losses written here.

The references never use ``dpzero_jax.peft``: they start from the base model's full objective and differentiate only
the trainable arrays -- LoRA as merged weights ``W + (alpha / rank) A B`` (``A [*in, r]``, ``B [r, *out]``), BiTFiT as
the base objective as a function of the biases, linear probing as a function of the head -- with
``vmap(grad)``. The engine runs on the model and filter that ``peft.apply`` returns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import B, Setup, build, check_private, mlp_batch

import dpzero_jax as dz

RANK, ALPHA = 3, 6.0
MLP_CONFIG = dz.models.MLPConfig(in_features=12, hidden=(16, 16), num_classes=5)
VIT_CONFIG = dz.models.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_classes=5)
# The test's own choices of what each method trains (module paths of the LoRA targets, full-trained paths).
LORA_TARGETS = {"mlp": ("layers/0", "layers/1", "head"),
                "vit": ("blocks/0/attn/c_attn", "blocks/0/attn/c_proj", "blocks/0/mlp/c_fc", "blocks/0/mlp/c_proj")}
INPUT_KEY = {"mlp": "x", "vit": "image"}


@functools.cache
def base_model(name: str) -> nnx.Module:
    if name == "mlp":
        return build(dz.models.MLP, MLP_CONFIG, 4)
    return build(dz.models.ViT, VIT_CONFIG, 3)


@functools.cache
def batch_of(name: str):
    if name == "mlp":
        return mlp_batch(12, scale=2.0)
    rng = np.random.default_rng(11)
    return {"image": jnp.asarray(rng.standard_normal((B, 8, 8, 3)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 5, (B,)), jnp.int32)}


def _direct_paths(name: str, method: str, also_train: tuple[str, ...]) -> list[str]:
    """Base-model parameters the method trains in full (the test's own selection)."""
    paths = ref.paths(dz.models.classification_objective(base_model(name), INPUT_KEY[name])[0])
    if method == "bitfit":
        chosen = [p for p in paths if p.endswith("/bias")]
    elif method == "linear-probe":
        chosen = [p for p in paths if p.startswith("head/")]
    else:
        chosen = []
    return chosen + [p for p in paths if any(p.startswith(f"{prefix}/") for prefix in also_train)]


def reference_peft_loss(name: str, lora_targets, direct_paths):
    """``loss(trainable {path: array}, batch) -> [B]``: the base objective with LoRA merged into the target kernels
    and the ``direct_paths`` parameters replaced; everything else fixed at the base model's values."""
    full_params, full_loss = dz.models.classification_objective(base_model(name), INPUT_KEY[name])
    leaves, treedef = jax.tree.flatten(full_params)
    paths = ref.paths(full_params)
    scale = ALPHA / RANK

    def loss(trainable, batch):
        values = dict(zip(paths, leaves))
        for path in direct_paths:
            values[path] = trainable[path]
        for target in lora_targets:
            delta = jnp.tensordot(trainable[f"{target}/lora_a/kernel"], trainable[f"{target}/lora_b/kernel"], axes=1)
            values[f"{target}/kernel"] = values[f"{target}/kernel"] + scale * delta
        return full_loss(jax.tree.unflatten(treedef, [values[p] for p in paths]), batch)

    return loss, dict(zip(paths, leaves))


@functools.cache
def peft_setup(name: str, method: str, also_train: tuple[str, ...] = ()) -> Setup:
    """The engine's side (``peft.apply`` + objective) with the reference per-example gradients and losses attached.

    LoRA's ``A`` and ``B`` are set to random values (``B = 0`` would make ``A``'s gradient vanish)."""
    model, trainable = dz.peft.apply(base_model(name), method, rank=RANK, alpha=ALPHA, key=jax.random.key(7),
                                     also_train=also_train)
    params, loss_fn = dz.models.classification_objective(model, INPUT_KEY[name], trainable=trainable)
    lora_targets = LORA_TARGETS[name] if method == "lora" else ()
    direct = _direct_paths(name, method, also_train)
    reference_loss, base_values = reference_peft_loss(name, lora_targets, direct)
    rng = np.random.default_rng(len(name) + len(method))
    values = {p: base_values[p] for p in direct}
    for path, leaf in zip(ref.paths(params), jax.tree.leaves(params)):
        if "/lora_" in path:
            fan_in = np.prod(leaf.shape[:-1] if path.endswith("lora_a/kernel") else leaf.shape[:1])
            values[path] = jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan_in), jnp.float32)
    leaves, treedef = jax.tree.flatten(params)
    params = jax.tree.unflatten(treedef, [values[p] for p in ref.paths(params)])
    batch = batch_of(name)
    setup = Setup(f"{name}-{method}", params, loss_fn, batch, layer_order=())
    # The reference: vmap(grad) of the independently written PEFT loss (replaces Setup's own cached properties).
    setup.__dict__["grads"] = ref.per_example_grads(reference_loss, values, batch)
    setup.__dict__["losses"] = ref.per_example_losses(reference_loss, values, batch)
    return setup


CASES = [
    # model, method, mode, clip_fn, groups, extra config
    ("mlp", "lora", "bk", "abadi", "all-layer", {}),
    ("mlp", "lora", "bk", "global", "param-wise", {"norm_method": "ghost", "microbatch_size": 2}),
    ("mlp", "lora", "ghost", "automatic", "layer-wise", {"norm_method": "instantiate"}),
    ("mlp", "lora", "fused", "abadi", "layer-wise", {}),
    ("mlp", "bitfit", "bk", "abadi", "all-layer", {}),
    ("mlp", "bitfit", "bk", "automatic", "layer-wise", {"microbatch_size": 2}),
    ("mlp", "bitfit", "ghost", "global", "param-wise", {}),
    ("mlp", "bitfit", "fused", "abadi", "layer-wise", {}),
    ("mlp", "linear-probe", "bk", "abadi", "all-layer", {}),
    ("mlp", "linear-probe", "ghost", "global", "all-layer", {}),
    ("mlp", "linear-probe", "fused", "automatic", "layer-wise", {}),
    ("vit", "lora", "bk", "abadi", "all-layer", {}),
    ("vit", "lora", "ghost", "automatic", "param-wise", {"norm_method": "ghost"}),
    # floor 1e-5 of the leaf's largest entry: on an AMD EPYC host one adapter entry of ~3e-4 differed from the
    # float64 reference by 1.5e-7 (1.7e-6 of the leaf's largest, float32 rounding of a sum with cancellation)
    ("vit", "lora", "fused", "global", "layer-wise", {"floor": 1e-5}),
    ("vit", "bitfit", "bk", "global", "all-layer", {}),
    ("vit", "bitfit", "ghost", "abadi", "layer-wise", {}),
    ("vit", "bitfit", "fused", "automatic", "param-wise", {}),
    ("vit", "linear-probe", "bk", "abadi", "all-layer", {}),
]


@pytest.mark.parametrize("name, method, mode, clip_fn, groups, extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}" for c in CASES])
def test_peft_private_gradient_matches_reference(name, method, mode, clip_fn, groups, extra):
    """Norms, clip factors and the noiseless clipped gradient; the gradient pytree holds exactly the trainable
    parameters (``assert_grads_close`` compares the path sets)."""
    check_private(peft_setup(name, method), clip_fn=clip_fn, groups=groups, mode=mode, **extra)


def test_lora_with_a_fully_trained_head():
    check_private(peft_setup("vit", "lora", ("head",)), clip_fn="abadi", groups="layer-wise", mode="bk")


@pytest.mark.parametrize("method", ["lora", "bitfit", "linear-probe"])
def test_frozen_weights_are_not_parameters(method):
    """Frozen weights are not in params, so the plan has a row for the trainable arrays only, none of them a
    fallback, and they alone get gradients."""
    setup = peft_setup("vit", method)
    paths = set(ref.paths(setup.params))
    assert paths == set(setup.grads)
    report = dz.explain_plan(setup.loss_fn, dz.DPConfig(mode="bk"), setup.params, setup.batch)
    # LoRA's adapters are dpzero_jax.layers layers (planned from their calls), the ViT's own layers Flax's
    assert report.front_end == ("layers" if method == "lora" else "program")
    assert {row["path"] for row in report.rows} == paths
    assert all(row["rule"] not in ("fallback", "unused") for row in report.rows), report.table()
    if method == "lora":
        # the adapter matrices only: the frozen base layer calls are plain computations
        assert len(paths) == 2 * len(LORA_TARGETS["vit"])
        assert all(p.endswith(("lora_a/kernel", "lora_b/kernel")) for p in paths)
        assert not any("/base/" in p for p in paths)
    if method == "linear-probe":
        assert paths == {"head/kernel", "head/bias"}
    if method == "bitfit":
        assert all(p.endswith("/bias") for p in paths)
        assert {"blocks/0/ln_1/bias", "ln/bias", "patch_embed/bias", "head/bias"} <= paths  # norms included


def _logits(model, trainable, inputs):
    params, apply_fn = dz.models.logits_fn(model, trainable=trainable)
    return np.asarray(ref.jit(apply_fn)(params, inputs))


@pytest.mark.parametrize("name", ["mlp", "vit", "gpt2"])
def test_lora_zero_init_is_the_base_model(name):
    """``B = 0``: the adapted model computes the base model's logits; ``A`` is drawn from the key (shape
    ``[*in, r]``), ``B`` is ``[r, *out]`` zeros; the input model is left unchanged."""
    if name == "gpt2":
        config = dz.models.GPT2Config(vocab_size=23, n_positions=12, n_embd=16, n_layer=1, n_head=2)
        model = build(dz.models.GPT2, config, 1)
        inputs = jnp.asarray(np.random.default_rng(0).integers(0, 23, (B, 10)), jnp.int32)
    else:
        model, inputs = base_model(name), batch_of(name)[INPUT_KEY[name]]
    before = nnx.state(model)
    adapted, trainable = dz.peft.apply(model, "lora", rank=RANK, alpha=ALPHA, key=jax.random.key(3))
    np.testing.assert_allclose(_logits(adapted, trainable, inputs), _logits(model, nnx.Param, inputs), rtol=1e-6,
                               atol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)
    assert not any(isinstance(m, dz.peft.LoRA) for _, m in nnx.iter_modules(model))
    lora = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(adapted) if isinstance(m, dz.peft.LoRA)}
    assert lora, name
    for path, module in lora.items():
        in_shape, out_shape = dz.layers.dense_shapes(module.base)
        a, b = np.asarray(module.lora_a.kernel[...]), np.asarray(module.lora_b.kernel[...])
        assert a.shape == in_shape + (RANK,) and b.shape == (RANK,) + out_shape, path
        assert np.all(b == 0) and np.std(a) > 0, path
    assert sorted(trainable.names) == sorted(f"{p}/lora_{m}/kernel" for p in lora for m in "ab")
    again = dz.peft.apply(model, "lora", rank=RANK, alpha=ALPHA, key=jax.random.key(3))[0]
    other = dz.peft.apply(model, "lora", rank=RANK, alpha=ALPHA, key=jax.random.key(4))[0]
    first = next(iter(lora))
    a_of = {"/".join(map(str, p)): np.asarray(m.lora_a.kernel[...])
            for p, m in nnx.iter_modules(again) if isinstance(m, dz.peft.LoRA)}
    np.testing.assert_array_equal(a_of[first], np.asarray(lora[first].lora_a.kernel[...]))
    b_of = {"/".join(map(str, p)): np.asarray(m.lora_a.kernel[...])
            for p, m in nnx.iter_modules(other) if isinstance(m, dz.peft.LoRA)}
    assert not np.allclose(b_of[first], a_of[first])


def test_default_lora_targets():
    """Transformers: the attention and MLP projections of every block (not the patch embedding or the head); MLP
    models: every Linear."""
    vit = nnx.eval_shape(lambda: dz.models.ViT(VIT_CONFIG, rngs=nnx.Rngs(0)))
    gpt2 = nnx.eval_shape(lambda: dz.models.GPT2(dz.models.GPT2Config(vocab_size=11, n_positions=8, n_embd=8,
                                                                      n_layer=2, n_head=2), rngs=nnx.Rngs(0)))
    mlp = nnx.eval_shape(lambda: dz.models.MLP(MLP_CONFIG, rngs=nnx.Rngs(0)))
    names = lambda model: [dz.peft.path_name(p) for p in dz.peft.default_lora_targets(model)]  # noqa: E731
    assert names(vit) == list(LORA_TARGETS["vit"])
    assert names(gpt2) == [f"h/{i}/{m}" for i in range(2) for m in ("attn/c_attn", "attn/c_proj", "mlp/c_fc",
                                                                        "mlp/c_proj")]
    assert names(mlp) == ["head", "layers/0", "layers/1"]
    # patterns select modules and everything under them, matched on whole trailing path components
    _, trainable = dz.peft.apply(gpt2, "lora", targets=["attn", "h/1/mlp/c_fc"], key=jax.random.key(0))
    assert {n.rsplit("/", 2)[0] for n in trainable.names} == {"h/0/attn/c_attn", "h/0/attn/c_proj",
                                                              "h/1/attn/c_attn", "h/1/attn/c_proj", "h/1/mlp/c_fc"}
    _, trainable = dz.peft.apply(vit, "linear-probe")
    assert trainable.names == ["head/bias", "head/kernel"]


# ---------------------------------------------------------------------------------------------------------------
# BiTFiT keeps no layer input.

class WideInput(nnx.Module):
    """``mean_t layer_norm(dense(exp(x)))`` with ``x [B, T, 40]``: the dense layer's input is an activation of a
    width that nothing else has, and that ordinary backpropagation (to the probes) never needs."""

    def __init__(self, *, rngs):
        self.dense = dz.layers.Linear(40, 6, rngs=rngs)
        self.ln = dz.layers.LayerNorm(6)

    def __call__(self, x):
        return jnp.mean(self.ln(self.dense(jnp.exp(x))), axis=1)   # [B, 6] logits


def _kept_by_bk(model, trainable, batch, input_key):
    """Shapes of everything the book-keeping forward keeps for the backward: the residuals of its pullback and
    the captured layer inputs."""
    params, loss_fn = dz.models.classification_objective(model, input_key, trainable=trainable)
    plan = dz.make_plan(loss_fn, dz.DPConfig(mode="bk"), params, batch)

    def kept(params, batch):
        _, pullback, calls = dz.engine.bk_forward(loss_fn, plan, params, dz.engine._leaf_ids(params), batch)
        return jax.tree.leaves((pullback, calls))

    return [tuple(s.shape) for s in jax.eval_shape(kept, params, batch)]


def _recorded_by_program(model, trainable, batch, input_key):
    """Shapes of the operands the traced-program front-end's book-keeping pass records (``[B, 1, ...]``: one
    example at a time)."""
    from dpzero_jax.layer_plan import leaf_paths
    from dpzero_jax.program import mode as program_mode

    params, loss_fn = dz.models.classification_objective(model, input_key, trainable=trainable)
    plan = program_mode.plan_program(loss_fn, dz.DPConfig(mode="bk", front_end="program"), params, batch,
                                     leaf_paths(params), B)

    def recorded(params, batch):
        return program_mode._pass(plan, jax.tree.leaves(params), jax.tree.leaves(batch))[1]

    return [tuple(s.shape) for s in jax.tree.leaves(jax.eval_shape(recorded, params, batch))]


@pytest.mark.parametrize("method", ["bitfit", "full"])
def test_bitfit_keeps_no_activation(method):
    """With only biases trainable no array of the dense layer's input shape ``[B, T, 40]`` is kept (with the kernel
    trainable it is: the test can see it); same for the ViT's images ``[B, 8, 8, 3]`` (its patch convolution's
    input, recorded by the traced-program front-end: the ViT is built from Flax layers)."""
    model = WideInput(rngs=nnx.Rngs(0))
    batch = {"x": np.zeros((B, 3, 40), np.float32), "label": np.zeros((B,), np.int32)}
    kept = _kept_by_bk(model, dz.peft.apply(model, method)[1], batch, "x")
    vit = base_model("vit")
    recorded_vit = _recorded_by_program(vit, dz.peft.apply(vit, method)[1], batch_of("vit"), "image")
    if method == "bitfit":
        assert (B, 3, 40) not in kept and not any(s[-1:] == (40,) and s[0] == B for s in kept), kept
        assert (B, 1, 8, 8, 3) not in recorded_vit, recorded_vit
    else:
        assert (B, 3, 40) in kept and (B, 1, 8, 8, 3) in recorded_vit


# ---------------------------------------------------------------------------------------------------------------
# Errors name the bad value.

@functools.cache
def _abstract_gpt2(tied: bool):
    config = dz.models.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                  tie_word_embeddings=tied)
    return nnx.eval_shape(lambda: dz.models.GPT2(config, rngs=nnx.Rngs(0)))


class NoBias(nnx.Module):
    def __init__(self, *, rngs):
        self.dense = dz.layers.Linear(4, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


@pytest.mark.parametrize("method, kwargs, match", [
    ("prefix", {}, "unknown method 'prefix'"),
    ("LoRA", {}, "unknown method 'LoRA'"),
    ("lora", {"rank": 0}, "rank must be a positive int, got 0"),
    ("lora", {"rank": 2.0}, "rank must be a positive int, got 2.0"),
    ("lora", {"rank": True}, "rank must be a positive int, got True"),
    ("lora", {"alpha": 0.0}, "alpha must be a finite number > 0, got 0.0"),
    ("lora", {"alpha": float("nan")}, "alpha must be a finite number > 0, got nan"),
    ("lora", {"key": None}, "needs key="),
    ("lora", {"targets": "q_proj"}, "LoRA target pattern 'q_proj' matches no dense layer"),
    ("lora", {"targets": ["attn", "wte"]}, "LoRA target pattern 'wte' matches no dense layer"),
    ("lora", {"targets": "mlp/(c_fc"}, "'mlp/\\(c_fc' is not a valid regular expression"),
    ("lora", {"targets": []}, "LoRA target must name at least one pattern"),
    ("bitfit", {"targets": "attn"}, "targets='attn' applies to LoRA only"),
    ("linear-probe", {"head": "classifier"}, "head pattern 'classifier' matches no parameter"),
    ("bitfit", {"also_train": "classifier"}, "also_train pattern 'classifier' matches no parameter"),
])
def test_bad_options(method, kwargs, match):
    kwargs = {"key": jax.random.key(0), **kwargs}
    with pytest.raises(ValueError, match=match):
        dz.peft.apply(_abstract_gpt2(False), method, **kwargs)


def test_bad_models():
    with pytest.raises(ValueError, match="tied LM head is the embedding table"):
        dz.peft.apply(_abstract_gpt2(True), "linear-probe")
    with pytest.raises(ValueError, match="BiTFiT needs bias parameters"):
        dz.peft.apply(nnx.eval_shape(lambda: NoBias(rngs=nnx.Rngs(0))), "bitfit")


class LeadingAxisProjection(nnx.Module):
    """An ``nnx.LinearGeneral`` that contracts its input's first feature axis (``[B, 3, 4]`` over the 3)."""

    def __init__(self, *, rngs):
        self.proj = nnx.LinearGeneral(3, 5, axis=-2, rngs=rngs)

    def __call__(self, x):
        return self.proj(x)


def test_lora_refuses_a_projection_it_would_not_reproduce():
    """LoRA's adapters contract the trailing axes: a ``LinearGeneral`` over another axis is refused by name."""
    model = nnx.eval_shape(lambda: LeadingAxisProjection(rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"nnx.LinearGeneral contracting axes \(-2,\)"):
        dz.peft.apply(model, "lora", rank=2, alpha=4.0, key=jax.random.key(0))


class WideThenWide(nnx.Module):
    """``exp(x) [B, T, 256] -> 8 -> 256 (tanh) -> 4``: the backward's peak holds two ``[B, T, 256]`` arrays; a kept
    input of the first layer would be a third."""

    def __init__(self, *, rngs):
        self.dense = dz.layers.Linear(256, 8, rngs=rngs)
        self.up = dz.layers.Linear(8, 256, rngs=rngs)
        self.head = dz.layers.Linear(256, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.mean(self.head(jnp.tanh(self.up(self.dense(jnp.exp(x))))), axis=1)


def test_bitfit_compiled_memory_is_non_dp_memory():
    """Compiled scratch memory of the private gradient with BiTFiT in bk, ghost and fused mode stays at that of the
    non-private gradient of the same loss (no activation kept for the norms); with every parameter trainable,
    ghost holds the wide input for the backward, one activation more."""
    batch = {"x": jnp.zeros((4, 64, 256)), "label": jnp.zeros((4,), jnp.int32)}
    activation = 4 * 64 * 256 * 4

    def temp_bytes(method, mode=None):
        model = WideThenWide(rngs=nnx.Rngs(0))
        params, loss_fn = dz.models.classification_objective(model, "x", trainable=dz.peft.apply(model, method)[1])
        if mode is None:
            fn, args = jax.grad(lambda p, b: jnp.mean(loss_fn(p, b))), (params, batch)
        else:
            cfg = dz.DPConfig(noise_multiplier=1.0, mode=mode, groups="layer-wise")
            fn, args = dz.private_value_and_grad(loss_fn, cfg), (params, batch, jax.random.key(0))
        return ref.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    non_dp = temp_bytes("bitfit")
    assert non_dp >= 2 * activation
    for mode in ("bk", "ghost", "fused"):
        assert temp_bytes("bitfit", mode) < non_dp + activation / 4, mode
    assert temp_bytes("full", "ghost") >= temp_bytes("full") + activation * 3 / 4


def test_lora_on_a_scanned_gpt2_matches_reference():
    """LoRA around the dense layers of a GPT-2 whose blocks are stacked and scanned (``scan_layers``): one adapter
    per layer, stacked like its kernel; the private gradient (traced-program front-end, the scan kept) against
    ``vmap(grad)`` of the base objective with ``W_l + (alpha / rank) A_l B_l`` merged layer by layer, and
    ``merge_lora`` gives the same function."""
    config = dz.models.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=3, n_head=2, scan_layers=True)
    base = build(dz.models.GPT2, config, 2)
    model, trainable = dz.peft.apply(base, "lora", rank=RANK, alpha=ALPHA, key=jax.random.key(5))
    params, loss_fn = dz.models.lm_objective(model, trainable=trainable)
    rng = np.random.default_rng(3)
    values = {p: jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[-2]), jnp.float32)
              for p, v in ref.flat(params).items()}
    assert all(v.shape[0] == 3 for v in values.values())            # stacked: one adapter per layer
    params = jax.tree.unflatten(jax.tree.structure(params), [values[p] for p in ref.paths(params)])
    targets = sorted({p.rsplit("/lora_", 1)[0] for p in values})

    full_params, full_loss = dz.models.lm_objective(base)
    full_leaves, treedef = jax.tree.flatten(full_params)
    full_paths = ref.paths(full_params)

    def reference_loss(trainable_values, batch):
        merged = dict(zip(full_paths, full_leaves))
        for target in targets:
            a, b = trainable_values[f"{target}/lora_a/kernel"], trainable_values[f"{target}/lora_b/kernel"]
            delta = jax.vmap(lambda a_l, b_l: jnp.tensordot(a_l, b_l, axes=1))(a, b)
            merged[f"{target}/kernel"] = merged[f"{target}/kernel"] + (ALPHA / RANK) * delta
        return full_loss(jax.tree.unflatten(treedef, [merged[p] for p in full_paths]), batch)

    batch = {"input_ids": jnp.asarray(rng.integers(0, 40, (B, 8)), jnp.int32)}
    setup = Setup("gpt2-scan-lora", params, loss_fn, batch, layer_order=())
    setup.__dict__["grads"] = ref.per_example_grads(reference_loss, values, batch)
    setup.__dict__["losses"] = ref.per_example_losses(reference_loss, values, batch)
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="auto", floor=2e-5)   # fp32: merged-weight order

    for target in targets:
        for which in ("lora_a", "lora_b"):
            node = model
            for part in f"{target}/{which}/kernel".split("/"):
                node = getattr(node, part)
            node.set_value(values[f"{target}/{which}/kernel"])
    ids = batch["input_ids"]
    np.testing.assert_allclose(np.asarray(dz.peft.merge_lora(model)(ids)), np.asarray(model(ids)), rtol=1e-5,
                               atol=1e-5)
