"""The reference mode: per-example gradients by ``jax.vmap(jax.grad)``, ``microbatch_size`` examples at a time."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dpzero_jax import clipping, pergrad
from dpzero_jax.config import DPConfig
from dpzero_jax.layer_plan import (
    Plan,
    _Clipped,
    _keep,
    _microbatches,
)

Array = jax.Array


def one_example_loss(loss_fn: Callable) -> Callable:
    """``fn(params, example) -> scalar``: ``loss_fn(params, batch) -> [B]`` on a batch of one (the example given a
    leading axis of 1): how this mode -- and :func:`dpzero_jax.check_per_example_loss` -- evaluates one example."""
    def loss(params, example):
        return loss_fn(params, jax.tree.map(lambda x: x[None], example))[0]
    return loss


def _vmap(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    if layout is not None:
        raise ValueError("mode='vmap' differentiates the loss per example and needs whole parameters; it cannot "
                         "gather layer by layer (the explicit strategy gathers every weight first in this mode)")
    chunk = min(cfg.microbatch_size or plan.batch_size, plan.batch_size)
    chunks, chunk_mask, unsplit = _microbatches(batch, mask, chunk)
    leaves, treedef = jax.tree.flatten(params)
    leaf_groups = [plan.group_of[p] for p in plan.paths]
    thresholds = jnp.asarray(plan.thresholds)
    n_groups = len(plan.group_names)

    value_and_grads = jax.vmap(jax.value_and_grad(one_example_loss(loss_fn)), in_axes=(None, 0))

    def step(acc, inputs):
        examples, keep = inputs
        losses, grads = value_and_grads(params, examples)
        grad_leaves = jax.tree.leaves(grads)
        group_sq = jnp.zeros((chunk, n_groups), jnp.float32)
        for leaf, group in zip(grad_leaves, leaf_groups):
            group_sq = group_sq.at[:, group].add(jnp.sum(jnp.square(leaf.astype(jnp.float32)).reshape(chunk, -1), 1))
        norms = jnp.sqrt(group_sq)
        coef = clipping.coefficients(norms, thresholds, _keep(losses, keep), cfg.clip_fn, cfg.gamma)
        acc = [a + pergrad.weighted_sum([pergrad.Direct(g)], coef[:, group])
               for a, g, group in zip(acc, grad_leaves, leaf_groups)]
        return acc, (losses, norms, coef)

    init = [jnp.zeros(leaf.shape, jnp.float32) for leaf in leaves]
    acc, (losses, norms, coef) = jax.lax.scan(step, init, (chunks, chunk_mask))
    clipped = jax.tree.unflatten(treedef, [a.astype(leaf.dtype) for a, leaf in zip(acc, leaves)])
    return _Clipped(unsplit(losses), clipped, unsplit(norms), unsplit(coef))
