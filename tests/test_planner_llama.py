"""The memory planner's Llama family (Llama 2/3, Mistral, Qwen2, Gemma 1/2) against independent references: the
published checkpoints' parameter counts, ``transformers`` models built from the same ``config.json``, and the
engine's own plan of the project's :class:`~dpzero_jax.models.Llama`."""

import argparse
import math

import hf_helpers
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import dpzero_jax as dz
from dpzero_jax import planner
from dpzero_jax.program.mode import plan_program

# ``num_parameters()`` of the published transformers checkpoints (model cards agree).
PUBLISHED = {"llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
             "llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096, "qwen2-7b": 7_615_616_512,
             "gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma-2-9b": 9_241_705_984}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    assert planner.PRESETS[name].n_params == PUBLISHED[name]


@pytest.mark.parametrize("kind", sorted(hf_helpers.LLAMA_FAMILY))
def test_count_of_a_checkpoint_directory_equals_transformers(tmp_path, kind, capsys):
    """``dpzero plan --model DIR`` reads the checkpoint's config.json as the loader does; its count equals the
    number of parameters of the transformers model saved there (tied weights counted once)."""
    model = hf_helpers.llama(tmp_path, kind, tokenizer=False)
    expected = sum(p.numel() for p in model.parameters())
    config = planner.resolve_model(str(tmp_path))
    assert config.family == "llama" and config.n_params == expected
    assert planner.main(["--model", str(tmp_path), "--batch", "2", "--seq", "16"]) == 0
    assert f"{expected:,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [
    dict(num_key_value_heads=2, tie_word_embeddings=False),
    dict(num_key_value_heads=1, tie_word_embeddings=True, qkv_bias=True, head_dim=6),
    dict(num_key_value_heads=2, gemma=True, sandwich_norms=True, tie_word_embeddings=True),
])
def test_weights_are_the_leaves_the_engine_traces(overrides):
    """Paths, sizes and number of uses of every weight against the program front-end's plan of the project's
    Llama (the sites where each leaf meets the example)."""
    c = dz.models.LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=8, scan_layers=False, **overrides)
    model = nnx.eval_shape(lambda: dz.models.Llama(c, rngs=nnx.Rngs(0)))
    params, loss_fn = dz.models.lm_objective(model)
    batch = {"input_ids": jax.ShapeDtypeStruct((3, 8), jnp.int32)}
    paths = [jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    plan = plan_program(loss_fn, dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0), params, batch, paths, 3)
    sizes = {path: math.prod(leaf.shape) for path, leaf in zip(plan.paths, jax.tree.leaves(params))}
    uses = {path: len(plan.sites_of(i)) for i, path in enumerate(plan.paths)}
    ours = planner.weights(planner.DecoderConfig(
        "test", 2, 16, 4, 29, 8, d_ff=24, tied=c.tie_word_embeddings, family="llama", n_kv_head=c.kv_heads,
        head_dim=c.head_size, qkv_bias=c.qkv_bias, sandwich_norms=c.sandwich_norms))
    assert {w.path: w.size for w in ours} == sizes
    # matrices (whose uses set the ghost norm's positions); Gemma's (1 + w) norm scales take the fallback, no site
    assert {w.path: w.uses for w in ours if w.is_matrix} == {w.path: uses[w.path] for w in ours if w.is_matrix}


def test_block_remat_temporaries_are_the_carries_and_the_largest_phase():
    """With ``remat='block'`` the temporaries are the buffers live throughout plus the largest moment
    (dpzero_jax.step_memory). Llama 2 7B, 256 chips, T 2048, one sequence per chip, counted by hand: from the backward
    on, the fp32 stacked block gradients beyond the gradients row ``2 x 32 x p_l / 256`` with ``p_l = 4 d^2 + 3 d d_ff +
    2 d = 202,383,360``; carried, the scan's saved block inputs ``32 x 2048 x 4096 x 2``; the vocabulary-sharded table
    (``V = 32000 <= N b T``) is gathered and the head's gradient, formed whole, is held, ``2 V d``; a block's backward
    at its attention (the largest): fp32 probabilities and their bf16 cast ``32 x 2048^2 x 6``, half the activations
    ``2048 x 2 x (8 d + 3 d_ff) / 2``, the MLP matrix twice ``2 x 2 d d_ff``. The LM head's phases are smaller. The DP
    step's sums are fp32: the matrices at the weights ``14 d d_ff`` (with Llama's fp32 probabilities ``32 x 2048^2 x
    4``, the larger block moment), the held head sum ``4 V d``."""
    plan = planner.plan_memory("llama-2-7b", 256, 256, 2048, "bf16", 3, remat="block")
    v, d, f = 32000, 4096, 11008
    p_l, w = 4 * d**2 + 3 * d * f + 2 * d, d * f
    always, carried = -(-2 * 32 * p_l // 256), 32 * 2048 * d * 2
    half_acts = 2048 * 2 * (8 * d + 3 * f) // 2
    attention, weights_ = 32 * 2048**2 * 6 + half_acts + 2 * 2 * w, 32 * 2048**2 * 4 + half_acts + 4 * 2 * w
    assert p_l == 202_383_360 and attention > weights_
    head = max(2 * 2 * v * d, 2 * v * d + 2 * 2 * 2048 * v, 2 * v * d + 2 * 2048 * v + 2 * v * d)
    assert head < 2 * v * d + attention
    assert plan.activations == always + carried + 2 * v * d + attention
    dp_attention, dp_weights = attention + 4 * w, weights_ + 6 * w
    assert dp_weights > dp_attention and 4 * v * d + 4 * v * d < carried + 4 * v * d + dp_weights
    assert plan.dp_extra == (4 * v * d + dp_weights) - (2 * v * d + attention)
    assert plan.gathered_weights == 0     # one of the block phase's buffers
    none = planner.plan_memory("llama-2-7b", 256, 256, 2048, "bf16", 3)
    assert plan.model_states == none.model_states
    with pytest.raises(ValueError, match="does not model the 'dots' policy"):
        planner.plan_memory("llama-2-7b", 8, 8, 2048, "bf16", 3, remat="dots")


def test_shards_partition_the_model_states_not_the_batch():
    """``shards=F``: the model states are split ``F`` ways (a mesh's fsdp axis), the batch over all ``N``."""
    plan = planner.plan_memory("llama-2-7b", 256, 256, 2048, "bf16", 3, remat="block", shards=64)
    assert plan.optimizer_state == 12 * -(-plan.n_params // 64) and plan.batch_per_device == 1
    with pytest.raises(ValueError, match="shards=48 does not divide devices=256"):
        planner.plan_memory("llama-2-7b", 256, 256, 2048, "bf16", 3, shards=48)


@pytest.mark.parametrize("values, message", [
    (dict(n_layer=2, d_model=8, n_head=2, vocab=5, n_ctx=4, n_kv_head=1), "describe the llama family"),
    (dict(n_layer=2, d_model=8, n_head=4, vocab=5, n_ctx=4, family="llama", n_kv_head=3),
     "n_head=4 is not a multiple of n_kv_head=3"),
    (dict(n_layer=2, d_model=8, n_head=2, vocab=5, n_ctx=4, family="mamba"), "family must be one of"),
    (dict(model_type="falcon", num_hidden_layers=2), "model_type 'falcon'"),
])
def test_bad_configs_name_the_problem(values, message):
    with pytest.raises(ValueError, match=message):
        planner.config_from_dict(values)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_adapters_are_those_peft_adds(family):
    """``lora_weights`` (what ``dpzero plan --peft lora`` trains) against the trainable leaves of
    ``peft.apply(model, "lora", rank=4)`` on the project's model of the same shapes: the same count."""
    if family == "llama":
        c = dz.models.LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                  scan_layers=False)
        make = lambda: dz.models.Llama(c, rngs=nnx.Rngs(0))   # noqa: E731
        ours = planner.DecoderConfig("t", 2, 16, 4, 29, 8, d_ff=24, tied=c.tie_word_embeddings, family="llama",
                                     n_kv_head=2)
    else:
        c = dz.models.GPT2Config(vocab_size=29, n_positions=8, n_embd=16, n_layer=2, n_head=4)
        make = lambda: dz.models.GPT2(c, rngs=nnx.Rngs(0))   # noqa: E731
        ours = planner.DecoderConfig("t", 2, 16, 4, 29, 8)
    model, trainable = dz.peft.apply(nnx.eval_shape(make), "lora", rank=4, key=jax.random.key(0))
    expected = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, trainable)))
    assert sum(w.size for w in planner.lora_weights(ours, 4)) == expected
    base = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) - expected
    assert ours.n_params == base


def test_lora_plan_trains_the_adapters_and_holds_the_base_frozen():
    """LoRA rank 8 on Llama 2 70B, 128 chips (the AOT case of experiments/tpu_aot.py), counted by hand: adapters
    ``8 (rows + cols)`` per block kernel, ``Psi_a = 80 x 8 x (2 (d + d) + 2 (d + 1024) + 3 (d + 28672))``; model
    states ``16 Psi_a / 128`` trained plus the frozen base in bf16, ``2 Psi / 128``; temporaries as for a full
    fine-tuning but the stacked gradients are the adapters' (``p_a``), the frozen head holds no gradient, and the
    DP step adds no buffer (its fp32 sums are the adapters'; the base's gathers are the non-private step's)."""
    d, f, kv, psi = 8192, 28672, 1024, 68_976_648_192
    p_a = 8 * (2 * (d + d) + 2 * (d + kv) + 3 * (d + f))
    psi_a = 80 * p_a
    plan = planner.plan_memory("llama-2-70b", 128, 128, 2048, "bf16", 3, remat="block", peft="lora", lora_rank=8)
    assert plan.n_trainable == psi_a == 103_546_880 and plan.n_params == psi
    assert plan.frozen == 2 * -(-psi // 128)
    assert plan.model_states == plan.frozen + 16 * -(-psi_a // 128)
    w = d * f
    always, carried = -(-2 * 80 * p_a // 128), 80 * 2048 * d * 2
    half_acts = 2048 * 2 * (4 * d + 2 * d + 2 * kv + 3 * f) // 2
    attention, weights_ = 64 * 2048**2 * 6 + half_acts + 2 * 2 * w, 64 * 2048**2 * 4 + half_acts + 4 * 2 * w
    assert weights_ > attention                 # the block's moment at its weights: the 8192 x 28672 matrix, 4x
    assert plan.activations == always + carried + weights_             # nothing held: the head is frozen
    assert plan.dp_extra == 0                # the adapters' fp32 sums are small; the base's gathers are the same
    full = planner.plan_memory("llama-2-70b", 128, 128, 2048, "bf16", 3, remat="block")
    p_l = 2 * d * d + 2 * d * kv + 3 * f * d + 2 * d
    # full fine-tuning: the blocks' stacked gradients and the head's, held whole (the table is gathered)
    assert full.activations - plan.activations == -(-2 * 80 * p_l // 128) - always + 2 * 32000 * d
    text = planner.run(argparse.Namespace(model="llama-2-70b", devices=128, batch=128, seq=2048, precision="bf16",
                                          zero=3, remat="block", shards=None, peft="lora", lora_rank=8, sizes=False,
                                          json=False))
    assert "LoRA rank 8" in text and "103,546,880 trained" in text and "frozen base weights" in text
    with pytest.raises(ValueError, match="peft must be one of"):
        planner.plan_memory("llama-2-7b", 1, 1, 16, peft="dora")
    with pytest.raises(ValueError, match="lora_rank"):
        planner.plan_memory("llama-2-7b", 1, 1, 16, peft="lora", lora_rank=0)
