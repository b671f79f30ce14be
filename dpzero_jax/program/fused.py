"""Fused clipping on the traced program: ONE pullback, each site clips its own group in its backward.

Book-keeping (:mod:`dpzero_jax.program.mode`) keeps every site's operands and output gradient until the norms are
known; ghost (:mod:`dpzero_jax.program.ghost`) keeps nothing but runs the backward twice (norms, then the clipped
sum), and under ``jax.checkpoint`` recomputes every block twice. When every clipping group is *local to one site*
the coefficient of an example in that group is known as soon as that site's output gradient is, so one backward
pass does it all:

* the site's equation is evaluated twice in the forward, ``y_data = f(stop_gradient(w), ops)`` (the data path:
  its value is the site's output) and ``y_weight = f(w, stop_gradient(ops'))`` (the weight path: its value is
  never used, so XLA drops it; only its linearisation in ``w`` is kept, whose transpose is the non-private weight
  gradient's contraction over examples and positions, at the same cost);
* both enter a ``jax.custom_vjp`` *tap* whose backward, per example (under ``jax.vmap``), computes the squared norm
  of the site's parameter gradient from what it holds -- the operands and the output gradient ``g``, by the ghost
  or instantiated form of the mixed rule (:func:`dpzero_jax.program.ghost.squared_norm`) -- the clip coefficient
  ``C = clip_fn(||grad||, R_m)`` of the site's group (``clipping.coefficients``; ``R_m`` enters as an argument, so
  thresholds given at call time work: adaptive clipping), and returns ``g`` to the data path and ``C g`` to the
  weight path. The transpose of ``vmap`` then sums ``C_i grad_i`` over the batch in the weight gradient's own
  contraction: no per-example parameter gradient is formed for the sum;
* the squared norm also goes out as the cotangent of a per-example scalar *sink* (for the statistics).

NaN safety: an example whose site operands are not all finite has them replaced by zeros on the weight path
(``ops'``) and its norm reported as NaN, so it gets ``C = 0`` and contributes exactly zero (never ``0 * NaN``);
the output gradient of an example with ``C = 0`` is selected away. The loss cotangent is 0 for a non-finite loss
(as in the layers' fused mode), and the mask enters the taps as a per-example ``keep``. As in the layers' fused
mode, an example with a finite loss but a non-finite norm in one group is dropped from that group only (each tap
sees only its own group; the per-group bound still holds).

Locality (:func:`local_groups`): a group is local when its trainable leaves meet the example's data at exactly one
site (one equation, not inside a ``scan``), or when all its leaves are fallback leaves (their per-example
gradients come out of the same pullback, through per-example copies, and are clipped after it). A group that spans
several sites -- tied weights, a layer-wise group of a kernel and its bias (two equations: ``dot`` then ``add``),
``all-layer`` -- or a site inside a ``scan`` is refused with the group's name: on the program front-end a stacked
leaf ``[L, ...]`` is ONE parameter path, so its group (param-wise: the leaf; layer-wise: its parent path) holds
all ``L`` iterations' gradients (book-keeping and ghost add the iterations' squared norms), and no iteration's
coefficient is known before the backward has run through all of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpzero_jax import clipping, pergrad, spmd
from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program.ghost import squared_norm
from dpzero_jax.program.interpret import run


def local_groups(plan) -> tuple[dict, dict]:
    """``({site path: group}, {group: [fallback leaves]})`` when every group is local (see the module doc); else a
    ``ValueError`` naming the first group that is not, and why."""
    analysis = plan.analysis
    site_groups: dict = {}
    fallback_groups: dict = {}
    for group, name in enumerate(plan.group_names):
        leaves = [i for i, path in enumerate(plan.paths) if plan.group_of[path] == group]
        group_sites = sorted((s for s in analysis.sites.values() if s.view.leaf in leaves), key=lambda s: s.path)
        fallback = [i for i in leaves if i in analysis.fallback]
        way_out = "use mode='bk' or 'ghost' (same clipped gradient)"
        if group_sites and fallback:
            raise ValueError(
                f"mode='fused' clips each group inside the backward of the one site where it meets the example's "
                f"data, but group {name!r} mixes parameters used at sites "
                f"({sorted({plan.paths[s.view.leaf] for s in group_sites})}) with per-example fallback parameters "
                f"({[plan.paths[i] for i in fallback]}); use groups='param-wise', or {way_out}")
        if len(group_sites) > 1:
            uses = ", ".join(f"{plan.paths[s.view.leaf]!r} at {s.eqn.primitive.name!r}" for s in group_sites[:4])
            if len(group_sites) > 4:
                uses += f" and {len(group_sites) - 4} more"
            tied = [plan.paths[i] for i in leaves if sum(s.view.leaf == i for s in group_sites) > 1]
            hint = (f" ({tied} used more than once: tied weights); {way_out}" if tied else
                    f". Use groups='param-wise' (a weight and its bias are two sites), or {way_out}")
            raise ValueError(
                f"mode='fused' needs every clipping group local to one site of the program, but group {name!r} "
                f"spans {len(group_sites)} sites: {uses}{hint}")
        if group_sites and group_sites[0].lengths:
            site = group_sites[0]
            raise ValueError(
                f"mode='fused' needs every clipping group local to one site, but group {name!r} is used inside a "
                f"scan ({' x '.join(map(str, site.lengths))} iterations): {plan.paths[site.view.leaf]!r} is one "
                f"parameter {'stacked over the iterations' if 'xs' in site.view.levels else 'shared by them'}, "
                f"its group holds every iteration's gradient, and no iteration's clip coefficient is known before "
                f"the backward has gone through all of them; {way_out}")
        if group_sites:
            site_groups[group_sites[0].path] = group
        elif fallback:
            fallback_groups[group] = fallback
    return site_groups, fallback_groups


# Sites whose parameter gradient does not depend on the values of the other operands (a bias, a shift, a class
# token): the tap keeps none of them, the weight path is linear in the parameter with no residual.
INPUT_FREE = frozenset({"add", "add_any", "sub", "concatenate"})


def _finite(ops):
    """``(ok, ops')``: whether every float operand is finite (a scalar) and the operands with their non-finite
    entries zeroed (integer operands unchanged)."""
    floats = [o for o in ops if jnp.issubdtype(o.dtype, jnp.inexact)]
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(o)) for o in floats])) if floats else jnp.asarray(True)
    return ok, [jnp.where(jnp.isfinite(o), o, jnp.zeros((), o.dtype)) if jnp.issubdtype(o.dtype, jnp.inexact)
                else o for o in ops]


def _fused_handler(method: str, clip_fn: str, gamma: float):
    """The site handler: the data path, the weight path and the tap (see the module doc). A site's input is
    ``(sink, keep, threshold)`` for this example."""
    def handler(site, invals, site_input, records):
        sink, keep, threshold = site_input
        w = invals[site.param_operand]
        ops = [invals[i] for i in site.recorded]
        y_data = sites_lib.apply_site(site, jax.lax.stop_gradient(w), ops)
        shapes = [(o.shape, o.dtype) for o in ops]
        if site.kind == "local" and site.eqn.primitive.name in INPUT_FREE:
            ok, held = jnp.asarray(True), []
            y_weight = sites_lib.apply_site(site, w, [jnp.zeros(shape, dtype) for shape, dtype in shapes])
        else:
            # The weight path and the norm see the operands with non-finite entries zeroed: an example with one
            # gets C = 0 (its norm is reported NaN), and 0 * NaN would not be 0 in the weight's contraction.
            ok, held = _finite([jax.lax.stop_gradient(o) for o in ops])
            y_weight = sites_lib.apply_site(site, w, held)

        @jax.custom_vjp
        def tap(y_data, y_weight, w, held, ok, sink, keep, threshold):
            if site.constant:   # no data enters: make the output (and so its cotangent) per example
                return y_data + (sink * 0.0).astype(y_data.dtype)
            return y_data

        def forward(y_data, y_weight, w, held, ok, sink, keep, threshold):
            return tap(y_data, y_weight, w, held, ok, sink, keep, threshold), (w, held, ok, keep, threshold)

        def backward(saved, g):
            w, held, ok, keep, threshold = saved
            values = held if held else [jnp.zeros(shape, dtype) for shape, dtype in shapes]
            sq = jnp.where(ok, squared_norm(site, method, w, values, g).astype(jnp.float32), jnp.nan)
            coef = clipping.coefficients(jnp.sqrt(sq).reshape(1, 1), jnp.reshape(threshold, (1,)),
                                         jnp.reshape(keep, (1,)), clip_fn, gamma)[0, 0]
            scaled = jnp.where(coef != 0, g * coef.astype(g.dtype), jnp.zeros((), g.dtype))
            return g, scaled, None, [None] * len(held), None, sq, None, None

        tap.defvjp(forward, backward)
        return [tap(y_data, y_weight, jax.lax.stop_gradient(w), held, ok, sink, keep, threshold)]
    return handler


def program_fused(cfg, plan, params, batch, mask):
    """``(losses [B], clipped sum like params (float32), norms [B, M], coef [B, M])``: one forward (``vmap`` over
    the examples inside one ``jax.vjp``), one pullback."""
    site_groups, fallback_groups = local_groups(plan)
    leaves, treedef = jax.tree.flatten(params)
    batch_leaves = jax.tree.leaves(batch)
    size = batch_leaves[0].shape[0]
    analysis = plan.analysis
    site_leaves = sorted({analysis.sites[p].view.leaf for p in site_groups})
    fallback = sorted(analysis.fallback)
    thresholds = jnp.asarray(plan.thresholds, jnp.float32)
    handler = _fused_handler(cfg.norm_method, cfg.clip_fn, cfg.gamma)

    def forward(trained, copies, sinks):
        values = list(leaves)
        for i, v in zip(site_leaves, trained):
            values[i] = v

        def one(copies_i, example, sinks_i, keep_i):
            local = list(values)
            for i, v in zip(fallback, copies_i):
                local[i] = v
            inputs = {path: (sinks_i[path], keep_i, thresholds[group]) for path, group in site_groups.items()}
            (loss,) = run(plan.closed.jaxpr, plan.closed.consts, local + list(example), analysis, inputs, {},
                          handler=handler)
            return loss
        return jax.vmap(one, spmd_axis_name=spmd.batch_axes(size))(copies, list(batch_leaves), sinks, mask)

    sinks = {path: jnp.zeros((size,), jnp.float32) for path in site_groups}
    copies = [jnp.broadcast_to(leaves[i], (size,) + leaves[i].shape) for i in fallback]
    losses, pullback = jax.vjp(forward, [leaves[i] for i in site_leaves], copies, sinks)
    # An example with a non-finite loss gets a zero cotangent: its output gradients are zero (or non-finite, and
    # then its norms are), so it contributes nothing at any site.
    sums, fallback_ct, sq_of_site = pullback(jnp.where(jnp.isfinite(losses), 1.0, 0.0).astype(losses.dtype))

    n_groups = len(plan.group_names)
    sq = [jnp.zeros((size,), jnp.float32)] * n_groups
    for path, group in site_groups.items():
        sq[group] = sq_of_site[path]
    per_example = dict(zip(fallback, fallback_ct))
    for group, members in fallback_groups.items():
        sq[group] = sum(jnp.sum(jnp.square(per_example[i].astype(jnp.float32)).reshape(size, -1), axis=1)
                        for i in members)
    norms = jnp.sqrt(jnp.stack(sq, axis=1))
    # The coefficients the taps applied, group by group (a non-finite norm drops the example from its group only).
    keep = jnp.logical_and(mask, jnp.isfinite(losses))
    coef = jnp.concatenate([clipping.coefficients(norms[:, m:m + 1], thresholds[m:m + 1], keep, cfg.clip_fn,
                                                  cfg.gamma) for m in range(n_groups)], axis=1)
    out = [jnp.zeros(leaf.shape, jnp.float32) for leaf in leaves]
    for i, value in zip(site_leaves, sums):
        out[i] = value.astype(jnp.float32)
    for group, members in fallback_groups.items():
        for i in members:
            out[i] = pergrad.weighted_sum([pergrad.Direct(per_example[i])], coef[:, group]).reshape(leaves[i].shape)
    return losses, jax.tree.unflatten(treedef, out), norms, coef
