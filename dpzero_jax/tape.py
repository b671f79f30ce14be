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
* ``GhostTape`` (in :mod:`dpzero_jax.modes.ghost`, with the mode that uses it): a ``custom_vjp`` per layer whose
  backward writes the per-parameter squared norms into the cotangent of a ``[B, P]`` *sink* input and, through
  the cotangent of a ``[B, P]`` *port* output, receives the clip coefficients with which it forms the clipped
  weight gradient. Calls whose parameters are shared with another call (tied weights) are captured as in
  book-keeping so that cross terms can be formed.
* ``FusedTape`` (in :mod:`dpzero_jax.modes.fused`): a ``custom_vjp`` per layer whose backward computes the
  layer's norms, the clip coefficients of its (layer-local) groups and the clipped weight gradient in one go.
* :class:`GatherTape`: no DP work; only for parameters stored as shards (below). The non-private counterpart.
* :class:`ProgramTape`: the traced-program front-end's trace (:mod:`dpzero_jax.program`): no DP work either; each
  layer is traced as its rule's ``program_apply`` (for most rules its ``apply``), so the front-end, which reads
  per-example gradients off the jaxpr, sees the gradient the rule defines.

Every tape keeps of a layer input what its rule asks for (``rules.stored_input``: ``x`` itself, or less, such as
the random projection ``S^T x`` of an RMM layer) and forms the input cotangent with ``rules.input_grad``.

Parameters stored as shards (ZeRO-3 inside ``jax.shard_map``; :class:`ParamLayout`, implemented by
:class:`dpzero_jax.sharding.ShardLayout`). Then the trainable leaves the loss receives are each device's shards,
and every tape gathers a call's weights just before the layer uses them and lets the copy go after it:

* every layer becomes a ``custom_vjp`` whose residuals are the shards (never the whole weight): the forward
  gathers after the layer input exists, the backward gathers again after the output gradient exists (so XLA can
  neither hoist the gathers to the start of the program nor merge the backward's with the forward's), and each
  weight gradient the backward forms -- the clipped sum in ``GhostTape`` and ``FusedTape``, the plain
  gradient in :class:`GatherTape` -- is handed back already reduce-scattered to its owner (``layout.scatter``);
  book-keeping (:class:`CaptureTape`) forms no weight gradient in the backward (the engine forms the clipped sums
  from the kept inputs and output gradients, then scatters them).

Norms and clip factors need no communication: each device's examples are complete on that device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from dpzero_jax import rules

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


class ParamLayout(Protocol):
    """Trainable leaves stored as shards (see the module docstring); ``path`` names a leaf as the engine does.

    * ``gathers(path)``: whether the leaf arrives as a shard (else it is already whole);
    * ``gather(path, shard, after)``: the whole weight, gathered only once ``after`` exists (a data dependency
      that changes no value: the layer input in a forward pass, the output gradient in a backward pass);
    * ``scatter(path, grad)``: the owner's part of a whole-weight gradient, summed over the devices sharing it;
    * ``full(path)``: ``jax.ShapeDtypeStruct`` of the whole weight (of every leaf, sharded or not);
    * ``dim(path)``: the dimension a sharded leaf is split on (None: whole); the traced-program front-end gathers
      with it (:mod:`dpzero_jax.program.zero3`).
    """

    def gathers(self, path: str) -> bool: ...

    def dim(self, path: str) -> int | None: ...

    def gather(self, path: str, shard: jax.Array, after: jax.Array) -> jax.Array: ...

    def scatter(self, path: str, grad: jax.Array) -> jax.Array: ...

    def full(self, path: str) -> jax.ShapeDtypeStruct: ...


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
    top_level: bool = True   # traced in the loss itself, not inside a nested trace (scan, remat, vmap, cond, jit)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.param_paths)


class _Tape:
    def __init__(self, leaf_paths: Mapping[int, str], layout: ParamLayout | None = None):
        self._leaf_paths = leaf_paths
        self.layout = layout
        self._count = 0

    def _gathers(self, paths) -> bool:
        """Whether any of a call's trainable parameters (``paths {name: path}``) arrives as a shard."""
        return self.layout is not None and any(self.layout.gathers(path) for path in paths.values())

    def _gather(self, paths, trainable, after, rule=None, x_dtype=None):
        """``{name: whole weight}`` of a call's trainable parameters, gathered after ``after`` (identity without a
        layout) -- in the input's dtype ``x_dtype`` where the layer ``rule`` uses the weight in it anyway
        (:func:`dpzero_jax.rules.gather_dtype`: the same result, half the bytes in half precision)."""
        if self.layout is None:
            return trainable
        whole = {}
        for name, value in trainable.items():
            dtype = None if rule is None else rules.gather_dtype(rule, name, value.dtype, x_dtype)
            whole[name] = self.layout.gather(paths[name], value if dtype is None else value.astype(dtype), after)
        return whole

    def _gatherer(self, paths, rule, x):
        """``gather(trainable, after)`` for one call of ``rule`` on ``x``."""
        return functools.partial(self._gather, paths, rule=rule, x_dtype=x.dtype)

    def _scatter(self, paths, grads):
        """``{name: owner's gradient}`` from whole-weight gradients (identity without a layout)."""
        if self.layout is None:
            return grads
        return {name: self.layout.scatter(paths[name], grad) for name, grad in grads.items()}

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
    """Records every layer call. ``top_trace``: the trace of the loss's own inputs; a call whose input belongs to
    another trace -- a ``lax.scan`` / ``nn.scan`` or ``jax.checkpoint`` body, a ``vmap``, a ``cond`` branch, a nested
    ``jit`` -- is recorded with ``top_level=False`` (the tapes that compute per-example quantities cannot reach into
    those: :func:`dpzero_jax.layer_plan.make_plan` leaves such calls to the traced-program front-end)."""

    def __init__(self, leaf_paths, top_trace=None):
        super().__init__(leaf_paths)
        self.records: list[CallRecord] = []
        self._top_trace = top_trace

    def call(self, rule, spec, params, x):
        index = self._next()
        trainable, frozen, paths = self._split(params)
        stand_ins = {name: jnp.zeros(v.shape, v.dtype) for name, v in trainable.items()}
        y = rule.apply({**frozen, **stand_ins}, x, spec)
        top_level = self._top_trace is None or getattr(x, "_trace", None) is self._top_trace
        self.records.append(CallRecord(index, rule, spec, tuple(paths.items()), tuple(x.shape), tuple(y.shape),
                                       y.dtype, top_level))
        return y


class CaptureTape(_Tape):
    """Book-keeping capture: ``y + probe`` for the listed calls; ``calls[index] = (saved, layer params)`` with
    ``saved = rules.stored_input(...)`` -- the layer input ``x`` itself unless the rule keeps less (RMM), ``None``
    when no trainable parameter of the call needs the input (``rules.needs_input``), or always ``x`` with
    ``keep_inputs`` (for diagnostics that need the exact input)."""

    def __init__(self, leaf_paths, probes: Mapping[int, jax.Array], keep_inputs: bool = False,
                 layout: ParamLayout | None = None):
        super().__init__(leaf_paths, layout)
        self.probes = probes
        self.keep_inputs = keep_inputs
        self.calls: dict[int, tuple] = {}

    def _capture(self, index, rule, spec, params, x):
        trainable, frozen, paths = self._split(params)
        held = {name: jax.lax.stop_gradient(v) for name, v in trainable.items()}
        layer_params = {**frozen, **held}
        if self._gathers(paths):  # shards: the layer gathers its weights and the backward gathers them again
            if rule.keeps_residual:
                raise ValueError(f"layer rule {rule.name!r} keeps a residual in place of its input; it cannot "
                                 "gather its weights layer by layer (use whole parameters)")
            y = _regathering_layer(rule, spec, self._gatherer(paths, rule, x), None, held, frozen, x)
            saved = x if self.keep_inputs or rules.needs_input(rule, trainable) else None
        elif self.keep_inputs:
            y, saved = rule.apply(layer_params, x, spec), x
        elif rules.needs_input(rule, trainable):
            y, saved = rules.forward_and_stored(rule, layer_params, x, spec)
        else:
            # A trainable parameter needs the input only if its per-example gradient does: a layer whose only
            # trainable parameter is its bias (BiTFiT) keeps its output gradient alone.
            y, saved = rule.apply(layer_params, x, spec), None
        self.calls[index] = (saved, layer_params)  # with a layout: the shards (see engine._call_params)
        return y + self.probes[index].astype(y.dtype)

    def call(self, rule, spec, params, x):
        index = self._next()
        if index not in self.probes:
            return rule.apply(params, x, spec)
        return self._capture(index, rule, spec, params, x)


def _regathering_layer(rule, spec, gather, scatter, trainable, frozen, x):
    """``rule.apply`` on whole weights gathered from the shards ``trainable`` (``gather(trainable, after)``), as a
    ``custom_vjp`` that keeps the shards and the input, never the whole weights: the backward gathers again and
    returns the input cotangent and -- with ``scatter`` (``scatter(grads)``: whole-weight gradients to their
    owners) -- the weight gradients reduce-scattered to their owners and the cotangents of floating ``frozen``
    arrays; without it (book-keeping, whose parameters are not differentiated) no weight gradient."""

    def inexact(v):
        return v is not None and jnp.issubdtype(v.dtype, jnp.inexact)

    def forward(trainable, frozen, x):
        return rule.apply({**frozen, **gather(trainable, x)}, x, spec)

    def forward_with_residuals(trainable, frozen, x):
        return forward(trainable, frozen, x), (trainable, frozen, x)

    def backward(residuals, g):
        trainable, frozen, x = residuals
        whole = gather(trainable, g)
        if scatter is None:
            x_grad = rules.input_grad(rule, {**frozen, **whole}, x, g, spec) if inexact(x) else None
            return None, None, x_grad
        floating = {name: v for name, v in frozen.items() if inexact(v)}

        def layer(whole, floating, x_):
            return rule.apply({**frozen, **floating, **whole}, x_ if inexact(x) else x, spec)

        _, pullback = jax.vjp(layer, whole, floating, x if inexact(x) else None)
        weight_grads, floating_grads, x_grad = pullback(g)
        weight_grads = {name: grad.astype(trainable[name].dtype) for name, grad in weight_grads.items()}
        frozen_grads = {name: floating_grads.get(name) for name in frozen}
        return scatter(weight_grads), frozen_grads, x_grad

    layer = jax.custom_vjp(forward)
    layer.defvjp(forward_with_residuals, backward)
    return layer(trainable, frozen, x)


class ProgramTape:
    """The tape of the traced-program front-end's trace (:func:`dpzero_jax.program.mode.plan_program`): each DP
    layer call becomes ``rule.program_apply`` -- ordinary JAX whose autodiff is the rule's per-example gradient.
    Equal to ``rule.apply`` except where the rule's gradient is not the derivative of its forward (an RMM layer:
    exact output, sketched weight gradient; :meth:`dpzero_jax.rules.rmm.RMMLinearRule.program_apply`). Knows no
    leaves (the front-end finds them in the jaxpr) and keeps only the number of ``calls``: with none, the engine
    knows the layer tapes have nothing to compute and does not trace the loss for them."""

    layout = None

    def __init__(self):
        self.calls = 0

    def call(self, rule, spec, params, x):
        self.calls += 1
        return rule.program_apply(params, x, spec)


class GatherTape(_Tape):
    """Ordinary layers on parameters stored as shards (``layout``; no DP work): each call with a sharded trainable
    parameter gathers it just before use and again in the backward pass, and its weight gradient comes back
    reduce-scattered to the owner (:func:`_regathering_layer`). Differentiate the loss with ``jax.grad`` as usual:
    the gradient of each shard is the owner's sum over the ``fsdp`` devices."""

    def __init__(self, leaf_paths, layout: ParamLayout):
        super().__init__(leaf_paths, layout)

    def call(self, rule, spec, params, x):
        self._next()
        trainable, frozen, paths = self._split(params)
        if not self._gathers(paths):
            return rule.apply(params, x, spec)
        return _regathering_layer(rule, spec, self._gatherer(paths, rule, x),
                                  functools.partial(self._scatter, paths), trainable, frozen, x)
