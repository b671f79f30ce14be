"""Hugging Face BERT / RoBERTa checkpoints (``*ForSequenceClassification``, ``*Model``) <->
:class:`~dpzero_jax.models.BertEncoder`.

``nn.Linear`` weights are ``[out, in]`` and are transposed; ``query``, ``key`` and ``value`` are side by side in
one ``c_attn`` ``[d, 3d]``. Old checkpoints' ``LayerNorm.gamma`` / ``beta`` are read as ``weight`` / ``bias``.
The task head (BERT's pooler and classifier, RoBERTa's classifier) may be missing or have another number of labels:
it is then initialised afresh.
"""

from __future__ import annotations

from dpzero_jax.models.bert import BertConfig
from dpzero_jax.models.hf_mapping import Entry, dense, fused_qkv, layer_norm, refuse, same


def config_from_hf(c: dict, model_type: str, scan_layers: bool | None = None,
                   num_labels: int | None = None) -> BertConfig:
    refuse(c, "is_decoder", False, "a decoder (causal) BERT")
    refuse(c, "add_cross_attention", False, "cross-attention")
    refuse(c, "position_embedding_type", "absolute", "relative position embeddings")
    refuse(c, "hidden_act", "gelu", "another activation than the exact GELU")
    problem = c.get("problem_type")
    if problem not in (None, "single_label_classification"):
        raise ValueError(f"config.json: problem_type {problem!r} is not supported (single-label classification "
                         f"with softmax cross-entropy only)")
    d = BertConfig()
    pad = c.get("pad_token_id")
    if pad is None:
        pad = 1 if model_type == "roberta" else 0
    return BertConfig(vocab_size=c.get("vocab_size", d.vocab_size), hidden_size=c.get("hidden_size", d.hidden_size),
                      num_hidden_layers=c.get("num_hidden_layers", d.num_hidden_layers),
                      num_attention_heads=c.get("num_attention_heads", d.num_attention_heads),
                      intermediate_size=c.get("intermediate_size", d.intermediate_size),
                      max_position_embeddings=c.get("max_position_embeddings", d.max_position_embeddings),
                      type_vocab_size=c.get("type_vocab_size", d.type_vocab_size),
                      layer_norm_eps=float(c.get("layer_norm_eps", d.layer_norm_eps)), num_labels=num_labels,
                      pad_token_id=int(pad), model_type=model_type)


def entries(c: BertConfig, prefix: str) -> list[Entry]:
    """The :class:`~dpzero_jax.models.hf_mapping.Entry` table of a model with config ``c``."""
    d, p = c.hidden_size, prefix
    out = [same("word_embeddings/embedding", f"{p}embeddings.word_embeddings.weight"),
           same("position_embeddings/embedding", f"{p}embeddings.position_embeddings.weight"),
           same("token_type_embeddings/embedding", f"{p}embeddings.token_type_embeddings.weight")]
    out += layer_norm("ln_embed", f"{p}embeddings.LayerNorm")
    for i in range(c.num_hidden_layers):
        h, o = f"{p}encoder.layer.{i}", f"layers/{i}"
        out += fused_qkv(f"{o}/attn/c_attn", f"{h}.attention.self", d)
        out += dense(f"{o}/attn/c_proj", f"{h}.attention.output.dense")
        out += layer_norm(f"{o}/ln_1", f"{h}.attention.output.LayerNorm")
        out += dense(f"{o}/mlp/c_fc", f"{h}.intermediate.dense") + dense(f"{o}/mlp/c_proj", f"{h}.output.dense")
        out += layer_norm(f"{o}/ln_2", f"{h}.output.LayerNorm")
    if c.model_type == "roberta":
        out += dense("head/dense", "classifier.dense", head=True) + dense("head/out_proj", "classifier.out_proj",
                                                                         head=True)
    else:
        out += dense("pooler", f"{p}pooler.dense", head=True) + dense("head", "classifier", head=True)
    return out


def hf_config(c: BertConfig) -> dict:
    """The ``config.json`` keys that describe ``c`` (merged over the checkpoint's own on export)."""
    name = "RobertaForSequenceClassification" if c.model_type == "roberta" else "BertForSequenceClassification"
    return {"model_type": c.model_type, "architectures": [name], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings, "type_vocab_size": c.type_vocab_size,
            "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id, "hidden_act": "gelu",
            "position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}


def max_length(hf_config: dict, model_type: str) -> int:
    """The longest sequence a BERT / RoBERTa ``config.json`` has positions for."""
    positions = int(hf_config.get("max_position_embeddings", 512))
    if model_type != "roberta":
        return positions
    pad = hf_config.get("pad_token_id")
    return positions - (1 if pad is None else int(pad)) - 1
