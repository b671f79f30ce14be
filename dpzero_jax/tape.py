"""Tapes: what a DP layer does while the engine traces a loss.

The engine (:mod:`dpzero_jax.engine`) traces the user's ``loss_fn(params, batch)`` inside :func:`active`; every
layer primitive of :mod:`dpzero_jax.ops` then hands itself to the active tape. The tape is scoped to that one trace
(a ``contextvars`` variable set and reset around it) -- there is no global mode.

Layer calls are numbered in trace order; the numbering is identical in every trace of the same function, which lets
the discovery trace plan what the later traces add. A parameter is recognised as trainable when the array passed to
the layer *is* (by identity) a leaf of the ``params`` being differentiated.

* :class:`DiscoveryTape` records each call (rule, spec, which trainable leaves it uses, shapes) and computes the
  layer with zero stand-ins for trainable parameters, so that any remaining use of a parameter in the jaxpr is a
  use outside the supported layers.
* :class:`CaptureTape` (book-keeping): adds a zero probe to each layer output, whose cotangent is the output
  gradient ``g``, and keeps the layer input ``x`` as auxiliary output -- unless the call's trainable parameters
  do not need it (only a bias trainable: ``rule.input_free``). Parameters are not differentiated.
* :class:`GhostTape`: a ``custom_vjp`` per layer whose backward writes the per-parameter squared norms into the
  cotangent of a ``[B, P]`` *sink* input and, through the cotangent of a ``[B, P]`` *port* output, receives the
  clip coefficients with which it forms the clipped weight gradient. Calls whose parameters are shared with
  another call (tied weights) are captured as in book-keeping so that cross terms can be formed.
* :class:`FusedTape`: a ``custom_vjp`` per layer whose backward computes the layer's norms, the clip
  coefficients of its (layer-local) groups and the clipped weight gradient in one go.

Every tape keeps of a layer input what its rule asks for (``rules.stored_input``: ``x`` itself, or less, such as
the random projection ``S^T x`` of an RMM layer) and forms the input cotangent with ``rules.input_grad``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dpzero_jax import pergrad, rules

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("dpzero_active_tape", default=None)


def current():
    """The tape of the trace in progress, or ``None`` outside the engine."""
    return _ACTIVE.get()


@contextlib.contextmanager
def active(tape):
    token = _ACTIVE.set(tape)
    try:
        yield tape
    finally:
        _ACTIVE.reset(token)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One layer call seen by the discovery trace."""

    index: int
    rule: Any
    spec: Any
    param_paths: tuple[tuple[str, str], ...]   # (parameter name in the layer, path of the trainable leaf)
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    output_dtype: Any

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.param_paths)


class _Tape:
    def __init__(self, leaf_paths: Mapping[int, str]):
        self._leaf_paths = leaf_paths
        self._count = 0

    def _next(self) -> int:
        index = self._count
        self._count += 1
        return index

    def _split(self, params):
        """``(trainable {name: array}, frozen {name: array | None}, paths {name: path})``."""
        trainable, frozen, paths = {}, {}, {}
        for name, value in params.items():
            path = None if value is None else self._leaf_paths.get(id(value))
            if path is None:
                frozen[name] = value
            else:
                trainable[name] = value
                paths[name] = path
        return trainable, frozen, paths


class DiscoveryTape(_Tape):
    def __init__(self, leaf_paths):
        super().__init__(leaf_paths)
        self.records: list[CallRecord] = []

    def call(self, rule, spec, params, x):
        index = self._next()
        trainable, frozen, paths = self._split(params)
        stand_ins = {name: jnp.zeros(v.shape, v.dtype) for name, v in trainable.items()}
        y = rule.apply({**frozen, **stand_ins}, x, spec)
        self.records.append(CallRecord(index, rule, spec, tuple(paths.items()), tuple(x.shape), tuple(y.shape),
                                       y.dtype))
        return y


class CaptureTape(_Tape):
    """Book-keeping capture: ``y + probe`` for the listed calls; ``calls[index] = (saved, layer params)`` with
    ``saved = rules.stored_input(...)`` -- the layer input ``x`` itself unless the rule keeps less (RMM), ``None``
    when no trainable parameter of the call needs the input (``rules.needs_input``), or always ``x`` with
    ``keep_inputs`` (for diagnostics that need the exact input)."""

    def __init__(self, leaf_paths, probes: Mapping[int, jax.Array], keep_inputs: bool = False):
        super().__init__(leaf_paths)
        self.probes = probes
        self.keep_inputs = keep_inputs
        self.calls: dict[int, tuple] = {}

    def _capture(self, index, rule, spec, params, x):
        trainable, frozen, _ = self._split(params)
        held = {name: jax.lax.stop_gradient(v) for name, v in trainable.items()}
        layer_params = {**frozen, **held}
        if self.keep_inputs:
            y, saved = rule.apply(layer_params, x, spec), x
        elif rules.needs_input(rule, trainable):
            y, saved = rules.forward_and_stored(rule, layer_params, x, spec)
        else:
            # A trainable parameter needs the input only if its per-example gradient does: a layer whose only
            # trainable parameter is its bias (BiTFiT) keeps its output gradient alone.
            y, saved = rule.apply(layer_params, x, spec), None
        self.calls[index] = (saved, layer_params)
        return y + self.probes[index].astype(y.dtype)

    def call(self, rule, spec, params, x):
        index = self._next()
        if index not in self.probes:
            return rule.apply(params, x, spec)
        return self._capture(index, rule, spec, params, x)


def _ghost_layer(rule, spec, names, method, kernel, trainable, frozen, x, sink):
    """``(y, port)``; backward: ``sink`` cotangent = per-parameter squared norms ``[B, P]``, parameter cotangents =
    ``sum_i port_ct[i, j] * grad_i`` for parameter ``names[j]``."""

    def forward(trainable, frozen, x, sink):
        return rule.apply({**frozen, **trainable}, x, spec), jnp.zeros_like(sink)

    def forward_with_residuals(trainable, frozen, x, sink):
        y, saved = rules.forward_and_stored(rule, {**frozen, **trainable}, x, spec)
        return (y, jnp.zeros_like(sink)), (trainable, frozen, saved)

    def backward(residuals, cotangents):
        trainable, frozen, saved = residuals
        g, coef = cotangents
        params = {**frozen, **trainable}
        uses = rule.per_example_grads(params, saved, g, spec)
        sq = jnp.stack([pergrad.sq_norm([uses[n]], method, kernel) for n in names], axis=1)
        grads = {n: pergrad.weighted_sum([uses[n]], coef[:, j], kernel).astype(trainable[n].dtype)
                 for j, n in enumerate(names)}
        return grads, None, rules.input_grad(rule, params, saved, g, spec), sq

    layer = jax.custom_vjp(forward)
    layer.defvjp(forward_with_residuals, backward)
    return layer(trainable, frozen, x, sink)


class GhostTape(CaptureTape):
    def __init__(self, leaf_paths, probes, sinks: Mapping[int, jax.Array], method: str, kernel: str = "xla"):
        super().__init__(leaf_paths, probes)
        self.sinks = sinks
        self.method = method
        self.kernel = kernel
        self.ports: dict[int, jax.Array] = {}

    def call(self, rule, spec, params, x):
        index = self._next()
        if index in self.probes:
            return self._capture(index, rule, spec, params, x)
        if index not in self.sinks:
            return rule.apply(params, x, spec)
        trainable, frozen, _ = self._split(params)
        y, port = _ghost_layer(rule, spec, tuple(trainable), self.method, self.kernel, trainable, frozen, x,
                               self.sinks[index])
        self.ports[index] = port
        return y


@dataclasses.dataclass(frozen=True)
class LocalClip:
    """Clipping of the groups that live inside one layer call (fused mode).

    ``group_of[j]``: local group of parameter ``j``; ``thresholds[k]``: threshold of local group ``k``;
    ``coefficients(norms [B, K], thresholds [K], keep [B]) -> [B, K]``.
    """

    group_of: tuple[int, ...]
    thresholds: tuple[float, ...]
    coefficients: Callable


def _fused_layer(rule, spec, names, method, kernel, clip: LocalClip, trainable, frozen, x, sink, keep):
    def forward(trainable, frozen, x, sink, keep):
        return rule.apply({**frozen, **trainable}, x, spec)

    def forward_with_residuals(trainable, frozen, x, sink, keep):
        y, saved = rules.forward_and_stored(rule, {**frozen, **trainable}, x, spec)
        return y, (trainable, frozen, saved, keep)

    def backward(residuals, g):
        trainable, frozen, saved, keep = residuals
        params = {**frozen, **trainable}
        uses = rule.per_example_grads(params, saved, g, spec)
        sq = jnp.stack([pergrad.sq_norm([uses[n]], method, kernel) for n in names], axis=1)
        group_of = jnp.asarray(clip.group_of)
        n_local = len(clip.thresholds)
        group_sq = jnp.zeros((sq.shape[0], n_local), jnp.float32).at[:, group_of].add(sq)
        coef = clip.coefficients(jnp.sqrt(group_sq), jnp.asarray(clip.thresholds, jnp.float32), keep)
        grads = {n: pergrad.weighted_sum([uses[n]], coef[:, clip.group_of[j]], kernel).astype(trainable[n].dtype)
                 for j, n in enumerate(names)}
        return grads, None, rules.input_grad(rule, params, saved, g, spec), sq, None

    layer = jax.custom_vjp(forward)
    layer.defvjp(forward_with_residuals, backward)
    return layer(trainable, frozen, x, sink, keep)


class FusedTape(_Tape):
    def __init__(self, leaf_paths, sinks: Mapping[int, jax.Array], clips: Mapping[int, LocalClip], keep, method,
                 kernel: str = "xla"):
        super().__init__(leaf_paths)
        self.sinks, self.clips, self.keep, self.method, self.kernel = sinks, clips, keep, method, kernel

    def call(self, rule, spec, params, x):
        index = self._next()
        if index not in self.sinks:
            return rule.apply(params, x, spec)
        trainable, frozen, _ = self._split(params)
        return _fused_layer(rule, spec, tuple(trainable), self.method, self.kernel, self.clips[index], trainable,
                            frozen, x, self.sinks[index], self.keep)
