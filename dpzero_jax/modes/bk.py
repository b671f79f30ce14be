"""Book-keeping mode: one backward pass to the layer outputs (no parameter gradients by autodiff); norms and
clipped sums from the captured layer inputs and output gradients, ``microbatch_size`` examples at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import clipping, pergrad
from dpzero_jax import tape as tape_lib
from dpzero_jax.config import DPConfig
from dpzero_jax.layer_plan import (
    Plan,
    _assemble,
    _batch_size,
    _Clipped,
    _group_sq,
    _keep,
    _leaf_ids,
    _microbatches,
    _per_example_uses,
    _scatter,
)

Array = jax.Array


def bk_forward(loss_fn, plan: Plan, params, leaf_ids, batch, layout=None):
    """The book-keeping forward on one (micro)batch: ``(losses [b], pullback, calls)``.

    ``pullback`` maps a loss cotangent to the output gradients of the trainable layer calls (its residuals and
    ``calls[index] = (layer input or None, layer params)`` are everything book-keeping keeps from the forward).
    """
    size = _batch_size(batch)
    probes = {r.index: jnp.zeros((size,) + r.output_shape[1:], r.output_dtype) for r in plan.records}

    def forward(probes):
        capture = tape_lib.CaptureTape(leaf_ids, probes, layout=layout)
        with tape_lib.active(capture):
            losses = loss_fn(params, batch)
        return losses, capture.calls

    return jax.vjp(forward, probes, has_aux=True)


def _bk_chunk(loss_fn, cfg: DPConfig, plan: Plan, params, leaf_ids, batch, mask, layout=None):
    """Book-keeping on one (micro)batch: ``(losses [b], {path: clipped sum}, norms [b, M], coef [b, M])``."""
    losses, pullback, calls = bk_forward(loss_fn, plan, params, leaf_ids, batch, layout)
    (output_grads,) = pullback(jnp.ones_like(losses))
    uses = _per_example_uses(plan, calls, output_grads, plan.uses, layout)
    kernel = cfg.norm_kernel
    if kernel == "pallas":
        # The kernels never hold a per-example gradient: norms and clipped sums are separate tiled passes.
        sq = {path: pergrad.sq_norm(u, cfg.norm_method, kernel) for path, u in uses.items()}
        instantiated = {}
    else:
        # Where a parameter's norm is computed by instantiation, the instantiated per-example gradient is kept and
        # reused for the clipped sum (no second contraction).
        # (in cfg.instantiated_dtype: the norm is taken after rounding, so what is summed is what is clipped)
        kept_and_sq = {path: pergrad.kept_sum_and_sq_norm(u, cfg.instantiated_dtype)
                       for path, u in uses.items() if not pergrad.use_ghost(u, cfg.norm_method)}
        instantiated = {path: value for path, (value, _) in kept_and_sq.items()}
        sq = {path: kept_and_sq[path][1] if path in kept_and_sq else pergrad.sq_norm(u, "ghost")
              for path, u in uses.items()}
    norms = jnp.sqrt(_group_sq(plan, sq))
    coef = clipping.coefficients(norms, jnp.asarray(plan.thresholds), _keep(losses, mask), cfg.clip_fn, cfg.gamma)
    grads = {path: (pergrad.weighted_sum([pergrad.Direct(instantiated[path])], coef[:, plan.group_of[path]])
                    .reshape(pergrad.param_shape(u[0])) if path in instantiated
                    else pergrad.weighted_sum(u, coef[:, plan.group_of[path]], kernel)) for path, u in uses.items()}
    return losses, _scatter(layout, grads), norms, coef


def _bk(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    leaf_ids = _leaf_ids(params)
    chunk = cfg.microbatch_size or plan.batch_size
    if chunk >= plan.batch_size:
        losses, grads, norms, coef = _bk_chunk(loss_fn, cfg, plan, params, leaf_ids, batch, mask, layout)
        return _Clipped(losses, _assemble(params, grads), norms, coef)
    chunks, chunk_mask, unsplit = _microbatches(batch, mask, chunk)

    def step(acc, inputs):  # with a layout each microbatch's sums go to their owners (no whole-size accumulator)
        losses, grads, norms, coef = _bk_chunk(loss_fn, cfg, plan, params, leaf_ids, *inputs, layout)
        return {path: acc[path] + grads[path] for path in acc}, (losses, norms, coef)

    init = {path: jnp.zeros(np.shape(leaf), jnp.float32)
            for path, leaf in zip(plan.paths, jax.tree.leaves(params)) if path in plan.uses}
    acc, (losses, norms, coef) = jax.lax.scan(step, init, (chunks, chunk_mask))
    return _Clipped(unsplit(losses), _assemble(params, acc), unsplit(norms), unsplit(coef))
