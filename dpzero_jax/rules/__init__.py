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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax

from dpzero_jax import pergrad
from dpzero_jax.rules.embed import EMBED
from dpzero_jax.rules.linear import LINEAR
from dpzero_jax.rules.norm import NORM


class LayerRule(Protocol):
    name: str
    input_free: frozenset[str]

    def apply(self, params: Mapping[str, jax.Array | None], x: jax.Array, spec: Any) -> jax.Array: ...

    def per_example_grads(self, params: Mapping[str, jax.Array | None], x: jax.Array, g: jax.Array,
                          spec: Any) -> dict[str, pergrad.PerExampleGrad]: ...


RULES: dict[str, LayerRule] = {rule.name: rule for rule in (LINEAR, EMBED, NORM)}


def needs_input(rule: LayerRule, trainable_names) -> bool:
    """Whether the per-example gradients of the parameters ``trainable_names`` of one call need the layer input."""
    return any(name not in rule.input_free for name in trainable_names)


def sq_norms(rule: LayerRule, params, x, g, spec, method: str = "mixed") -> dict[str, jax.Array]:
    """``{name: [B]}`` squared per-example gradient norms of one layer call's parameters."""
    return {name: pergrad.sq_norm([use], method) for name, use in rule.per_example_grads(params, x, g, spec).items()}


def clipped_grads(rule: LayerRule, params, x, g, spec, coef: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """``{name: sum_i coef[name]_i * grad_i}`` for one layer call; ``coef[name]: [B]``."""
    uses = rule.per_example_grads(params, x, g, spec)
    return {name: pergrad.weighted_sum([use], coef[name]) for name, use in uses.items()}
