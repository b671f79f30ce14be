"""Ghost mode: one forward, two pullbacks -- norms through per-layer sinks, then the clipped sum through
per-layer ports."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpzero_jax import clipping, pergrad
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


def _ghost(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    shared = plan.shared_calls
    probes = {r.index: jnp.zeros(r.output_shape, r.output_dtype) for r in plan.records if r.index in shared}
    sinks = {r.index: jnp.zeros((plan.batch_size, len(r.names)), jnp.float32)
             for r in plan.records if r.index not in shared}

    def forward(params, sinks, probes):
        ghost = tape_lib.GhostTape(_leaf_ids(params), probes, sinks, cfg.norm_method, cfg.norm_kernel, layout)
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
        sq[path] = pergrad.sq_norm(u, cfg.norm_method, cfg.norm_kernel)
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
