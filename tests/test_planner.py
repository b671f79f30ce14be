"""The memory planner against independent references: textbook parameter counts, counts of built models, the ZeRO
paper's formulas, and XLA's compiled memory analysis of real (abstractly traced, never run) steps.

What is compared with compiled figures, and how closely (XLA:CPU, jax 0.10.2):

* parameters + optimizer state == the per-device argument bytes of a compiled Adam step (less batch, key and Adam's
  step counter), on 1 device and ZeRO-3-sharded over 4 devices -- exact;
* gradients == the per-device output bytes of a compiled ``jax.grad`` -- exact;
* each dense weight's per-example norm buffer == the compiled scratch of the engine's norm of that weight, within
  10% (ghost and instantiated); see :func:`test_norm_buffers_match_compiled_scratch` for the two exceptions;
* activations: **not** within 10% -- see :func:`test_activation_estimate_against_compiled_layers`.

Not compared: the whole-step difference ``temp(DP step) - temp(non-DP step)``. On XLA:CPU it measured between -0.3
and +1.1 MB for steps of 4-13 MB of scratch (2-layer GPT-2s, bk and ghost modes), i.e. noise of the scheduler: the
norms are formed after (bk) or inside (ghost) the backward pass, away from the activation peak, so that difference
does not isolate the norm buffers; they are therefore compared one weight at a time.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dpzero_jax as dz
from dpzero_jax import pergrad, planner, step_memory
from dpzero_jax.models.transformer import DP_LAYERS

# XLA:CPU's default YNNPACK fusion evaluates ``sum(Gram_a * Gram_g)`` in one kernel without materialising the
# ``[B, T, T]`` Grams (compiled scratch 0); accelerator backends run the two Gram GEMMs into memory. Switching that
# fusion off makes the CPU program hold the buffers the paper's space complexity counts.
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def _abstract_gpt2(**kwargs):
    config = dz.models.GPT2Config(**kwargs)
    model = nnx.eval_shape(lambda: dz.models.GPT2(config, rngs=nnx.Rngs(0), layers=DP_LAYERS))
    return dz.models.lm_objective(model)


def _planner_config(vocab, n_ctx, d, layers, heads, tied=True, d_ff=None):
    return planner.DecoderConfig("test", layers, d, heads, vocab, n_ctx, d_ff=d_ff, tied=tied)


# ---------------------------------------------------------------------------------------------------- counts

# Hugging Face GPT-2 checkpoints (GPT2LMHeadModel, tied head): the textbook sizes.
TEXTBOOK_GPT2 = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                 "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", sorted(TEXTBOOK_GPT2))
def test_gpt2_parameter_counts_are_the_textbook_ones(name):
    assert planner.PRESETS[name].n_params == TEXTBOOK_GPT2[name]


@pytest.mark.parametrize("key, paper", [("gpt2-large", 774e6), ("gpt2-xl", 1.56e9), ("gpt-j-6b", 6e9),
                                        ("gpt3-175b", 175e9), ("gpt-1t", 1e12)])
def test_table2_sizes_within_two_percent_of_paper_000(key, paper):
    """Paper 000 Table 2 rounds (GPT-J is 6.05B, the 1T model of Megatron-LM 1.008T); our GPT-2-style counts of
    the published architectures must land within 2% of the rounded figures."""
    assert abs(planner.PRESETS[key].n_params / paper - 1) < 0.02


@pytest.mark.parametrize("tied, n_inner", [(True, None), (False, None), (True, 24)])
def test_parameter_count_equals_a_built_gpt2(tied, n_inner):
    config = dz.models.GPT2Config(vocab_size=37, n_positions=11, n_embd=16, n_layer=3, n_head=4, n_inner=n_inner,
                                  tie_word_embeddings=tied)
    model = nnx.eval_shape(lambda: dz.models.GPT2(config, rngs=nnx.Rngs(0)))
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert _planner_config(37, 11, 16, 3, 4, tied, n_inner).n_params == counted


def test_weights_are_the_leaves_the_engine_traces():
    """Paths, sizes and number of layer calls per weight against the engine's plan of the real model."""
    params, loss_fn = _abstract_gpt2(vocab_size=29, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    batch = {"input_ids": jax.ShapeDtypeStruct((3, 8), jnp.int32)}
    plan = dz.make_plan(loss_fn, dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0), params, batch)
    sizes = {path: math.prod(leaf.shape) for path, leaf in zip(plan.paths, jax.tree.leaves(params))}
    ours = planner.weights(_planner_config(29, 8, 16, 2, 2))
    assert {w.path: w.size for w in ours} == sizes
    assert {w.path: w.uses for w in ours} == {path: len(uses) for path, uses in plan.uses.items()}


# ------------------------------------------------------------------------------------------------ model states

def test_zero_stages_follow_the_zero_paper():
    """Paper 000 §2.2.2 (mixed-precision Adam): 16 Psi replicated; (4 + 12/N) Psi, (2 + 14/N) Psi, 16 Psi / N."""
    psi, n = planner.PRESETS["gpt2-xl"].n_params, 8
    assert psi % n == 0
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}
    for zero, value in expected.items():
        plan = planner.plan_memory("gpt2-xl", n, 8, 1024, "bf16", zero)
        assert plan.model_states == value, zero
    fp32 = planner.plan_memory("gpt2-xl", n, 8, 1024, "fp32", 3)
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_state) == (4 * psi // n, 4 * psi // n, 8 * psi // n)


def _shard_largest_divisible(mesh, shape):
    axes = [i for i, size in enumerate(shape) if size % mesh.size == 0]
    spec = [None] * len(shape)
    if axes:
        spec[max(axes, key=lambda i: shape[i])] = "fsdp"
    return NamedSharding(mesh, P(*spec))


@pytest.mark.parametrize("devices", [1, 4])
def test_model_states_match_compiled_step(devices):
    """fp32 ZeRO-3 on 1 and 4 devices (every leaf of this model divides by 4 on some axis, so the per-leaf
    sharding equals the flat-buffer partition): parameters + Adam moments are the per-device arguments of the
    compiled DP step, gradients the per-device outputs of ``jax.grad``."""
    vocab, n_ctx, d, layers, heads, batch_size = 64, 8, 16, 1, 2, 8
    params, loss_fn = _abstract_gpt2(vocab_size=vocab, n_positions=n_ctx, n_embd=d, n_layer=layers, n_head=heads)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=_shard_largest_divisible(mesh, x.shape)), params)
    optimizer = optax.adam(1e-3)
    opt_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_shard_largest_divisible(mesh, x.shape)
                                       if x.ndim else replicated), jax.eval_shape(optimizer.init, params))
    batch = {"input_ids": jax.ShapeDtypeStruct((batch_size, n_ctx), jnp.int32,
                                               sharding=NamedSharding(mesh, P("fsdp")))}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    private_grad = dz.private_value_and_grad(loss_fn, dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0,
                                                                  mode="bk"))

    def step(params, opt_state, batch, key):
        losses, grads, _ = private_grad(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch, key).compile()
    arguments = compiled.memory_analysis().argument_size_in_bytes
    others = 4 * batch_size * n_ctx // devices + 4 + 8    # int32 ids shard, Adam's int32 count, the key's 2 uint32
    plan = planner.plan_memory(_planner_config(vocab, n_ctx, d, layers, heads), devices, batch_size, n_ctx, "fp32", 3)
    assert arguments - others == plan.parameters + plan.optimizer_state

    grad_fn = jax.jit(jax.grad(lambda p, b: jnp.mean(loss_fn(p, b))),
                      out_shardings=jax.tree.map(lambda x: x.sharding, params))
    outputs = grad_fn.lower(params, batch).compile().memory_analysis().output_size_in_bytes
    tuple_table = 8 * len(jax.tree.leaves(params))        # XLA counts the output tuple's pointers
    assert outputs - tuple_table == plan.gradients


def test_bf16_gradients_match_compiled_grad():
    """16-bit parameters give 16-bit gradients: 2 Psi, as the planner's mixed-precision gradient line says."""
    params, loss_fn = _abstract_gpt2(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    batch = {"input_ids": jax.ShapeDtypeStruct((2, 8), jnp.int32)}
    outputs = jax.jit(jax.grad(lambda p, b: jnp.mean(loss_fn(p, b)))).lower(params, batch).compile() \
        .memory_analysis().output_size_in_bytes
    plan = planner.plan_memory(_planner_config(64, 8, 16, 1, 2), 1, 2, 8, "bf16", 3)
    assert outputs - 8 * len(jax.tree.leaves(params)) == plan.gradients       # less the output tuple's pointers


# ------------------------------------------------------------------------------------------------ DP extra

def _norm_scratch(uses_shapes, rows, shape, left_is_ids=False):
    """Compiled scratch bytes of ``pergrad.sq_norm`` (mixed rule) of one weight from abstract factors."""

    def norm(*factors):
        uses = [pergrad.Outer(factors[2 * k], factors[2 * k + 1], rows, shape, left_is_ids=ids)
                for k, ids in enumerate(left_is_ids)]
        return pergrad.sq_norm(uses, "mixed")

    args = [jax.ShapeDtypeStruct(s, jnp.int32 if len(s) == 2 else jnp.float32) for pair in uses_shapes for s in pair]
    return jax.jit(norm).lower(*args).compile(compiler_options=NO_YNN).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("vocab, d, heads, seq, batch", [(512, 64, 4, 32, 8), (256, 64, 4, 64, 8)])
def test_norm_buffers_match_compiled_scratch(vocab, d, heads, seq, batch):
    """Every dense weight's buffer (ghost ``2 B T^2`` or instantiated ``B p d``, fp32) within 10% of XLA's scratch
    for the engine's norm of that weight; the two configurations exercise both branches of the mixed rule.

    Exceptions, not within 10% and why: a *tied* embedding table (two uses) -- the planner counts the Grams over
    all ``2T`` positions (``8 B T^2``, the paper's form) while the engine forms the cross terms pair by pair
    (measured ``4 B T^2``), so the planner is an upper bound there; an *instantiated embedding* -- the engine
    scatter-adds into a zero ``[B, V, d]`` array and XLA:CPU keeps both (2x); real models never instantiate
    embeddings (``V d >> 2 T^2``).
    """
    config = _planner_config(vocab, seq, d, 1, heads)
    buffers = {b.path: b for b in planner.norm_buffers(config, batch, seq)}
    branches = set()
    for w in planner.weights(config):
        if not w.is_matrix or w.path.endswith("embedding"):
            continue
        scratch = _norm_scratch([((batch, seq, w.rows), (batch, seq, w.cols))], w.rows, (w.rows, w.cols),
                                left_is_ids=(False,))
        assert abs(scratch / buffers[w.path].bytes - 1) < 0.1, (w.path, scratch, buffers[w.path])
        branches.add(buffers[w.path].ghost)
    wte = buffers["wte/embedding"]
    if wte.ghost:
        scratch = _norm_scratch([((batch, seq), (batch, seq, d)), ((batch, seq, vocab), (batch, seq, d))], vocab,
                                (vocab, d), left_is_ids=(True, False))
        assert 0 < scratch <= wte.bytes
    assert branches == ({True} if seq == 32 else {True, False})


def test_mixed_rule_matches_the_engine_choice():
    """The planner's ghost/instantiate choice equals ``pergrad.use_ghost`` on the engine's factors of the model."""
    for seq in (8, 24, 64):
        config = _planner_config(300, 64, 32, 1, 2)
        for w, b in zip(planner.weights(config), planner.norm_buffers(config, 2, seq)):
            if not w.is_matrix:
                continue
            left = jnp.zeros((1, seq), jnp.int32) if w.path.endswith("embedding") else jnp.zeros((1, seq, w.rows))
            use = pergrad.Outer(left, jnp.zeros((1, seq, w.cols)), w.rows, (w.rows, w.cols),
                                left_is_ids=left.ndim == 2)
            assert b.ghost == pergrad.use_ghost([use] * w.uses, "mixed"), (seq, w.path)


# ------------------------------------------------------------------------------------------------ activations

def _grad_scratch(vocab, n_ctx, d, layers, heads, batch):
    params, loss_fn = _abstract_gpt2(vocab_size=vocab, n_positions=n_ctx, n_embd=d, n_layer=layers, n_head=heads)
    ids = jax.ShapeDtypeStruct((batch, n_ctx), jnp.int32)
    fn = jax.jit(jax.value_and_grad(lambda p, b: jnp.mean(loss_fn(p, {"input_ids": b}))))
    return fn.lower(params, ids).compile(compiler_options=NO_YNN).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("vocab, d, heads, seq, batch", [(256, 64, 4, 64, 8), (512, 128, 2, 32, 16)])
def test_activation_estimate_against_compiled_layers(vocab, d, heads, seq, batch):
    """The per-block residuals of ``remat='none'`` (``activation_bytes_per_token``: what the TPU compiler keeps for
    the project's models, checked against TPU compiles in ``tests/test_planner_tpu.py``) against XLA:CPU's marginal
    scratch per block (``temp(L=2) - temp(L=1)`` of a compiled fp32 ``value_and_grad``; exactly linear in L on
    XLA:CPU). XLA:CPU keeps a subset: it recomputes the activation's intermediates and a norm's output inside fused
    consumers (measured marginal / estimate 0.64 and 0.50 on these two shapes), so the count bounds it from above;
    the band [0.4, 1.0] fails the count of Korthikanti et al. 2022 that the planner used before (1.40 and 1.13 here)
    and a count without the ``d_ff`` term (1.40 on the first shape). (The ``n_head T`` term matters at long
    sequences only: the TPU test checks it at T = 2048.)
    """
    per_block = _grad_scratch(vocab, seq, d, 2, heads, batch) - _grad_scratch(vocab, seq, d, 1, heads, batch)
    block, _ = planner.activation_bytes_per_token(_planner_config(vocab, seq, d, 1, heads), seq, "fp32")
    ratio = per_block / (block * batch * seq)
    assert 0.4 < ratio <= 1.0, ratio


# ------------------------------------------------------------------------------------------------ API and CLI

def test_plan_scales_with_the_per_device_batch():
    one = planner.plan_memory("gpt2", 1, 4, 512, "bf16", 3)
    four = planner.plan_memory("gpt2", 4, 16, 512, "bf16", 3)
    assert four.activations == one.activations and four.norm_buffers == one.norm_buffers
    # the DP extra: the largest norm buffer (per-device batch) and the float32 clipped sums (a share of the stacked
    # block sums on each of the devices)
    largest = max(b.bytes for b in four.norm_buffers)
    assert largest < four.dp_extra < one.dp_extra and four.dp_extra == largest + four.dp_sums
    assert four.total == four.model_states + four.gathered_weights + four.activations + four.dp_extra


def test_dp_float32_sums_without_remat_counted_by_hand():
    """``remat='none'``: the DP extra is the largest norm buffer plus the DP step's float32 clipped sums, counted by
    hand for GPT-2 XL on 8 devices: the stacked block sums ``4 x 48 p_l``, split 8 ways from ZeRO stage 2 (the
    gradients' partition), whole on every device below; and, in a block's backward, its unsharded sum over its bf16
    gradient (``2 p_l``) beside the tied table's sum held whole, ``4 V d`` (``V = 50257`` is no multiple of 8: the
    table is split along ``d``); the LM head's phase adds no formed sum (the head is tied). With LoRA only the
    adapters' sums."""
    v, d = 50257, 1600
    p_l = 12 * d**2 + 13 * d
    for zero, split in ((3, 8), (2, 8), (1, 1), (0, 1)):
        plan = planner.plan_memory("gpt2-xl", 8, 64, 1024, "bf16", zero)
        assert plan.dp_sums == 4 * -(-48 * p_l // split) + 2 * p_l + 4 * v * d, zero
        assert plan.dp_extra == max(b.bytes for b in plan.norm_buffers) + plan.dp_sums
    lora = planner.plan_memory("gpt2-xl", 8, 64, 1024, "bf16", 3, peft="lora", lora_rank=4)
    # rank-4 adapters of the attention's and the MLP's kernels, [1600, 4800] [1600, 1600] [1600, 6400] [6400, 1600]
    p_a = 4 * (1600 + 4800) + 4 * (1600 + 1600) + 4 * (1600 + 6400) + 4 * (6400 + 1600)
    assert lora.dp_sums == 4 * -(-48 * p_a // 8) + 2 * p_a     # the frozen head has no sum


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="gpt5"), "unknown model 'gpt5'"),
    (dict(devices=0), "devices must be a positive int, got 0"),
    (dict(batch=10, devices=4), "batch=10 is not divisible by devices=4"),
    (dict(seq=4096), "seq=4096 exceeds the context n_ctx=1024"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(zero=4), "zero must be one of"),
    (dict(model=dict(n_layer=2, d_model=10, n_head=3, vocab=5, n_ctx=4)), "d_model=10 is not divisible by n_head=3"),
    (dict(model=dict(n_layer=2, d_model=8, n_head=2, vocab=5, n_ctx=4, dropout=0.1)), "unknown keys ['dropout']"),
    (dict(model=dict(n_layer=0, d_model=8, n_head=2, vocab=5, n_ctx=4)), "n_layer must be a positive int, got 0"),
])
def test_errors_name_the_bad_value(kwargs, message):
    args = dict(model="gpt2", devices=1, batch=8, seq=512, precision="bf16", zero=3) | kwargs
    with pytest.raises(ValueError) as error:
        planner.plan_memory(**args)
    assert message in str(error.value)


def test_cli_prints_the_breakdown(capsys):
    assert planner.main(["--model", "gpt2-xl", "--devices", "8", "--batch", "64", "--seq", "1024",
                         "--precision", "bf16", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    expected = planner.plan_memory("gpt2-xl", 8, 64, 1024, "bf16", 3)
    for item in ("parameters", "gradients", "optimizer state", "activations", "DP extra", "total"):
        assert item in out
    assert f"{expected.total / 2**30:.3f}" in out and "1,557,611,200" in out


def test_cli_block_remat_prints_the_compiled_step_buffers(capsys):
    """``--remat block --shards 64``: GPT-2 XL as tpu_aot.py compiles it on 256 chips (data 4 x fsdp 64); the table
    lists the named buffers with their phases, the moment of the peak, and the DP step's fp32 head sum."""
    assert planner.main(["--model", "gpt2-xl", "--devices", "256", "--shards", "64", "--batch", "256", "--seq",
                         "1024", "--remat", "block"]) == 0
    out = capsys.readouterr().out
    expected = planner.plan_memory("gpt2-xl", 256, 256, 1024, "bf16", 3, remat="block", shards=64)
    assert "12 (master, m, v) x Psi / F" in out and "[table gradient]" in out and "[block: attention]" in out
    assert "the largest moment: backward + carried + held + block: attention" in out
    assert "DP step's largest moment: backward + carried + held + block: attention" in out
    assert "An estimate:" in out and "--compile TARGET" in out     # the table says how far to trust it
    assert f"{expected.total / 2**30:.3f}" in out
    assert expected.optimizer_state == 12 * -(-1_557_611_200 // 64)


def test_block_remat_gpt2_xl_tied_table_counted_by_hand():
    """GPT-2 XL on 256 chips (data 4 x fsdp 64), T 1024, one sequence per chip, ``remat='block'``, counted by hand from
    the buffers live at the peaks of its compiled steps (docs/planner.md, ``experiments/hlo_liveness.py``). Its table
    (``V = 50257``, not a multiple of 64) is sharded along ``d`` and gathered whole; 64 shards are too many for the
    compiler's windowed einsum, so the head's gradient is formed and held whole. From the backward on: the fp32 stacked
    block gradients beyond the gradients row, ``2 x 48 p_l / 64``; carried: block inputs ``48 x 1024 x 1600 x 2``. A
    block's backward (the largest moment): the held head gradient ``2 V d``, at the attention the bf16 probabilities and
    gradient ``25 x 1024^2 x 4``, half the activations ``1024 x 2 x 16 d / 2`` and the MLP matrix twice ``2 x 2 W``; at
    the weights half the activations and the matrix four times. Just below, the table gradient (data axis 4): the
    lookup's scatter-add and head gradient ``2 x 2 V d`` beside the held one, the block inputs dead; then the LM head:
    the table ``2 V d`` and two bf16 logits ``2 x 2 x 1024 V``. The DP step sums the tied table by its weight path
    (``ghost.weighted``'s memory rule), so nothing book-kept; its sums are fp32: the matrix's ``8 W`` at the attention
    (still the block's larger moment) and ``16 W`` at the weights, the head's sum ``4 V d`` held. GPT-2 small at 8
    sequences per chip book-keeps its table, and its fp32 sum (over 64 MiB) is formed in pieces: the per-example
    gradients ``4 x 8 V d`` in the LM head, for the norm, and no whole sum."""
    v, d, t = 50257, 1600, 1024
    plan = planner.plan_memory("gpt2-xl", 256, 256, t, "bf16", 3, remat="block", shards=64)
    p_l, w = 12 * d**2 + 13 * d, 4 * d * d
    backward, carried = -(-2 * 48 * p_l // 64), 48 * t * d * 2
    head = 2 * v * d + 2 * 2 * t * v
    half_acts = t * 2 * 16 * d // 2
    attention, weights_ = 25 * t**2 * 4 + half_acts + 2 * 2 * w, half_acts + 4 * 2 * w
    block = backward + carried + 2 * v * d + attention
    assert attention > weights_ and block > backward + 2 * v * d + 2 * 2 * v * d > carried + head
    assert plan.activations == block
    totals = {term.name: term.bytes for term in plan.temporaries}
    assert totals["lookup + head table gradients, whole, compute precision"] == 2 * 2 * v * d
    assert step_memory.tied_table_weighted(plan.model, 1, t, 2)
    dp_block = backward + carried + 4 * v * d + max(attention + 4 * w, weights_ + 6 * w)
    assert dp_block == backward + carried + 4 * v * d + attention + 4 * w > backward + 4 * v * d + 2 * 2 * v * d
    assert plan.dp_extra == dp_block - block
    small = planner.plan_memory("gpt2", 4, 32, t, "bf16", 3, remat="block", shards=4)
    booked = {term.name: term.bytes for term in small.temporaries}
    assert booked["DP: tied table's per-example gradients (book-kept) + clipped sum, fp32"] == 4 * 8 * v * 768


def test_block_remat_windowed_head_and_gathered_activations_counted_by_hand():
    """Other head layouts. GPT-2 XL's 12 layers on 32 chips (fsdp 32, T 1024): the ``d``-sharded table's
    gradient is reduce-scattered by the compiler's windowed einsum (``F <= 32``), so the head holds ``2 V d / 32``
    and the DP step's sum ``4 V d / 32``, not the whole table. A 2-block Llama (d 2048, V 32000) on 4 chips (T
    2048): the vocabulary-sharded table is larger than the devices' activations (``V > N b T = 8192``), so the
    activations are gathered (``2 x 4 x 2048 x d``), nothing is held for the untied head, and the DP step's second
    pass keeps the logits' gradient and the activations, ``2 x 2048 V + 2 x 4 x 2048 d``."""
    gpt2 = dataclasses.replace(planner.resolve_model("gpt2-xl"), n_layer=12)
    plan = planner.plan_memory(gpt2, 32, 32, 1024, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    v, d = 50257, 1600
    assert terms["LM head gradient (or what forms it), held to the update"] == 2 * -(-v * d // 32)
    assert terms["DP: LM head's clipped sum, fp32, held"] == 2 * -(-v * d // 32)
    assert terms["LM head gradient, formed whole"] == 0
    # at most 32 devices the block's matrices are gathered and reduce-scattered in windowed einsums: two copies of
    # the largest at its weights, and the DP step's fp32 sums are never whole matrices
    assert terms["largest block matrix, gathered, gradient (and reduction)"] == 2 * 2 * d * 4 * d
    assert terms["DP: the block's matrices' sums in fp32, at the weights"] == 0
    assert terms["DP: largest block matrix's sums in fp32, at the attention"] == 0
    # GPT-J's 4 layers on 16 chips: vocabulary-sharded (50400 = 16 x 3150) and larger than the chips' activations
    # (16 x 2048 tokens): the untied GPT-2-family head keeps the logits' gradient and the gathered activations to
    # the update in the non-private step; the DP step's second pass keeps the logits' gradient only
    gptj = dataclasses.replace(planner.resolve_model("gpt-j-6b"), n_layer=4)
    plan = planner.plan_memory(gptj, 16, 16, 2048, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    gathered = 2 * 16 * 2048 * 4096
    assert terms["LM head gradient (or what forms it), held to the update"] == 2 * 2048 * 50400 + gathered
    assert terms["DP: gathered activations not held (the second pass keeps the logits' gradient only)"] == -gathered
    assert plan.dp_extra < 0 < plan.total        # this DP step holds less than the non-private one
    llama = planner.DecoderConfig("two-block", 2, 2048, 16, 32000, 4096, d_ff=5504, tied=False, family="llama")
    plan = planner.plan_memory(llama, 4, 4, 2048, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    assert terms["table or activations gathered for the head"] == 2 * 4 * 2048 * 2048
    assert terms["LM head gradient (or what forms it), held to the update"] == 0
    assert terms["DP: logits gradient + gathered activations, held for the second pass"] == (
        2 * 2048 * 32000 + 2 * 4 * 2048 * 2048)
    p_l, w = 4 * 2048**2 + 3 * 2048 * 5504 + 2 * 2048, 2048 * 5504
    half_acts = 2048 * 2 * (8 * 2048 + 3 * 5504) // 2
    attention = 16 * 2048**2 * 6 + half_acts + 2 * 2 * w
    head = 2 * 4 * 2048 * 2048 + 2 * 2 * 2048 * 32000
    assert plan.activations == max(-(-2 * 2 * p_l // 4) + attention, head) + 2 * 2048 * 2048 * 2


def test_block_remat_tied_table_weight_path_first_pass_counted_by_hand():
    """A tied table summed by its weight path keeps its sites' output gradients (``b T (V + d)`` at 2 bytes) for the
    second pullback, held through the first pass's blocks; at T 2048 the time rule without reuse instantiates the
    head's per-example gradient for the norm (fp32, ``4 V d`` at one sequence), held until the lookup's is added.
    What the second pass holds of the head (its gradient and fp32 sum, reduce-scattered on 16 chips) is the
    smaller and is not counted twice. At T 1024 the rule keeps the norm ghost: only the output gradients."""
    v, d = 50257, 1536
    gpt2 = dataclasses.replace(planner.resolve_model("gpt2-xl"), n_layer=6, d_model=d, n_head=12, n_ctx=2048)
    plan = planner.plan_memory(gpt2, 16, 16, 2048, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    name = "DP: tied table's weight path, first pass (output gradients, per-example gradients)"
    second_pass = (2 + 2) * -(-v * d // 16)
    assert terms[name] == 2048 * (v + d) * 2 + 4 * v * d - second_pass
    plan = planner.plan_memory(gpt2, 16, 16, 1024, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    assert terms[name] == 1024 * (v + d) * 2 - second_pass
    # at two sequences per chip the compiled step keeps a relayout of the head's output gradient beside it, and
    # GPT-2's attention its fp32 probabilities and their cast (GPT-2 XL, 12 layers on 64 chips: the table whole)
    xl = dataclasses.replace(planner.resolve_model("gpt2-xl"), n_layer=12)
    plan = planner.plan_memory(xl, 64, 128, 1024, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    v, d = 50257, 1600
    assert terms[name] == 2 * 1024 * (2 * v + d) * 2 - 4 * v * d
    assert terms["attention probabilities (+ gradient)"] == 2 * 25 * 1024**2 * (4 + 2 * 2)
    # on at most 32 chips the head's gradient is reduce-scattered by a windowed einsum after the blocks: at two
    # sequences per chip the logits' gradient waits for it through the blocks' backward
    plan = planner.plan_memory(xl, 32, 64, 1024, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    assert terms["LM head gradient (or what forms it), held to the update"] == 2 * -(-v * d // 32) + 2 * 2 * 1024 * v
    # book-kept (GPT-2 XL's table at 8 sequences per chip): no such buffer. At T 1024 its norm is ghost: the
    # logits' gradient and a relayout of it are held through the blocks, the fp32 sum formed in the head (on 16
    # chips, windowed, the non-private step holds the logits' gradient already: the DP step adds the relayout); at
    # T 2048 the rule with reuse instantiates the per-example gradients, but the table's clipped sum is formed in
    # pieces from its uses' factors (its fp32 sum over ShardingRules.sum_chunk_bytes), so they live at the head only,
    # for the norm; the logits' gradient is held through the blocks, and no whole fp32 sum. On 32 chips (windowed) the
    # non-private step already holds that logits' gradient at two sequences per chip: the DP step adds none
    held_name = "DP: tied table's per-example gradients (book-kept) + logits gradient, held"
    formed_name = "DP: tied table's per-example gradients (book-kept) + clipped sum, fp32"
    plan = planner.plan_memory(planner.resolve_model("gpt2-xl"), 16, 128, 1024, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    assert terms.get(name, 0) == 0
    assert terms["LM head gradient (or what forms it), held to the update"] == 2 * -(-v * d // 16) + 2 * 8 * 1024 * v
    assert terms[held_name] == 2 * 8 * 1024 * v and terms[formed_name] == 4 * v * d
    long_context = dataclasses.replace(planner.resolve_model("gpt2-xl"), n_ctx=2048)
    assert 4 * v * d > 64 * 2**20      # the default ShardingRules.sum_chunk_bytes
    plan = planner.plan_memory(long_context, 32, 64, 2048, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    assert terms["LM head gradient (or what forms it), held to the update"] == 2 * -(-v * d // 32) + 2 * 2 * 2048 * v
    assert terms[held_name] == 0 and terms[formed_name] == 4 * 2 * v * d
    assert terms["DP: LM head's clipped sum, fp32, held"] == 0
    plan = planner.plan_memory(long_context, 64, 128, 2048, "bf16", 3, remat="block")
    terms = {term.name: term.bytes for term in plan.temporaries}
    assert terms[held_name] == 2 * 2 * 2048 * v and terms[formed_name] == 4 * 2 * v * d
    assert terms["DP: LM head's clipped sum, fp32, held"] == 0


def test_block_remat_tied_table_norm_behind_a_vocabulary_sharded_head_counted_by_hand():
    """Gemma-2B (tied, V 256000, d 2048) on 64 chips at T 2048: more vocabulary than tokens, so the head runs on the
    device's vocabulary rows with every chip's activations gathered; the weight path's norm after the blocks holds
    the fp32 per-example gradient (``4 V d`` at one sequence, as the compiler's peak holds it: the head's rows for all
    64 sequences or the lookup's whole scatter), the logits' gradient's ``T x T`` Grams of the 64 gathered sequences
    in fp32 (``4 N T^2``) and a relayout of the logits' gradient (``2 T V``). Gemma-7B's table (d 3072) is ghost-normed
    there: the Grams' all-reduce written beside them (``4 N T^2`` more, as the compiler's own list at the peak of
    Gemma-2-2B's sizes on 64 chips holds it) instead of the per-example gradient. On 256 chips the head is whole: no
    such term."""
    name = ("DP: tied table's weight path, its norm after the blocks (fp32 per-example gradients or the Grams' "
            "all-reduce, fp32 Grams, a relayout of the logits' gradient)")
    v, t, n = 256000, 2048, 64
    terms = {term.name: term for term in planner.plan_memory("gemma-2b", n, n, t, "bf16", 3,
                                                             remat="block").temporaries}
    assert terms[name].bytes == 4 * v * 2048 + 4 * n * t * t + 2 * t * v and terms[name].phase == "table gradient"
    terms = {term.name: term.bytes for term in planner.plan_memory("gemma-7b", n, n, t, "bf16", 3,
                                                                   remat="block").temporaries}
    assert terms[name] == 4 * n * t * t + 4 * n * t * t + 2 * t * v
    terms = {term.name: term.bytes for term in planner.plan_memory("gemma-2b", 256, 256, t, "bf16", 3,
                                                                   remat="block").temporaries}
    assert terms.get(name, 0) == 0


def test_block_remat_late_head_gradient_on_more_than_16_devices_counted_by_hand():
    """Qwen2-7B (untied, V 152064, d 3584) on 32 chips at T 2048: more vocabulary than tokens, so the head runs on
    each chip's vocabulary rows with every chip's activations gathered; the non-private step forms the head's
    gradient after the blocks, holding the logits' gradient and the gathered activations through them (``c b T V +
    c N b T d``); the DP step norms the head where its output gradient is formed and holds neither, but at the head
    the ghost norm's fp32 Grams of all 32 gathered sequences and a relayout of the logits' gradient. On 16 chips the
    non-private step holds nothing there (a Llama family's untied head); on 64 both steps hold them."""
    v, d, t, n = 152064, 3584, 2048, 32
    held = "LM head gradient (or what forms it), held to the update"
    terms = {term.name: term.bytes for term in planner.plan_memory("qwen2-7b", n, n, t, "bf16", 3,
                                                                   remat="block").temporaries}
    assert terms[held] == 2 * t * v + 2 * n * t * d
    assert terms["DP: logits gradient + gathered activations not held (normed at the head, summed in the second "
                 "pass)"] == -terms[held]
    assert terms["DP: the head's norm for every gathered sequence (fp32) + a relayout of the logits' gradient"] == (
        4 * n * t * t + 2 * t * v)
    terms = {term.name: term.bytes for term in planner.plan_memory("qwen2-7b", 16, 16, 1024, "bf16", 3,
                                                                   remat="block").temporaries}
    assert terms[held] == 0
    # on 64 chips (no windowed einsums) both steps hold them (round 12's compile): the DP step adds nothing
    terms = {term.name: term.bytes for term in planner.plan_memory("qwen2-7b", 64, 64, t, "bf16", 3,
                                                                   remat="block").temporaries}
    assert terms[held] == 2 * t * v + 2 * 64 * t * d
    assert terms["DP: logits gradient + gathered activations, held for the second pass"] == 0

def test_block_remat_head_gradient_reduce_scattered_on_65_to_128_devices_counted_by_hand():
    """Llama-3-8B (untied, V 128256, d 4096) and Gemma-2B (tied, V 256000, d 2048) on 128 chips at T 2048: the
    vocabulary fits the chips' tokens, so the whole table is gathered for the head; on 128 devices the compiler
    reduce-scatters the head's gradient at the head (``c V d / F`` held), where on 64 and 256 it all-reduces it whole
    and holds it through the blocks (``c V d``). The DP step forms the fp32 sum whole at the head with the gathered
    table released (Llama: ``4 V d - c V d`` beyond the non-private step's moment, which forms no whole gradient;
    Gemma, whose tied gradient is formed whole in both: ``4 V d - 2 c V d``), reduce-scattered, never all-reduced
    whole at the end; Gemma's weight path holds its fp32 share whole through the second pass (``4 V d - c V d /
    F``) and the logits' gradient and lookup's output gradients through the first (``c T V + c T d``)."""
    t, n = 2048, 128
    held = "LM head gradient (or what forms it), held to the update"
    formed = "LM head gradient, formed whole"
    at_head = "DP: LM head's clipped sum, fp32, formed whole at the head (the table released)"
    at_end = "DP: LM head's clipped sum, fp32, all-reduced whole at the end"
    fp32_held = "DP: LM head's clipped sum, fp32, held"
    first = "DP: tied table's weight path, first pass (output gradients, per-example gradients)"

    def terms(model, devices):
        return {term.name: term.bytes for term in planner.plan_memory(model, devices, devices, t, "bf16", 3,
                                                                      remat="block").temporaries}

    v, d = 128256, 4096
    llama = terms("llama-3-8b", n)
    share = -(-v * d // n)
    assert llama[held] == 2 * share and llama[formed] == 0
    assert llama[at_head] == 2 * v * d and llama[at_end] == 0 and llama[fp32_held] == 2 * share
    for devices in (64, 256):   # all-reduced whole and held
        other = terms("llama-3-8b", devices)
        assert other[held] == 2 * v * d and other[formed] == 2 * v * d
        assert other[at_head] == 0 and other[at_end] == 4 * v * d
    v, d = 256000, 2048
    gemma = terms("gemma-2b", n)
    share = -(-v * d // n)
    assert gemma[held] == 2 * share and gemma[formed] == 2 * v * d
    assert gemma[at_head] == 0   # 4 V d - 2 c V d at c = 2: the tied gradient's moment already holds 2 c V d
    assert gemma[fp32_held] == 4 * v * d - 2 * share
    second_pass = 2 * share + 4 * v * d - 2 * share
    assert gemma[first] == max(0, 2 * t * v + 2 * t * d - second_pass) == 0
    # a head of 630 MiB or less (Llama-2-7B's, 250 MiB in bf16; its fp32 sum 500 MiB) is all-reduced whole and
    # held on 128 devices too
    v, d = 32000, 4096
    small = terms("llama-2-7b", n)
    assert small[held] == 2 * v * d and small[at_head] == 0 and small[at_end] == 4 * v * d
    assert small[fp32_held] == (4 - 2) * v * d
    # vocabulary 49152 (round 15): the bf16 gradient (384 MiB) held whole, the fp32 sum (768 MiB) reduce-scattered:
    # the DP step holds less than the non-private one through the blocks
    v = 49152
    mixed = terms(dataclasses.replace(planner.PRESETS["llama-2-7b"], vocab=v), n)
    share = -(-v * d // n)
    assert mixed[held] == 2 * v * d and mixed[fp32_held] == 4 * share - 2 * v * d < 0 and mixed[at_end] == 0
    # vocabulary 98304: 768 rows a device fill whole 8-row tiles, so the gradient is formed whole before it is
    # reduce-scattered (1002 rows, Llama-3-8B's above, are padded when gathered: not formed whole); 98560's 770 not
    for vocab, formed_bytes in ((98304, 2 * 98304 * d), (98560, 0)):
        aligned = terms(dataclasses.replace(planner.PRESETS["llama-2-7b"], vocab=vocab), n)
        assert aligned[formed] == formed_bytes
        assert aligned[at_head] == (4 - 2) * vocab * d - formed_bytes


def test_cli_sizes_and_json_config(tmp_path, capsys):
    assert planner.main(["--sizes"]) == 0
    out = capsys.readouterr().out
    assert "1,557,611,200" in out and "175B" in out and "1T" in out
    config = tmp_path / "tiny.json"     # GPT2Config's key names are accepted
    config.write_text(json.dumps({"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 50, "n_positions": 8}))
    assert planner.main(["--model", str(config), "--batch", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["n_params"] == _planner_config(50, 8, 16, 2, 2).n_params and plan["seq"] == 8


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt2", "--batch", "6", "--devices", "4"], "batch=6 is not divisible by devices=4"),
    (["--model", "nope.json", "--batch", "4"], "model config file 'nope.json' does not exist"),
    (["--model", "gpt2"], "--batch is required"),
    (["--model", "gpt2", "--batch", "8", "--devices", "8", "--shards", "3"], "shards=3 does not divide devices=8"),
])
def test_cli_errors(argv, message, capsys):
    assert planner.main(argv) == 2
    assert message in capsys.readouterr().err


def test_block_remat_lookup_gradient_all_reduced_whole_after_the_blocks_counted_by_hand():
    """An 8-layer Llama-2-7B shape at vocabulary 128000 on 256 chips, T 2048, one sequence a chip: after the blocks'
    backward the non-private step holds the head's gradient whole (``c V d``), the lookup's scatter-add formed whole
    and its all-reduce into a second whole table (``2 c V d``): the step's peak (3.07 GiB compiled; the model
    without the lookup's two tables read 2.72). The DP step's fp32 sum there replaces them (``4 V d`` at the end);
    on at most 32 devices (windowed) nothing of it is counted."""
    v, d, t, n = 128000, 4096, 2048, 256
    config = dataclasses.replace(planner.PRESETS["llama-2-7b"], vocab=v, n_layer=8)
    plan = planner.plan_memory(config, n, n, t, "bf16", 3, remat="block")
    named = {term.name: term for term in plan.temporaries}
    lookup = "lookup's gradient, whole, and its all-reduce, compute precision"
    assert named[lookup].bytes == 2 * 2 * v * d and named[lookup].phase == "table gradient"
    assert named["DP: the lookup's compute-precision gradient and its all-reduce, not formed"].bytes == -2 * 2 * v * d
    non_private = step_memory.non_private(plan.temporaries)
    assert step_memory.largest_phase(non_private) == "backward + held + table gradient"
    totals = step_memory.phase_totals(non_private)
    assert totals["held"] == 2 * v * d and totals["table gradient"] == 2 * 2 * v * d
    # on 32 devices (windowed einsums: the head's gradient reduce-scattered as formed) no lookup table is counted
    small = {term.name: term.bytes for term in planner.plan_memory(config, 32, 64, t, "bf16", 3,
                                                                   remat="block").temporaries}
    assert small[lookup] == 0


def test_block_remat_dp_block_keeps_all_activations_at_the_attention_at_several_sequences_counted_by_hand():
    """GPT-J-6B at four sequences a chip on 32 chips, T 1024: the DP step's block holds all its activations at the
    attention (the MLP's three ``bf16[4, 1024, 16384]`` beside the attention's), the non-private step half
    (``b T c x / 2`` more); at one sequence a chip, or on 64 devices, no such term."""
    name = "DP: the block's other half of activations, at the attention (b > 1, at most 32 devices)"
    x = step_memory.per_token_block_numbers(planner.PRESETS["gpt-j-6b"])

    def term(devices, batch):
        named = {t.name: t for t in planner.plan_memory("gpt-j-6b", devices, batch, 1024, "bf16", 3,
                                                        remat="block").temporaries}
        return named[name]
    assert term(32, 128).bytes == 4 * 1024 * 2 * x // 2 and term(32, 128).phase == "block: attention"
    assert term(32, 32).bytes == 0 and term(64, 256).bytes == 0

