"""The layers front-end's Flax NNX modules: dense, embedding and norm layers over the DP primitives of
:mod:`dpzero_jax.ops`, whose calls its tapes record (``DPConfig(front_end="layers")``, and the ``fused`` mode, RMM
conversion and ZeRO-3 gathering it offers on them).

Thin wrappers: each holds its ``nnx.Param`` s and calls one primitive, so any model built from them gets exact
per-example norms in every engine mode. All inputs carry the batch axis first. A model needs none of them: standard
layers (``flax.nnx``, ``flax.linen``, plain JAX) get the same private gradients from the traced-program front-end;
these are kept for models written on them and as the reference the bundled models are compared with
(``models.transformer.DP_LAYERS``, ``experiments/bench_front_ends.py``). Until 2026-11-30 they were
``dpzero_jax.nn``, which now holds only the DP-specific layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax import ops

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class Linear(nnx.Module):
    """``[B, *T, in_features] -> [B, *T, out_features]``."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 kernel_init=default_kernel_init, bias_init=default_bias_init, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), jnp.float32))
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), jnp.float32)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.dense(x, self.kernel[...], None if self.bias is None else self.bias[...])


class DenseGeneral(nnx.Module):
    """Contract the trailing ``len(in_shape)`` axes of ``x [B, *T, *in_shape]`` into ``out_shape``.

    E.g. a fused QKV projection ``DenseGeneral((d,), (3, H, Dh))`` or an attention output projection
    ``DenseGeneral((H, Dh), (d,))``.
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *, use_bias: bool = True,
                 kernel_init=None, rngs: nnx.Rngs):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        fan_in = math.prod(self.in_shape)
        init = kernel_init or nnx.initializers.normal(stddev=1.0 / math.sqrt(fan_in))
        self.kernel = nnx.Param(init(rngs.params(), self.in_shape + self.out_shape, jnp.float32))
        self.bias = nnx.Param(jnp.zeros(self.out_shape, jnp.float32)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        return ops.dense(x, self.kernel[...], bias, n_in=len(self.in_shape))


def dense_shapes(layer: Linear | DenseGeneral | nnx.Linear | nnx.LinearGeneral) -> tuple[tuple[int, ...],
                                                                                         tuple[int, ...]]:
    """``(in_shape, out_shape)`` of a dense layer as declared (without the leading axes of a stacked layer); also
    Flax's own ``nnx.Linear`` and ``nnx.LinearGeneral`` (contracting its input's trailing axes, without batch axes:
    anything else is refused, naming the layer's ``axis`` / ``batch_axis``)."""
    if isinstance(layer, (Linear, nnx.Linear)):
        return (layer.in_features,), (layer.out_features,)
    if isinstance(layer, nnx.LinearGeneral):
        in_shape, out_shape = tuple(layer.in_features), tuple(layer.out_features)
        trailing = tuple(range(-len(in_shape), 0))
        if tuple(layer.axis) != trailing or layer.batch_axis:
            raise ValueError(f"an nnx.LinearGeneral contracting axes {tuple(layer.axis)} with batch axes "
                             f"{dict(layer.batch_axis)}: only one contracting its input's trailing axes {trailing}, "
                             "without batch axes, is supported here")
        return in_shape, out_shape
    return tuple(layer.in_shape), tuple(layer.out_shape)


def stacked_axes(layer: Linear | DenseGeneral | nnx.Linear | nnx.LinearGeneral) -> tuple[int, ...]:
    """The leading axes of a stacked layer's kernel ``[*S, *in, *out]`` (layers created under ``nnx.vmap`` to be
    scanned), else ``()``; also on abstract (``nnx.eval_shape``) models."""
    in_shape, out_shape = dense_shapes(layer)
    shape = tuple(layer.kernel.get_value().shape)
    return shape[:len(shape) - len(in_shape) - len(out_shape)]


class Embed(nnx.Module):
    """Token or positional embedding ``ids [B, *T] -> [B, *T, features]``; ``attend`` is the tied output head."""

    def __init__(self, num_embeddings: int, features: int, *, stddev: float = 0.02, rngs: nnx.Rngs):
        self.num_embeddings, self.features = num_embeddings, features
        self.embedding = nnx.Param(nnx.initializers.normal(stddev)(rngs.params(), (num_embeddings, features),
                                                                   jnp.float32))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return ops.embed(ids, self.embedding[...])

    def attend(self, x: jax.Array) -> jax.Array:
        """``x [B, *T, features] -> [B, *T, num_embeddings]`` logits against the table (tied weights)."""
        return ops.dense_transposed(x, self.embedding[...])


class LayerNorm(nnx.Module):
    def __init__(self, num_features: int, *, eps: float = 1e-5, use_scale: bool = True, use_bias: bool = True,
                 rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((num_features,), jnp.float32)) if use_scale else None
        self.bias = nnx.Param(jnp.zeros((num_features,), jnp.float32)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.layer_norm(x, None if self.scale is None else self.scale[...],
                              None if self.bias is None else self.bias[...], eps=self.eps)


class RMSNorm(nnx.Module):
    def __init__(self, num_features: int, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((num_features,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.rms_norm(x, self.scale[...], eps=self.eps)


class PatchEmbed(nnx.Module):
    """ViT patch embedding as a linear map on flattened patches: ``[B, H, W, C] -> [B, (H/P)(W/P), features]``."""

    def __init__(self, patch_size: int, in_channels: int, features: int, *, rngs: nnx.Rngs):
        self.patch_size = patch_size
        self.proj = Linear(patch_size * patch_size * in_channels, features, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        batch, height, width, channels = images.shape
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(f"image size {height}x{width} is not divisible by the patch size {p}")
        patches = images.reshape(batch, height // p, p, width // p, p, channels)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(batch, (height // p) * (width // p), p * p * channels)
        return self.proj(patches)
