"""A pre-LayerNorm transformer block built only from DP layers (shared by GPT-2 and ViT)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax import nn


class Attention(nnx.Module):
    """Multi-head self-attention ``[B, T, d] -> [B, T, d]``.

    Fused QKV projection ``[d] -> [3, H, Dh]``, output projection ``[H, Dh] -> [d]``.
    """

    def __init__(self, features: int, num_heads: int, *, causal: bool, rngs: nnx.Rngs):
        if features % num_heads:
            raise ValueError(f"n_embd={features} is not divisible by n_head={num_heads}")
        self.num_heads, self.head_dim, self.causal = num_heads, features // num_heads, causal
        self.c_attn = nn.DenseGeneral((features,), (3, num_heads, self.head_dim), rngs=rngs)
        self.c_proj = nn.DenseGeneral((num_heads, self.head_dim), (features,), rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """``mask``: optional ``[B, T]`` keys that may be attended to (padding is ``0``/``False``)."""
        qkv = self.c_attn(x)                                   # [B, T, 3, H, Dh]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / jnp.sqrt(self.head_dim).astype(jnp.float32)
        if self.causal:
            length = x.shape[1]
            allowed = jnp.tril(jnp.ones((length, length), bool))
            scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        if mask is not None:
            scores = jnp.where(mask.astype(bool)[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.c_proj(jnp.einsum("bhts,bshd->bthd", weights, v))


class MLP(nnx.Module):
    def __init__(self, features: int, hidden: int, *, approximate_gelu: bool, rngs: nnx.Rngs):
        self.approximate_gelu = approximate_gelu
        self.c_fc = nn.Linear(features, hidden, rngs=rngs)
        self.c_proj = nn.Linear(hidden, features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=self.approximate_gelu))


class Block(nnx.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, features: int, num_heads: int, hidden: int, *, causal: bool, approximate_gelu: bool,
                 eps: float, rngs: nnx.Rngs):
        self.ln_1 = nn.LayerNorm(features, eps=eps)
        self.attn = Attention(features, num_heads, causal=causal, rngs=rngs)
        self.ln_2 = nn.LayerNorm(features, eps=eps)
        self.mlp = MLP(features, hidden, approximate_gelu=approximate_gelu, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def encoder_blocks(d: int, heads: int, intermediate: int, layers: int, eps: float, *, rngs: nnx.Rngs) -> nnx.List:
    """``layers`` bidirectional pre-LN blocks with exact GELU (ViT and the small encoder classifier)."""
    return nnx.List([Block(d, heads, intermediate, causal=False, approximate_gelu=False, eps=eps, rngs=rngs)
                     for _ in range(layers)])


def prepend_class_token(x: jax.Array, class_embed: nn.Embed, position_embed: nn.Embed) -> jax.Array:
    """``x [B, T, d] -> [B, T + 1, d]``: the class token (``class_embed`` row 0) first, then the learned positions
    ``0 .. T`` added."""
    batch, length = x.shape[:2]
    x = jnp.concatenate([class_embed(jnp.zeros((batch, 1), jnp.int32)), x], axis=1)
    return x + position_embed(jnp.broadcast_to(jnp.arange(length + 1), (batch, length + 1)))
