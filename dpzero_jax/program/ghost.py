"""Ghost clipping on the traced program: norms from the backward pass itself, nothing kept per layer.

Book-keeping (:mod:`dpzero_jax.program.mode`) keeps every site's operands and output gradient until the norms are
known -- under ``jax.checkpoint`` that undoes the rematerialisation. The ghost mode keeps nothing:

1. **Norm pass.** Each eligible site becomes a ``jax.custom_vjp`` function of (the parameter view, the data
   operands, a scalar *sink*). Its forward is the equation; its backward returns the data cotangents as autodiff
   would, zero for the parameter, and for the sink the example's squared norm of the site's parameter gradient,
   computed right there from the operands and the output gradient (ghost or instantiated form by the mixed rule;
   local sites instantiate and map through the view's VJP). One VJP with respect to the sinks gives every norm; in
   a rematerialised block the operands are the recomputed ones.
2. **Sum pass.** Each eligible site becomes a ``custom_vjp`` whose backward scales the example's output gradient by
   its clip coefficient (examples with coefficient 0 selected away, so a NaN example contributes exactly zero)
   before the parameter's VJP; ``jax.grad`` of the summed losses, taken through ``jax.vmap``, then sums
   ``C_i grad_i`` over the batch in the same contractions as the non-private gradient.

Eligible: a leaf with exactly one site, not inside a scan that passes it whole (``"const"`` level: the iterations'
gradients would need cross terms). Other leaves -- tied weights, a weight shared across scan iterations -- are
captured as in book-keeping during the norm pass, and fallback leaves are differentiated per example as ever; both
are held constant in the sum pass and summed from what the norm pass kept.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpzero_jax.program import mode as bk
from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program.interpret import add_probe, bind, run


def eligible(plan) -> frozenset:
    """Site paths handled by the ghost custom VJPs."""
    count: dict[int, int] = {}
    for site in plan.analysis.sites.values():
        count[site.view.leaf] = count.get(site.view.leaf, 0) + 1
    return frozenset(path for path, site in plan.analysis.sites.items()
                     if count[site.view.leaf] == 1 and "const" not in site.view.levels)


def _assemble(site, w, ops):
    values, k = [], 0
    for i, var in enumerate(site.eqn.invars):
        if i == site.param_operand:
            values.append(w)
        elif i in site.recorded:
            values.append(ops[k])
            k += 1
        else:
            values.append(var.val)
    return values


def _apply(site, w, ops):
    return bind(site.eqn, _assemble(site, w, ops))[0]


def _use_ghost(method: str, positions: int, size: int) -> bool:
    if method == "ghost":
        return True
    if method == "instantiate":
        return False
    return 2 * positions ** 2 < size


def _squared_norm(site, method: str, w, ops, g):
    """One example's squared norm of the gradient of the site's leaf (slice), float32 scalar."""
    if site.kind == "dot":
        left, right, _, _ = sites_lib._dot_factors(site, ops[0], g)
        left, right = left.astype(jnp.float32), right.astype(jnp.float32)
        if _use_ghost(method, left.shape[1], left.shape[2] * right.shape[2]):
            return jnp.sum(jnp.einsum("ktr,ksr->kts", left, left) * jnp.einsum("ktc,ksc->kts", right, right))
        return jnp.sum(jnp.square(jnp.einsum("ktr,ktc->krc", left, right)))
    if site.kind == "gather":
        ids = ops[0].reshape(-1)
        table = site.eqn.invars[0].aval.shape
        right = g.reshape(ids.shape[0], math.prod(table[1:])).astype(jnp.float32)
        if _use_ghost(method, ids.shape[0], math.prod(table)):
            return jnp.sum((ids[:, None] == ids[None, :]) * (right @ right.T))
        return jnp.sum(jnp.square(jnp.zeros((table[0], right.shape[1]), jnp.float32).at[ids].add(right)))
    _, pullback = jax.vjp(lambda w_: _apply(site, w_, ops), w)
    (view_grad,) = pullback(g)
    base_shape = site.view.chain[0].invars[0].aval.shape if site.view.chain else w.shape
    _, to_base = jax.vjp(lambda b: sites_lib.replay_chain(site, b, skip_casts=True).astype(jnp.float32),
                         jnp.zeros(base_shape, jnp.float32))
    (leaf_grad,) = to_base(view_grad.astype(jnp.float32))
    return jnp.sum(jnp.square(leaf_grad))


def _data_cotangents(site, w, ops, g):
    floats = [i for i, o in enumerate(ops) if jnp.issubdtype(o.dtype, jnp.inexact)]
    out = [None] * len(ops)
    if floats:
        def of_floats(*values):
            full = list(ops)
            for i, v in zip(floats, values):
                full[i] = v
            return _apply(site, w, full)
        _, pullback = jax.vjp(of_floats, *[ops[i] for i in floats])
        for i, ct in zip(floats, pullback(g)):
            out[i] = ct
    return out


def _norm_handler(ghost_paths: frozenset, method: str):
    def handler(site, invals, site_input, records):
        if site.path not in ghost_paths:
            return add_probe(site, invals, site_input, records)
        w = invals[site.param_operand]
        ops = [invals[i] for i in site.recorded]

        @jax.custom_vjp
        def with_sink(w, ops, sink):
            return _apply(site, w, ops)

        def forward(w, ops, sink):
            return _apply(site, w, ops), (w, ops)

        def backward(saved, g):
            w, ops = saved
            return (jnp.zeros_like(w), _data_cotangents(site, w, ops, g),
                    _squared_norm(site, method, w, ops, g).astype(jnp.float32))

        with_sink.defvjp(forward, backward)
        return [with_sink(w, ops, site_input)]
    return handler


def _sum_handler(ghost_paths: frozenset):
    def handler(site, invals, scale, records):
        w = invals[site.param_operand]
        if site.path not in ghost_paths:
            frozen = list(invals)
            frozen[site.param_operand] = jax.lax.stop_gradient(w)
            return bind(site.eqn, frozen)
        ops = [invals[i] for i in site.recorded]

        @jax.custom_vjp
        def scaled(w, ops, scale):
            return _apply(site, w, ops)

        def forward(w, ops, scale):
            return _apply(site, w, ops), (w, ops, scale)

        def backward(saved, g):
            w, ops, scale = saved
            keep = scale != 0
            g_kept = jnp.where(keep, g * scale.astype(g.dtype), jnp.zeros((), g.dtype))
            ops_kept = [jnp.where(keep, o, jnp.zeros((), o.dtype)) if jnp.issubdtype(o.dtype, jnp.inexact) else o
                        for o in ops]
            _, pullback = jax.vjp(lambda w_: _apply(site, w_, ops_kept), w)
            (w_grad,) = pullback(g_kept)
            return w_grad, _data_cotangents(site, w, ops, g), jnp.zeros_like(scale)

        scaled.defvjp(forward, backward)
        return [scaled(w, ops, scale)]
    return handler


def _sink(site):
    return jnp.zeros(tuple(site.lengths), jnp.float32)


def program_ghost(cfg, plan, params, batch, mask):
    """``(losses [B], clipped sum like params (float32), norms [B, M], coef [B, M])``, two pullbacks."""
    leaves, treedef = jax.tree.flatten(params)
    batch_leaves = jax.tree.leaves(batch)
    size = batch_leaves[0].shape[0]
    ghost_paths = eligible(plan)

    def site_input(site):
        return _sink(site) if site.path in ghost_paths else bk.zero_probe(site)

    losses, records, cotangents, fallback_ct = bk._pass(plan, leaves, batch_leaves,
                                                         _norm_handler(ghost_paths, cfg.norm_method), site_input)
    ghost_leaves = {plan.analysis.sites[p].view.leaf for p in ghost_paths}
    captured = {s.view.leaf for s in plan.analysis.sites.values()} - ghost_leaves
    terms = bk._leaf_terms(plan, leaves, records, cotangents, fallback_ct, captured)
    sq, summers = bk.norms_and_summers(cfg, plan, leaves, terms, size)
    for path in ghost_paths:
        site = plan.analysis.sites[path]
        sq[site.view.leaf] = jnp.sum(cotangents[path].reshape(size, -1), axis=1)
    norms, coef = bk.coefficients(cfg, plan, sq, losses, mask, size)

    differentiated = sorted(ghost_leaves)
    scales = {}
    for path, site in plan.analysis.sites.items():
        column = coef[:, plan.group_of[plan.paths[site.view.leaf]]].reshape((size,) + (1,) * len(site.lengths))
        scales[path] = jnp.broadcast_to(column, (size,) + tuple(site.lengths))
    frozen = [jax.lax.stop_gradient(leaf) for leaf in leaves]

    def summed_losses(trained):
        values = list(frozen)
        for i, v in zip(differentiated, trained):
            values[i] = v

        def one(example, site_scales):
            (loss,) = run(plan.closed.jaxpr, plan.closed.consts, values + list(example), plan.analysis, site_scales,
                          {}, handler=_sum_handler(ghost_paths))
            return loss
        return jnp.sum(jax.vmap(one)(list(batch_leaves), scales))

    ghost_sums = jax.grad(summed_losses)([leaves[i] for i in differentiated]) if differentiated else []
    sums = dict(zip(differentiated, ghost_sums))
    out = []
    for i, leaf in enumerate(leaves):
        if i in sums:
            out.append(sums[i].astype(jnp.float32))
        elif i in summers:
            out.append(summers[i](coef[:, plan.group_of[plan.paths[i]]]).reshape(leaf.shape).astype(jnp.float32))
        else:
            out.append(jnp.zeros(leaf.shape, jnp.float32))
    return losses, jax.tree.unflatten(treedef, out), norms, coef
