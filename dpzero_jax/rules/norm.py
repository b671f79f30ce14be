"""Rule for LayerNorm and RMSNorm: ``y = xhat * scale + bias`` over the last axis.

``x [B, *T, d]``. LayerNorm: ``xhat = (x - mean) / sqrt(var + eps)``; RMSNorm: ``xhat = x / sqrt(mean(x^2) + eps)``.
Statistics are computed in float32. Per example: ``grad scale = sum_t g_t * xhat_t`` and ``grad bias = sum_t g_t``,
both instantiated as ``[B, d]`` (cheap).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dpzero_jax.pergrad import Direct
from dpzero_jax.rules.base import LayerRule


@dataclasses.dataclass(frozen=True)
class NormSpec:
    eps: float = 1e-5
    rms: bool = False


def normalize(x, spec: NormSpec):
    """``xhat`` in float32."""
    x32 = x.astype(jnp.float32)
    if spec.rms:
        return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + spec.eps)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    return centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + spec.eps)


class NormRule(LayerRule):
    name = "norm"
    input_free = frozenset({"bias"})

    def apply(self, params, x, spec: NormSpec):
        scale, bias = params.get("scale"), params.get("bias")
        for name, p in (("scale", scale), ("bias", bias)):
            if p is not None and p.shape != x.shape[-1:]:
                raise ValueError(f"norm layer: {name} shape {p.shape} does not match the feature axis of x {x.shape}")
        y = normalize(x, spec)
        if scale is not None:
            y = y * scale.astype(jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)

    def per_example_grads(self, params, x, g, spec: NormSpec):
        """``x`` may be ``None`` (only the bias is trainable): then only the bias gradient is returned."""
        batch, features = g.shape[0], g.shape[-1]
        g32 = g.astype(jnp.float32).reshape(batch, -1, features)
        grads = {}
        if x is not None and params.get("scale") is not None:
            xhat = normalize(x, spec).reshape(batch, -1, features)
            grads["scale"] = Direct(jnp.sum(g32 * xhat, axis=1))
        if params.get("bias") is not None:
            grads["bias"] = Direct(jnp.sum(g32, axis=1))
        return grads


NORM = NormRule()
jax.tree_util.register_static(NormSpec)
