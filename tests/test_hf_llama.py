"""Llama-family checkpoints (Llama with Llama-3 RoPE scaling and GQA, tied multi-query Llama, Mistral, Qwen2 with
qkv biases, Gemma with its (1 + w) norms and scaled embedding, Gemma 2 with soft-capping, sandwich norms and
alternating sliding windows, Qwen2 with a window on its last layers, YaRN RoPE): logits equal ``transformers``',
per-example gradient norms (traced-program front-end, scanned layers) equal ``torch.func``'s, export round-trips,
clear refusals."""

import json

import hf_helpers
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from test_hf import RTOL, _edit_config, assert_close, torch_per_example_norms

import dpzero_jax as dz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KINDS = tuple(hf_helpers.LLAMA_FAMILY)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {kind: (root / kind, hf_helpers.llama(root / kind, kind, seed=i, tokenizer=False))
            for i, kind in enumerate(KINDS)}


def logits(torch_model, ids, mask=None):
    with torch.no_grad():
        mask = None if mask is None else torch.tensor(mask)
        return torch_model(torch.tensor(ids), attention_mask=mask).logits.numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_and_export_round_trips(checkpoints, kind, tmp_path):
    path, torch_model = checkpoints[kind]
    model = dz.models.from_pretrained(path)
    assert isinstance(model, dz.models.Llama) and model.config.scan_layers          # scanned by default
    assert (model.lm_head is None) == model.config.tie_word_embeddings == (kind in ("llama-tied", "gemma", "gemma2"))
    assert model.layers.mlp.gate_proj.kernel[...].shape == (2, 32, 64)               # stacked on [num_layers]
    ids = hf_helpers.token_batch(320, 3, 20, seed=3)
    expected = logits(torch_model, ids)
    assert np.std(expected) > 0.1
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected)
    unrolled = dz.models.Llama.from_pretrained(path, scan_layers=False)
    assert_close(unrolled(jnp.asarray(ids, jnp.int32)), expected)

    model.save_pretrained(tmp_path)
    names = set(dz.hf.read_state_dict(tmp_path))
    assert ("lm_head.weight" in names) == (model.lm_head is not None)                # a tied table is written once
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(torch_model)
    assert_close(logits(reloaded, ids), expected)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == torch_model.config.model_type


def test_left_padding_mask_and_sliding_window_match_transformers(checkpoints, tmp_path):
    path, torch_model = checkpoints["llama"]
    ids = hf_helpers.token_batch(320, 3, 12, seed=4)
    mask = np.ones_like(ids)
    mask[0, :4] = 0                                      # left padding: the attention mask is an argument
    model = dz.models.Llama.from_pretrained(path)
    real = mask.astype(bool)
    assert_close(np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))[real],
                 logits(torch_model, ids, mask)[real])

    windowed = hf_helpers.llama(tmp_path / "mistral", "mistral", sliding_window=5, tokenizer=False)
    ids = hf_helpers.token_batch(320, 2, 16, seed=5)
    expected = logits(windowed, ids)
    assert np.max(np.abs(expected - logits(transformers.MistralForCausalLM.from_pretrained(
        tmp_path / "mistral", sliding_window=None).eval(), ids))) > 1e-3              # the window matters here
    assert_close(dz.models.from_pretrained(tmp_path / "mistral")(jnp.asarray(ids, jnp.int32)), expected)


@pytest.mark.parametrize("yarn", [{"factor": 4.0, "original_max_position_embeddings": 16},
                                  {"factor": 3.0, "original_max_position_embeddings": 512, "beta_fast": 16.0,
                                   "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 1.1, "truncate": False}])
def test_yarn_rope_matches_transformers(tmp_path, yarn):
    """YaRN RoPE (the blended frequencies and the attention factor on cos and sin, transformers' defaults or every
    option given): logits against ``transformers``, scanned and unrolled, and the export."""
    torch_model = hf_helpers.llama(tmp_path / "in", "llama", tokenizer=False,
                                   rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, **yarn})
    ids = hf_helpers.token_batch(320, 2, 40, seed=12)
    expected = logits(torch_model, ids)
    plain = hf_helpers.llama(tmp_path / "plain", "llama", tokenizer=False, rope_scaling=None)   # the same weights
    assert np.max(np.abs(expected - logits(plain, ids))) > 1e-3                      # the scaling matters here
    model = dz.models.from_pretrained(tmp_path / "in")
    assert model.config.rope_type == "yarn"
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected)
    assert_close(dz.models.Llama.from_pretrained(tmp_path / "in", scan_layers=False)(jnp.asarray(ids, jnp.int32)),
                 expected)
    model.save_pretrained(tmp_path / "out")
    assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ids), expected)


def test_dynamic_rope_is_the_default_rope_within_the_accepted_lengths(tmp_path):
    """Dynamic NTK RoPE recomputes the frequencies only for sequences past ``max_position_embeddings``, which the
    model refuses: up to that length its logits equal ``transformers``'; the export keeps the scaling."""
    torch_model = hf_helpers.llama(tmp_path / "in", "llama", tokenizer=False,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ids = hf_helpers.token_batch(320, 2, 64, seed=13)                                # max_position_embeddings 64
    expected = logits(torch_model, ids)
    model = dz.models.from_pretrained(tmp_path / "in")
    assert (model.config.rope_type, model.config.rope_factor) == ("dynamic", 2.0)
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=64"):
        model(jnp.zeros((1, 65), jnp.int32))
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_type"] == "dynamic"
    assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ids), expected)


def test_qwen2_sliding_window_layers_match_transformers(tmp_path):
    """Qwen2 with ``use_sliding_window``: the window on the layers from ``max_window_layers`` on (here the last of
    three), full attention before; logits, per-example norms and the export against ``transformers``."""
    torch_model = hf_helpers.llama(tmp_path / "in", "qwen2", layers=3, tokenizer=False, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=2)
    assert torch_model.config.layer_types == ["full_attention", "full_attention", "sliding_attention"]
    ids = hf_helpers.token_batch(320, 3, 16, seed=11)
    expected = logits(torch_model, ids)
    unwindowed = hf_helpers.llama(tmp_path / "full", "qwen2", layers=3, tokenizer=False)   # the same weights
    assert np.max(np.abs(expected - logits(unwindowed, ids))) > 1e-3                  # the window matters here
    model = dz.models.from_pretrained(tmp_path / "in")
    assert model.config.sliding_layers == (False, False, True) and model.config.sliding_window == 4
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected)
    assert_close(dz.models.Llama.from_pretrained(tmp_path / "in", scan_layers=False)(jnp.asarray(ids, jnp.int32)),
                 expected)
    # a config.json without layer_types (older transformers): the pattern from max_window_layers
    older = dz.models.from_pretrained(_edit_config(tmp_path / "in", tmp_path / "older", layer_types=None))
    assert older.config.sliding_layers == (False, False, True)
    assert_close(older(jnp.asarray(ids, jnp.int32)), expected)

    mask = np.ones_like(ids)
    mask[2, 10:] = 0
    params, loss_fn = dz.models.lm_objective(model)
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask, jnp.int32)}
    norms = ref.jit(lambda p, b: dz.per_example_grad_norms(loss_fn, p, b))(params, batch)
    np.testing.assert_allclose(np.asarray(norms), torch_per_example_norms(torch_model, ids, mask), rtol=RTOL)

    model.save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["use_sliding_window"], written["sliding_window"], written["max_window_layers"]) == (True, 4, 2)
    assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ids), expected)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma", "gemma2"])
def test_per_example_grad_norms_match_torch_func(checkpoints, kind):
    path, torch_model = checkpoints[kind]
    ids = hf_helpers.token_batch(320, 4, 12, seed=6)
    mask = np.ones_like(ids)
    mask[1, 8:] = 0                                    # a right-padded example
    expected = torch_per_example_norms(torch_model, ids, mask)
    params, loss_fn = dz.models.lm_objective(dz.models.from_pretrained(path))
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask, jnp.int32)}
    norms = ref.jit(lambda p, b: dz.per_example_grad_norms(loss_fn, p, b))(params, batch)
    np.testing.assert_allclose(np.asarray(norms), expected, rtol=RTOL)


def test_unsupported_llama_family_configs_are_refused(checkpoints, tmp_path):
    path = checkpoints["llama"][0]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        dz.models.from_pretrained(_edit_config(checkpoints["gemma2"][0], tmp_path / "g2",
                                               layer_types=["sliding_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        dz.models.from_pretrained(_edit_config(path, tmp_path / "longrope", rope_parameters={
            "rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="yarn RoPE needs original_max_position_embeddings"):
        dz.models.from_pretrained(_edit_config(path, tmp_path / "yarn", rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
        dz.models.from_pretrained(_edit_config(path, tmp_path / "partial", partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="mlp_bias=True"):
        dz.models.from_pretrained(_edit_config(path, tmp_path / "mlpb", mlp_bias=True))
    with pytest.raises(ValueError, match="layer_types lists 1 layers, num_hidden_layers is 2"):
        dz.models.from_pretrained(_edit_config(checkpoints["qwen2"][0], tmp_path / "qsw", use_sliding_window=True,
                                               sliding_window=4, layer_types=["sliding_attention"]))
    legacy = dz.models.from_pretrained(_edit_config(checkpoints["gemma"][0], tmp_path / "legacy", hidden_act="gelu"))
    assert legacy.config.hidden_act == "gelu_pytorch_tanh"     # Gemma's legacy "gelu" means the tanh GELU
    with pytest.raises(ValueError, match="causal language model: num_labels"):
        dz.models.from_pretrained(path, num_labels=3)


def test_lora_default_targets_are_the_seven_projections(checkpoints):
    import jax

    model = dz.models.from_pretrained(checkpoints["llama"][0])
    lora, trainable = dz.peft.apply(model, "lora", rank=2, key=jax.random.key(0))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    expected = sorted(f"layers/{'mlp' if p.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}/{p}/"
                      f"lora_{ab}/kernel" for p in projections for ab in "ab")
    assert trainable.names == expected                                   # not the LM head
    assert lora.layers.self_attn.k_proj.lora_a.kernel[...].shape == (2, 32, 2)   # one adapter per stacked layer
    ids = jnp.asarray(hf_helpers.token_batch(320, 2, 8, seed=8), jnp.int32)
    np.testing.assert_allclose(np.asarray(lora(ids)), np.asarray(model(ids)), rtol=1e-6)   # B starts at zero

    # adapters moved off zero: per-example norms (traced program, scan) equal jax.vmap(jax.grad)'s
    params, loss_fn = dz.models.lm_objective(lora, trainable=trainable)
    params = jax.tree.map(lambda p: p + 0.05, params)
    batch = {"input_ids": ids}
    grads = ref.per_example_grads(loss_fn, params, batch)
    expected = np.sqrt(sum(np.sum(np.asarray(g).reshape(2, -1) ** 2, axis=1) for g in grads.values()))
    norms = ref.jit(lambda p, b: dz.per_example_grad_norms(loss_fn, p, b))(params, batch)
    np.testing.assert_allclose(np.asarray(norms), expected, rtol=1e-5)


def test_sharded_checkpoints_load_and_export(checkpoints, tmp_path):
    path, torch_model = checkpoints["qwen2"]
    torch_model.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    assert (tmp_path / "in" / "model.safetensors.index.json").is_file()
    model = dz.models.from_pretrained(tmp_path / "in")
    ids = hf_helpers.token_batch(320, 2, 10, seed=9)
    expected = logits(torch_model, ids)
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected)
    model.save_pretrained(tmp_path / "out", max_shard_bytes=30_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    assert_close(logits(transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval(), ids), expected)


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_rematerialised_layers_give_exact_norms_and_clipped_gradients(checkpoints, remat):
    """``remat`` puts ``jax.checkpoint`` (its policy) around the scanned layer: per-example norms still equal
    ``torch.func``'s, and the ghost and book-keeping clipped gradients equal ``vmap(grad)``'s clipped by hand."""
    path, torch_model = checkpoints["llama"]
    ids = hf_helpers.token_batch(320, 4, 12, seed=7)
    expected_norms = torch_per_example_norms(torch_model, ids, np.ones_like(ids))
    params, loss_fn = dz.models.lm_objective(dz.models.from_pretrained(path, remat=remat))
    batch = {"input_ids": jnp.asarray(ids, jnp.int32)}
    clip = float(np.median(expected_norms))                                 # half the examples clipped
    expected, _, _ = ref.private_grads(ref.per_example_grads(loss_fn, params, batch), "all-layer", "abadi",
                                       max_grad_norm=clip)
    for mode in ("ghost", "bk"):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=clip, mode=mode)
        _, grads, stats = ref.jit(dz.private_value_and_grad(loss_fn, cfg))(params, batch, None)
        np.testing.assert_allclose(np.asarray(stats.norms).reshape(-1), expected_norms, rtol=RTOL)
        for name, value in ref.flat(grads).items():
            assert_close(value, expected[name], rtol=RTOL)


def test_block_remat_cuts_the_private_steps_activation_memory():
    """Compiled temporaries (XLA:CPU ``memory_analysis``) of the ghost private gradient of a 4-layer Llama at T 96:
    with ``remat="block"`` less than half of those without, and within 1.3x the non-private remat gradient's."""
    import jax
    from flax import nnx

    def temp_bytes(remat, private):
        config = dz.models.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                                       num_attention_heads=4, max_position_embeddings=96, remat=remat)
        params, loss_fn = dz.models.lm_objective(dz.models.Llama(config, rngs=nnx.Rngs(0)))
        batch = {"input_ids": jax.ShapeDtypeStruct((4, 96), jnp.int32)}
        if private:
            fn = dz.private_value_and_grad(loss_fn, dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0,
                                                                 mode="ghost"))
            args = (params, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
        else:
            fn, args = jax.grad(lambda p, b: jnp.mean(loss_fn(p, b))), (params, batch)
        return ref.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    plain, remat, non_private = temp_bytes("none", True), temp_bytes("block", True), temp_bytes("block", False)
    print(f"ghost temp: {plain / 2**20:.1f} MiB, with block remat {remat / 2**20:.1f} MiB "
          f"(non-private remat {non_private / 2**20:.1f} MiB)")
    assert remat < 0.5 * plain
    assert remat <= 1.3 * non_private
