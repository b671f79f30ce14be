"""Hugging Face GPT-2 checkpoints (``GPT2LMHeadModel``, ``GPT2Model``) <-> :class:`~dpzero_jax.models.GPT2`.

``Conv1D`` weights are ``[in, out]``, as the kernels are (``c_attn`` ``[d, 3d]``: q, k, v, then heads); the LM
head is the word embedding when ``tie_word_embeddings`` (the default: one array, exported once), else
``lm_head.weight`` ``[V, d]`` transposed.
"""

from __future__ import annotations

from dpzero_jax.models.gpt2 import GELUS, GPT2Config
from dpzero_jax.models.hf_mapping import Entry, blocks, layer_norm, refuse, same, transposed


def config_from_hf(c: dict, model_type: str = "gpt2", scan_layers: bool | None = None,
                   num_labels: int | None = None) -> GPT2Config:
    refuse(c, "add_cross_attention", False, "cross-attention")
    refuse(c, "scale_attn_weights", True, "unscaled attention")
    refuse(c, "scale_attn_by_inverse_layer_idx", False, "attention scaled by the inverse layer index")
    act = c.get("activation_function", "gelu_new")
    if act not in GELUS:
        raise ValueError(f"config.json: activation_function {act!r} is not supported (one of {tuple(GELUS)})")
    d = GPT2Config()
    return GPT2Config(vocab_size=c.get("vocab_size", d.vocab_size), n_positions=c.get("n_positions", d.n_positions),
                      n_embd=c.get("n_embd", d.n_embd), n_layer=c.get("n_layer", d.n_layer),
                      n_head=c.get("n_head", d.n_head), n_inner=c.get("n_inner"),
                      layer_norm_epsilon=float(c.get("layer_norm_epsilon", d.layer_norm_epsilon)),
                      tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), activation_function=act,
                      scan_layers=bool(scan_layers))


def _block(c: GPT2Config, h: str, o: str) -> list[Entry]:
    """One block: checkpoint prefix ``h`` (``transformer.h.3``), parameter prefix ``o`` (``h/3``)."""
    return layer_norm(f"{o}/ln_1", f"{h}.ln_1") + layer_norm(f"{o}/ln_2", f"{h}.ln_2") + [
        same(f"{o}/attn/c_attn/kernel", f"{h}.attn.c_attn.weight"),
        same(f"{o}/attn/c_attn/bias", f"{h}.attn.c_attn.bias"),
        same(f"{o}/attn/c_proj/kernel", f"{h}.attn.c_proj.weight"),
        same(f"{o}/attn/c_proj/bias", f"{h}.attn.c_proj.bias"),
        same(f"{o}/mlp/c_fc/kernel", f"{h}.mlp.c_fc.weight"),
        same(f"{o}/mlp/c_fc/bias", f"{h}.mlp.c_fc.bias"),
        same(f"{o}/mlp/c_proj/kernel", f"{h}.mlp.c_proj.weight"),
        same(f"{o}/mlp/c_proj/bias", f"{h}.mlp.c_proj.bias")]


def entries(c: GPT2Config, prefix: str = "transformer.") -> list[Entry]:
    """The :class:`~dpzero_jax.models.hf_mapping.Entry` table of a model with config ``c``."""
    p = prefix
    out = [same("wte/embedding", f"{p}wte.weight"), same("wpe/embedding", f"{p}wpe.weight")]
    out += blocks(c.n_layer, c.scan_layers, f"{p}h", "h", lambda h, o: _block(c, h, o))
    out += layer_norm("ln_f", f"{p}ln_f")
    if not c.tie_word_embeddings:
        out.append(transposed("lm_head/kernel", "lm_head.weight"))
    return out


def hf_config(c: GPT2Config) -> dict:
    """The ``config.json`` keys that describe ``c`` (merged over the checkpoint's own on export)."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
            "n_positions": c.n_positions, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
            "n_inner": c.n_inner, "layer_norm_epsilon": c.layer_norm_epsilon,
            "tie_word_embeddings": c.tie_word_embeddings, "activation_function": c.activation_function,
            "add_cross_attention": False, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}
