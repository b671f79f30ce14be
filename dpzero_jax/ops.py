"""Array-level DP layer primitives.

Each function computes an ordinary layer. Called outside a private-gradient transform it is plain JAX (``jax.grad``
works as usual). Called while :mod:`dpzero_jax.engine` traces a loss, it reports itself to the active tape, which
adds the probes, norm sinks and custom VJPs the engine mode needs (see :mod:`dpzero_jax.tape`).

All inputs carry the batch axis first. Parameters passed here are recognised by identity as leaves of the
trainable ``params`` pytree; anything else (frozen weights closed over by the loss) is treated as a constant.
"""

from __future__ import annotations

import jax

from dpzero_jax import tape as tape_lib
from dpzero_jax.rules.embed import EMBED
from dpzero_jax.rules.linear import LINEAR, LinearSpec
from dpzero_jax.rules.norm import NORM, NormSpec

Array = jax.Array


def _call(rule, spec, params, x):
    active = tape_lib.current()
    if active is None:
        return rule.apply(params, x, spec)
    return active.call(rule, spec, params, x)


def dense(x: Array, kernel: Array, bias: Array | None = None, *, n_in: int = 1) -> Array:
    """``x [B, *T, *in] . kernel [*in, *out] (+ bias [*out]) -> [B, *T, *out]``; ``n_in = len(in)``."""
    return _call(LINEAR, LinearSpec(n_in=n_in), {"kernel": kernel, "bias": bias}, x)


def dense_transposed(x: Array, kernel: Array, bias: Array | None = None) -> Array:
    """``x [B, *T, d] . kernel[V, d]^T (+ bias [V]) -> [B, *T, V]`` (e.g. a tied LM head on the embedding table)."""
    return _call(LINEAR, LinearSpec(n_in=1, transpose=True), {"kernel": kernel, "bias": bias}, x)


def embed(ids: Array, table: Array) -> Array:
    """``table [V, d][ids [B, *T]] -> [B, *T, d]``."""
    return _call(EMBED, None, {"table": table}, ids)


def layer_norm(x: Array, scale: Array | None, bias: Array | None, *, eps: float = 1e-5) -> Array:
    """LayerNorm over the last axis of ``x [B, *T, d]``; ``scale, bias: [d]`` or ``None``."""
    return _call(NORM, NormSpec(eps=eps, rms=False), {"scale": scale, "bias": bias}, x)


def rms_norm(x: Array, scale: Array | None, *, eps: float = 1e-6) -> Array:
    """RMSNorm over the last axis of ``x [B, *T, d]``; ``scale: [d]`` or ``None``."""
    return _call(NORM, NormSpec(eps=eps, rms=True), {"scale": scale, "bias": None}, x)
