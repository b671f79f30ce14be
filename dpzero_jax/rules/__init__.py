"""Registry of supported layer types: one module per layer rule.

Every rule subclasses :class:`~dpzero_jax.rules.base.LayerRule` (:mod:`dpzero_jax.rules.base`: the contract,
with shapes), which requires

* ``name``: its registry key;
* ``apply(params, x, spec) -> y``: the forward computation (``params`` maps parameter names to arrays, or ``None``
  for an absent parameter such as a disabled bias);
* ``per_example_grads(params, x, g, spec) -> {name: Outer | Direct}``: the factored per-example gradient of each
  present parameter from the layer input ``x`` and the output gradient ``g = dL_i/dy``;

and from these two the registry derives, for any rule, ``sq_norm(a, g)`` and ``clipped_grad(a, g, c)``
(see :func:`sq_norms` and :func:`clipped_grads`). Inputs always carry the batch axis first: ``x [B, ...]``.

Optional, with defaults in the base class:

* ``input_free``: the names of the parameters whose per-example gradient is a function of ``g`` alone (biases:
  ``sum_t g_t``). When only such parameters are trainable the engine does not keep ``x``: ``per_example_grads`` is
  then called with ``x=None`` and returns those parameters only (see :func:`needs_input`);
* ``used_in_input_dtype`` (a set of parameter names): which parameters ``apply`` casts to the input's dtype before
  using them (a linear layer's kernel and bias): casting such a parameter to a narrower input dtype earlier changes
  no result, so a sharded copy can be gathered in that dtype (:func:`gather_dtype`).

Two hooks let a layer keep less than its input for the backward pass (the RMM layer keeps a random projection
``S^T x``, :mod:`dpzero_jax.rules.rmm`):

* ``residual(params, x, spec) -> saved``: what the tapes keep instead of ``x``; ``per_example_grads`` then receives
  ``saved`` in place of ``x`` (default: ``saved = x``; a rule that overrides it ``keeps_residual``);
* ``input_grad(params, saved, g, spec) -> dL/dx``: the input cotangent from ``saved`` (default: the VJP of
  ``apply`` at ``x = saved``, ``None`` for integer inputs).

:func:`stored_input` and :func:`input_grad` apply them; the tapes use :func:`forward_and_stored`. :data:`RULES`
maps names to the built-in rules, each checked against the contract (:func:`~dpzero_jax.rules.base.check_rule`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

from dpzero_jax import pergrad
from dpzero_jax.rules.base import LayerRule, check_rule
from dpzero_jax.rules.embed import EMBED
from dpzero_jax.rules.linear import LINEAR
from dpzero_jax.rules.norm import NORM
from dpzero_jax.rules.rmm import RMM_LINEAR
from dpzero_jax.sketch import finite_zero

__all__ = ["RULES", "LayerRule", "check_rule", "clipped_grads", "forward_and_stored", "gather_dtype", "input_grad",
           "needs_input", "registry", "sq_norms", "stored_input"]


def registry(rules: Iterable[LayerRule]) -> dict[str, LayerRule]:
    """``{rule.name: rule}`` of ``rules``, each checked against the :class:`LayerRule` contract; two rules with
    one name are a ``ValueError``."""
    out: dict[str, LayerRule] = {}
    for rule in rules:
        check_rule(rule)
        if rule.name in out:
            raise ValueError(f"two layer rules are named {rule.name!r}: {type(out[rule.name]).__name__} and "
                             f"{type(rule).__name__}")
        out[rule.name] = rule
    return out


RULES: dict[str, LayerRule] = registry((LINEAR, EMBED, NORM, RMM_LINEAR))


def stored_input(rule: LayerRule, params, x, spec):
    """What a tape keeps of the layer input ``x`` for the backward pass: ``rule.residual(...)`` (by default
    ``x``)."""
    return rule.residual(params, x, spec)


def forward_and_stored(rule: LayerRule, params, x, spec):
    """``(y, saved)``: the layer output and :func:`stored_input`. When the rule keeps a residual, ``y`` is given a
    data dependency on it (per example, no value or gradient change) so that XLA computes the residual before the
    next layer runs and can free ``x``; left alone, XLA:CPU's scheduler delays such side computations to the end of
    the forward pass, keeping every layer input alive."""
    y = rule.apply(params, x, spec)
    if not rule.keeps_residual:
        return y, x
    saved = stored_input(rule, params, x, spec)
    zero = finite_zero(saved, batched=True).reshape((-1,) + (1,) * (y.ndim - 1))
    return y + zero.astype(y.dtype), saved


def input_grad(rule: LayerRule, params, saved, g, spec):
    """``dL/dx`` of one layer call from what was kept (:func:`stored_input`) and the output gradient ``g``:
    ``rule.input_grad(...)`` (by default the VJP of ``apply``)."""
    return rule.input_grad(params, saved, g, spec)


def gather_dtype(rule: LayerRule, name: str, param_dtype, x_dtype):
    """The dtype in which parameter ``name`` of a call on an input of ``x_dtype`` can be gathered without changing
    the layer's result: the input's dtype when the rule uses the parameter in it and it is narrower (half-precision
    compute on fp32 master weights: half the communication), else ``None`` (as stored)."""
    if name not in rule.used_in_input_dtype or not jnp.issubdtype(x_dtype, jnp.floating):
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
