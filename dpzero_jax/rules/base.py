"""The contract of a layer rule: :class:`LayerRule`, the base class every rule of :mod:`dpzero_jax.rules` subclasses.

A rule describes one kind of layer call to the engine's tapes (:mod:`dpzero_jax.tape`): its forward computation and
the factored per-example gradients of its parameters from the layer input and the output gradient, from which the
registry derives squared norms and clipped sums for any rule (:func:`dpzero_jax.rules.sq_norms`,
:func:`dpzero_jax.rules.clipped_grads`). A rule object holds no state (one instance per rule, shared by every call);
what differs between calls is the ``spec`` (static, hashable: a frozen dataclass registered with
``jax.tree_util.register_static``, or None) and the ``params``.

Shapes: inputs carry the batch axis first, ``x [B, ...]``; the output gradient ``g = dL_i/dy`` has the output's
shape ``[B, ...]``; ``params`` maps the rule's parameter names to arrays, or to ``None`` for an absent parameter (a
disabled bias).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from dpzero_jax import pergrad


class LayerRule(abc.ABC):
    """Base class of the layer rules.

    Required (a subclass that leaves one out cannot be instantiated, and the registry refuses a rule without a
    name):

    * ``name``: the registry key (a non-empty string, unique among the registered rules);
    * :meth:`apply`: the forward computation;
    * :meth:`per_example_grads`: the factored per-example gradient of each present parameter.

    Optional, with defaults:

    * ``input_free`` (default: none): the names of the parameters whose per-example gradient is a function of ``g``
      alone (biases: ``sum_t g_t``). When only such parameters of a call are trainable, book-keeping keeps nothing
      of the input: :meth:`per_example_grads` is then called with ``x=None`` and must return those parameters only
      (:func:`dpzero_jax.rules.needs_input`);
    * ``used_in_input_dtype`` (default: none): the parameters :meth:`apply` casts to the input's dtype before using
      them (a linear layer's kernel and bias); casting such a parameter to a narrower input dtype earlier changes
      no result, so a sharded copy can be gathered in that dtype (:func:`dpzero_jax.rules.gather_dtype`);
    * :meth:`residual` (default: the input itself): what the tapes keep of the input for the backward pass;
    * :meth:`input_grad` (default: the VJP of :meth:`apply`): the input cotangent from what was kept;
    * :meth:`program_apply` (default: :meth:`apply`): the layer as the traced-program front-end sees it, a plain
      program whose autodiff gives the rule's per-example gradients (:class:`dpzero_jax.tape.ProgramTape`).

    A rule that overrides :meth:`residual` (:attr:`keeps_residual`) cannot gather sharded weights layer by layer
    in book-keeping (the tapes refuse it), and its output gets a data dependency on the residual
    (:func:`dpzero_jax.rules.forward_and_stored`).
    """

    name: ClassVar[str]
    input_free: ClassVar[frozenset[str]] = frozenset()
    used_in_input_dtype: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def apply(self, params: Mapping[str, jax.Array | None], x: jax.Array, spec: Any) -> jax.Array:
        """The layer's output ``y [B, ...]`` on the input ``x [B, ...]``."""

    @abc.abstractmethod
    def per_example_grads(self, params: Mapping[str, jax.Array | None], x: jax.Array | None, g: jax.Array,
                          spec: Any) -> dict[str, pergrad.PerExampleGrad]:
        """``{name: Outer | Direct}`` for each present parameter: the gradient of example ``i``'s loss, factored
        (:class:`~dpzero_jax.pergrad.Outer`: ``left [B, T, rows]``, ``right [B, T, cols]``, ``G_i = sum_t left_{i,t}
        (x) right_{i,t}``) or instantiated (:class:`~dpzero_jax.pergrad.Direct`: ``[B, *param.shape]``).

        ``x``: what :meth:`residual` kept of the input (the input ``[B, ...]`` by default), or ``None`` when only
        ``input_free`` parameters are trainable; ``g [B, ...]``: the output gradient."""

    def residual(self, params: Mapping[str, jax.Array | None], x: jax.Array, spec: Any):
        """What the tapes keep of the input ``x [B, ...]`` for the backward pass and hand to
        :meth:`per_example_grads` and :meth:`input_grad` in its place. Default: ``x`` itself. Must keep the batch
        axis first (``[B, ...]``: the engine masks and chunks it per example)."""
        return x

    def input_grad(self, params: Mapping[str, jax.Array | None], saved, g: jax.Array, spec: Any):
        """``dL/dx [B, ...]`` of one call from what was kept (``saved``, :meth:`residual`) and the output gradient
        ``g [B, ...]``. Default: the VJP of :meth:`apply` at ``x = saved``; ``None`` for integer inputs (ids)."""
        if not jnp.issubdtype(saved.dtype, jnp.inexact):
            return None
        _, pullback = jax.vjp(lambda x_: self.apply(params, x_, spec), saved)
        return pullback(g)[0]

    def program_apply(self, params: Mapping[str, jax.Array | None], x: jax.Array, spec: Any) -> jax.Array:
        """``y [B, ...]`` as a program for the traced-program front-end (:mod:`dpzero_jax.program`), which finds
        per-example gradients by analysing the jaxpr: the same value as :meth:`apply`, written so that each
        parameter's gradient through it is the one :meth:`per_example_grads` describes. Default: :meth:`apply`
        (its autodiff gradient is that one); a rule whose gradient is not its forward's derivative (an RMM layer's
        sketched estimate) overrides it."""
        return self.apply(params, x, spec)

    @property
    def keeps_residual(self) -> bool:
        """Whether the rule keeps something other than its input (overrides :meth:`residual`)."""
        return type(self).residual is not LayerRule.residual


def check_rule(rule) -> LayerRule:
    """``rule`` if it is a usable :class:`LayerRule`, else a ``TypeError`` / ``ValueError`` naming what is wrong."""
    if not isinstance(rule, LayerRule):
        raise TypeError(f"a layer rule must be an instance of a dpzero_jax.rules.LayerRule subclass, got "
                        f"{type(rule).__name__}")
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"layer rule {type(rule).__name__} needs a non-empty string `name`, got {name!r}")
    for field in ("input_free", "used_in_input_dtype"):
        value = getattr(rule, field)
        if not isinstance(value, frozenset) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"layer rule {name!r}: `{field}` must be a frozenset of parameter names, got {value!r}")
    return rule
