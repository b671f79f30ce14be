"""The memory planner's Llama family (Llama 2/3, Mistral, Qwen2, Gemma 1/2) against independent references: the
published checkpoints' parameter counts, ``transformers`` models built from the same ``config.json``, and the
engine's own plan of the project's :class:`~dpzero_jax.models.Llama`."""

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


def test_block_remat_keeps_one_input_per_layer():
    """With ``remat='block'`` the backward keeps each block's input (``d`` numbers per token per layer, 2 bytes in
    bf16) and one block's activations: the estimate shrinks by ``(L - 1) x block - L x 2 d`` per token."""
    none = planner.plan_memory("llama-2-7b", 8, 8, 2048, "bf16", 3)
    block = planner.plan_memory("llama-2-7b", 8, 8, 2048, "bf16", 3, remat="block")
    per_block, _ = planner.activation_bytes_per_token(planner.PRESETS["llama-2-7b"], 2048, "bf16")
    tokens = 1 * 2048
    assert none.activations - block.activations == tokens * (31 * per_block - 32 * 2 * 4096)
    assert block.model_states == none.model_states and block.dp_extra == none.dp_extra
    with pytest.raises(ValueError, match="does not model the 'dots' policy"):
        planner.plan_memory("llama-2-7b", 8, 8, 2048, "bf16", 3, remat="dots")


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
