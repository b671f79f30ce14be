"""Fused mode: one pullback; each layer clips its own (layer-local) groups in its custom backward."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from dpzero_jax import clipping, pergrad, rules
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


# ---------------------------------------------------------------- the mode's tape

@dataclasses.dataclass(frozen=True)
class LocalClip:
    """Clipping of the groups that live inside one layer call (fused mode).

    ``group_of[j]``: local group of parameter ``j``; ``thresholds[k]``: threshold of local group ``k``;
    ``coefficients(norms [B, K], thresholds [K], keep [B]) -> [B, K]``.
    """

    group_of: tuple[int, ...]
    thresholds: tuple[float, ...]
    coefficients: Callable


def _fused_layer(rule, spec, names, method, kernel, clip: LocalClip, gather, scatter, trainable, frozen, x,
                 sink, keep):
    """``gather`` / ``scatter``: as in :func:`dpzero_jax.modes.ghost._ghost_layer`. The thresholds enter the
    ``custom_vjp`` as an argument (they may be traced: adaptive clipping), not through the backward's closure."""

    def forward(trainable, frozen, x, sink, keep, thresholds):
        return rule.apply({**frozen, **gather(trainable, x)}, x, spec)

    def forward_with_residuals(trainable, frozen, x, sink, keep, thresholds):
        y, saved = rules.forward_and_stored(rule, {**frozen, **gather(trainable, x)}, x, spec)
        return y, (trainable, frozen, saved, keep, thresholds)

    def backward(residuals, g):
        trainable, frozen, saved, keep, thresholds = residuals
        params = {**frozen, **gather(trainable, g)}
        uses = rule.per_example_grads(params, saved, g, spec)
        # the clipped gradient below is its own contraction: an instantiated gradient would serve the norm only
        sq = jnp.stack([pergrad.sq_norm([uses[n]], method, kernel, reuse=False) for n in names], axis=1)
        group_of = jnp.asarray(clip.group_of)
        n_local = len(clip.thresholds)
        group_sq = jnp.zeros((sq.shape[0], n_local), jnp.float32).at[:, group_of].add(sq)
        coef = clip.coefficients(jnp.sqrt(group_sq), thresholds, keep)
        grads = {n: pergrad.weighted_sum([uses[n]], coef[:, clip.group_of[j]], kernel).astype(trainable[n].dtype)
                 for j, n in enumerate(names)}
        return scatter(grads), None, rules.input_grad(rule, params, saved, g, spec), sq, None, None

    layer = jax.custom_vjp(forward)
    layer.defvjp(forward_with_residuals, backward)
    thresholds = jnp.stack([jnp.asarray(t, jnp.float32) for t in clip.thresholds])
    return layer(trainable, frozen, x, sink, keep, thresholds)


class FusedTape(tape_lib._Tape):
    def __init__(self, leaf_paths, sinks: Mapping[int, jax.Array], clips: Mapping[int, LocalClip], keep, method,
                 kernel: str = "xla", layout: tape_lib.ParamLayout | None = None):
        super().__init__(leaf_paths, layout)
        self.sinks, self.clips, self.keep, self.method, self.kernel = sinks, clips, keep, method, kernel

    def call(self, rule, spec, params, x):
        index = self._next()
        if index not in self.sinks:
            return rule.apply(params, x, spec)
        trainable, frozen, paths = self._split(params)
        return _fused_layer(rule, spec, tuple(trainable), self.method, self.kernel, self.clips[index],
                            self._gatherer(paths, rule, x), functools.partial(self._scatter, paths),
                            trainable, frozen, x, self.sinks[index], self.keep)


# ---------------------------------------------------------------- the mode


def _fused_local_clips(cfg: DPConfig, plan: Plan) -> dict[int, LocalClip]:
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
        clips[record.index] = LocalClip(tuple(local.index(g) for g in groups),
                                                 tuple(plan.thresholds[g] for g in local), coefficients)
    return clips


def _fused(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    clips = _fused_local_clips(cfg, plan)
    sinks = {r.index: jnp.zeros((plan.batch_size, len(r.names)), jnp.float32) for r in plan.records}
    keep = mask.astype(jnp.float32)

    def forward(params, sinks):
        fused = FusedTape(_leaf_ids(params), sinks, clips, keep, cfg.norm_method, cfg.norm_kernel, layout)
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
