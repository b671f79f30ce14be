"""Fused mode: one pullback; each layer clips its own (layer-local) groups in its custom backward."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from dpzero_jax import clipping
from dpzero_jax import tape as tape_lib
from dpzero_jax.config import DPConfig
from dpzero_jax.layer_plan import (
    Plan,
    _Clipped,
    _group_sq,
    _keep,
    _leaf_ids,
)

Array = jax.Array


def _fused_local_clips(cfg: DPConfig, plan: Plan) -> dict[int, tape_lib.LocalClip]:
    calls_of_group = collections.defaultdict(set)
    for path, us in plan.uses.items():
        if len(us) > 1:
            raise ValueError(f"mode='fused' clips inside each layer, but parameter {path!r} is used by "
                             f"{len(us)} layer calls (tied weights); use mode='bk' or 'ghost'")
        calls_of_group[plan.group_of[path]].add(us[0][0])
    for group, calls in calls_of_group.items():
        if len(calls) > 1:
            raise ValueError(f"mode='fused' needs every clipping group inside one layer, but group "
                             f"{plan.group_names[group]!r} spans {len(calls)} layer calls; use groups='layer-wise' "
                             "or 'param-wise', or mode='bk' / 'ghost' / 'vmap'")

    def coefficients(norms, thresholds, keep):
        return clipping.coefficients(norms, thresholds, keep, cfg.clip_fn, cfg.gamma)

    clips = {}
    for record in plan.records:
        groups = [plan.group_of[path] for _, path in record.param_paths]
        local = list(dict.fromkeys(groups))
        clips[record.index] = tape_lib.LocalClip(tuple(local.index(g) for g in groups),
                                                 tuple(plan.thresholds[g] for g in local), coefficients)
    return clips


def _fused(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    clips = _fused_local_clips(cfg, plan)
    sinks = {r.index: jnp.zeros((plan.batch_size, len(r.names)), jnp.float32) for r in plan.records}
    keep = mask.astype(jnp.float32)

    def forward(params, sinks):
        fused = tape_lib.FusedTape(_leaf_ids(params), sinks, clips, keep, cfg.norm_method, cfg.norm_kernel, layout)
        with tape_lib.active(fused):
            return loss_fn(params, batch)

    losses, pullback = jax.vjp(forward, params, sinks)
    # An example with a non-finite loss gets a zero cotangent: its output gradients are zero (or non-finite, and
    # then its norms are), so it contributes nothing in any layer.
    clipped, sink_ct = pullback(jnp.where(jnp.isfinite(losses), 1.0, 0.0).astype(losses.dtype))
    sq = {path: sink_ct[r.index][:, j] for r in plan.records for j, (_, path) in enumerate(r.param_paths)}
    norms = jnp.sqrt(_group_sq(plan, sq))
    # The coefficients the layers applied. Each layer sees only its own groups, so an example whose norm is
    # non-finite in one group only (finite loss) is dropped from that group alone -- each group's contribution is
    # still bounded by its threshold. Such examples are counted in the statistics all the same.
    keep = _keep(losses, mask)
    coef = jnp.concatenate([clipping.coefficients(norms[:, m:m + 1], jnp.asarray(plan.thresholds[m:m + 1]), keep,
                                                  cfg.clip_fn, cfg.gamma) for m in range(norms.shape[1])], axis=1)
    return _Clipped(losses, clipped, norms, coef)
