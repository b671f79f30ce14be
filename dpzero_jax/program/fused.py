"""Fused clipping on the traced program: ONE pullback, each site clips its own group in its backward.

Book-keeping (:mod:`dpzero_jax.program.mode`) keeps every site's operands and output gradient until the norms are
known; ghost (:mod:`dpzero_jax.program.ghost`) keeps nothing but runs the backward twice (norms, then the clipped
sum), and under ``jax.checkpoint`` recomputes every block twice. When every clipping group is *local* (one site,
or one site and small ones next to it: see Locality below) the coefficient of an example in that group is known as
soon as that site's output gradient is, so one backward pass does it all:

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

NaN safety: the weight path and the norm see the site's operands with non-finite entries zeroed (``ops'``), and
an example with such an entry has its norm reported as NaN, so it gets ``C = 0`` and contributes exactly zero
(never ``0 * NaN``); the output gradient of an example with ``C = 0`` is selected away. Sites whose parameter
gradient ignores the other operands' values (``add``, ``sub``, ``concatenate``: a bias, a shift, a class token)
keep none of them. The loss cotangent is 0 for a non-finite loss (as in the layers' fused mode), and the mask
enters the taps as a per-example ``keep``. As in the layers' fused mode, an example with a finite loss but a
non-finite norm in one group is dropped from that group only (each tap sees only its own group; the per-group
bound still holds).

Locality (:func:`local_groups`): a group is clipped in the backward of its *head*, its first site in program order
(the last the backward reaches). Its other sites, the *members*, must be ``local`` sites (a bias, a norm's scale:
per-example gradients as small as the parameter) in the same sub-program, each leaf used once: the head's tap
has one more output per member, a zero *link* of the member's view shape, which the member's tap takes as an
input; the member's backward, reached first, returns the example's gradient of its view as the link's cotangent;
the head adds its norm to the group's and returns it, times ``C``, to the member's view (replayed from the leaf at
the head, so that the member's weight path runs through the head's tap). So ``layer-wise`` groups of a kernel and
its bias (``dot`` / ``conv`` then ``add``) or of a norm's scale and bias are local; so are ``param-wise`` groups,
and groups whose leaves are all fallback leaves (their per-example gradients come out of the same pullback,
through per-example copies, and are clipped after it). The other groups are *book-kept* in the same pass
(:func:`_book`: book-keeping's zero probe at each of their sites and its records, no weight path; their norms and
clipped sums formed after the pullback exactly as :func:`dpzero_jax.program.mode.program_bk` forms them): tied weights
(the uses' gradients add up, with cross terms), a group with two ``dot`` / ``conv`` / ``gather`` sites
(``all-layer``, a layer-wise block of several matrices) or with sites in different sub-programs, sites mixed with
fallback parameters, and a group of a stacked leaf inside a ``scan`` -- on the program front-end a stacked leaf
``[L, ...]`` is ONE parameter path, so its group holds all ``L`` iterations' gradients, and no iteration's
coefficient is known before the backward has run through all of them -- and, under a ZeRO-3 layout, a group
that looks up rows of a large table the layout splits (:func:`_sharded_table`: its sum is then formed and
reduce-scattered in pieces, never the whole float32 table). A book-kept group keeps its sites' operands
and output gradients until the pullback ends, as ``bk`` would; ``explain_plan`` names each such group and why. With
every group book-kept (``all-layer``) the pass is book-keeping's.

Scans (``DPConfig.scan_groups="per-iteration"``, :func:`dpzero_jax.program.mode.split_per_iteration`): each
iteration's slice of a stacked leaf is a parameter of its own, so a group of stacked leaves becomes one group per
iteration (such a group must be local: book-keeping adds the iterations up, so a split group no one site can clip
is refused by name). Its head's tap sits in the scan body; its inputs -- the sink, the keep flag, the threshold and the
member leaves -- are stacked over the iterations and sliced by the interpreter's scan like any site input, so each
iteration's backward clips its own slice with its own threshold, and the scan's transpose stacks the clipped
slices into the leaf's gradient. The rematerialised body (``remat`` inside the scan) is recomputed once, as in the
non-private backward, and each layer's weights are used (gathered, under ZeRO-3) as often as there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpzero_jax import clipping, pergrad, spmd
from dpzero_jax.program import mode as bk
from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program import zero3
from dpzero_jax.program.ghost import squared_norm
from dpzero_jax.program.interpret import bind_squeezing, run


def local_groups(plan, layout=None) -> tuple[dict, dict, dict]:
    """``({head site path: (group, member site paths)}, {group: [fallback leaves]}, {group: reason})``: the groups
    clipped in the backward of their head site, those made of fallback leaves only (clipped after the pullback from
    their per-example copies), and the groups that are not local to one site (see the module doc), with the reason
    -- those are book-kept in the same pass, as is, under a ZeRO-3 ``layout``, a group that looks up rows of a large
    table the layout splits (:func:`_sharded_table`). A group's *head* is its first site in program order (the last
    one the backward reaches), its *members* the others."""
    analysis = plan.analysis
    heads: dict = {}
    fallback_groups: dict = {}
    booked: dict = {}
    for group, name in enumerate(plan.group_names):
        leaves = [i for i, path in enumerate(plan.paths) if plan.group_of[path] == group]
        group_sites = sorted((s for s in analysis.sites.values() if s.view.leaf in leaves), key=lambda s: s.path)
        fallback = [i for i in leaves if i in analysis.fallback]
        reason = _not_local(plan, name, group_sites, fallback, split=group in plan.iterations)
        if reason and group in plan.iterations:   # book-keeping adds up the iterations: no per-iteration norms
            raise ValueError(
                f"DPConfig(scan_groups='per-iteration') makes each iteration of a scan a group that mode='fused' "
                f"clips inside that iteration's backward, but {reason}: no one site can clip it. Use "
                f"groups='param-wise' (or layer-wise groups of one matrix and its bias / a norm's scale and bias), "
                f"or scan_groups='whole' with mode='bk' or 'ghost'")
        if not reason and layout is not None and group not in plan.iterations:
            reason = _sharded_table(plan, name, group_sites, layout)
        if reason:
            booked[group] = reason
        elif group_sites:
            heads[group_sites[0].path] = (group, tuple(s.path for s in group_sites[1:]))
        elif fallback:
            fallback_groups[group] = fallback
    return heads, fallback_groups, booked


def _not_local(plan, name: str, group_sites, fallback, split: bool) -> str:
    """Why group ``name`` cannot be clipped in the backward of one site (``""`` when it can)."""
    if group_sites and fallback:
        return (f"group {name!r} mixes parameters used at sites "
                f"({sorted({plan.paths[s.view.leaf] for s in group_sites})}) with per-example fallback parameters "
                f"({[plan.paths[i] for i in fallback]})")
    if any(s.lengths for s in group_sites) and not split:
        site = next(s for s in group_sites if s.lengths)
        return (f"group {name!r} is used inside a scan ({' x '.join(map(str, site.lengths))} iterations): "
                f"{plan.paths[site.view.leaf]!r} is one parameter "
                f"{'stacked over the iterations' if 'xs' in site.view.levels else 'shared by them'}, so the group "
                f"holds every iteration's gradient (DPConfig(scan_groups='per-iteration') splits it)")
    tied = [plan.paths[i] for i in sorted({s.view.leaf for s in group_sites})
            if sum(s.view.leaf == i for s in group_sites) > 1]
    if tied:
        return f"group {name!r}: {tied} used at {len(group_sites)} sites (tied weights: the uses' gradients add up)"
    if len({s.path[:-1] for s in group_sites}) > 1:
        return f"group {name!r} spans {len(group_sites)} sites in different sub-programs (jit / remat regions)"
    factored = [s for s in group_sites if s.kind != "local"]
    if len(factored) > 1 or (factored and factored[0] is not group_sites[0]):
        uses = ", ".join(repr(plan.paths[s.view.leaf]) for s in factored[:4])
        return (f"group {name!r} has {len(factored)} dot / conv / gather sites ({uses}"
                f"{' ...' if len(factored) > 4 else ''})" if len(factored) > 1 else
                f"group {name!r} has a dot / conv / gather site after another site")
    return ""


def _sharded_table(plan, name: str, group_sites, layout) -> str:
    """Why group ``name`` is book-kept under ZeRO-3 ``layout`` although one site could clip it (``""`` if not): it
    looks up rows of a large table the layout splits (:func:`~dpzero_jax.program.zero3.sharded_table`). Clipped in
    the lookup's backward, its sum would be autodiff's transpose of the lookup, the whole float32 table; book-kept,
    it is formed and reduce-scattered in pieces (:func:`~dpzero_jax.program.mode.norms_and_summers`)."""
    for site in group_sites:
        if zero3.sharded_table(plan, site, layout):
            path = plan.paths[site.view.leaf]
            return (f"group {name!r} looks up rows of {path!r} {list(layout.full(path).shape)}, split by the ZeRO-3 "
                    f"layout: its clipped sum is formed and reduce-scattered in pieces of at most "
                    f"{layout.sum_chunk_bytes} bytes, never whole")
    return ""


# Sites whose parameter gradient does not depend on the values of the other operands (a bias, a shift, a class
# token): the tap keeps none of them, the weight path is linear in the parameter with no residual.
INPUT_FREE = frozenset({"add", "add_any", "sub", "concatenate"})


def _leaf_sq(site, view_grad, base_shape):
    """One example's squared norm (float32) of a leaf's gradient given the gradient of its view (through the view's
    chain from ``base_shape``, the leaf's or its per-iteration slice's: a broadcast sums, a reshape or transpose
    keeps the norm)."""
    _, to_base = jax.vjp(lambda b: sites_lib.replay_chain(site, b, skip_casts=True).astype(jnp.float32),
                         jnp.zeros(base_shape, jnp.float32))
    (leaf_grad,) = to_base(view_grad.astype(jnp.float32))
    return jnp.sum(jnp.square(leaf_grad))


def _book(site, invals, probe, records: dict, shared: bool = False) -> list:
    """A site of a book-kept group: book-keeping's probe and records, with no weight path (the parameter under
    ``stop_gradient``: its clipped sum is formed after the pullback). ``shared``: another book-kept site records
    the same operands (``Analysis.shared_records``): nothing recorded here."""
    values = list(invals)
    values[site.param_operand] = jax.lax.stop_gradient(values[site.param_operand])
    (out,) = bind_squeezing(site.eqn, values, site.squeeze)
    if not shared:
        records[site.path] = [invals[i] for i in site.recorded]
    return [out + probe.astype(out.dtype)]


def _fused_handler(plan, heads: dict, booked_sites: frozenset, shared_records: dict, method: str, clip_fn: str,
                   gamma: float):
    """The site handler: the data path, the weight path and the tap (see the module doc). A head site's input is
    ``(sink, keep, threshold, member leaves)`` for this example; a member site's is None. A head's tap has one more
    output per member, a zero *link* of the member's view shape, which the member's tap takes as an input: its
    backward (reached first) returns the example's gradient of the member's view as the link's cotangent, and the
    head's backward adds its norm to the group's and returns it, scaled by the coefficient, to the member's view
    (computed at the head from the leaf, so that its weight path goes through the head). ``shared_records``: the
    book-kept sites that record nothing (:func:`book_kept_sharing`)."""
    links: dict = {}      # member site path -> its link (a value of the trace both sites are evaluated in)
    sites = plan.analysis.sites

    def member(site, invals):
        link = links.pop(site.path)
        w = invals[site.param_operand]
        ops = [invals[i] for i in site.recorded]
        y_data = sites_lib.apply_site(site, jax.lax.stop_gradient(w), ops)

        @jax.custom_vjp
        def tap(y_data, link, w, ops):
            if site.constant:   # no data enters: make the output (and so its cotangent) per example
                return y_data + (jnp.sum(link) * 0.0).astype(y_data.dtype)
            return y_data

        def forward(y_data, link, w, ops):
            return tap(y_data, link, w, ops), (w, ops)

        def backward(saved, g):
            w, ops = saved
            _, pullback = jax.vjp(lambda w_: sites_lib.apply_site(site, w_, ops), w)
            return g, pullback(g)[0].astype(link.dtype), None, [None] * len(ops)

        tap.defvjp(forward, backward)
        return [tap(y_data, link, jax.lax.stop_gradient(w), ops)]

    def handler(site, invals, site_input, records, view32=None):
        if site.path in booked_sites:
            return _book(site, invals, site_input, records, site.path in shared_records)
        if site_input is None:
            return member(site, invals)
        sink, keep, threshold, member_leaves = site_input
        members = [sites[p] for p in heads[site.path][1]]
        # the members' views from their leaves without casts: each example's clipped member gradient, returned to
        # them, is summed over the examples (and devices) in the leaf's float32, never in a half-precision view
        views = [sites_lib.replay_chain(m, leaf, skip_casts=True) for m, leaf in zip(members, member_leaves)]
        bases = [leaf.shape for leaf in member_leaves]   # inside a scan: the per-iteration slices
        w = invals[site.param_operand]
        ops = [invals[i] for i in site.recorded]
        y_data = sites_lib.apply_site(site, jax.lax.stop_gradient(w), ops)
        shapes = [(o.shape, o.dtype) for o in ops]
        if site.kind == "local" and site.eqn.primitive.name in INPUT_FREE:
            ok, held = jnp.asarray(True), []
            zeros = [jnp.zeros(shape, dtype) for shape, dtype in shapes]
            y_weight = (sites_lib.apply_site(site, w, zeros) if view32 is None else
                        sites_lib.apply_site_float32(site, view32, zeros))
        else:
            # The weight path and the norm see the operands with non-finite entries zeroed: an example with one
            # gets C = 0 (its norm is reported NaN), and 0 * NaN would not be 0 in the weight's contraction.
            ok, held = sites_lib.finite_operands([jax.lax.stop_gradient(o) for o in ops])
            y_weight = (sites_lib.apply_site(site, w, held) if view32 is None else
                        sites_lib.apply_site_float32(site, view32, held))
        weight_dtype = y_weight.dtype

        @jax.custom_vjp
        def tap(y_data, y_weight, w, held, ok, sink, keep, threshold, views):
            out = y_data + (sink * 0.0).astype(y_data.dtype) if site.constant else y_data
            return out, [jnp.zeros(v.shape, v.dtype) + (sink * 0.0).astype(v.dtype) for v in views]

        def forward(y_data, y_weight, w, held, ok, sink, keep, threshold, views):
            return tap(y_data, y_weight, w, held, ok, sink, keep, threshold, views), (w, held, ok, keep, threshold)

        def backward(saved, cotangents):
            w, held, ok, keep, threshold = saved
            g, member_grads = cotangents
            values = held if held else [jnp.zeros(shape, dtype) for shape, dtype in shapes]
            sq = jnp.where(ok, squared_norm(site, method, w, values, g).astype(jnp.float32), jnp.nan)
            for m, grad, base in zip(members, member_grads, bases):
                sq = sq + _leaf_sq(m, grad, base)
            coef = clipping.coefficients(jnp.sqrt(sq).reshape(1, 1), jnp.reshape(threshold, (1,)),
                                         jnp.reshape(keep, (1,)), clip_fn, gamma)[0, 0]
            member_scaled = [sites_lib.scaled(grad, coef) for grad in member_grads]
            return (g, sites_lib.scaled(g, coef, weight_dtype), None, [None] * len(held), None, sq, None, None,
                    member_scaled)

        tap.defvjp(forward, backward)
        out, member_links = tap(y_data, y_weight, jax.lax.stop_gradient(w), held, ok, sink, keep, threshold, views)
        links.update(zip(heads[site.path][1], member_links))
        return [out]

    handler.state = links   # the interpreter threads the links through a use it wraps (ZeRO-3 gathering)
    handler.float32_views = True   # and passes each site's float32 view (sites.float32_view)
    return handler


def book_kept_sharing(shared: dict, booked_sites: frozenset) -> dict:
    """The pairs of ``Analysis.shared_records`` / ``shared_gradient`` whose sites are both book-kept here."""
    return {p: q for p, q in shared.items() if p in booked_sites and q in booked_sites}


def program_fused(cfg, plan, params, batch, mask, layout=None):
    """``(losses [B], clipped sum like params (float32), norms [B, M], coef [B, M])``: one forward (``vmap`` over
    the examples inside one ``jax.vjp``), one pullback. With a ZeRO-3 ``layout``: on the shards, gathered at each
    use (:mod:`dpzero_jax.program.zero3`); every sum comes back in its owner's layout."""
    # a lookup clipped at its site is book-kept to be summed in pieces under the explicit layout only: under GSPMD
    # that costs more than it saves (GPT-J-6B on 256 v5e chips, layer-wise groups: 3.05 GiB of temporaries, 2.50
    # clipped at its site); a table book-kept anyway (tied) is summed in pieces under both
    heads, fallback_groups, booked = local_groups(plan, layout)
    leaves, treedef = jax.tree.flatten(params)
    split = zero3.tables(plan.paths, leaves, layout)
    booked_leaves = {i for i, path in enumerate(plan.paths) if plan.group_of[path] in booked}
    batch_leaves = jax.tree.leaves(batch)
    size = batch_leaves[0].shape[0]
    analysis = plan.analysis
    site_leaves = sorted({s.view.leaf for s in analysis.sites.values()})
    fallback = sorted(analysis.fallback)
    thresholds = jnp.asarray(plan.thresholds, jnp.float32)
    booked_sites = frozenset(path for path, s in analysis.sites.items() if s.view.leaf in booked_leaves)
    shared_records = book_kept_sharing(analysis.shared_records, booked_sites)
    shared_gradient = book_kept_sharing(analysis.shared_gradient, booked_sites)
    handler = _fused_handler(plan, heads, booked_sites, shared_records, cfg.norm_method, cfg.clip_fn, cfg.gamma)

    held = zero3.held(plan.paths, leaves, layout)
    consts = zero3.held_consts(plan.closed.consts, layout)   # frozen variables' shards, as the leaves'

    def forward(trained, copies, sinks, probes):
        values = list(held)
        for i, v in zip(site_leaves, trained):
            values[i] = zero3.hold(plan.paths[i], v, layout)

        def one(copies_i, example, sinks_i, keep_i, probes_i):
            local = list(values)
            for i, v in zip(fallback, copies_i):
                local[i] = v
            inputs = {path: None for path in analysis.sites}
            for path, (group, members) in heads.items():
                # a group split per iteration (scan_groups="per-iteration") takes one sink, keep flag and threshold
                # per iteration, and its stacked member leaves whole: the interpreter's scans slice them
                lengths = plan.iterations.get(group, ())
                inputs[path] = (sinks_i[path], jnp.broadcast_to(keep_i, lengths),
                                thresholds[group:group + math.prod(lengths)].reshape(lengths),
                                [local[analysis.sites[m].view.leaf] for m in members])
            inputs.update(probes_i)   # book-kept sites: book-keeping's zero probes
            records: dict = {}
            (loss,) = run(plan.closed.jaxpr, consts, local + list(example), analysis, inputs, records,
                          handler=handler)
            return loss, records
        # book-kept sites' probes, records and probe cotangents with the examples after the enclosing scans' axes,
        # as book-keeping's pass (mode._pass: the layout the scans produce them in)
        return jax.vmap(one, in_axes=(0, 0, 0, 0, depth), out_axes=(0, record_axes),
                        spmd_axis_name=spmd.batch_axes(size))(copies, list(batch_leaves), sinks, mask, probes)

    sinks = {path: jnp.zeros((size,) + tuple(plan.iterations.get(group, ())), jnp.float32)
             for path, (group, _) in heads.items()}
    copies = [jnp.broadcast_to(w, (size,) + w.shape) for w in (zero3.materialise(held[i]) for i in fallback)]
    depth = {path: axis for path, axis in bk.example_axes(plan).items() if path in booked_sites}
    record_axes = {path: [depth[path]] * len(analysis.sites[path].recorded) for path in booked_sites
                   if path not in shared_records}
    probes = {path: jnp.zeros(analysis.sites[path].lengths + (size,) + tuple(analysis.sites[path].out_aval.shape),
                              analysis.sites[path].out_aval.dtype) for path in booked_sites}
    losses, pullback, records = jax.vjp(forward, [leaves[i] for i in site_leaves], copies, sinks, probes,
                                        has_aux=True)
    # An example with a non-finite loss gets a zero cotangent: its output gradients are zero (or non-finite, and
    # then its norms are), so it contributes nothing at any site.
    sums, fallback_ct, sq_of_head, probe_ct = pullback(
        jnp.where(jnp.isfinite(losses), 1.0, 0.0).astype(losses.dtype))
    bk.share(records, probe_ct, shared_records, shared_gradient)

    n_groups = len(plan.group_names)
    sq = [jnp.zeros((size,), jnp.float32)] * n_groups
    for path, (group, _) in heads.items():
        per_iteration = sq_of_head[path].reshape(size, -1)   # [B, 1], or [B, iterations] for a split group
        for k in range(per_iteration.shape[1]):
            sq[group + k] = per_iteration[:, k]
    per_example = dict(zip(fallback, fallback_ct))
    for group, members in fallback_groups.items():
        sq[group] = sum(jnp.sum(jnp.square(per_example[i].astype(jnp.float32)).reshape(size, -1), axis=1)
                        for i in members)
    summers = {}
    whole = bk.whole_leaves(plan, leaves, layout, probe_ct)
    if booked:   # book-keeping's norms and clipped sums, from the records and probe cotangents of the same pass
        terms = bk._leaf_terms(plan, whole, records, probe_ct, fallback_ct, captured=booked_leaves,
                               method=cfg.norm_method, example_axis=depth)
        booked_sq, summers = bk.norms_and_summers(cfg, plan, whole,
                                                  {i: t for i, t in terms.items() if i in booked_leaves}, size,
                                                  layout=split)
        for i, value in booked_sq.items():
            group = plan.group_of[plan.paths[i]]
            sq[group] = sq[group] + value.astype(jnp.float32)
    norms = jnp.sqrt(jnp.stack(sq, axis=1))
    # The coefficients the taps applied, group by group (a non-finite norm drops the example from its group only).
    keep = jnp.logical_and(mask, jnp.isfinite(losses))
    coef = jnp.concatenate([clipping.coefficients(norms[:, m:m + 1], thresholds[m:m + 1], keep, cfg.clip_fn,
                                                  cfg.gamma) for m in range(n_groups)], axis=1)
    formed = {i: zero3.ready(v) for i, v in zip(site_leaves, sums)}
    for group, members in fallback_groups.items():
        for i in members:
            formed[i] = bk.clipped_sum(lambda c, i=i: pergrad.weighted_sum([pergrad.Direct(per_example[i])], c),
                                       coef[:, group], whole[i])
    for i, summer in summers.items():
        formed[i] = bk.clipped_sum(summer, coef[:, plan.group_of[plan.paths[i]]], whole[i])
    # sums that autodiff formed (site leaves clipped in their backward) are in the owners' layout already
    scattered = frozenset(site_leaves) - set(summers) - {i for m in fallback_groups.values() for i in m}
    out = zero3.owned(plan.paths, leaves, formed, layout, scattered=scattered, split=split)
    return losses, jax.tree.unflatten(treedef, out), norms, coef
