"""A BERT / RoBERTa encoder with a sequence-classification head, from standard Flax layers (the layout of Hugging Face's
``BertForSequenceClassification`` / ``RobertaForSequenceClassification``, to load their checkpoints).

Word + position + token-type embeddings and a LayerNorm; post-LN blocks ``x = LN(x + attn(x))``,
``x = LN(x + mlp(x))`` with a key padding mask; the first token's state goes through ``tanh(pooler(.))`` and the
classification head. RoBERTa differs in its positions (``padding_idx + 1 + index`` of non-pad tokens, pads at
``padding_idx``) and in where its ``tanh`` dense layer lives (``classifier.dense``: part of the head, here
``head/dense``; BERT's is the pretrained ``pooler``). Dropout is not implemented (inference semantics).
Query, key and value are one fused ``c_attn`` projection ``[d] -> [3d]`` as in the other transformers of this
package (LoRA on ``c_attn`` adapts all three).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax.models.transformer import Block

MODEL_TYPES = ("bert", "roberta")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    num_labels: int = 2
    pad_token_id: int = 0
    model_type: str = "bert"             # "roberta": position ids offset by pad_token_id + 1, head with its dense

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BertConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"BertConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"BertConfig.model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if not isinstance(self.pad_token_id, int) or not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"BertConfig.pad_token_id must be a token id in [0, {self.vocab_size}), "
                             f"got {self.pad_token_id!r}")
        if self.model_type == "roberta" and self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError("BertConfig: RoBERTa positions start at pad_token_id + 1, so max_position_embeddings "
                             f"must exceed {self.pad_token_id + 1}")

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers."""
        offset = self.pad_token_id + 1 if self.model_type == "roberta" else 0
        return self.max_position_embeddings - offset


class RobertaHead(nnx.Module):
    """``out_proj(tanh(dense(h)))`` (RoBERTa's ``classifier``)."""

    def __init__(self, features: int, num_labels: int, *, dtype, rngs: nnx.Rngs):
        self.dense = nnx.Linear(features, features, dtype=dtype, rngs=rngs)
        self.out_proj = nnx.Linear(features, num_labels, dtype=dtype, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.out_proj(jnp.tanh(self.dense(h)))


class BertEncoder(nnx.Module):
    """``input_ids [B, T] (+ attention_mask [B, T], token_type_ids [B, T]) -> logits [B, num_labels]``.

    ``dtype``: the compute dtype of the activations (``None``: that of the weights, fp32); weights stay as stored.
    ``from_pretrained(path)`` loads a Hugging Face BERT or RoBERTa checkpoint directory.
    """

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype=None):
        self.config = config
        self.dtype = None if dtype is None else jnp.dtype(dtype).name
        self.hf_config: str | None = None       # the checkpoint's config.json (JSON text), kept for export
        d = config.hidden_size
        embed = functools.partial(nnx.Embed, features=d, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.word_embeddings = embed(config.vocab_size)
        self.position_embeddings = embed(config.max_position_embeddings)
        self.token_type_embeddings = embed(config.type_vocab_size)
        self.ln_embed = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, use_fast_variance=False, dtype=self.dtype,
                                      rngs=rngs)
        self.layers = nnx.List([Block(d, config.num_attention_heads, config.intermediate_size, causal=False,
                                      approximate_gelu=False, eps=config.layer_norm_eps, post_norm=True,
                                      dtype=self.dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        if config.model_type == "roberta":
            self.pooler = None
            self.head = RobertaHead(d, config.num_labels, dtype=self.dtype, rngs=rngs)
        else:
            self.pooler = nnx.Linear(d, d, dtype=self.dtype, rngs=rngs)
            self.head = nnx.Linear(d, config.num_labels, dtype=self.dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        c = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        batch, length = input_ids.shape
        if length > c.max_length:
            raise ValueError(f"sequence length {length} exceeds the {c.max_length} positions of the model")
        for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if value is not None and value.shape != input_ids.shape:
                raise ValueError(f"{name} must have the shape of input_ids {input_ids.shape}, got {value.shape}")
        if c.model_type == "roberta":  # fairseq positions: pads sit at padding_idx, tokens count from it + 1
            real = (input_ids != c.pad_token_id).astype(jnp.int32)
            positions = jnp.cumsum(real, axis=1) * real + c.pad_token_id
        else:
            positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
        if token_type_ids is None:
            token_type_ids = jnp.zeros((batch, length), jnp.int32)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) \
            + self.position_embeddings(positions)
        if self.dtype is not None:
            x = x.astype(self.dtype)
        x = self.ln_embed(x)
        for layer in self.layers:
            x = layer(x, attention_mask)
        first = x[:, 0]
        if self.pooler is not None:
            first = jnp.tanh(self.pooler(first))
        return self.head(first)

    @classmethod
    def from_pretrained(cls, path, *, num_labels: int | None = None, id2label=None, dtype=None,
                        seed: int = 0) -> BertEncoder:
        """A Hugging Face BERT / RoBERTa checkpoint directory (see :func:`dpzero_jax.models.from_pretrained`)."""
        from dpzero_jax.models import pretrained

        return pretrained.load(path, expect=cls, num_labels=num_labels, id2label=id2label, dtype=dtype, seed=seed)

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads
        (``BertForSequenceClassification`` / ``RobertaForSequenceClassification``)."""
        from dpzero_jax.models import pretrained

        pretrained.save(self, path)
