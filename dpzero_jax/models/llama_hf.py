"""Hugging Face Llama / Mistral / Qwen2 / Gemma (1, 2) checkpoints <-> :class:`~dpzero_jax.models.llama.Llama`.

:func:`config_from_hf` reads ``config.json`` into a :class:`LlamaConfig`, refusing what the model does not compute
exactly (RoPE scalings other than linear, llama3, yarn, dynamic; MLP biases, bidirectional attention); :func:`entries`
maps every tensor (``nn.Linear`` weights ``[out, in]`` are transposed to kernels ``[in, out]``; names otherwise the
same: ``model.layers.3.self_attn.q_proj.weight`` -> ``layers/self_attn/q_proj/kernel`` stacked over layers, or
``layers/3/self_attn/q_proj/kernel`` unscanned); :func:`hf_config` describes the model for export.
"""

from __future__ import annotations

import math

from dpzero_jax.models.hf_mapping import blocks, refuse, same, transposed
from dpzero_jax.models.llama import ACTIVATIONS, ROPE_TYPES, LlamaConfig

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
GEMMAS = ("gemma", "gemma2")


def _rope(c: dict) -> dict:
    """The RoPE parameters of either config layout: ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (earlier)."""
    params = dict(c.get("rope_parameters") or {})
    if not params:
        params = dict(c.get("rope_scaling") or {})
        params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json: rope_type {kind!r} is not supported (only {', '.join(map(repr, ROPE_TYPES))})")
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={partial} is not supported (rotary embeddings on the "
                         f"whole head only)")
    out = {"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_type": kind}
    if kind in ("linear", "llama3", "dynamic"):
        out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_position=int(params["original_max_position_embeddings"]))
    if kind == "yarn":
        out.update(_yarn(params, c))
    return out


def _yarn(params: dict, c: dict) -> dict:
    """YaRN's :class:`LlamaConfig` fields, with ``transformers``' defaults: ``factor`` (else ``max_position_embeddings /
    original_max_position_embeddings``), ``beta_fast`` 32, ``beta_slow`` 1, ``truncate``, and the attention factor
    on cos and sin (else ``0.1 ln(factor) + 1``, or the ratio of that with ``mscale`` and with ``mscale_all_dim``)."""
    original = params.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("config.json: yarn RoPE needs original_max_position_embeddings")
    factor = float(params.get("factor") or c.get("max_position_embeddings", 2048) / original)

    def magnitude(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = magnitude(factor, mscale) / magnitude(factor, mscale_all) if mscale and mscale_all else \
            magnitude(factor)
    return {"rope_factor": factor, "rope_original_max_position": int(original),
            "rope_beta_fast": float(params.get("beta_fast") or 32),
            "rope_beta_slow": float(params.get("beta_slow") or 1), "rope_truncate": bool(params.get("truncate", True)),
            "rope_attention_factor": float(attention)}


def config_from_hf(c: dict, scan_layers: bool = True) -> LlamaConfig:
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not a Llama-family model ({tuple(MODEL_TYPES)})")
    refuse(c, "mlp_bias", False, "biases in the MLP")
    refuse(c, "pretraining_tp", 1, "tensor-parallel slicing of the projections")
    refuse(c, "use_bidirectional_attention", None, "bidirectional attention")
    act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
    if model_type in GEMMAS and c.get("hidden_activation"):
        act = c["hidden_activation"]
    if model_type in GEMMAS and act == "gelu":   # Gemma's legacy value, meant as the tanh GELU (transformers agrees)
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (one of {tuple(ACTIVATIONS)})")
    window = None
    per_layer = {}
    if model_type == "mistral":
        window = c.get("sliding_window")
    elif model_type == "qwen2" and c.get("use_sliding_window") and c.get("sliding_window"):
        # the window on the layers from max_window_layers on (transformers' own default layer_types), or as listed
        window = c["sliding_window"]
        first = c.get("max_window_layers", 28)
        kinds = _layer_kinds(c, lambda i: i >= first)
        per_layer = {"sliding_layers": tuple(k == "sliding_attention" for k in kinds)}
    attention_bias = bool(c.get("attention_bias", False))
    gemma2 = {}
    if model_type == "gemma2":
        window = c.get("sliding_window")
        kinds = _layer_kinds(c, lambda i: i % 2 == 0)
        gemma2 = {"attn_softcap": c.get("attn_logit_softcapping"), "final_softcap": c.get("final_logit_softcapping"),
                  "query_pre_attn_scalar": c.get("query_pre_attn_scalar", 256), "sandwich_norms": True,
                  "sliding_layers": tuple(k == "sliding_attention" for k in kinds) if window else None}
    return LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads"), head_dim=c.get("head_dim"),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), **_rope(c), hidden_act=act,
        qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias and model_type != "qwen2",
        tie_word_embeddings=bool(c.get("tie_word_embeddings", model_type in GEMMAS)), sliding_window=window,
        gemma=model_type in GEMMAS, scan_layers=scan_layers, model_type=model_type, **gemma2, **per_layer)


def _layer_kinds(c: dict, sliding) -> list[str]:
    """Each layer's attention, ``"sliding_attention"`` or ``"full_attention"``: ``config.json``'s ``layer_types``, or
    else ``sliding(layer index)`` (the model type's default pattern)."""
    kinds = c.get("layer_types") or ["sliding_attention" if sliding(i) else "full_attention"
                                     for i in range(c["num_hidden_layers"])]
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported (only sliding_attention, "
                         f"full_attention)")
    if len(kinds) != c["num_hidden_layers"]:
        raise ValueError(f"config.json: layer_types lists {len(kinds)} layers, num_hidden_layers is "
                         f"{c['num_hidden_layers']}")
    return kinds


def hf_config(c: LlamaConfig) -> dict:
    """The ``config.json`` keys that describe ``c`` (merged over the checkpoint's own on export)."""
    rope = {"rope_theta": c.rope_theta, "rope_type": c.rope_type}
    if c.rope_type in ("linear", "llama3", "dynamic"):
        rope["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rope.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_position)
    if c.rope_type == "yarn":
        rope.update(factor=c.rope_factor, original_max_position_embeddings=c.rope_original_max_position,
                    beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow, truncate=c.rope_truncate,
                    attention_factor=c.rope_attention_factor)
    out = {"model_type": c.model_type, "architectures": [MODEL_TYPES[c.model_type]], "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.kv_heads, "head_dim": c.head_size,
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
           "rope_parameters": rope, "rope_theta": c.rope_theta, "hidden_act": c.hidden_act,
           "tie_word_embeddings": c.tie_word_embeddings}
    if c.rope_type != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if c.model_type in ("llama", *GEMMAS):
        out["attention_bias"] = c.o_bias
    if c.model_type == "llama":
        out["mlp_bias"] = False
    if c.model_type in ("mistral", "gemma2"):
        out["sliding_window"] = c.sliding_window
    if c.model_type == "qwen2":
        out["use_sliding_window"] = c.sliding_window is not None
        out["sliding_window"] = c.sliding_window
        if c.sliding_layers is not None:
            kinds = ["sliding_attention" if s else "full_attention" for s in c.sliding_layers]
            out["layer_types"] = kinds
            # transformers derives layer_types from max_window_layers where the file has none: the first sliding
            # layer, which states the pattern exactly when the sliding layers are the last ones
            out["max_window_layers"] = kinds.index("sliding_attention") if any(c.sliding_layers) else len(kinds)
    if c.model_type in GEMMAS:
        out["hidden_activation"] = c.hidden_act
    if c.model_type == "gemma2":
        out.update(attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.final_softcap,
                   query_pre_attn_scalar=c.query_pre_attn_scalar)
        if c.sliding_layers is not None:
            out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in c.sliding_layers]
    return out


def entries(c: LlamaConfig, prefix: str = "model."):
    """The :class:`~dpzero_jax.models.hf_mapping.Entry` table of a model with config ``c``."""
    def linear(path, name, bias):
        return [transposed(f"{path}/kernel", f"{name}.weight")] + ([same(f"{path}/bias", f"{name}.bias")] if bias
                                                                   else [])

    def layer(h, o):
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if c.sandwich_norms else []
        out = [same(f"{o}/{n}/scale", f"{h}.{n}.weight") for n in norms]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += linear(f"{o}/self_attn/{proj}", f"{h}.self_attn.{proj}", c.o_bias if proj == "o_proj"
                          else c.qkv_bias)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out += linear(f"{o}/mlp/{proj}", f"{h}.mlp.{proj}", False)
        return out

    p = prefix
    out = [same("embed_tokens/embedding", f"{p}embed_tokens.weight")]
    out += blocks(c.num_hidden_layers, c.scan_layers, f"{p}layers", "layers", layer)
    out.append(same("norm/scale", f"{p}norm.weight"))
    if not c.tie_word_embeddings:
        out += linear("lm_head", "lm_head", False)
    return out
