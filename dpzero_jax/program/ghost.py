"""Ghost clipping on the traced program: norms from the backward pass itself, nothing kept per layer.

Book-keeping (:mod:`dpzero_jax.program.mode`) keeps every site's operands and output gradient until the norms are
known -- under ``jax.checkpoint`` that undoes the rematerialisation. The ghost mode keeps nothing:

Each eligible site is evaluated twice -- a *data path* (the parameter under ``stop_gradient``) and a *weight
path* (the operands under ``stop_gradient``, non-finite entries zeroed; its forward value is unused and compiled
away) -- joined by a ``jax.custom_vjp`` *tap* of (data path, weight path, parameter view, operands, a scalar *sink*)
with two outputs: the data path's value and a zero scalar *port*. The batch runs once forward (``jax.vmap`` of the
single-example program inside one ``jax.vjp``), then two pullbacks:

1. **Norms** (port cotangent 0): each tap's backward passes the output gradient to the data path (the data
   cotangents are autodiff's) and, for the sink, the example's squared norm of the site's parameter gradient,
   computed right there from the operands and the output gradient (ghost or instantiated form by the norm rule;
   local sites instantiate and map through the view's VJP); in a rematerialised block the operands are the
   recomputed ones.
2. **Clipped sum** (port cotangent = the example's clip coefficient): the tap passes the output gradient scaled
   by it (examples with coefficient 0 selected away, so a NaN example contributes exactly zero) to the weight path,
   whose transpose under ``vmap`` sums ``C_i grad_i`` over the batch in the same contractions as the non-private
   gradient. (Returning the parameter's gradient from the tap itself would make it per example: GPT-2 W1's step
   took 3.6x the non-private step that way, 1.2x now.) Inside a ``remat`` region the tap does return it (one
   ``custom_vjp`` of view, operands and sink): the weight path's copy of the operands with non-finite entries
   zeroed would be kept besides them (a 12-layer scanned ``nn.remat`` decoder: temporaries 1.11x the non-private
   step's, against 1.07x).

Eligible: a leaf with exactly one site, not inside a scan that passes it whole (``"const"`` level: the iterations'
gradients would need cross terms), that takes the example's data (not a lookup at constant indices). A leaf whose
norm needs cross terms between its uses -- tied weights (an embedding and its LM head), a weight shared across scan
iterations -- but whose sites are all ``dot`` / ``gather`` with data and outside ``remat`` is *weighted* where that
holds less memory than book-keeping it (:func:`weighted`): its sites
are captured as in book-keeping (operands and output gradient kept, the norm with every cross term formed after the
first pullback) and also carry the weight path and a port, so that its clipped sum, too, comes from the second
pullback in the non-private gradient's contractions. Nothing is kept for the sum, so the norm is taken in float32
and the time rule (``norm_method="fastest"``) counts an instantiation's own contraction (``pergrad.use_ghost`` with
``reuse=False``): book-kept, GPT-2 XL's tied table on a TPU chip held two float32 ``[V, d]`` buffers (its
per-example gradient and clipped sum) that the non-private step does not have. Other leaves -- a position table,
a scale or shift of a leaf used several times, tied weights inside ``remat`` or where book-keeping holds less --
are captured as in book-keeping,
and fallback leaves are differentiated per example (per-example copies); both are summed from what the first
pullback gave.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpzero_jax import pergrad, spmd
from dpzero_jax.program import conv, explanation, zero3
from dpzero_jax.program import mode as bk
from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program.analyze import view_size
from dpzero_jax.program.interpret import add_probe, run


def eligible(plan) -> frozenset:
    """Site paths handled by the ghost custom VJPs."""
    count: dict[int, int] = {}
    for site in plan.analysis.sites.values():
        count[site.view.leaf] = count.get(site.view.leaf, 0) + 1
    # A site without data (a lookup at constant indices) has an output that vmap does not batch: the cotangent
    # reaching its custom backward would be the batch's sum. Captured as in book-keeping (a per-example probe).
    return frozenset(path for path, site in plan.analysis.sites.items()
                     if count[site.view.leaf] == 1 and "const" not in site.view.levels and not site.constant)


def weighted(plan, ghost_paths: frozenset, cfg, size: int) -> frozenset:
    """Leaves (indices) that are not ghost-eligible and whose clipped sum the weight path forms: every site a
    ``dot`` or ``gather`` that takes the example's data, none inside a ``remat`` region (there the weight path's
    operand copy would be kept besides the records), and the weight path the smaller in memory (:func:`_saves_memory`)
    for ``size`` examples per device."""
    by_leaf: dict[int, list] = {}
    for path, site in plan.analysis.sites.items():
        by_leaf.setdefault(site.view.leaf, []).append((path, site))
    return frozenset(leaf for leaf, uses in by_leaf.items()
                     if all(path not in ghost_paths and site.kind in ("dot", "gather") and not site.constant
                            and not plan.analysis.in_remat(path) for path, site in uses)
                     and _saves_memory([site for _, site in uses], cfg, size))


def _saves_memory(leaf_sites, cfg, size: int) -> bool:
    """Whether summing a leaf by the weight path holds fewer bytes per device than book-keeping it (``B``: examples
    per device, ``n``: the leaf's size). Book-kept: the float32 clipped sum, ``4 n`` (formed whole), and the
    instantiated per-example gradients if the rule with reuse instantiates, ``B n`` in ``instantiated_dtype``.
    Weighted: each site's output gradient scaled by the coefficients in the second pullback, ``B x`` its output at
    its own precision (the TPU compiler does not fold the scaling into the contraction), and ``4 B n`` if the rule
    without reuse instantiates (for the norm alone). Compiled for a v5e chip: GPT-2 XL's tied table at one example
    per chip (T 1024) is weighted -- the ghost step's temporaries from 1.59x to 0.96x the non-private step's
    allocation -- while GPT-2 small's at 8 per chip stays book-kept (weighted: 12.1-12.9 GiB against 10.4 by
    ``memory_analysis()``)."""
    n = view_size(leaf_sites[0]) * math.prod(sites_lib.xs_lengths(leaf_sites[0]))   # the leaf's size
    kernel = "pallas" if cfg.norm_kernel == "pallas" else "xla"

    def instantiated(reuse: bool) -> bool:
        return explanation.factored_form(leaf_sites, cfg.norm_method, kernel, n, reuse=reuse,
                                         kept_dtype=cfg.instantiated_dtype)[0] == "instantiate"
    kept = 4 * n + (jnp.dtype(cfg.instantiated_dtype).itemsize * size * n if instantiated(True) else 0)
    scaled = sum(size * math.prod(s.out_aval.shape) * s.out_aval.dtype.itemsize for s in leaf_sites)
    return scaled + (4 * size * n if instantiated(False) else 0) < kept


def squared_norm(site, method: str, w, ops, g):
    """One example's squared norm of the gradient of the site's leaf (slice), float32 scalar."""
    if site.kind == "dot" or (site.kind == "conv" and sites_lib.conv_factored([site], method, reuse=False)):
        if site.kind == "dot":
            left, right, _, _ = sites_lib._dot_factors(site, ops[0], g)
            # book-keeping's rule, counting an instantiation's own contraction: the sum never reuses it here (nor
            # in fused mode's taps, which return C g to the weight path)
            ghost = conv.use_ghost(method, left.shape[1], left.shape[2], right.shape[2], reuse=False)
        else:   # unfolded only for the ghost norm; an instantiated kernel comes from the VJP below
            left, right = conv.factors(site.eqn, ops[0], g)
            ghost = True
        left, right = left.astype(jnp.float32), right.astype(jnp.float32)
        if ghost:
            return jnp.sum(jnp.einsum("ktr,ksr->kts", left, left) * jnp.einsum("ktc,ksc->kts", right, right))
        return jnp.sum(jnp.square(jnp.einsum("ktr,ktc->krc", left, right)))
    if site.kind == "gather":
        ids = ops[0].reshape(-1)
        table = site.eqn.invars[0].aval.shape
        right = g.reshape(ids.shape[0], math.prod(table[1:])).astype(jnp.float32)
        if pergrad.space_rule(method, ids.shape[0], math.prod(table)):
            return jnp.sum((ids[:, None] == ids[None, :]) * (right @ right.T))
        return jnp.sum(jnp.square(jnp.zeros((table[0], right.shape[1]), jnp.float32).at[ids].add(right)))
    return jnp.sum(jnp.square(sites_lib.base_grad(site, w, ops, g, sites_lib.base_shape(site))))


def _remat_tap(site, w, ops, sink, method: str, view32=None):
    """A ghost site inside a ``remat`` region: one ``custom_vjp`` of (view, operands, sink) whose backward returns
    the data cotangents, the sink's squared norm and the parameter gradient scaled by the port's cotangent, formed per
    example (``[B, *shape]`` under ``vmap`` before the sum: slower than the weight path below, but nothing of the
    block is kept beyond what the rematerialised backward recomputes -- the weight path's operand copy would be).
    ``view32``: the float32 view of a narrowed float32 leaf (:func:`~dpzero_jax.program.sites.float32_view`): the
    tap takes it instead of ``w`` (its value cast back is ``w``), and returns the gradient in float32."""
    narrow = None if view32 is None else w.dtype

    @jax.custom_vjp
    def with_port(w, ops, sink):
        return sites_lib.apply_site(site, w if narrow is None else w.astype(narrow), ops), sink * 0.0

    def forward(w, ops, sink):
        return with_port(w, ops, sink), (w, ops)

    def backward(saved, cotangents):
        w, ops = saved
        g, coef = cotangents
        # a zero coefficient selects the gradient away and non-finite entries are zeroed, as on the weight path
        _, ops_kept = sites_lib.finite_operands(ops)
        if narrow is None:
            g_kept = sites_lib.scaled(g, coef)
            _, pullback = jax.vjp(lambda w_: sites_lib.apply_site(site, w_, ops_kept), w)
        else:
            g_kept = sites_lib.scaled(g, coef, jnp.float32)
            _, pullback = jax.vjp(lambda w_: sites_lib.apply_site_float32(site, w_, ops_kept), w)
            w = w.astype(narrow)
        floats = [i for i, o in enumerate(ops) if jnp.issubdtype(o.dtype, jnp.inexact)]   # ids get no cotangent
        data = [None] * len(ops)

        def of_floats(*values):
            full = list(ops)
            for i, v in zip(floats, values):
                full[i] = v
            return sites_lib.apply_site(site, w, full)
        if floats:
            _, data_pullback = jax.vjp(of_floats, *[ops[i] for i in floats])
            for i, ct in zip(floats, data_pullback(g)):
                data[i] = ct
        return pullback(g_kept)[0], data, squared_norm(site, method, w, ops, g).astype(jnp.float32)

    with_port.defvjp(forward, backward)
    return with_port(w if view32 is None else view32, ops, sink)


def _port_key(path: tuple) -> tuple:
    """The records key of a weighted site's port: beside the site's records, and sortable with the sites' paths
    (pytree dictionaries sort their keys; no equation index is negative)."""
    return path + (-1,)


def _weighted_site(site, invals, site_input, records, view32=None):
    """A site of a weighted leaf: book-keeping's probe and records on the data path (the parameter under
    ``stop_gradient``), the weight path beside it, joined by a tap whose backward passes the output gradient to the
    data path (and so to the probe) and the gradient scaled by the port's cotangent to the weight path.
    ``site_input`` is ``(probe, sink)``; the port is recorded under :func:`_port_key`."""
    probe, sink = site_input
    w = invals[site.param_operand]
    ops = [invals[i] for i in site.recorded]
    records[site.path] = list(jax.lax.optimization_barrier(ops))   # as add_probe: the forward's values, kept
    y_data, _, _, y_weight = sites_lib.data_and_weight_paths(site, w, ops, view32)
    y_data = y_data + probe.astype(y_data.dtype)
    weight_dtype = y_weight.dtype

    @jax.custom_vjp
    def tap(y_data, y_weight, sink):
        return y_data, sink * 0.0

    def forward(y_data, y_weight, sink):
        return tap(y_data, y_weight, sink), None

    def backward(_, cotangents):
        g, coef = cotangents
        return g, sites_lib.scaled(g, coef, weight_dtype), jnp.zeros_like(coef)

    tap.defvjp(forward, backward)
    out, records[_port_key(site.path)] = tap(y_data, y_weight, sink)
    return [out]


def _ghost_handler(ghost_paths: frozenset, method: str, in_remat: frozenset = frozenset(),
                   weighted_paths: frozenset = frozenset()):
    """Book-keeping's probe for captured sites; for ghost sites the equation twice -- the *data path* (the parameter
    under ``stop_gradient``) and the *weight path* (the operands under ``stop_gradient``, non-finite entries
    zeroed) -- joined by a ``custom_vjp`` *tap* that outputs the data path's value and a zero *port*. Its backward
    passes the output gradient to the data path, the gradient scaled by the port's cotangent (the example's clip
    coefficient) to the weight path, and the example's squared norm to the sink. The weight path is
    differentiated by autodiff under the per-example ``vmap``, whose transpose contracts the examples in the same
    operation as the non-private gradient (a parameter gradient returned per example from the tap would be
    instantiated ``[B, *shape]`` and then summed); its forward value is unused and compiled away."""
    def handler(site, invals, site_input, records, view32=None):
        if site.path in weighted_paths:
            return _weighted_site(site, invals, site_input, records, view32)
        if site.path not in ghost_paths:
            return add_probe(site, invals, site_input, records)
        w = invals[site.param_operand]
        ops = [invals[i] for i in site.recorded]
        if site.path in in_remat:
            out, records[site.path] = _remat_tap(site, w, ops, site_input, method, view32)
            return [out]
        y_data, ok, held, y_weight = sites_lib.data_and_weight_paths(site, w, ops, view32)
        weight_dtype = y_weight.dtype

        @jax.custom_vjp
        def tap(y_data, y_weight, w, held, ok, sink):
            # The port is computed from the per-example sink so that, under vmap, it is per-example too (a constant
            # port would be one value for the batch, and its cotangent the batch's sum of coefficients).
            return y_data, sink * 0.0

        def forward(y_data, y_weight, w, held, ok, sink):
            return tap(y_data, y_weight, w, held, ok, sink), (w, held, ok)

        def backward(saved, cotangents):
            w, held, ok = saved
            g, coef = cotangents
            # Pullback 1 (port cotangent 0) uses only the sink's cotangent, pullback 2 only the weight path's: under
            # jit the other one is dead code. An example with a non-finite operand has its norm reported NaN (and
            # so the coefficient 0); a zero coefficient selects its gradient away (never NaN * 0).
            sq = jnp.where(ok, squared_norm(site, method, w, held, g).astype(jnp.float32), jnp.nan)
            return g, sites_lib.scaled(g, coef, weight_dtype), None, [None] * len(held), None, sq

        tap.defvjp(forward, backward)
        out, port = tap(y_data, y_weight, jax.lax.stop_gradient(w), held, ok, site_input)
        records[site.path] = port
        return [out]
    handler.float32_views = True   # the interpreter passes each site's float32 view (sites.float32_view)
    return handler


def _sink(site):
    return jnp.zeros(tuple(site.lengths), jnp.float32)


def program_ghost(cfg, plan, params, batch, mask, layout=None):
    """``(losses [B], clipped sum like params (float32), norms [B, M], coef [B, M])``: one forward (``vmap`` over
    the examples inside one ``jax.vjp``), two pullbacks. With a ZeRO-3 ``layout``: on the shards, gathered at
    each use (:mod:`dpzero_jax.program.zero3`); every sum comes back in its owner's layout."""
    leaves, treedef = jax.tree.flatten(params)
    batch_leaves = jax.tree.leaves(batch)
    size = batch_leaves[0].shape[0]
    analysis = plan.analysis
    ghost_paths = eligible(plan)
    weighted_leaves = weighted(plan, ghost_paths, cfg, spmd.examples_per_device(size))
    weighted_paths = frozenset(p for p, s in analysis.sites.items() if s.view.leaf in weighted_leaves)
    ported = ghost_paths | weighted_paths
    trained_leaves = sorted({analysis.sites[p].view.leaf for p in ported})
    fallback = sorted(analysis.fallback)
    handler = _ghost_handler(ghost_paths, cfg.norm_method,
                             frozenset(filter(analysis.in_remat, ghost_paths)), weighted_paths)
    consts = zero3.held_consts(plan.closed.consts, layout)   # frozen variables' shards, as the leaves'

    def per_example(values, example, site_inputs):
        records: dict = {}
        (loss,) = run(plan.closed.jaxpr, consts, values + list(example), analysis, site_inputs, records,
                      handler=handler)
        ports = {p: records.pop(p) for p in ghost_paths}
        ports.update({p: records.pop(_port_key(p)) for p in weighted_paths})
        return (loss, ports), records

    held = zero3.held(plan.paths, leaves, layout)

    def forward(trained, copies, site_inputs):
        values = list(held)
        for i, v in zip(trained_leaves, trained):
            values[i] = zero3.hold(plan.paths[i], v, layout)

        def one(copies_i, example, inputs_i):
            local = list(values)
            for i, v in zip(fallback, copies_i):
                local[i] = v
            return per_example(local, example, inputs_i)
        return jax.vmap(one, in_axes=(0, 0, 0), spmd_axis_name=spmd.batch_axes(size))(copies, list(batch_leaves),
                                                                                 site_inputs)

    def batched(x):
        return jnp.broadcast_to(x, (size,) + x.shape)

    site_inputs = {path: batched(_sink(site)) if path in ghost_paths else
                   (batched(bk.zero_probe(site)), batched(_sink(site))) if path in weighted_paths else
                   batched(bk.zero_probe(site)) for path, site in analysis.sites.items()}
    copies = [jnp.broadcast_to(w, (size,) + w.shape) for w in (zero3.materialise(held[i]) for i in fallback)]
    (losses, ports), pullback, records = jax.vjp(forward, [leaves[i] for i in trained_leaves], copies, site_inputs,
                                                 has_aux=True)
    ones = jnp.ones_like(losses)
    _, fallback_ct, cotangents = pullback((ones, jax.tree.map(jnp.zeros_like, ports)))
    cotangents.update({path: cotangents[path][0] for path in weighted_paths})     # the probes' cotangents

    captured = {s.view.leaf for s in analysis.sites.values()} - set(trained_leaves)
    whole = bk.whole_leaves(plan, leaves, layout, cotangents)
    terms = bk._leaf_terms(plan, whole, records, cotangents, fallback_ct, captured | weighted_leaves,
                           method=cfg.norm_method)
    split = zero3.tables(plan.paths, leaves, layout)
    sq, summers = bk.norms_and_summers(cfg, plan, whole, {i: t for i, t in terms.items() if i not in weighted_leaves},
                                       size, layout=split)
    # weighted leaves: normed as they are summed, in float32 (not in instantiated_dtype), nothing kept
    sq.update(bk.norms_and_summers(cfg, plan, whole, {i: t for i, t in terms.items() if i in weighted_leaves}, size,
                                   reuse=False)[0])
    for path in ghost_paths:
        sq[analysis.sites[path].view.leaf] = jnp.sum(cotangents[path].reshape(size, -1), axis=1)
    norms, coef = bk.coefficients(cfg, plan, sq, losses, mask, size)

    port_ct = {path: jnp.broadcast_to(coef[:, plan.group_of[plan.paths[analysis.sites[path].view.leaf]]].reshape(
        (size,) + (1,) * (ports[path].ndim - 1)), ports[path].shape) for path in ported}
    weight_path_sums, _, _ = pullback((ones, port_ct))
    sums = {i: bk.clipped_sum(summers[i], coef[:, plan.group_of[plan.paths[i]]], whole[i]) for i in summers}
    sums.update({i: zero3.ready(v) for i, v in zip(trained_leaves, weight_path_sums)})
    out = zero3.owned(plan.paths, leaves, sums, layout, scattered=frozenset(trained_leaves), split=split)
    return losses, jax.tree.unflatten(treedef, out), norms, coef
