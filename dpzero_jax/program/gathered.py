"""The non-private step and a forward pass on ZeRO-3 shards, for any JAX model (the explicit strategy's
counterparts of :mod:`dpzero_jax.program.zero3`'s private step): the traced program interpreted with each sharded
leaf gathered at its uses and again in the backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import spmd
from dpzero_jax.layer_plan import leaf_paths, whole_shapes
from dpzero_jax.program import zero3
from dpzero_jax.program.analyze import CALLS, Analysis, _sub_jaxpr
from dpzero_jax.program.interpret import bind, run
from dpzero_jax.program.mode import trace


def mean_gradient_sum(loss_fn, params, batch, mask, layout):
    """The non-private counterpart on ZeRO-3 shards, for any model: ``(losses [B], sum of the masked examples'
    gradients)``, each sharded leaf gathered at its uses (:mod:`dpzero_jax.program.zero3`) and its gradient
    reduce-scattered to its owner by autodiff of the gather; ``params`` are this device's shards."""
    paths = leaf_paths(params)
    leaves, treedef = jax.tree.flatten(params)
    closed, analysis, _ = trace(loss_fn, whole_shapes(params, layout), batch)
    site_inputs = {path: None for path in analysis.sites}
    consts = zero3.held_consts(closed.consts, layout)   # frozen variables' shards, as the leaves'

    def plain(site, invals, _, records):
        return bind(site.eqn, invals)

    def total(leaves):
        held = zero3.held(paths, leaves, layout)

        def one(example):
            (loss,) = run(closed.jaxpr, consts, held + list(example), analysis, site_inputs, {}, handler=plain)
            return loss
        losses = jax.vmap(one, spmd_axis_name=spmd.batch_axes(mask.shape[0]))(jax.tree.leaves(batch))
        return jnp.sum(jnp.where(mask, losses, 0.0)), losses

    grads, losses = jax.grad(total, has_aux=True)(leaves)
    return losses, jax.tree.unflatten(treedef, grads)


def gathered_apply(apply_fn, params, inputs, layout):
    """``apply_fn(params, inputs)`` (any JAX function, e.g. a batched forward) on ZeRO-3 shards: the traced program
    with each sharded leaf gathered at its uses (:mod:`dpzero_jax.program.zero3`), scans and calls entered (a leaf
    stacked over a scan gathered one iteration at a time)."""
    paths = leaf_paths(params)
    leaves = jax.tree.leaves(params)
    input_leaves, input_treedef = jax.tree.flatten(inputs)
    whole = whole_shapes(params, layout)

    structure = {}

    def flat(params, input_leaves):
        out, structure["out"] = jax.tree.flatten(apply_fn(params, jax.tree.unflatten(input_treedef, input_leaves)))
        return out

    closed = jax.make_jaxpr(flat)(whole, [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
                                          for x in input_leaves])
    analysis = Analysis(containers=set(_calls(closed.jaxpr)))
    consts = zero3.held_consts(closed.consts, layout)
    outs = run(closed.jaxpr, consts, zero3.held(paths, leaves, layout) + input_leaves, analysis, {}, {})
    return jax.tree.unflatten(structure["out"], outs)


def _calls(jaxpr, path: tuple = ()):
    """Paths of every scan and call-like equation (entered by the interpreter)."""
    for index, eqn in enumerate(jaxpr.eqns):
        here = path + (index,)
        if eqn.primitive.name == "scan" or eqn.primitive.name in CALLS:
            yield here
            yield from _calls(eqn.params["jaxpr"].jaxpr if eqn.primitive.name == "scan" else _sub_jaxpr(eqn)[0],
                              here)
