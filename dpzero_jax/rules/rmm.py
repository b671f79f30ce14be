"""Rule for randomized-matmul (RMM) linear layers under DP: the per-example structure of paper 002's estimate.

``y = x . W + b`` exactly, with ``x [B, *T, *in]``, ``W [*in, *out]``. Per example the weight gradient is
``a_i^T g_i`` (``a_i [T, F]`` the flattened input, ``g_i [T, P]`` the output gradient). The layer keeps only
``S^T a_i [k, F]`` (``S [T, k]`` one sketch for the whole batch, ``k = B_proj`` for ``T`` positions; see
:mod:`dpzero_jax.sketch`) and estimates

    ``G_i = (S^T a_i)^T (S^T g_i)``      -- ``Outer(left=S^T a, right=S^T g)`` over ``k`` "positions",

an unbiased estimate of ``a_i^T g_i`` that depends on example ``i`` only. Norms (ghost Gram ``[B, k, k]``,
instantiation, the mixed rule), clip coefficients and clipped sums are then the engine's usual ones, applied to
exactly the ``G_i`` that are summed: each clipped ``C_i G_i`` is bounded by the threshold for every ``S``, and
``S`` is drawn independently of the data, so the sensitivity -- and the privacy guarantee -- is unchanged. The
bias gradient ``sum_t g_i`` and the input gradient ``g W^T`` are exact.

Hooks used by the tapes (see :mod:`dpzero_jax.rules`): ``residual`` maps the input to what is kept (``S^T a``);
``input_grad`` needs only ``W``. The sketch key travels as the frozen parameter ``"key"``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dpzero_jax.pergrad import Direct, Outer
from dpzero_jax.rules.base import LayerRule
from dpzero_jax.rules.linear import LINEAR, LinearSpec
from dpzero_jax.sketch import RMMConfig, project


@dataclasses.dataclass(frozen=True)
class RMMSpec:
    """An RMM linear layer call: ``n_in`` trailing input axes contract with the kernel; ``config`` the sketch."""

    config: RMMConfig
    n_in: int = 1


def _split_kernel(kernel_shape, n_in: int):
    return tuple(kernel_shape[:n_in]), tuple(kernel_shape[n_in:])


def positions_view(x: jax.Array, n_in: int) -> jax.Array:
    """``x [B, *T, *in] -> [B, T, F]`` (``T = prod(*T)``, 1 for ``[B, *in]``; ``F = prod(*in)``)."""
    return x.reshape(x.shape[0], -1, math.prod(x.shape[x.ndim - n_in:]))


class RMMLinearRule(LayerRule):
    name = "rmm_linear"
    input_free = frozenset({"bias"})

    def apply(self, params, x, spec: RMMSpec):
        return LINEAR.apply(params, x, LinearSpec(n_in=spec.n_in))

    def residual(self, params, x, spec: RMMSpec):
        """``S^T a [B, k, F]`` in ``x.dtype``: all the backward keeps of the input."""
        if spec.config.projection != "tokens":
            raise ValueError("an RMM layer with projection='rows' mixes the examples of the batch in its sketch and "
                             "cannot be used under per-example clipping; use RMMConfig(projection='tokens') for DP "
                             "training (convert_to_rmm(..., private=True))")
        a = positions_view(x, spec.n_in)
        k = spec.config.projected_size(a.shape[1])
        return project(params["key"], a, k, spec.config.sketch)

    def input_grad(self, params, saved, g, spec: RMMSpec):
        """``dL/dx = g W^T`` exactly (needs no input): ``[B, *T, *in]``."""
        kernel = params["kernel"]
        in_shape, out_shape = _split_kernel(kernel.shape, spec.n_in)
        lead = g.shape[:g.ndim - len(out_shape)]
        w2 = kernel.reshape(math.prod(in_shape), math.prod(out_shape)).astype(g.dtype)
        dx = jnp.matmul(g.reshape(lead + (w2.shape[1],)), w2.T)
        return dx.reshape(lead + in_shape).astype(saved.dtype)

    def program_apply(self, params, x, spec: RMMSpec):
        """``y`` for the traced-program front-end: ``x . stop_gradient(W) + b + (z - stop_gradient(z))`` with
        ``z = S ((S^T a) W)`` and ``S^T a`` held without gradient. The value is the exact output (``z - z = 0``);
        the kernel's gradient flows only through the ``dot`` of ``S^T a [B, k, F]`` with ``W``, whose output
        gradient is ``S^T g``: the front-end sees an ordinary ``dot`` site with the factors ``(S^T a, S^T g)`` --
        the estimate :meth:`per_example_grads` describes -- and keeps ``S^T a``, not ``a``. ``dL/dx = g W^T`` and
        the bias gradient are exact. Costs one extra ``[k, F] x [F, P]`` product and one application of ``S`` per
        example in the forward."""
        if spec.config.projection != "tokens":
            self.residual(params, x, spec)   # refuses the batch-mixing layout, with the reason
        kernel, key = params["kernel"], params["key"]
        y = LINEAR.apply({"kernel": jax.lax.stop_gradient(kernel), "bias": params.get("bias")}, x,
                         LinearSpec(n_in=spec.n_in))
        kept = jax.lax.stop_gradient(self.residual(params, x, spec))                 # S^T a [B, k, F]
        in_shape, out_shape = _split_kernel(kernel.shape, spec.n_in)
        w2 = kernel.reshape(math.prod(in_shape), math.prod(out_shape)).astype(kept.dtype)
        projected = jnp.matmul(kept, w2)                                             # (S^T a) W [B, k, P]
        positions = positions_view(y, len(out_shape))                                # [B, T, P]
        _, apply_sketch = jax.vjp(lambda v: project(key, v, kept.shape[1], spec.config.sketch),
                                  jnp.zeros(positions.shape, projected.dtype))
        (z,) = apply_sketch(projected)                                               # S (S^T a) W [B, T, P]
        return y + (z - jax.lax.stop_gradient(z)).reshape(y.shape).astype(y.dtype)

    def per_example_grads(self, params, saved, g, spec: RMMSpec):
        """``saved = S^T a [B, k, F]`` (from :meth:`residual`), ``g [B, *T, *out]``. ``saved`` may be ``None``
        (only the bias is trainable, nothing of the input was kept): then only the bias gradient is returned."""
        kernel = params["kernel"]
        _, out_shape = _split_kernel(kernel.shape, spec.n_in)
        batch = g.shape[0]
        g2 = g.reshape(batch, -1, math.prod(out_shape))
        grads = {}
        if saved is not None:
            k, features = saved.shape[1:]
            grads["kernel"] = Outer(left=saved, right=project(params["key"], g2, k, spec.config.sketch),
                                    rows=features, shape=tuple(kernel.shape))
        if params.get("bias") is not None:
            grads["bias"] = Direct(jnp.sum(g2, axis=1, dtype=jnp.float32).reshape((batch,) + out_shape))
        return grads


RMM_LINEAR = RMMLinearRule()
jax.tree_util.register_static(RMMSpec)
