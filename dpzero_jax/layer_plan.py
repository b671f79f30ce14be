"""The layers front-end's plan and what its modes share.

:func:`make_plan` traces the loss once under a :class:`~dpzero_jax.tape.DiscoveryTape`: which layer calls use which
trainable leaves, shapes, tied weights, the parameter groups; a trainable leaf used outside a supported layer is
refused with its path (:class:`UnsupportedParameterError`). The modes (:mod:`dpzero_jax.modes`) compute from the
plan; the helpers below turn per-path results into group norms and parameter-shaped sums.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from dpzero_jax import clipping
from dpzero_jax import tape as tape_lib
from dpzero_jax.config import DPConfig

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


def whole_shapes(params, layout):
    """``ShapeDtypeStruct`` tree of the whole parameters whose ZeRO-3 shards ``params`` are (``layout.full``)."""
    return jax.tree.unflatten(jax.tree.structure(params), [layout.full(path) for path in leaf_paths(params)])


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
    misplaced: tuple[str, ...] = ()                # layer calls the layer tapes cannot compute, and why

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


def used_inputs(closed_jaxpr) -> list[bool]:
    from jax._src.interpreters import partial_eval as pe  # no public API for dead-code elimination

    _, used = pe.dce_jaxpr(closed_jaxpr.jaxpr, [True] * len(closed_jaxpr.jaxpr.outvars))
    return used


def _first_uses(jaxpr, invars, path: tuple = ()) -> dict[int, tuple]:
    """``{k: path of the first equation that reads invars[k]}`` (entering sub-programs, whose inputs map one to
    one onto their equation's operands: calls, ``scan``, ``remat``, custom-derivative functions)."""
    position = {v: k for k, v in enumerate(invars)}
    found: dict[int, tuple] = {}
    for index, eqn in enumerate(jaxpr.eqns):
        here = path + (index,)
        sub = next((eqn.params[n] for n in ("jaxpr", "call_jaxpr", "fun_jaxpr") if n in eqn.params), None)
        sub = getattr(sub, "jaxpr", sub)
        for j, var in enumerate(eqn.invars):
            k = position.get(var) if not isinstance(var, jcore.Literal) else None
            if k is None or k in found:
                continue
            if sub is not None and hasattr(sub, "eqns") and len(sub.invars) == len(eqn.invars):
                inner = _first_uses(sub, [sub.invars[j]], here)
                found[k] = inner.get(0, here)
            else:
                found[k] = here
    return found


def _trace_discovery(fn: Callable, treedef, paths, leaves, args):
    """``(closed jaxpr, layer call records)`` of ``fn(params, *args)`` traced abstractly under the discovery tape."""
    records: list[tape_lib.CallRecord] = []

    def traced(leaves, args):
        top = next((x for x in jax.tree.leaves((args, leaves)) if isinstance(x, jax.core.Tracer)), None)
        discovery = tape_lib.DiscoveryTape({id(leaf): path for leaf, path in zip(leaves, paths)},
                                           getattr(top, "_trace", None))
        with tape_lib.active(discovery):
            out = fn(jax.tree.unflatten(treedef, leaves), *args)
        records.extend(discovery.records)
        return out

    return jax.make_jaxpr(traced)(_abstract(leaves), _abstract(args)), records


def _discover(fn: Callable, params, *args):
    """``fn(params, *args)`` traced abstractly under the discovery tape: ``(closed jaxpr, layer call records,
    per leaf of params: whether the program uses it outside dpzero_jax layers, {call index: description of a misplaced
    call})``.
    The leaves of a misplaced layer call (:func:`_misplaced_calls`) count as used outside layers and its record is
    dropped: the layer tapes cannot compute it, the traced-program front-end can."""
    leaves, treedef = jax.tree.flatten(params)
    paths = leaf_paths(params)
    closed, records = _trace_discovery(fn, treedef, paths, leaves, args)
    used = used_inputs(closed)[:len(leaves)]
    why = _misplaced_calls(fn, treedef, paths, leaves, args, records)
    misplaced = {r.index: f"{r.rule.name} layer call on {[path for _, path in r.param_paths]}: {why[r.index]}"
                 for r in records if r.index in why}
    if misplaced:
        moved = {path for r in records if r.index in misplaced for _, path in r.param_paths}
        used = [u or path in moved for u, path in zip(used, paths)]
        records = [r for r in records if r.index not in misplaced]
    return closed, records, used, misplaced


def _misplaced_calls(fn: Callable, treedef, paths, leaves, args, records) -> dict[int, str]:
    """``{call index: why}`` for the calls of layers with trainable parameters that the layer tapes would get wrong:
    a call inside a nested trace (``jax.checkpoint`` / remat, ``lax.scan`` / ``nn.scan``, ``vmap``, ``cond``, a nested
    ``jit``: the tapes' probes cannot reach into it), or one whose input does not carry the examples on its leading
    axis (the rules read ``x[i]`` as example ``i``; a time-major ``[T, B, d]`` input is wrong when ``T == B`` and fails
    to broadcast otherwise). Where the leading axis has the batch's size and another axis too, the loss is traced
    once more with one example more and the call's leading axis must follow."""
    try:
        batch = _batch_size(args[0]) if args else None
    except ValueError:
        batch = None
    out, ambiguous = {}, []
    for r in records:
        if not r.param_paths:
            continue
        if not r.top_level:
            out[r.index] = ("called inside a transformation of the loss (jax.checkpoint / remat, lax.scan / nn.scan, "
                            "vmap, cond or a nested jit)")
        elif batch is not None and r.input_shape[:1] != (batch,):
            out[r.index] = f"input of shape {r.input_shape}: its leading axis is not the batch's {batch} examples"
        elif batch is not None and batch in r.input_shape[1:]:
            ambiguous.append(r)
    if ambiguous:
        grown = jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch + 1,) + np.shape(x)[1:], jnp.result_type(x)),
                             args[0])
        try:
            again = {r.index: r for r in _trace_discovery(fn, treedef, paths, leaves, (grown, *args[1:]))[1]}
        except Exception:   # the loss does not trace with another batch size (e.g. it closes over [B] arrays)
            again = {}
        for r in ambiguous:
            if again.get(r.index) is None or again[r.index].input_shape[:1] != (batch + 1,):
                out[r.index] = (f"input of shape {r.input_shape}: its leading axis did not follow the batch when the "
                                f"loss was traced with {batch + 1} examples")
    return out


def used_outside_layers(fn: Callable, params, *args) -> list[str]:
    """Paths of the leaves of ``params`` that ``fn(params, *args)`` uses outside ``dpzero_jax`` layers (traced
    abstractly; ``params`` and ``args`` may be ``ShapeDtypeStruct``)."""
    _, _, used, _ = _discover(fn, params, *args)
    return [path for path, u in zip(leaf_paths(params), used) if u]


def check_inputs(params, batch) -> tuple[list[str], int]:
    """``(leaf paths of params, batch size)``; refuses non-floating trainable leaves, an empty ``params`` and an empty
    or ragged batch, each with a message that names it."""
    leaves = jax.tree.leaves(params)
    paths = leaf_paths(params)
    for path, leaf in zip(paths, leaves):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(f"trainable parameter {path!r} has dtype {jnp.result_type(leaf)}; trainable "
                            "parameters must be floating point (keep integer state out of params)")
    if not leaves:
        raise ValueError("params has no arrays: there is nothing to train (a params pytree, or the model's "
                         "trainable state)")
    batch_size = _batch_size(batch)
    if batch_size == 0:
        raise ValueError("the batch is empty (0 examples); a sampled batch that may be empty is padded to a fixed "
                         "size and its padding excluded with mask")
    return paths, batch_size


def check_losses(out_avals, batch_size: int, traced_size: int | None = None) -> None:
    """Refuses a loss that does not return floating-point per-example losses ``[B]``: ``out_avals`` of the loss
    traced on ``traced_size`` examples (default: the batch's ``batch_size``; the program front-end traces one)."""
    traced_size = batch_size if traced_size is None else traced_size
    if len(out_avals) != 1 or tuple(out_avals[0].shape) != (traced_size,):
        on = "" if traced_size == batch_size else f" for a batch of {traced_size}"
        raise ValueError(f"loss_fn must return per-example losses of shape [B] = ({batch_size},); got "
                         f"{[tuple(a.shape) for a in out_avals]}{on}"
                         f"{' (for (losses, aux) pass has_aux=True)' if len(out_avals) > 1 else ''}")
    if not jnp.issubdtype(out_avals[0].dtype, jnp.floating):
        raise TypeError(f"loss_fn must return floating-point per-example losses; got dtype {out_avals[0].dtype} (an "
                        "integer loss has no gradient)")


def make_plan(loss_fn: Callable, cfg: DPConfig, params, batch, *, require_supported: bool = True) -> Plan:
    """Trace ``loss_fn`` abstractly once and plan the private gradient (see the module docstring)."""
    paths, batch_size = check_inputs(params, batch)
    closed, records, used, misplaced = _discover(loss_fn, params, batch)
    check_losses(closed.out_avals, batch_size)
    outside = [path for path, u in zip(paths, used) if u]
    if require_supported and outside:
        raise UnsupportedParameterError(
            f"trainable parameters used outside a supported DP layer: {outside}"
            f"{misplaced_note(misplaced.values())}. This engine path needs "
            "dpzero_jax layers (dpzero_jax.layers / dpzero_jax.ops); DPConfig(front_end='auto' or 'program') with "
            "mode='bk' or 'auto' computes any model from its traced program, and mode='vmap' always works.")
    trainable_records = tuple(r for r in records if r.param_paths)
    uses: dict[str, list] = collections.defaultdict(list)
    for record in trainable_records:
        for name, path in record.param_paths:
            uses[path].append((record.index, name))
    layer_order = [clipping.parent(path) for r in trainable_records for _, path in r.param_paths]
    if outside:   # leaves used outside dpzero_jax layers: in the order the traced program first uses them
        first = _first_uses(closed.jaxpr, closed.jaxpr.invars[:len(paths)])
        layer_order += [clipping.parent(paths[i]) for i in sorted(first, key=first.get) if used[i]]
    group_of, group_names = clipping.assign_groups(cfg.groups, paths, layer_order)
    thresholds = clipping.thresholds(cfg.max_grad_norm, len(group_names), cfg.group_thresholds)
    return Plan(tuple(paths), trainable_records, {p: tuple(u) for p, u in uses.items()}, group_of, group_names,
                tuple(float(t) for t in thresholds), batch_size, tuple(outside), misplaced=tuple(misplaced.values()))


def misplaced_note(misplaced) -> str:
    """The error-message clause for layer calls the layer tapes cannot compute ('' when there are none)."""
    misplaced = list(misplaced)
    if not misplaced:
        return ""
    return " (dpzero_jax layer calls that the layer tapes cannot compute: " + "; ".join(misplaced) + ")"


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
