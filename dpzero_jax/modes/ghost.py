"""Ghost mode: one forward, two pullbacks -- norms through per-layer sinks, then the clipped sum through
per-layer ports."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dpzero_jax import clipping, pergrad, rules
from dpzero_jax import tape as tape_lib
from dpzero_jax.config import DPConfig
from dpzero_jax.layer_plan import (
    Plan,
    _assemble,
    _Clipped,
    _group_sq,
    _keep,
    _leaf_ids,
    _per_example_uses,
    _scatter,
)

Array = jax.Array


# ---------------------------------------------------------------- the mode's tape

def _ghost_layer(rule, spec, names, method, kernel, gather, scatter, trainable, frozen, x, sink):
    """``(y, port)``; backward: ``sink`` cotangent = per-parameter squared norms ``[B, P]``, parameter cotangents =
    ``sum_i port_ct[i, j] * grad_i`` for parameter ``names[j]``. ``gather(trainable, after)`` gives the whole
    weights from what the layer receives, ``scatter(grads)`` the owners' gradients (both identities unless the
    parameters are stored as shards)."""

    def forward(trainable, frozen, x, sink):
        return rule.apply({**frozen, **gather(trainable, x)}, x, spec), jnp.zeros_like(sink)

    def forward_with_residuals(trainable, frozen, x, sink):
        y, saved = rules.forward_and_stored(rule, {**frozen, **gather(trainable, x)}, x, spec)
        return (y, jnp.zeros_like(sink)), (trainable, frozen, saved)

    def backward(residuals, cotangents):
        trainable, frozen, saved = residuals
        g, coef = cotangents
        params = {**frozen, **gather(trainable, g)}
        uses = rule.per_example_grads(params, saved, g, spec)
        # the clipped sum below is its own contraction: an instantiated gradient would serve the norm only
        sq = jnp.stack([pergrad.sq_norm([uses[n]], method, kernel, reuse=False) for n in names], axis=1)
        grads = {n: pergrad.weighted_sum([uses[n]], coef[:, j], kernel).astype(trainable[n].dtype)
                 for j, n in enumerate(names)}
        return scatter(grads), None, rules.input_grad(rule, params, saved, g, spec), sq

    layer = jax.custom_vjp(forward)
    layer.defvjp(forward_with_residuals, backward)
    return layer(trainable, frozen, x, sink)


class GhostTape(tape_lib.CaptureTape):
    def __init__(self, leaf_paths, probes, sinks: Mapping[int, jax.Array], method: str, kernel: str = "xla",
                 layout: tape_lib.ParamLayout | None = None):
        super().__init__(leaf_paths, probes, layout=layout)
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
        trainable, frozen, paths = self._split(params)
        y, port = _ghost_layer(rule, spec, tuple(trainable), self.method, self.kernel,
                               self._gatherer(paths, rule, x), functools.partial(self._scatter, paths),
                               trainable, frozen, x, self.sinks[index])
        self.ports[index] = port
        return y


# ---------------------------------------------------------------- the mode


def _ghost(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    shared = plan.shared_calls
    probes = {r.index: jnp.zeros(r.output_shape, r.output_dtype) for r in plan.records if r.index in shared}
    sinks = {r.index: jnp.zeros((plan.batch_size, len(r.names)), jnp.float32)
             for r in plan.records if r.index not in shared}

    def forward(params, sinks, probes):
        ghost = GhostTape(_leaf_ids(params), probes, sinks, cfg.norm_method, cfg.norm_kernel, layout)
        with tape_lib.active(ghost):
            losses = loss_fn(params, batch)
        return (losses, ghost.ports), ghost.calls

    (losses, ports), pullback, calls = jax.vjp(forward, params, sinks, probes, has_aux=True)
    ones = jnp.ones_like(losses)
    _, sink_ct, probe_ct = pullback((ones, jax.tree.map(jnp.zeros_like, ports)))
    by_index = {r.index: r for r in plan.records}
    sq = {}
    for index, per_param in sink_ct.items():
        for j, (_, path) in enumerate(by_index[index].param_paths):
            sq[path] = sq.get(path, 0.0) + per_param[:, j]
    # Every parameter of a captured call (not only the tied one: e.g. the bias of a tied head) is handled here.
    shared_paths = [p for p, us in plan.uses.items() if any(index in shared for index, _ in us)]
    shared_uses = _per_example_uses(plan, calls, probe_ct, shared_paths, layout)
    for path, u in shared_uses.items():
        sq[path] = pergrad.sq_norm(u, cfg.norm_method, cfg.norm_kernel, reuse=False)   # summed by weighted_sum
    norms = jnp.sqrt(_group_sq(plan, sq))
    coef = clipping.coefficients(norms, jnp.asarray(plan.thresholds), _keep(losses, mask), cfg.clip_fn, cfg.gamma)
    port_ct = {index: jnp.stack([coef[:, plan.group_of[path]] for _, path in by_index[index].param_paths], axis=1)
               for index in ports}
    clipped, _, _ = pullback((ones, port_ct))
    extra = _scatter(layout, {path: pergrad.weighted_sum(u, coef[:, plan.group_of[path]], cfg.norm_kernel)
                              for path, u in shared_uses.items()})
    if extra:
        extra_tree = _assemble(params, extra)
        clipped = jax.tree.map(jnp.add, clipped, extra_tree)
    return _Clipped(losses, clipped, norms, coef)
