"""The engine: exact clipped per-example gradient sums in four modes on one registry of layer rules.

Entry points (re-exported by the package): :func:`private_value_and_grad`, :func:`per_example_grad_norms`,
:func:`make_plan`.

A call first *plans* (one abstract trace of the loss under a :class:`~dpzero_jax.tape.DiscoveryTape`): which layer
calls use which trainable leaves, shapes, tied weights, the parameter groups -- and it fails with the parameter's
path if a trainable leaf is used outside a supported layer. Then a mode computes, per example ``i`` and group ``m``,
the norm of the group's gradient and the clipped sum ``sum_i C_{m,i} g_{m,i}``:

* ``bk``    book-keeping: one backward pass to the layer outputs (no parameter gradients by autodiff), norms and
            clipped sums from the captured layer inputs and output gradients;
* ``ghost`` one forward, two pullbacks: norms through per-layer sinks, then the clipped sum through per-layer ports;
* ``fused`` one pullback; each layer clips its own (layer-local) groups in its custom backward;
* ``vmap``  per-example gradients by ``jax.vmap(jax.grad)``, ``microbatch_size`` examples at a time (the reference);
* ``auto``  the mode the cost model (:func:`choose_mode`) picks for this backend and these shapes.

Noise and normalisation are in :mod:`dpzero_jax.noise`, the clip functions and groups in :mod:`dpzero_jax.clipping`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import clipping, noise, pergrad
from dpzero_jax import tape as tape_lib
from dpzero_jax.config import DPConfig
from dpzero_jax_kernels import ghost_norm

Array = jax.Array


class DPStats(NamedTuple):
    """Per-step statistics of the private gradient.

    norms: ``[B]`` per-example gradient norms (``[B, M]`` with ``M > 1`` groups); clip_factors: same shape, the
    coefficients actually applied (0 for masked or non-finite examples); num_nonfinite: examples (among those not
    masked) whose loss or norm was non-finite and that were therefore dropped; num_included: examples that
    contributed.
    """

    norms: Array
    clip_factors: Array
    num_nonfinite: Array
    num_included: Array


class UnsupportedParameterError(ValueError):
    """A trainable parameter is used outside the supported DP layers."""


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree) -> list[str]:
    """``"a/b/0/kernel"``-style paths of the leaves of ``tree`` in flatten order (nnx's ``.value`` dropped)."""
    paths = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_key_name(k) for k in keypath]
        if len(names) > 1 and names[-1] == "value" and isinstance(keypath[-1], jax.tree_util.GetAttrKey):
            names = names[:-1]
        paths.append("/".join(names))
    return paths


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one abstract trace of the loss tells the engine (static: no arrays)."""

    paths: tuple[str, ...]                         # trainable leaves, flatten order
    records: tuple[tape_lib.CallRecord, ...]       # layer calls that use trainable leaves, trace order
    uses: dict[str, tuple[tuple[int, str], ...]]   # path -> ((call index, parameter name), ...)
    group_of: dict[str, int]
    group_names: tuple[str, ...]
    thresholds: tuple[float, ...]
    batch_size: int
    outside: tuple[str, ...] = ()                  # trainable leaves used outside dpzero_jax layers
    front_end: str = "layers"

    @property
    def shared_calls(self) -> frozenset[int]:
        return frozenset(i for us in self.uses.values() if len(us) > 1 for i, _ in us)


def _batch_size(batch) -> int:
    sizes = {leaf.shape[0] if getattr(leaf, "ndim", 0) >= 1 else None for leaf in jax.tree.leaves(batch)}
    if not sizes:
        raise ValueError("the batch has no arrays")
    if None in sizes or len(sizes) != 1:
        shapes = jax.tree.map(lambda x: tuple(getattr(x, "shape", ())), batch)
        raise ValueError(f"every array of the batch needs the same leading batch axis; got shapes {shapes}")
    return sizes.pop()


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def _used_inputs(closed_jaxpr) -> list[bool]:
    from jax._src.interpreters import partial_eval as pe  # no public API for dead-code elimination

    _, used = pe.dce_jaxpr(closed_jaxpr.jaxpr, [True] * len(closed_jaxpr.jaxpr.outvars))
    return used


def make_plan(loss_fn: Callable, cfg: DPConfig, params, batch, *, require_supported: bool = True) -> Plan:
    """Trace ``loss_fn`` abstractly once and plan the private gradient (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(params)
    paths = leaf_paths(params)
    for path, leaf in zip(paths, leaves):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(f"trainable parameter {path!r} has dtype {jnp.result_type(leaf)}; trainable "
                            "parameters must be floating point (keep integer state out of params)")
    batch_size = _batch_size(batch)
    records: list[tape_lib.CallRecord] = []

    def traced(leaves, batch):
        discovery = tape_lib.DiscoveryTape({id(leaf): path for leaf, path in zip(leaves, paths)})
        with tape_lib.active(discovery):
            losses = loss_fn(jax.tree.unflatten(treedef, leaves), batch)
        records.extend(discovery.records)
        return losses

    closed = jax.make_jaxpr(traced)(_abstract(leaves), _abstract(batch))
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != (batch_size,):
        raise ValueError(f"loss_fn must return per-example losses of shape [B] = ({batch_size},); got "
                         f"{[tuple(a.shape) for a in out]}"
                         f"{' (for (losses, aux) pass has_aux=True)' if len(out) > 1 else ''}")
    used = _used_inputs(closed)[:len(leaves)]
    outside = [path for path, u in zip(paths, used) if u]
    if require_supported and outside:
        raise UnsupportedParameterError(
            f"trainable parameters used outside a supported DP layer: {outside}. This engine path needs "
            "dpzero_jax layers (dpzero_jax.nn / dpzero_jax.ops); DPConfig(front_end='auto' or 'program') with "
            "mode='bk' or 'auto' computes any model from its traced program, and mode='vmap' always works.")
    trainable_records = tuple(r for r in records if r.param_paths)
    uses: dict[str, list] = collections.defaultdict(list)
    for record in trainable_records:
        for name, path in record.param_paths:
            uses[path].append((record.index, name))
    layer_order = [clipping.parent(path) for r in trainable_records for _, path in r.param_paths]
    group_of, group_names = clipping.assign_groups(cfg.groups, paths, layer_order)
    thresholds = clipping.thresholds(cfg.max_grad_norm, len(group_names), cfg.group_thresholds)
    return Plan(tuple(paths), trainable_records, {p: tuple(u) for p, u in uses.items()}, group_of, group_names,
                tuple(float(t) for t in thresholds), batch_size, tuple(outside))


# ----------------------------------------------------------------------------------------------------------------
# Helpers shared by the modes.

def _leaf_ids(params) -> dict[int, str]:
    return {id(leaf): path for leaf, path in zip(jax.tree.leaves(params), leaf_paths(params))}


def _group_sq(plan: Plan, sq_by_path: dict[str, Array]) -> Array:
    """``[B, M]`` squared group norms from ``{path: [B]}``."""
    size = next(iter(sq_by_path.values())).shape[0] if sq_by_path else plan.batch_size
    group_sq = jnp.zeros((size, len(plan.group_names)), jnp.float32)
    for path, sq in sq_by_path.items():
        group_sq = group_sq.at[:, plan.group_of[path]].add(sq.astype(jnp.float32))
    return group_sq


def _assemble(params, grads_by_path: dict[str, Array]):
    """A pytree like ``params`` with the given gradients (zeros for unused leaves)."""
    leaves, treedef = jax.tree.flatten(params)
    out = [grads_by_path[p].astype(leaf.dtype) if p in grads_by_path else jnp.zeros(leaf.shape, leaf.dtype)
           for p, leaf in zip(leaf_paths(params), leaves)]
    return jax.tree.unflatten(treedef, out)


def _call_params(record: tape_lib.CallRecord, call_params: dict, layout) -> dict:
    """A captured call's parameters as the rule's ``per_example_grads`` reads them. With parameters stored as shards
    the capture holds the shards; the rules read only the shapes of trainable parameters (the per-example gradient
    is a function of the layer input and output gradient), so the whole weight's shape stands in for it."""
    if layout is None:
        return call_params
    return {**call_params, **{name: layout.full(path) for name, path in record.param_paths}}


def _scatter(layout, grads_by_path: dict[str, Array]) -> dict[str, Array]:
    """Whole-weight gradients to their owners (identity without a layout)."""
    if layout is None:
        return grads_by_path
    return {path: layout.scatter(path, grad) for path, grad in grads_by_path.items()}


def _per_example_uses(plan: Plan, calls: dict[int, tuple], cotangents: dict[int, Array], paths,
                      layout=None) -> dict:
    """``{path: [PerExampleGrad, ...]}`` from captured ``calls[index] = (x, params)`` and output gradients."""
    by_index = {r.index: r for r in plan.records}
    cache: dict[int, dict] = {}
    uses = {}
    for path in paths:
        uses[path] = []
        for index, name in plan.uses[path]:
            if index not in cache:
                record = by_index[index]
                x, call_params = calls[index]
                cache[index] = record.rule.per_example_grads(_call_params(record, call_params, layout), x,
                                                             cotangents[index], record.spec)
            uses[path].append(cache[index][name])
    return uses


class _Clipped(NamedTuple):
    losses: Array        # [B]
    clipped_sum: Any     # pytree like params, sum_i C_{m,i} g_{m,i}
    norms: Array         # [B, M]
    coef: Array          # [B, M]


def _keep(losses, mask):
    return jnp.logical_and(mask, jnp.isfinite(losses))


# ----------------------------------------------------------------------------------------------------------------
# The modes. Each takes ``(loss_fn, cfg, plan, params, batch, mask, layout=None)`` and returns the clipped sum
# (no noise). ``layout`` (a :class:`~dpzero_jax.tape.ParamLayout`; inside ``jax.shard_map`` only): ``params`` are
# the device's shards, every layer gathers its weights just before use (:mod:`dpzero_jax.tape`), and the clipped sum
# comes back as the owners' shards, summed over the ``fsdp`` axis only (the caller sums over the data axis).

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
    size = _batch_size(batch)
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
        instantiated = {path: sum(pergrad.instantiate(v) for v in u) for path, u in uses.items()
                        if not pergrad.use_ghost(u, cfg.norm_method)}
        sq = {path: (jnp.sum(jnp.square(instantiated[path]).reshape(size, -1), axis=1) if path in instantiated
                     else pergrad.sq_norm(u, "ghost")) for path, u in uses.items()}
    norms = jnp.sqrt(_group_sq(plan, sq))
    coef = clipping.coefficients(norms, jnp.asarray(plan.thresholds), _keep(losses, mask), cfg.clip_fn, cfg.gamma)
    grads = {path: pergrad.weighted_sum([pergrad.Direct(instantiated[path])] if path in instantiated else u,
                                        coef[:, plan.group_of[path]], kernel) for path, u in uses.items()}
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


def _microbatches(batch, mask, chunk: int):
    """Split ``[B, ...]`` arrays into ``[n, chunk, ...]`` (padding with masked examples) and a function undoing it."""
    batch_size = _batch_size(batch)
    n_chunks = -(-batch_size // chunk)
    padded = n_chunks * chunk - batch_size

    def split(x):
        if padded:
            x = jnp.concatenate([x, jnp.zeros((padded,) + x.shape[1:], x.dtype)])
        return x.reshape((n_chunks, chunk) + x.shape[1:])

    def unsplit(x):
        return x.reshape((n_chunks * chunk,) + x.shape[2:])[:batch_size]

    return jax.tree.map(split, batch), split(mask), unsplit


def _ghost(loss_fn, cfg: DPConfig, plan: Plan, params, batch, mask, layout=None) -> _Clipped:
    shared = plan.shared_calls
    probes = {r.index: jnp.zeros(r.output_shape, r.output_dtype) for r in plan.records if r.index in shared}
    sinks = {r.index: jnp.zeros((plan.batch_size, len(r.names)), jnp.float32)
             for r in plan.records if r.index not in shared}

    def forward(params, sinks, probes):
        ghost = tape_lib.GhostTape(_leaf_ids(params), probes, sinks, cfg.norm_method, cfg.norm_kernel, layout)
        with tape_lib.active(ghost):
            losses = loss_fn(params, batch)
        return (losses, ghost.ports), ghost.calls

    (losses, ports), pullback, calls = jax.vjp(forward, params, sinks, probes, has_aux=True)
    ones = jnp.ones_like(losses)
    _, sink_ct, probe_ct = pullback((ones, jax.tree.map(jnp.zeros_like, ports)))
    by_index = {r.index: r for r in plan.records}
    sq = {}
    for index, per_param in sink_ct.items():
        for j, (_, path) in enumerate(by_index[index].param_paths):
            sq[path] = sq.get(path, 0.0) + per_param[:, j]
    # Every parameter of a captured call (not only the tied one: e.g. the bias of a tied head) is handled here.
    shared_paths = [p for p, us in plan.uses.items() if any(index in shared for index, _ in us)]
    shared_uses = _per_example_uses(plan, calls, probe_ct, shared_paths, layout)
    for path, u in shared_uses.items():
        sq[path] = pergrad.sq_norm(u, cfg.norm_method, cfg.norm_kernel)
    norms = jnp.sqrt(_group_sq(plan, sq))
    coef = clipping.coefficients(norms, jnp.asarray(plan.thresholds), _keep(losses, mask), cfg.clip_fn, cfg.gamma)
    port_ct = {index: jnp.stack([coef[:, plan.group_of[path]] for _, path in by_index[index].param_paths], axis=1)
               for index in ports}
    clipped, _, _ = pullback((ones, port_ct))
    extra = _scatter(layout, {path: pergrad.weighted_sum(u, coef[:, plan.group_of[path]], cfg.norm_kernel)
                              for path, u in shared_uses.items()})
    if extra:
        extra_tree = _assemble(params, extra)
        clipped = jax.tree.map(jnp.add, clipped, extra_tree)
    return _Clipped(losses, clipped, norms, coef)


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

    def example_loss(params, example):
        return loss_fn(params, jax.tree.map(lambda x: x[None], example))[0]

    value_and_grads = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0))

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


MODES: dict[str, Callable[..., _Clipped]] = {"bk": _bk, "ghost": _ghost, "fused": _fused, "vmap": _vmap}


def choose_mode(cfg: DPConfig, plan: Plan, backend: str | None = None,
                memory_budget_bytes: int | None = None) -> DPConfig:
    """The cost model behind ``mode="auto"``: a config with a concrete mode for this plan.

    Book-keeping needs no parameter gradient from autodiff and computes the clipped sum with the same
    contractions as the non-private weight gradient; its extra work is the norms (ghost or instantiated, whichever
    ``norm_method`` picks per layer). Measured on this project's CPU benchmark it is the fastest exact mode on
    every workload (per-example gradients one example at a time pay ``B`` full parameter-sized writes and reads:
    1.2-2.4x the non-private step). Its extra memory is at most the output gradient of every trainable layer, kept
    until the norms are known; when that exceeds ``memory_budget_bytes`` the ``ghost`` mode, which keeps none, is
    chosen instead.

    The default budget is a quarter of a GPU's memory when the target (``backend``, else ``cfg.target``) is this
    process's backend, and none (always ``bk``) on a CPU and on a TPU. On a TPU the compiler schedules the kept
    gradients away: compiled for a v5e chip (``experiments/bench_compiled.py``, GPT-2 small, T 1024, tied table)
    ``ghost`` holds as many temporaries as ``bk`` at 8 per chip (11.40 against 11.38 GiB) and 0.12 GiB fewer at 16
    (14.57 against 14.69 GiB), for 1.29x the FLOPs, while the output gradients count 4.4 GB at 8 per chip -- the
    quarter-of-memory rule picked ``ghost`` there for nothing. Pass ``mode="ghost"`` for the last example per chip
    (17 against 16 there). Programs with remat regions get ``ghost`` on the traced-program front-end whatever the
    target (book-keeping would keep what remat recomputes).
    """
    if cfg.mode != "auto":
        return cfg
    backend = backend or cfg.target or jax.default_backend()
    if memory_budget_bytes is None and backend == "gpu" and backend == jax.default_backend():
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        memory_budget_bytes = None if limit is None else limit // 4
    kept_output_grads = sum(math.prod(r.output_shape) * np.dtype(r.output_dtype).itemsize for r in plan.records)
    if memory_budget_bytes is not None and kept_output_grads > memory_budget_bytes:
        return cfg.replace(mode="ghost")
    return cfg.replace(mode="bk")


def resolve_target(cfg: DPConfig) -> DPConfig:
    """``cfg`` with its target-dependent ``"auto"`` settings made concrete for ``cfg.target`` (``None``:
    ``jax.default_backend()``): ``norm_method`` and ``norm_kernel``; ``mode`` is :func:`choose_mode`'s.

    ``norm_method="auto"`` is ``"fastest"`` for a TPU and ``"mixed"`` elsewhere. Compiled for a v5e slice
    (``experiments/bench_compiled.py``, GPT-2 small, T 1024, 8 examples per chip, tied table), the time rule
    instantiates the long-sequence weights and the tied table and reuses them for the clipped sum: temporaries
    1.25x the non-private step's, FLOPs 1.00x, bytes accessed 1.25x, against 1.42x / 1.35x / 1.39x for the space
    rule. On the CPU the space rule is what the overhead benchmarks were tuned with; on GPUs nothing was measured.
    """
    target = cfg.target or jax.default_backend()
    method = cfg.norm_method
    if method == "auto":
        method = "fastest" if target == "tpu" else "mixed"
    return cfg.replace(norm_method=method, norm_kernel=ghost_norm.resolve(cfg.norm_kernel, target))


def _check_mask(mask, batch_size):
    if mask is None:
        return jnp.ones((batch_size,), bool)
    mask = jnp.asarray(mask)
    if mask.shape != (batch_size,):
        raise ValueError(f"mask must have shape [B] = ({batch_size},), got {mask.shape}")
    return mask.astype(bool)


def _front_end(cfg: DPConfig, plan: Plan, layout) -> str:
    """``"layers"`` or ``"program"`` for this config and plan; refuses what the program front-end cannot do."""
    if cfg.mode == "vmap":
        return "layers"  # differentiates the loss itself: any model
    wanted = cfg.front_end
    if wanted == "auto":
        wanted = "program" if plan.outside else "layers"
    if wanted == "layers":
        if plan.outside:
            raise UnsupportedParameterError(
                f"trainable parameters used outside a supported DP layer: {list(plan.outside)}, and "
                "DPConfig.front_end='layers'. Use front_end='auto' or 'program' (any JAX model, mode 'bk' or "
                "'auto'), build the model from dpzero_jax layers, or use mode='vmap'.")
        return "layers"
    if cfg.mode == "fused":
        which = f"trainable parameters {list(plan.outside)} are used outside dpzero_jax layers (or inside a scan, " \
            "where the layers' tape does not follow them)" if plan.outside else "front_end='program' was asked for"
        raise UnsupportedParameterError(
            f"mode='fused' runs on dpzero_jax layers only, and {which}. The traced-program front-end runs "
            "mode='bk', 'ghost' or 'auto', which give the same clipped gradient; mode='vmap' works for any model.")
    if layout is not None:
        raise UnsupportedParameterError(
            "gathering ZeRO-3 shards layer by layer needs dpzero_jax layers, and trainable parameters "
            f"{list(plan.outside) or 'of this model'} are handled by the traced-program front-end: use the "
            "gspmd strategy or gather_by_layer=False.")
    return "program"


def _program_clip(cfg: DPConfig, plan, params, batch, mask) -> _Clipped:
    """Book-keeping or ghost clipping on the traced program (:mod:`dpzero_jax.program`), ``microbatch_size`` at a
    time."""
    from dpzero_jax.program import ghost as program_ghost
    from dpzero_jax.program import mode as program_mode

    run = program_ghost.program_ghost if cfg.mode == "ghost" else program_mode.program_bk
    chunk = cfg.microbatch_size or plan.batch_size
    leaves = jax.tree.leaves(params)

    def cast(grads):
        return jax.tree.unflatten(jax.tree.structure(params),
                                  [g.astype(leaf.dtype) for g, leaf in zip(jax.tree.leaves(grads), leaves)])

    if chunk >= plan.batch_size:
        losses, grads, norms, coef = run(cfg, plan, params, batch, mask)
        return _Clipped(losses, cast(grads), norms, coef)
    chunks, chunk_mask, unsplit = _microbatches(batch, mask, chunk)

    def step(acc, inputs):
        losses, grads, norms, coef = run(cfg, plan, params, *inputs)
        return jax.tree.map(jnp.add, acc, grads), (losses, norms, coef)

    init = jax.tree.map(lambda leaf: jnp.zeros(np.shape(leaf), jnp.float32), params)
    acc, (losses, norms, coef) = jax.lax.scan(step, init, (chunks, chunk_mask))
    return _Clipped(unsplit(losses), cast(acc), unsplit(norms), unsplit(coef))


def _with_thresholds(plan, thresholds):
    """``plan`` with the group thresholds ``thresholds [M]`` (a traced array allowed: adaptive clipping,
    :mod:`dpzero_jax.adaptive_clipping`) in place of the configured ones; ``plan`` itself when None."""
    if thresholds is None:
        return plan
    thresholds = jnp.asarray(thresholds, jnp.float32)
    if thresholds.shape != (len(plan.group_names),):
        raise ValueError(f"thresholds must have shape [M] = ({len(plan.group_names)},) (one per group "
                         f"{plan.group_names}), got {thresholds.shape}")
    return dataclasses.replace(plan, thresholds=thresholds)


def _plan_and_run(loss_fn: Callable, cfg: DPConfig, params, batch, mask, layout=None, thresholds=None):
    """Plan with the configured front-end and run the mode: ``(plan, concrete config, clipped result)``.
    ``thresholds``: ``[M]`` group thresholds replacing the plan's (see :func:`_with_thresholds`)."""
    cfg = resolve_target(cfg)
    plan_params = params if layout is None else _whole_shapes(params, layout)
    plan = _with_thresholds(make_plan(loss_fn, cfg, plan_params, batch, require_supported=False), thresholds)
    mask = _check_mask(mask, plan.batch_size)
    if _front_end(cfg, plan, layout) == "program":
        from dpzero_jax.program import mode as program_mode

        program_plan = _with_thresholds(
            program_mode.plan_program(loss_fn, cfg, params, batch, plan.paths, plan.batch_size), thresholds)
        concrete = cfg.replace(mode=program_mode.concrete_mode(cfg, program_plan))
        return program_plan, concrete, _program_clip(concrete, program_plan, params, batch, mask)
    concrete = choose_mode(cfg, plan)
    return plan, concrete, MODES[concrete.mode](loss_fn, concrete, plan, params, batch, mask, layout=layout)


def _clip(loss_fn: Callable, cfg: DPConfig, params, batch, mask, layout=None,
          thresholds=None) -> tuple[Plan, _Clipped, DPStats]:
    """Plan, run the configured mode, and summarise: ``(plan, clipped result, stats)``. With a ``layout`` the plan
    is traced on the whole parameters' shapes (``layout.full``) and the mode on the shards. ``thresholds``: ``[M]``
    group thresholds given at call time (None: the configured ones); the returned plan carries them."""
    plan, _, result = _plan_and_run(loss_fn, cfg, params, batch, mask, layout, thresholds)
    mask = _check_mask(mask, plan.batch_size)
    nonfinite = jnp.logical_and(mask, jnp.logical_not(jnp.logical_and(
        jnp.isfinite(result.losses), jnp.all(jnp.isfinite(result.norms), axis=1))))
    squeeze = (lambda x: x[:, 0]) if result.norms.shape[1] == 1 else (lambda x: x)
    stats = DPStats(squeeze(result.norms), squeeze(result.coef), jnp.sum(nonfinite).astype(jnp.int32),
                    jnp.sum(jnp.logical_and(mask, jnp.logical_not(nonfinite))).astype(jnp.int32))
    return plan, result, stats


def _whole_shapes(params, layout):
    """``ShapeDtypeStruct`` tree of the whole parameters whose shards ``params`` are."""
    return jax.tree.unflatten(jax.tree.structure(params), [layout.full(path) for path in leaf_paths(params)])


def clipped_grad_sum(loss_fn: Callable, cfg: DPConfig, *, layout=None) -> Callable:
    """The clipped per-example gradient SUM, no noise and no normalisation: ``fn(params, batch, mask=None) ->
    (losses [B], sum_i mask_i C_i grad L_i, stats: DPStats)`` (``cfg.noise_multiplier`` and
    ``expected_batch_size`` are not used). The building block of :func:`private_value_and_grad` and of the
    sharded strategies, which sum it over devices before adding noise once. ``thresholds``: ``[M]`` group
    thresholds for this call (a traced array is fine: adaptive clipping), else the configured ``R / sqrt(M)`` or
    ``group_thresholds``.

    ``layout`` (a :class:`~dpzero_jax.tape.ParamLayout`, inside ``jax.shard_map``): ``params`` are this device's
    shards; each layer gathers its weights just before use and the sum comes back as the owners' shards reduced over
    the ``fsdp`` axis (:class:`dpzero_jax.sharding.ShardLayout`). Not with ``mode="vmap"``.
    """
    if not isinstance(cfg, DPConfig):
        raise TypeError(f"cfg must be a dpzero_jax.DPConfig, got {type(cfg).__name__}")

    def clipped(params, batch, mask=None, *, thresholds=None):
        _, result, stats = _clip(loss_fn, cfg, params, batch, mask, layout, thresholds)
        return result.losses, result.clipped_sum, stats

    return clipped


def split_aux(loss_fn: Callable, has_aux: bool) -> tuple[Callable, Callable | None]:
    """``(losses-only loss, aux function or None)`` for ``loss_fn(params, batch) -> (losses [B], aux)``.

    The engine traces and differentiates the losses-only function; the aux comes from one more plain call of
    ``loss_fn`` on the same inputs (no tape, no gradient; under ``jax.jit`` it is dead code when unused).
    """
    if not has_aux:
        return loss_fn, None

    def losses_only(params, batch):
        out = loss_fn(params, batch)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            got = (f"a {type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else
                   f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else type(out).__name__)
            raise ValueError(f"has_aux=True: loss_fn must return a pair (losses [B], aux), got {got}")
        return out[0]

    def aux_of(params, batch):
        return loss_fn(params, batch)[1]

    return losses_only, aux_of


def private_value_and_grad(loss_fn: Callable, cfg: DPConfig, *, has_aux: bool = False,
                           clipped_sum_hook: Callable | None = None) -> Callable:
    """Transform ``loss_fn(params, batch) -> [B]`` into a differentially private gradient function.

    Returns ``fn(params, batch, key, mask=None) -> (losses [B], grads, stats: DPStats)`` with
    ``grads = (sum_i mask_i C_i grad L_i + sigma ||R|| N(0, I)) / expected_batch_size`` (paper 000, eq. 1), where
    the clip factors ``C_{m,i}`` are taken per group. ``key`` is the PRNG key of the noise (required, even with
    ``noise_multiplier=0``, so that the call signature never changes). Works under ``jax.jit``.

    ``thresholds``: ``[M]`` group thresholds for this call (a traced array is fine), in place of the configured
    ones; the noise scale follows them (``sigma * ||thresholds||``). Adaptive clipping
    (:mod:`dpzero_jax.adaptive_clipping`) passes its current thresholds here.

    ``has_aux=True``: ``loss_fn`` returns ``(losses [B], aux)`` and ``fn`` returns ``((losses, aux), grads, stats)``
    (as ``jax.value_and_grad(..., has_aux=True)`` does); see :func:`split_aux` for how the aux is computed.

    ``clipped_sum_hook(clipped_sum, key, plan) -> clipped_sum``: the one seam of a privacy audit
    (:mod:`dpzero_jax.audit`), called between the clipped sum and the noise with the noise key and the plan (its
    ``paths``, ``group_of`` and ``thresholds``); it adds the clipped contributions of the step's gradient canaries
    exactly, as examples of the batch would. ``None`` (default): nothing is added.
    """
    if not isinstance(cfg, DPConfig):
        raise TypeError(f"cfg must be a dpzero_jax.DPConfig, got {type(cfg).__name__}")
    losses_fn, aux_of = split_aux(loss_fn, has_aux)

    def private_grad(params, batch, key, mask=None, *, thresholds=None):
        plan, result, stats = _clip(losses_fn, cfg, params, batch, mask, thresholds=thresholds)
        divisor = cfg.expected_batch_size or plan.batch_size
        clipped_sum = result.clipped_sum
        if clipped_sum_hook is not None:
            clipped_sum = clipped_sum_hook(clipped_sum, key, plan)
        grads = noise.privatize(clipped_sum, key, cfg.noise_multiplier, clipping.l2_sensitivity(plan.thresholds),
                                divisor, cfg.noise_rng)
        if aux_of is not None:
            return (result.losses, aux_of(params, batch)), grads, stats
        return result.losses, grads, stats

    return private_grad


def per_example_grad_norms(loss_fn: Callable, params, batch, *, norm_method: str = "mixed",
                           mode: str = "bk", norm_kernel: str = "auto", front_end: str = "auto") -> Array:
    """``[B]`` exact L2 norms of the per-example gradients over all parameters (no clipping, no noise).

    ``mode="bk"`` uses the layer rules, or the traced program when parameters are used outside ``dpzero_jax``
    layers (``front_end``, as in :class:`DPConfig`); ``mode="ghost"`` needs ``dpzero_jax`` layers; ``mode="vmap"``
    computes per-example gradients. ``norm_kernel``: as in :class:`DPConfig`.
    """
    if mode not in ("bk", "ghost", "vmap"):
        raise ValueError(f"per_example_grad_norms: mode must be 'bk', 'ghost' or 'vmap', got {mode!r}")
    cfg = DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode=mode, norm_method=norm_method,
                   norm_kernel=norm_kernel, front_end=front_end)
    _, _, result = _plan_and_run(loss_fn, cfg, params, batch, None)
    return result.norms[:, 0]


def autotune(loss_fn: Callable, cfg: DPConfig, params, batch, key, *, mask=None, candidates=None,
             repeats: int = 3) -> DPConfig:
    """Time the exact candidates once compiled on these inputs and return the fastest as a concrete config.

    The alternative to ``choose_mode``'s cost model when a few extra compilations are affordable: candidates are
    ``bk``, ``ghost``, ``fused`` (when the groups allow it), ``vmap`` with microbatch 1 and the whole batch, or the
    given list of configs. Each is compiled, run once to warm up, then timed ``repeats`` times (median).
    """
    if cfg.mode != "auto":
        return cfg
    batch_size = _batch_size(batch)
    if candidates is None:
        candidates = [cfg.replace(mode="bk"), cfg.replace(mode="ghost"), cfg.replace(mode="fused"),
                      cfg.replace(mode="vmap", microbatch_size=1),
                      cfg.replace(mode="vmap", microbatch_size=batch_size)]
    best, best_time = None, math.inf
    failed = []
    for candidate in candidates:
        fn = jax.jit(private_value_and_grad(loss_fn, candidate))
        try:
            jax.block_until_ready(fn(params, batch, key, mask))
        except (ValueError, UnsupportedParameterError) as error:
            failed.append(f"{candidate.mode}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            continue  # e.g. fused with groups spanning layers
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(params, batch, key, mask))
            times.append(time.perf_counter() - start)
        elapsed = float(np.median(times))
        if elapsed < best_time:
            best, best_time = candidate, elapsed
    if best is None:
        raise ValueError("autotune: no candidate mode could run on this model and config")
    if best.mode == "vmap" and failed and all(c.mode == "vmap" for c in candidates
                                              if not any(f.startswith(c.mode + ":") for f in failed)):
        import warnings

        warnings.warn("autotune: falling back to mode='vmap' (per-example gradients instantiated: the slowest and "
                      "largest mode) because the other modes cannot run on this model: " + "; ".join(failed),
                      RuntimeWarning, stacklevel=2)
    return best
