"""Book-keeping on the traced program: exact clipped per-example gradient sums for any JAX model.

``plan_program`` traces the single-example loss once and finds the sites (:mod:`dpzero_jax.program.analyze`).
``program_bk`` then runs, over the batch (``jax.vmap``), the single-example program with a zero probe on every
site's output (:mod:`dpzero_jax.program.interpret`) and one ``jax.vjp`` with respect to the probes and the
fallback leaves only, so that no other parameter gradient is formed by autodiff. From each site's operands and
output gradient (:mod:`dpzero_jax.program.sites`):

* leaves whose sites are all ``dot`` / ``gather`` (or all ``conv`` with the ghost norm picked: unfolded patches,
  blocks = feature groups) get :class:`~dpzero_jax.pergrad.Outer` factors, blockwise: norms by the ghost or
  instantiated form (the mixed rule of ``pergrad``, with every cross term between uses: tied weights exact),
  clipped sums as one contraction per use;
* leaves with a ``local`` site get their per-example gradient instantiated (``B x`` the leaf: scales, shifts,
  position tables, class tokens, convolutions the conv rule does not take or instantiates); a local site that takes
  the example's data forms it in the backward, from a tap on its output (:mod:`dpzero_jax.program.local_tap`),
  and keeps no output gradient;
* fallback leaves get theirs from the VJP (``B x`` the leaf).

Then the usual clip coefficients per group and ``sum_i C_{m,i} g_{m,i}``. Examples with a zero coefficient
contribute exactly zero (rows selected away, never multiplied).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import clipping, layer_plan, pergrad, spmd
from dpzero_jax import tape as tape_lib
from dpzero_jax.program import local_tap, zero3
from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program.analyze import DATA, Analysis, View, analyze
from dpzero_jax.program.interpret import add_probe, run
from dpzero_jax.sketch import finite_zero


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """The plan of the program front-end (static: no arrays besides the jaxpr's constants)."""

    paths: tuple[str, ...]
    closed: Any                     # ClosedJaxpr of loss_i(leaves, example leaves) -> []
    analysis: Analysis
    group_of: dict[str, int]
    group_names: tuple[str, ...]
    thresholds: tuple[float, ...]
    batch_size: int
    front_end: str = "program"
    # DPConfig.scan_groups="per-iteration": {first group index: enclosing scans' lengths} of each group split per
    # iteration; its groups are numbered first + the iteration's index (row-major over the lengths), and group_of
    # maps each of its leaves to the first
    iterations: dict = dataclasses.field(default_factory=dict)
    layer_calls: int = 0            # calls of dpzero_jax layers (any tape-aware layer) in the traced program

    def sites_of(self, leaf: int) -> list:
        return [s for s in self.analysis.sites.values() if s.view.leaf == leaf]


def _single_example(loss_fn, treedef, example_treedef, batch_size: int):
    def loss_one(leaves, example_leaves):
        example = jax.tree.unflatten(example_treedef, example_leaves)
        losses = loss_fn(jax.tree.unflatten(treedef, leaves), jax.tree.map(lambda x: x[None], example))
        layer_plan.check_losses([jax.typeof(x) for x in jax.tree.leaves(losses)], batch_size, 1)
        return losses[0]
    return loss_one


def plan_program(loss_fn, cfg, params, batch, paths, batch_size: int) -> ProgramPlan:
    """Trace the single-example loss and find where each trainable leaf meets the example (see module doc)."""
    closed, analysis, layer_calls = trace(loss_fn, params, batch, batch_size=batch_size)
    if (cfg.target or jax.default_backend()) == "cpu":   # XLA:CPU's slow fusions on unit axes (program.unit_axis)
        analysis.squeeze_unit_axis = True
        analysis.sites = {path: dataclasses.replace(site, squeeze=True) for path, site in analysis.sites.items()}
    order = sorted(analysis.sites.values(), key=lambda s: s.path)
    layer_order = [clipping.parent(paths[s.view.leaf]) for s in order]
    layer_order += [clipping.parent(paths[i]) for i in sorted(analysis.fallback)]
    group_of, group_names = clipping.assign_groups(cfg.groups, paths, layer_order)
    iterations = {}
    if cfg.scan_groups == "per-iteration":
        group_of, group_names, iterations = split_per_iteration(analysis, paths, group_of, group_names)
    thresholds = clipping.thresholds(cfg.max_grad_norm, len(group_names), cfg.group_thresholds)
    return ProgramPlan(tuple(paths), closed, analysis, group_of, group_names, tuple(float(t) for t in thresholds),
                       batch_size, iterations=iterations, layer_calls=layer_calls)


def trace(loss_fn, params, batch, *, batch_size: int | None = None):
    """``(closed jaxpr of the single-example loss, its analysis, the number of dpzero_jax layer calls in it)``;
    ``params`` may be ``ShapeDtypeStruct``. A loss that does not return
    floating-point per-example losses is refused (``batch_size``, for the message: the batch's, by default its
    leading axis)."""
    leaves, treedef = jax.tree.flatten(params)
    example_leaves, example_treedef = jax.tree.flatten(batch)
    abstract = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]
    abstract_example = [jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in example_leaves]
    if batch_size is None:
        batch_size = np.shape(example_leaves[0])[0] if example_leaves else 1
    program_tape = tape_lib.ProgramTape()
    with tape_lib.active(program_tape):   # DP layers as their rules' program form (an RMM estimate)
        closed = jax.make_jaxpr(_single_example(loss_fn, treedef, example_treedef, batch_size))(
            abstract, abstract_example)
    analysis = Analysis()
    kinds = [View(i) for i in range(len(leaves))] + [DATA] * len(example_leaves)
    outs = analyze(closed.jaxpr, kinds, analysis)
    for kind in outs:  # a loss term from the parameters alone (no data): every example carries it
        if not isinstance(kind, str):
            analysis.mark_fallback(_kind_leaves(kind), "enters the loss without the example's data")
    for site in list(analysis.sites.values()):
        if not jnp.issubdtype(site.out_aval.dtype, jnp.inexact):
            analysis.mark_fallback({site.view.leaf}, f"used by '{site.eqn.primitive.name}' with an integer result")
    analysis.finish()
    return closed, analysis, program_tape.calls


def split_per_iteration(analysis: Analysis, paths, group_of: dict, group_names: tuple):
    """``DPConfig.scan_groups="per-iteration"``: ``(group_of, group_names, iterations)`` with every group whose
    parameters are all stacked over the same scans (each site sees the leaf's per-iteration slice: levels all
    ``"xs"``) split into one group per iteration, ``name[i]`` (``name[i,j]`` under nested scans). A group mixing
    stacked and other parameters is refused with its name; groups without stacked parameters are unchanged."""
    stacked = {}
    for site in analysis.sites.values():
        levels = site.view.levels[-len(site.lengths):] if site.lengths else ()
        lengths = tuple(site.lengths) if levels and all(lv == "xs" for lv in levels) else None
        stacked.setdefault(site.view.leaf, set()).add(lengths)
    new_of, new_names, iterations = {}, [], {}
    for group, name in enumerate(group_names):
        members = [i for i, p in enumerate(paths) if group_of[p] == group]
        kinds = {frozenset(stacked.get(i, {None})) for i in members}
        first = len(new_names)
        if kinds == {frozenset({None})}:
            new_names.append(name)
        elif len(kinds) == 1 and len(next(iter(kinds))) == 1:
            (lengths,) = next(iter(kinds))
            iterations[first] = lengths
            new_names.extend(f"{name}[{','.join(map(str, index))}]" for index in np.ndindex(*lengths))
        else:
            described = {paths[i]: sorted(("not stacked" if k is None else "x".join(map(str, k))) for k in
                                          stacked.get(i, {None})) for i in members}
            raise ValueError(
                f"DPConfig.scan_groups='per-iteration' splits a group per iteration of the scan its parameters are "
                f"stacked over, but group {name!r} mixes parameters stacked differently or not at all "
                f"({described}); use groups='layer-wise' or 'param-wise', or scan_groups='whole'")
        for i in members:
            new_of[paths[i]] = first
    return new_of, tuple(new_names), iterations


def concrete_mode(cfg, plan: ProgramPlan) -> str:
    """The mode ``cfg.mode`` runs as on the program front-end. ``"auto"``: book-keeping, unless sites sit inside
    remat regions -- book-keeping would keep their operands and undo the rematerialisation; ghost computes their
    norms in the rematerialised backward."""
    if plan.iterations:   # per-iteration groups: only fused computes them (engine._front_end checked the mode)
        return "fused"
    if cfg.mode != "auto":
        return cfg.mode
    return "ghost" if plan.analysis.rematerialised else "bk"


def _kind_leaves(kind) -> set:
    if isinstance(kind, View):
        return {kind.leaf}
    return set(getattr(kind, "leaves", ()))


def zero_probe(site):
    """Book-keeping's per-site input: a zero of the site's output shape (stacked over enclosing scans)."""
    return jnp.zeros(tuple(site.lengths) + tuple(site.out_aval.shape), site.out_aval.dtype)


def _pass(plan: ProgramPlan, leaves, batch_leaves, layout=None):
    """The probed forward and one VJP, per example: ``(losses [B], records, probe cotangents, fallback grads,
    tapped sites)``; a site's records and probe cotangent ``[*scan lengths, B, ...]`` (:func:`example_axes`); a
    tapped local site's probe cotangent is its per-example parameter gradient (:mod:`.local_tap`). With a ZeRO-3
    ``layout`` the leaves are this device's shards, gathered at their uses (:mod:`dpzero_jax.program.zero3`);
    fallback leaves whole."""
    analysis = plan.analysis
    fallback = sorted(analysis.fallback)
    held = zero3.held(plan.paths, leaves, layout)
    consts = zero3.held_consts(plan.closed.consts, layout)   # frozen variables' shards, as the leaves'
    fallback_whole = [zero3.materialise(held[i]) for i in fallback]
    tapped = local_tap.tapped_sites(analysis, layout)
    shared_records, shared_gradient = local_tap.sharing(analysis.shared_records, analysis.shared_gradient, tapped)

    def per_example(leaves, fallback_whole, example):
        probes = {path: local_tap.probe(site) if path in tapped else zero_probe(site)
                  for path, site in analysis.sites.items()}

        def forward(probes, fallback_values):
            values = list(leaves)
            for i, v in zip(fallback, fallback_values):
                values[i] = v
            records: dict = {}
            (loss,) = run(plan.closed.jaxpr, consts, values + list(example), analysis, probes, records,
                          handler=functools.partial(_probe_once, shared_records, tapped))
            return loss, records

        loss, pullback, records = jax.vjp(forward, probes, fallback_whole, has_aux=True)
        probe_ct, fallback_ct = pullback(jnp.ones_like(loss))
        return loss, records, probe_ct, fallback_ct

    # A site's outputs (records, probe cotangent) leave the vmap with the examples after the enclosing scans' axes,
    # the layout the scans produce them in (examples first would make XLA transpose every record: ~15% of a deep
    # scanned step's time); :func:`_leaf_terms` reads them in that layout (sites.factored makes blocks-first factors,
    # sites.local_grad maps over the examples where they are).
    depth = example_axes(plan)
    out_axes = (0, {path: [depth[path]] * len(site.recorded) for path, site in analysis.sites.items()
                    if path not in shared_records and path not in tapped}, depth, 0)
    # spmd_axis_name: under a GSPMD step the example axis is split over the batch axes (dpzero_jax.spmd)
    losses, records, probe_ct, fallback_ct = jax.vmap(per_example, in_axes=(None, None, 0), out_axes=out_axes,
                                                      spmd_axis_name=spmd.batch_axes(len(batch_leaves[0])))(
        held, fallback_whole, list(batch_leaves))
    share(records, probe_ct, shared_records, shared_gradient)
    return losses, records, probe_ct, fallback_ct, tapped


def share(records: dict, probe_ct: dict, shared_records: dict, shared_gradient: dict) -> None:
    """Values kept once (``analyze._shared``): a site repeating another's records or output gradient reads that
    site's (its own output gradient, the same value, is left unused and compiled away). In place."""
    for path, first in shared_records.items():
        records[path] = records[first]
    for path in shared_gradient:
        source = path
        while source in shared_gradient:
            source = shared_gradient[source]
        probe_ct[path] = probe_ct[source]


def _probe_once(shared_records: dict, tapped: frozenset, site, invals, probe, records: dict) -> list:
    """Book-keeping's handling of a site (:func:`~dpzero_jax.program.interpret.add_probe`), recording nothing for a
    site whose operands an earlier site of its sub-program records (``shared_records``); a ``tapped`` local site
    through its tap (:mod:`~dpzero_jax.program.local_tap`)."""
    if site.path in tapped:
        return local_tap.tap(site, invals, probe)
    return add_probe(site, invals, probe, {} if site.path in shared_records else records)


def example_axes(plan: ProgramPlan) -> dict:
    """``{site path: axis of the examples}`` in :func:`_pass`'s records and probe cotangents (after the enclosing
    scans' iteration axes)."""
    return {path: len(site.lengths) for path, site in plan.analysis.sites.items()}


def _leaf_terms(plan: ProgramPlan, leaves, records, probe_ct, fallback_ct, captured=None, method: str = "mixed",
                example_axis: dict | None = None, tapped: frozenset = frozenset()):
    """``{leaf: ("outer", [(site, Factored)], None) | ("direct", per-example gradients, their example axis)}``
    (``[B, *shape]`` and 0, or a stacked leaf's one tapped use as the scan left it, ``[*lengths, B, *base]``) for
    the fallback leaves and the leaves whose sites were captured (all, or those in ``captured``). Conv sites are
    factored only where :func:`~dpzero_jax.program.sites.conv_factored` says so for ``method``; else instantiated
    like local sites.
    ``example_axis``: ``{site path: axis}`` where a site's records and probe cotangent hold the examples (default:
    first). ``tapped``: local sites whose probe cotangent is their per-example parameter gradient already."""
    example_axis = example_axis or {}
    fallback = sorted(plan.analysis.fallback)
    terms: dict[int, Any] = {i: ("direct", g.astype(jnp.float32), 0) for i, g in zip(fallback, fallback_ct)}
    by_leaf: dict[int, list] = {}
    for _, site in sorted(plan.analysis.sites.items(), key=lambda item: item[0]):
        if captured is None or site.view.leaf in captured:
            by_leaf.setdefault(site.view.leaf, []).append(site)
    for leaf, leaf_sites in by_leaf.items():
        one = leaf_sites[0]
        if len(leaf_sites) == 1 and one.path in tapped and sites_lib.xs_lengths(one) == tuple(one.lengths):
            # a leaf's one tapped use, sliced per iteration by every enclosing scan: its per-example gradients as
            # the scan left them, [*lengths, B, *base] (moved examples-first, XLA:CPU wrote a transposed copy to
            # norm and sum: two kernels a leaf)
            terms[leaf] = ("direct", probe_ct[one.path], example_axis.get(one.path, 0))
            continue
        direct = {"local"} if sites_lib.conv_factored(leaf_sites, method) else {"local", "conv"}
        factored = [(s, sites_lib.factored(s, records[s.path], probe_ct[s.path], example_axis.get(s.path, 0)))
                    for s in leaf_sites if s.kind not in direct]
        if len(factored) == len(leaf_sites) and _same_blocks(factored):
            terms[leaf] = ("outer", factored, None)
            continue
        total = 0.0
        for s, f in factored:
            total = total + sites_lib.instantiate(s, f, leaves[leaf])
        for s in leaf_sites:
            if s.path in tapped:
                total = total + sites_lib.from_tap(s, probe_ct[s.path], example_axis.get(s.path, 0))
            elif s.kind in direct:
                total = total + sites_lib.local_grad(s, records[s.path], probe_ct[s.path], leaves[leaf],
                                                     example_axis.get(s.path, 0))
        terms[leaf] = ("direct", total, 0)
    return terms


def _same_blocks(factored) -> bool:
    """Uses whose blocks, rows, columns and canonical layout agree can share cross terms (ids or not)."""
    keys = {f.structure + (sites_lib.xs_lengths(s),) for s, f in factored}
    return len(keys) == 1


def _outer_uses(factored, k: int | None = None, examples_major: bool = False):
    """pergrad ``Outer`` uses with blocks and examples merged into the leading axis, blocks major unless
    ``examples_major`` (or block ``k`` only)."""
    uses = []
    for _, f in factored:
        left, right = f.left, f.right
        if k is not None:
            left, right = left[k], right[k]
        elif examples_major:
            left = jnp.swapaxes(left, 0, 1).reshape((-1,) + left.shape[2:])
            right = jnp.swapaxes(right, 0, 1).reshape((-1,) + right.shape[2:])
        else:
            left = left.reshape((-1,) + left.shape[2:])
            right = right.reshape((-1,) + right.shape[2:])
        uses.append(pergrad.Outer(left, right, f.rows, (f.rows, f.right.shape[-1]), f.left_is_ids))
    return uses


def _outer_norm_and_sum(factored, method: str, kernel: str, batch: int, dtype="float32", reuse: bool = True):
    """``(sq [B], clipped(coef) -> [K, rows, cols])`` for one leaf with factored uses; an instantiated gradient is
    kept (and normed) in ``dtype`` (``DPConfig.instantiated_dtype``). ``reuse=False``: the clipped sum is formed
    elsewhere (ghost mode's weighted leaves, a table's pieces); the norm is then taken in float32 and nothing is kept
    for a sum."""
    k = factored[0][1].left.shape[0]
    # Blocks major, as sites.factored leaves them: an instantiated gradient is kept [K, B, rows, cols], its clipped
    # sum one contraction over the examples with the blocks as its batch (merged examples first, XLA:CPU transposed
    # every operand and then [B, K x p] for the sum: ~0.1x of a 48-layer scanned step). Examples major where the
    # examples are split over devices (GSPMD): a merged axis keeps that split only as its major factor.
    examples_major = k > 1 and spmd.batch_axes(batch) is not None
    uses = _outer_uses(factored, examples_major=examples_major)
    if k > 1:
        kernel = "xla"
    ghost = pergrad.use_ghost(uses, method, kernel, reuse, kept_dtype=dtype)
    shape = (batch, k) if examples_major else (k, batch)
    if not ghost and kernel == "xla" and reuse:
        dense, sq = pergrad.kept_sum_and_sq_norm(uses, dtype, shape + (uses[0].rows, uses[0].cols),
                                                 0 if examples_major else 1)

        def clipped(coef):
            if examples_major:
                return pergrad.weighted_sum([pergrad.Direct(dense)], coef)
            return pergrad.weighted_blocks(dense, coef)
        return sq, clipped
    sq = pergrad.sq_norm(uses, "ghost" if ghost else "instantiate", kernel).reshape(shape)
    sq = sq.sum(axis=1 if examples_major else 0)

    def clipped(coef):
        if k == 1:   # under GSPMD an embedding's scatter-add apart from the other uses' sum (pergrad.weighted_sum)
            return pergrad.weighted_sum(_outer_uses(factored, 0), coef, kernel,
                                        scatter_apart=spmd.batch_axes(batch) is not None)[None]
        return _blocked_weighted_sum(factored, coef)
    return sq, clipped


def _blocked_weighted_sum(factored, coef):
    """``[K, rows, cols]`` in float32: ``sum_i coef_i G_{i,k}`` for every block ``k`` at once (one contraction
    per use, written in float32 like :func:`~dpzero_jax.pergrad.weighted_sum`'s); examples with ``coef == 0``
    selected away before multiplying (NaN-safe)."""
    active = coef != 0
    scale = coef.astype(jnp.float32)
    total = 0.0
    for _, f in factored:
        right = pergrad.zero_inactive(f.right.astype(jnp.float32), active, 1) * scale[None, :, None, None]
        k = f.right.shape[0]
        if f.left_is_ids:
            blocks = jnp.broadcast_to(jnp.arange(k)[:, None, None], f.left.shape)
            part = jnp.zeros((k, f.rows, f.right.shape[-1]), jnp.float32).at[blocks, f.left].add(right)
        else:
            left = pergrad.zero_inactive(f.left, active, 1)
            part = jax.lax.dot_general(left, right, (((1, 2), (1, 2)), ((0,), (0,))),
                                       preferred_element_type=jnp.float32)
        total = total + part
    return total


class ChunkedSummer:
    """A table's clipped sum in pieces along ``axis`` (``bounds``: ``(lo, hi)`` each): ``part(coef, lo, hi)``."""

    def __init__(self, part, bounds, axis: int):
        self.part, self.bounds, self.axis = part, tuple(bounds), axis


def _lookup_pieces(factored, leaf, dim: int | None, chunk_bytes: int):
    """:func:`~dpzero_jax.program.zero3.piece_bounds` for a table's clipped sum, or None: not a lookup table (no
    ``gather`` use), stacked or blocked uses, or factors not in the leaf's own axis order."""
    shape = tuple(leaf.shape)
    if not any(f.left_is_ids for _, f in factored) or len(shape) != 2:
        return None
    if any(f.left.shape[0] != 1 or sites_lib.xs_lengths(s) or f.layout != ((0,), (1,)) or f.rows != shape[0]
           or f.right.shape[-1] != shape[1] for s, f in factored):
        return None
    return zero3.piece_bounds(shape, dim, chunk_bytes)


def _lookup_piece(factored, coef, axis: int, lo: int, hi: int, kernel: str):
    """Rows (``axis`` 0) or columns (1) ``lo:hi`` of a table's clipped sum, float32: an id outside the rows adds
    nothing (its output gradient selected away), a dense use's factor is sliced."""
    uses = []
    for _, f in factored:
        left, right, rows = f.left[0], f.right[0], f.rows
        if axis == 1:
            right = right[..., lo:hi]
        elif f.left_is_ids:
            inside = (left >= lo) & (left < hi)
            left, right, rows = jnp.where(inside, left - lo, 0), jnp.where(inside[..., None], right, 0), hi - lo
        else:
            left, rows = left[..., lo:hi], hi - lo
        uses.append(pergrad.Outer(left, right, rows, (rows, right.shape[-1]), f.left_is_ids))
    return pergrad.weighted_sum(uses, coef, kernel)


def norms_and_summers(cfg, plan: ProgramPlan, leaves, terms, size: int, reuse: bool = True, layout=None):
    """``({leaf: sq [B]}, {leaf: coef [B] -> clipped sum (leaf shape, float32)})`` from :func:`_leaf_terms`.
    ``reuse=False``: norms only (summed elsewhere: ghost mode's weighted leaves), in float32, nothing kept. Under a
    ZeRO-3 ``layout`` (:func:`~dpzero_jax.program.zero3.tables`: the shard_map's, or the GSPMD hint's split) a lookup
    table's summer larger than ``layout.sum_chunk_bytes`` is a :class:`ChunkedSummer` (its pieces go to their owners
    one at a time: :func:`~dpzero_jax.program.zero3.owned`), formed from the uses' factors in float32; its norm is
    taken as ``reuse=False`` takes it, of that gradient (no copy in ``instantiated_dtype``, which no sum would read)."""
    sq, summers = {}, {}
    for leaf, (form, value, axis) in terms.items():
        if not reuse:
            if form == "direct":
                sq[leaf] = pergrad.direct_sq_norm(value, axis)
            else:
                sq[leaf], _ = _outer_norm_and_sum(value, cfg.norm_method, cfg.norm_kernel, size, reuse=False)
            continue
        if form == "direct":
            value = pergrad.kept(value.astype(cfg.instantiated_dtype))   # kept for the clipped sum, normed as kept
            sq[leaf] = pergrad.direct_sq_norm(value, axis)
            summers[leaf] = (lambda v, a: lambda coef: pergrad.weighted_rows_at(v, coef, a))(value, axis)
        else:
            chunks = None if layout is None else _lookup_pieces(value, leaves[leaf], layout.dim(plan.paths[leaf]),
                                                                layout.sum_chunk_bytes)
            if chunks is not None:
                # summed in pieces from the uses' factors: normed alone, in float32 (nothing is kept for the sum,
                # and the norm is of the gradient the pieces add up, not of a copy in instantiated_dtype)
                sq[leaf], _ = _outer_norm_and_sum(value, cfg.norm_method, cfg.norm_kernel, size, reuse=False)
                summers[leaf] = ChunkedSummer(functools.partial(_lookup_piece, value, kernel=cfg.norm_kernel),
                                              chunks[1], chunks[0])
                continue
            sq[leaf], clipped = _outer_norm_and_sum(value, cfg.norm_method, cfg.norm_kernel, size,
                                                    cfg.instantiated_dtype)
            site, first = value[0]
            summers[leaf] = (lambda c, s, f, lf: lambda coef: sites_lib.to_leaf(s, c(coef), lf, f))(
                clipped, site, first, leaves[leaf])
    return sq, summers


def coefficients(cfg, plan: ProgramPlan, sq: dict, losses, mask, size: int):
    """``(norms [B, M], coef [B, M])`` from ``{leaf: sq [B]}``."""
    by_group: dict[int, Any] = {}
    for leaf, value in sq.items():
        group = plan.group_of[plan.paths[leaf]]
        by_group[group] = by_group.get(group, 0.0) + value.astype(jnp.float32)
    zero = jnp.zeros((size,), jnp.float32)
    norms = jnp.sqrt(jnp.stack([by_group.get(m, zero) for m in range(len(plan.group_names))], axis=1))
    keep = jnp.logical_and(mask, jnp.isfinite(losses))
    return norms, clipping.coefficients(norms, jnp.asarray(plan.thresholds), keep, cfg.clip_fn, cfg.gamma)


def program_bk(cfg, plan: ProgramPlan, params, batch, mask, layout=None):
    """``(losses [B], clipped sum like params (float32), norms [B, M], coef [B, M])`` on one (micro)batch. With a
    ZeRO-3 ``layout`` (:class:`~dpzero_jax.sharding.ShardLayout`, inside ``jax.shard_map``): ``params`` are this
    device's shards, gathered at each use, and each sum comes back reduce-scattered to its owner."""
    leaves, treedef = jax.tree.flatten(params)
    batch_leaves = jax.tree.leaves(batch)
    size = batch_leaves[0].shape[0]
    losses, records, probe_ct, fallback_ct, tapped = _pass(plan, leaves, batch_leaves, layout)
    whole = whole_leaves(plan, leaves, layout, probe_ct)
    terms = _leaf_terms(plan, whole, records, probe_ct, fallback_ct, method=cfg.norm_method,
                        example_axis=example_axes(plan), tapped=tapped)
    split = zero3.tables(plan.paths, leaves, layout)
    sq, summers = norms_and_summers(cfg, plan, whole, terms, size, layout=split)
    norms, coef = coefficients(cfg, plan, sq, losses, mask, size)
    sums = {i: clipped_sum(summers[i], coef[:, plan.group_of[plan.paths[i]]], whole[i]) for i in summers}
    return losses, jax.tree.unflatten(treedef, zero3.owned(plan.paths, leaves, sums, layout, split=split)), norms, coef


def clipped_sum(summer, coef, leaf):
    """``after -> sum_i coef_i g_i`` (the leaf's shape, float32), formed once ``after`` exists (None: at once); for a
    :class:`ChunkedSummer`, its pieces so (:class:`~dpzero_jax.program.zero3.InChunks`)."""
    if isinstance(summer, ChunkedSummer):
        def piece(after, lo, hi):
            scale = coef if after is None else coef + finite_zero(after)
            return summer.part(scale, summer.axis, lo, hi)
        return zero3.InChunks([functools.partial(piece, lo=lo, hi=hi) for lo, hi in summer.bounds], summer.axis)

    def form(after):
        scale = coef if after is None else coef + finite_zero(after)
        return summer(scale).reshape(leaf.shape).astype(jnp.float32)
    return form


def whole_leaves(plan: ProgramPlan, leaves, layout, probe_ct) -> list:
    """The whole leaves :func:`_leaf_terms` reads (see :func:`~dpzero_jax.program.zero3.whole`): a sharded leaf
    with a local or convolution site is gathered after that site's output gradient exists; others need shapes."""
    if layout is None:
        return list(leaves)
    after = {}
    for path, site in sorted(plan.analysis.sites.items()):
        if site.kind in ("local", "conv") and path in probe_ct:
            after.setdefault(site.view.leaf, probe_ct[path])
    return zero3.whole(plan.paths, leaves, layout, frozenset(after), after)
