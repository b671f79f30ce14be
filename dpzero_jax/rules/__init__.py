"""Registry of supported layer types: one module per layer rule.

A rule is an object with

* ``name``: its registry key;
* ``apply(params, x, spec) -> y``: the forward computation (``params`` maps parameter names to arrays, or ``None``
  for an absent parameter such as a disabled bias);
* ``per_example_grads(params, x, g, spec) -> {name: Outer | Direct}``: the factored per-example gradient of each
  present parameter from the layer input ``x`` and the output gradient ``g = dL_i/dy``;
* ``input_free``: the names of the parameters whose per-example gradient is a function of ``g`` alone (biases:
  ``sum_t g_t``). When only such parameters are trainable the engine does not keep ``x``: ``per_example_grads`` is
  then called with ``x=None`` and returns those parameters only (see :func:`needs_input`);

and from these two the registry derives, for any rule, ``sq_norm(a, g)`` and ``clipped_grad(a, g, c)``
(see :func:`sq_norms` and :func:`clipped_grads`). Inputs always carry the batch axis first: ``x [B, ...]``.

An optional ``used_in_input_dtype`` (a set of parameter names) says which parameters ``apply`` casts to the input's
dtype before using them (a linear layer's kernel and bias): casting such a parameter to a narrower input dtype
earlier changes no result, so a sharded copy can be gathered in that dtype (:func:`gather_dtype`).

Two optional hooks let a layer keep less than its input for the backward pass (the RMM layer keeps a random
projection ``S^T x``, :mod:`dpzero_jax.rules.rmm`):

* ``residual(params, x, spec) -> saved``: what the tapes keep instead of ``x``; ``per_example_grads`` then receives
  ``saved`` in place of ``x`` (default: ``saved = x``);
* ``input_grad(params, saved, g, spec) -> dL/dx``: the input cotangent from ``saved`` (default: the VJP of
  ``apply`` at ``x = saved``, ``None`` for integer inputs).

:func:`stored_input` and :func:`input_grad` apply a rule's hook or the default; the tapes use
:func:`forward_and_stored`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from dpzero_jax import pergrad
from dpzero_jax.rules.embed import EMBED
from dpzero_jax.rules.linear import LINEAR
from dpzero_jax.rules.norm import NORM
from dpzero_jax.rules.rmm import RMM_LINEAR
from dpzero_jax.sketch import finite_zero


class LayerRule(Protocol):
    name: str
    input_free: frozenset[str]

    def apply(self, params: Mapping[str, jax.Array | None], x: jax.Array, spec: Any) -> jax.Array: ...

    def per_example_grads(self, params: Mapping[str, jax.Array | None], x: jax.Array, g: jax.Array,
                          spec: Any) -> dict[str, pergrad.PerExampleGrad]: ...


RULES: dict[str, LayerRule] = {rule.name: rule for rule in (LINEAR, EMBED, NORM, RMM_LINEAR)}


def stored_input(rule: LayerRule, params, x, spec):
    """What a tape keeps of the layer input ``x`` for the backward pass: ``rule.residual(...)`` or ``x``."""
    hook = getattr(rule, "residual", None)
    return x if hook is None else hook(params, x, spec)


def forward_and_stored(rule: LayerRule, params, x, spec):
    """``(y, saved)``: the layer output and :func:`stored_input`. When the rule keeps a residual, ``y`` is given a
    data dependency on it (per example, no value or gradient change) so that XLA computes the residual before the
    next layer runs and can free ``x``; left alone, XLA:CPU's scheduler delays such side computations to the end of
    the forward pass, keeping every layer input alive."""
    y = rule.apply(params, x, spec)
    if getattr(rule, "residual", None) is None:
        return y, x
    saved = stored_input(rule, params, x, spec)
    zero = finite_zero(saved, batched=True).reshape((-1,) + (1,) * (y.ndim - 1))
    return y + zero.astype(y.dtype), saved


def input_grad(rule: LayerRule, params, saved, g, spec):
    """``dL/dx`` of one layer call from what was kept (:func:`stored_input`) and the output gradient ``g``."""
    hook = getattr(rule, "input_grad", None)
    if hook is not None:
        return hook(params, saved, g, spec)
    if not jnp.issubdtype(saved.dtype, jnp.inexact):
        return None
    _, pullback = jax.vjp(lambda x_: rule.apply(params, x_, spec), saved)
    return pullback(g)[0]


def gather_dtype(rule: LayerRule, name: str, param_dtype, x_dtype):
    """The dtype in which parameter ``name`` of a call on an input of ``x_dtype`` can be gathered without changing
    the layer's result: the input's dtype when the rule uses the parameter in it and it is narrower (half-precision
    compute on fp32 master weights: half the communication), else ``None`` (as stored)."""
    if name not in getattr(rule, "used_in_input_dtype", ()) or not jnp.issubdtype(x_dtype, jnp.floating):
        return None
    return x_dtype if jnp.finfo(x_dtype).bits < jnp.finfo(param_dtype).bits else None


def needs_input(rule: LayerRule, trainable_names) -> bool:
    """Whether the per-example gradients of the parameters ``trainable_names`` of one call need the layer input."""
    return any(name not in rule.input_free for name in trainable_names)


def sq_norms(rule: LayerRule, params, x, g, spec, method: str = "mixed") -> dict[str, jax.Array]:
    """``{name: [B]}`` squared per-example gradient norms of one layer call's parameters (``x`` the layer input)."""
    uses = rule.per_example_grads(params, stored_input(rule, params, x, spec), g, spec)
    return {name: pergrad.sq_norm([use], method) for name, use in uses.items()}


def clipped_grads(rule: LayerRule, params, x, g, spec, coef: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """``{name: sum_i coef[name]_i * grad_i}`` for one layer call; ``coef[name]: [B]``."""
    uses = rule.per_example_grads(params, stored_input(rule, params, x, spec), g, spec)
    return {name: pergrad.weighted_sum([use], coef[name]) for name, use in uses.items()}
