"""A BERT-style encoder classifier from standard Flax layers: token embeddings (``nnx.Embed``), a bare class token and
position table, bidirectional pre-LN blocks (:mod:`dpzero_jax.models.transformer`), classification from the class
token. Tokens are ids (``vocab_size``) or feature vectors
(``token_features``, embedded by a linear layer, e.g. image patches)."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from dpzero_jax.models.transformer import class_token_and_positions, encoder_blocks, prepend_class_token


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int | None = 17
    token_features: int | None = None
    max_length: int = 64            # tokens per example (the class token comes on top)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    num_classes: int = 10
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if (self.vocab_size is None) == (self.token_features is None):
            raise ValueError("EncoderConfig needs exactly one of vocab_size (token ids) and token_features "
                             f"(feature vectors); got {self.vocab_size!r} and {self.token_features!r}")
        for name in ("vocab_size", "token_features", "max_length", "hidden_size", "num_layers", "num_heads",
                     "intermediate_size", "num_classes"):
            value = getattr(self, name)
            if value is None and name in ("vocab_size", "token_features"):
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EncoderConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"EncoderConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")


class Encoder(nnx.Module):
    """``tokens [B, T] int (ids) or [B, T, token_features] -> logits [B, num_classes]``; a class token is prepended
    (``T + 1`` positions)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        self.config = config
        d = config.hidden_size
        if config.vocab_size is not None:
            self.tokens = nnx.Embed(config.vocab_size, d, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        else:
            self.tokens = nnx.Linear(config.token_features, d, rngs=rngs)
        self.cls, self.position = class_token_and_positions(d, config.max_length + 1, rngs=rngs)
        self.blocks = encoder_blocks(d, config.num_heads, config.intermediate_size, config.num_layers,
                                     config.layer_norm_eps, rngs=rngs)
        self.ln = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, use_fast_variance=False, rngs=rngs)
        self.head = nnx.Linear(d, config.num_classes, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        expected = 2 if c.vocab_size is not None else 3
        if tokens.ndim != expected or tokens.shape[1] > c.max_length or (
                expected == 3 and tokens.shape[2] != c.token_features):
            shape = "[B, T]" if expected == 2 else f"[B, T, {c.token_features}]"
            raise ValueError(f"tokens must be {shape} with T <= {c.max_length}, got shape {tokens.shape}")
        x = prepend_class_token(self.tokens(tokens), self.cls[...], self.position[...])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))
