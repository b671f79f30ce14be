"""Rule for linear maps: Dense on ``[B, d]`` / ``[B, T, d]``, DenseGeneral / attention einsums, the tied LM head.

``y = x . W + b`` where the trailing ``n_in`` axes of ``x [B, *T, *in]`` contract with the leading ``n_in`` axes of
``W [*in, *out]``; with ``transpose`` the kernel is stored ``[*out, *in]`` (``y = x . W^T``, e.g. logits from a
tied embedding table). Per example: ``grad W = a_i^T g_i`` (an outer-product sum over positions), ``grad b =
sum_t g_i``. All axes between the batch axis and ``in`` count as positions ``T`` (absent for ``[B, d]`` inputs).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dpzero_jax.pergrad import Direct, Outer
from dpzero_jax.rules.base import LayerRule


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    n_in: int = 1
    transpose: bool = False


def _shapes(kernel_shape, spec: LinearSpec):
    if spec.transpose:
        split = len(kernel_shape) - spec.n_in
        return tuple(kernel_shape[split:]), tuple(kernel_shape[:split])
    return tuple(kernel_shape[:spec.n_in]), tuple(kernel_shape[spec.n_in:])


class LinearRule(LayerRule):
    name = "linear"
    input_free = frozenset({"bias"})
    used_in_input_dtype = frozenset({"kernel", "bias"})  # cast to x's dtype before use (see rules.gather_dtype)

    def apply(self, params, x, spec: LinearSpec):
        kernel, bias = params["kernel"], params.get("bias")
        in_shape, out_shape = _shapes(kernel.shape, spec)
        if x.ndim < spec.n_in + 1 or tuple(x.shape[x.ndim - spec.n_in:]) != in_shape:
            raise ValueError(f"linear layer: input shape {x.shape} does not end in the kernel's input shape "
                             f"{in_shape} (kernel {kernel.shape}); inputs are [B, ..., *in]")
        lead = x.shape[:x.ndim - spec.n_in]
        x2 = x.reshape(lead + (math.prod(in_shape),))
        if spec.transpose:
            w2 = kernel.reshape(math.prod(out_shape), math.prod(in_shape)).T
        else:
            w2 = kernel.reshape(math.prod(in_shape), math.prod(out_shape))
        y = jnp.matmul(x2, w2.astype(x2.dtype)).reshape(lead + out_shape)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y

    def per_example_grads(self, params, x, g, spec: LinearSpec):
        """``x`` may be ``None`` (only the bias is trainable): then only the bias gradient is returned."""
        kernel = params["kernel"]
        in_shape, out_shape = _shapes(kernel.shape, spec)
        batch = g.shape[0]
        g = g.reshape(batch, -1, math.prod(out_shape))
        grads = {}
        if x is not None:
            a = x.reshape(batch, -1, math.prod(in_shape))
            if spec.transpose:
                grads["kernel"] = Outer(left=g, right=a, rows=g.shape[-1], shape=tuple(kernel.shape))
            else:
                grads["kernel"] = Outer(left=a, right=g, rows=a.shape[-1], shape=tuple(kernel.shape))
        if params.get("bias") is not None:
            grads["bias"] = Direct(jnp.sum(g, axis=1, dtype=jnp.float32).reshape((batch,) + out_shape))
        return grads


LINEAR = LinearRule()
jax.tree_util.register_static(LinearSpec)
