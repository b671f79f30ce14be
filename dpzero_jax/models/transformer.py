"""A pre- or post-LayerNorm transformer block (shared by ViT, the encoder classifier, BERT and GPT-2).

Every bundled model builds it from Flax's own layers (:data:`FLAX_LAYERS`: ``nnx.Linear``, ``nnx.LayerNorm``,
``nnx.Embed``), as a user writes a model; the engine plans them from the traced program. :data:`DP_LAYERS` builds the
same computation from :mod:`dpzero_jax.layers`, planned from the layers' own calls (the layers front-end:
``GPT2(..., layers=DP_LAYERS)``, the comparison of ``experiments/bench_front_ends.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax import layers as dp_layers


def _flax_linear(in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, use_bias: bool = True) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, rngs=rngs)


def _flax_norm(features: int, *, eps: float, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # the two-pass variance, as transformers computes it (Flax's default E[x^2] - E[x]^2 differs at 1e-5)
    return nnx.LayerNorm(features, epsilon=eps, use_fast_variance=False, dtype=dtype, rngs=rngs)


def _flax_embed(count: int, features: int, *, stddev: float, dtype, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(count, features, embedding_init=nnx.initializers.normal(stddev), dtype=dtype, rngs=rngs)


def _dp_linear(in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs,
               use_bias: bool = True) -> dp_layers.Linear:
    return dp_layers.Linear(in_features, out_features, use_bias=use_bias, rngs=rngs)   # computes in its input's dtype


def _dp_norm(features: int, *, eps: float, dtype, rngs: nnx.Rngs) -> dp_layers.LayerNorm:
    return dp_layers.LayerNorm(features, eps=eps)


def _dp_embed(count: int, features: int, *, stddev: float, dtype, rngs: nnx.Rngs) -> dp_layers.Embed:
    return dp_layers.Embed(count, features, stddev=stddev, rngs=rngs)          # looks up the stored dtype


@dataclasses.dataclass(frozen=True)
class LayerSet:
    """The layer constructors a model is built from: ``linear(in, out, use_bias=True)``, ``norm(features, eps=...)``
    and ``embed(count, features, stddev=...)`` (a table with ``attend`` for a tied head), each with ``dtype`` (the
    compute dtype; ``None``: the weights') and ``rngs``."""

    linear: Callable
    norm: Callable
    embed: Callable


FLAX_LAYERS = LayerSet(_flax_linear, _flax_norm, _flax_embed)
DP_LAYERS = LayerSet(_dp_linear, _dp_norm, _dp_embed)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, mask: jax.Array | None = None) -> jax.Array:
    """Softmax attention ``q, k, v [B, T, H, Dh] -> [B, T, H, Dh]``; scores in float32. ``mask``: optional ``[B, T]``
    keys that may be attended to (padding is ``0`` / ``False``)."""
    scale = jnp.sqrt(q.shape[-1]).astype(jnp.float32)
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / scale
    if causal:
        length = q.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, jnp.finfo(jnp.float32).min)
    if mask is not None:
        scores = jnp.where(mask.astype(bool)[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", weights, v)


class Attention(nnx.Module):
    """Multi-head self-attention ``[B, T, d] -> [B, T, d]``.

    Fused QKV projection ``c_attn: [d] -> [3d]`` (query, key, value, each ``H`` heads of ``Dh``), output projection
    ``c_proj: [d] -> [d]`` (the heads concatenated): 2-D kernels, as Hugging Face's GPT-2 keeps them. Kernels shaped
    by heads (``[d, 3, H, Dh]``, ``[H, Dh, d]``) would put ``Dh`` in an array's two minor dimensions, which the TPU
    lays out in tiles of 8 x 128 elements: with ``Dh = 64`` such a kernel's shard takes twice its bytes (GPT-2 XL's
    ZeRO-3 model states measured 1.36x the parameters' bytes that way, ``docs/benchmarks/tpu_aot.md``).
    """

    def __init__(self, features: int, num_heads: int, *, causal: bool, rngs: nnx.Rngs,
                 layers: LayerSet = FLAX_LAYERS, dtype=None):
        if features % num_heads:
            raise ValueError(f"the width {features} is not divisible by the {num_heads} attention heads")
        self.num_heads, self.head_dim, self.causal = num_heads, features // num_heads, causal
        self.c_attn = layers.linear(features, 3 * features, dtype=dtype, rngs=rngs)
        self.c_proj = layers.linear(features, features, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """``mask``: optional ``[B, T]`` keys that may be attended to (padding is ``0``/``False``)."""
        qkv = self.c_attn(x).reshape(*x.shape[:-1], 3, self.num_heads, self.head_dim)     # [B, T, 3, H, Dh]
        heads = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=self.causal, mask=mask)
        return self.c_proj(heads.reshape(*heads.shape[:-2], -1))                          # [B, T, d]


class MLP(nnx.Module):
    """``c_proj(gelu(c_fc(x)))``: ``[B, T, d] -> [B, T, d]`` through ``hidden`` features."""

    def __init__(self, features: int, hidden: int, *, approximate_gelu: bool, rngs: nnx.Rngs,
                 layers: LayerSet = FLAX_LAYERS, dtype=None):
        self.approximate_gelu = approximate_gelu
        self.c_fc = layers.linear(features, hidden, dtype=dtype, rngs=rngs)
        self.c_proj = layers.linear(hidden, features, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=self.approximate_gelu))


class Block(nnx.Module):
    """Pre-LN ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; post-LN (``post_norm``, BERT) ``ln_1(x + attn(x))``
    then ``ln_2(x + mlp(x))``."""

    def __init__(self, features: int, num_heads: int, hidden: int, *, causal: bool, approximate_gelu: bool,
                 eps: float, rngs: nnx.Rngs, layers: LayerSet = FLAX_LAYERS, dtype=None, post_norm: bool = False):
        self.post_norm = post_norm
        self.ln_1 = layers.norm(features, eps=eps, dtype=dtype, rngs=rngs)
        self.attn = Attention(features, num_heads, causal=causal, layers=layers, dtype=dtype, rngs=rngs)
        self.ln_2 = layers.norm(features, eps=eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(features, hidden, approximate_gelu=approximate_gelu, layers=layers, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        if self.post_norm:
            x = self.ln_1(x + self.attn(x, mask))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


def encoder_blocks(d: int, heads: int, intermediate: int, layers: int, eps: float, *, rngs: nnx.Rngs) -> nnx.List:
    """``layers`` bidirectional pre-LN blocks of Flax layers with exact GELU (ViT and the encoder classifier)."""
    return nnx.List([Block(d, heads, intermediate, causal=False, approximate_gelu=False, eps=eps, rngs=rngs)
                     for _ in range(layers)])


def class_token_and_positions(features: int, positions: int, *, rngs: nnx.Rngs) -> tuple[nnx.Param, nnx.Param]:
    """A learned class token ``[1, 1, features]`` and position table ``[1, positions, features]`` (bare parameters,
    as Hugging Face's ViT keeps them), drawn from ``N(0, 0.02^2)``."""
    init = nnx.initializers.normal(0.02)
    return (nnx.Param(init(rngs.params(), (1, 1, features), jnp.float32)),
            nnx.Param(init(rngs.params(), (1, positions, features), jnp.float32)))


def prepend_class_token(x: jax.Array, class_token: jax.Array, positions: jax.Array) -> jax.Array:
    """``x [B, T, d] -> [B, T + 1, d]``: the class token ``[1, 1, d]`` first, then the first ``T + 1`` rows of the
    position table ``[1, P, d]`` added."""
    batch, length, features = x.shape
    token = jnp.broadcast_to(class_token.astype(x.dtype), (batch, 1, features))
    return jnp.concatenate([token, x], axis=1) + positions[:, :length + 1].astype(x.dtype)
