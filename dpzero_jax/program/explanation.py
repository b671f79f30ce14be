"""The plan of the program front-end in words: per trainable parameter, the rule of its uses, how its per-example
norm is computed (ghost, instantiated, fallback) and at what cost per example, and its group -- the rows of
:func:`dpzero_jax.explain_plan` for models planned on the traced program (:mod:`dpzero_jax.program.mode`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from dpzero_jax import pergrad
from dpzero_jax.program import conv
from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program.mode import ProgramPlan


def explain(plan: ProgramPlan, params, cfg=None, summed_elsewhere: frozenset = frozenset()) -> list[dict]:
    """Per trainable parameter: how the program front-end computes its per-example gradient.

    Rows: ``path``, ``rule`` (the sites' kinds: ``dot`` / ``conv`` / ``gather`` / ``local``, or ``fallback``),
    ``method`` (``ghost`` / ``instantiate`` for factored uses by the rule of ``cfg.norm_method`` -- for ``conv`` on
    the unfolded sizes -- ``instantiate`` for local sites, ``fallback``:
    autodiff per example), ``per_example_bytes`` (float32 bytes the norm needs per example), ``group``, ``why``
    (the reason for a fallback, or the time rule's memory bound where it alone picks the ghost norm).
    ``summed_elsewhere``: leaves (indices) whose clipped sum does not reuse an
    instantiated gradient (ghost mode's leaves, summed by its second pullback, and the groups fused mode clips in
    their own backward, summed by the weight path: :func:`pergrad.use_ghost` with ``reuse=False``).
    """
    leaves = jax.tree.leaves(params)
    method = getattr(cfg, "norm_method", "mixed")
    kernel = "pallas" if getattr(cfg, "norm_kernel", "xla") == "pallas" else "xla"
    rows = []
    for i, (path, leaf) in enumerate(zip(plan.paths, leaves)):
        size = math.prod(np.shape(leaf))
        leaf_sites = plan.sites_of(i)
        why = ""
        if i in plan.analysis.fallback:
            rule, how, nbytes, why = "fallback", "fallback", 4 * size, plan.analysis.reasons.get(i, "")
        elif not leaf_sites:
            rule, how, nbytes = "unused", "-", 0
        else:
            kinds = sorted({s.kind for s in leaf_sites})
            rule = "+".join(kinds)
            if "local" in kinds:
                how, nbytes = "instantiate", 4 * size
            elif "conv" in kinds:
                how, nbytes = _explain_conv(leaf_sites, method, size, reuse=i not in summed_elsewhere)
            else:
                how, nbytes, why = _factored_row(leaf_sites, method, kernel, size, reuse=i not in summed_elsewhere,
                                                 kept_dtype=getattr(cfg, "instantiated_dtype", "float32"))
        rows.append({"path": path, "rule": rule, "method": how, "per_example_bytes": int(nbytes),
                     "group": group_label(plan, plan.group_of[path]), "why": why})
    return rows


def group_label(plan: ProgramPlan, group: int) -> str:
    """A group's name; for a group split per iteration, the range of its groups (``name[0..L-1]``)."""
    lengths = plan.iterations.get(group)
    if not lengths:
        return plan.group_names[group]
    first, last = plan.group_names[group], plan.group_names[group + math.prod(lengths) - 1]
    return f"{first[:-1]}..{last[last.rindex('[') + 1:]}"


def factored_form(leaf_sites, method: str, kernel: str, size: int, reuse: bool = True,
                  kept_dtype="float32") -> tuple[str, int]:
    """``(method, per-example bytes)`` of a leaf used by dot / gather sites, as book-keeping decides: the sites'
    factors (shapes and dtypes, from ``jax.eval_shape`` of :func:`~dpzero_jax.program.sites.factored` on one
    example) go through the rule of :func:`dpzero_jax.program.mode._outer_norm_and_sum` (an instantiated gradient
    kept in ``kept_dtype``); uses whose blocks or layouts differ are instantiated."""
    return _factored_row(leaf_sites, method, kernel, size, reuse, kept_dtype)[:2]


def _factored_row(leaf_sites, method: str, kernel: str, size: int, reuse: bool = True,
                  kept_dtype="float32") -> tuple[str, int, str]:
    """:func:`factored_form` and its reason where the time rule's memory bound alone picks the ghost norm (else
    ``""``)."""
    factored = _abstract_uses(leaf_sites)
    if factored is None:
        return "instantiate", 4 * size, ""
    uses, blocks = factored
    kernel = kernel if blocks == 1 else "xla"
    if pergrad.use_ghost(uses, method, kernel, reuse, kept_dtype):
        positions = sum(u.positions for u in uses)
        return "ghost", 4 * blocks * positions ** 2, pergrad.use_note(uses, method, kernel, reuse, kept_dtype)
    return "instantiate", 4 * size, ""


def _abstract_uses(leaf_sites):
    """``(pergrad Outer uses of one example's shapes, blocks)`` of a leaf's dot / gather sites, or ``None`` when
    their blocks or layouts differ (no shared cross terms: instantiated)."""
    factors = []
    for site in leaf_sites:
        lead = (1,) + tuple(site.lengths)
        operands = [jax.ShapeDtypeStruct(lead + tuple(site.eqn.invars[i].aval.shape), site.eqn.invars[i].aval.dtype)
                    for i in site.recorded]
        out = site.eqn.outvars[0].aval
        static = {}

        def shapes(ops, g, site=site, static=static):
            f = sites_lib.factored(site, ops, g)
            static.update(rows=f.rows, ids=f.left_is_ids, structure=f.structure[1:])
            return f.left, f.right
        left, right = jax.eval_shape(shapes, operands, jax.ShapeDtypeStruct(lead + tuple(out.shape), out.dtype))
        factors.append((jax.ShapeDtypeStruct((left.shape[0],) + left.shape[2:], left.dtype),
                        jax.ShapeDtypeStruct((right.shape[0],) + right.shape[2:], right.dtype), static))
    if len({f[2]["structure"] + (f[0].shape[0],) for f in factors}) > 1:   # as mode._same_blocks: no shared cross terms
        return None
    uses = [pergrad.Outer(left, right, st["rows"], (st["rows"], right.shape[-1]), st["ids"])
            for left, right, st in factors]
    return uses, factors[0][0].shape[0]


def _explain_conv(leaf_sites, method: str, size: int, reuse: bool = True) -> tuple[str, int]:
    """``(method, per-example bytes)`` of a kernel used by conv sites, as book-keeping decides
    (:func:`~dpzero_jax.program.sites.conv_factored`; ``reuse=False``: as ghost mode decides)."""
    if not sites_lib.conv_factored(leaf_sites, method, reuse):
        return "instantiate", 4 * size
    groups = conv.sizes(leaf_sites[0].eqn)[0]
    positions = sum(sites_lib.conv_positions(s) for s in leaf_sites)
    return "ghost", 4 * groups * math.prod(sites_lib.xs_lengths(leaf_sites[0])) * positions ** 2

