"""What the engine will do with a model, per parameter, before any training: :func:`explain_plan`.

    report = dz.explain_plan(loss_fn, cfg, params, batch)
    print(report)            # a table: path, rule, method, per-example bytes, group
    report.rows              # the same as dicts

Rows: ``rule`` -- how the parameter's uses were recognised (layers front-end: the ``dpzero_jax`` layer rule;
program front-end: ``dot`` / ``conv`` / ``gather`` / ``local`` sites, or ``fallback``); ``method`` -- ``ghost``
(Gram form, ``[T, T]`` per example), ``instantiate`` (the per-example gradient, the parameter's size per example),
``direct`` (a small per-example gradient by its rule) or ``fallback`` (autodiff per example); ``per_example_bytes``
-- float32 bytes per example the norm needs; ``why`` -- for a fallback, what in the program caused it; for a weight
whose ghost norm the time rule's memory bound alone picks, by how much its kept instantiation would exceed the bound.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dpzero_jax import engine, norm_rules, pergrad
from dpzero_jax.config import DPConfig
from dpzero_jax.mesh_options import STRATEGIES


@dataclasses.dataclass(frozen=True)
class PlanReport:
    front_end: str
    mode: str
    rows: tuple[dict, ...]
    misplaced: tuple[str, ...] = ()   # dpzero_jax layer calls sent to the program front-end, and why

    def table(self) -> str:
        columns = ("path", "rule", "method", "per_example_bytes", "group", "why")
        cells = [columns] + [tuple(str(row[c]) for c in columns) for row in self.rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        lines = [f"front end: {self.front_end}, mode: {self.mode}"]
        lines += [f"  (a dpzero_jax layer call the layer tapes cannot compute: {note})" for note in self.misplaced]
        for k, line in enumerate(cells):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _positions(record) -> int:
    """Positions per example of one layer call: an embedding's ids, a linear layer's input rows."""
    return math.prod(record.input_shape[1:] if record.rule.name == "embed" else record.input_shape[1:-1])


def _layers_rule(method: str, records, size: int, reuse: bool = True) -> tuple[bool, str]:
    """``(ghost, why)`` for a weight of ``size`` elements used by ``records`` (layer calls), by the rule
    book-keeping applies to their per-example factors (:func:`dpzero_jax.pergrad.shape_rule`; ``why``: where the
    time rule's memory bound alone picks the ghost norm): ``[rows, cols]`` is a table's ``[vocabulary, width]``
    where an embedding uses it, else a kernel's ``[inputs, outputs]``. ``reuse=False``: ghost and fused, which form
    the clipped sum by its own contraction."""
    embeds = [r for r in records if r.rule.name == "embed"]
    if embeds:
        cols = embeds[0].output_shape[-1]
    else:
        cols = size // records[0].input_shape[-1]
    shape = (sum(_positions(r) for r in records), sum(_positions(r) for r in records if r.rule.name != "embed"),
             size // cols, cols)
    return pergrad.shape_rule(method, *shape, reuse), norm_rules.bound_note(method, *shape, reuse)


def _layer_rows(plan, params, cfg: DPConfig) -> list[dict]:
    sizes = {path: math.prod(np.shape(leaf)) for path, leaf in zip(plan.paths, jax.tree.leaves(params))}
    by_index = {r.index: r for r in plan.records}
    rows = []
    for path in plan.paths:
        uses = plan.uses.get(path, ())
        rules = sorted({by_index[i].rule.name for i, _ in uses})
        why = ""
        if not uses:
            rule, method, nbytes = "unused", "-", 0
        elif set(rules) <= {"linear", "embed", "rmm_linear"} and any(name in ("kernel", "table") for _, name in uses):
            ghost, why = _layers_rule(cfg.norm_method, [by_index[i] for i, _ in uses], sizes[path],
                                      reuse=cfg.mode not in ("ghost", "fused"))
            positions = sum(_positions(by_index[i]) for i, _ in uses)
            rule, method = "+".join(rules), "ghost" if ghost else "instantiate"
            nbytes = 4 * (positions ** 2 if ghost else sizes[path])
        else:
            rule, method, nbytes = "+".join(rules), "direct", 4 * sizes[path]
        rows.append({"path": path, "rule": rule, "method": method, "per_example_bytes": int(nbytes),
                     "group": plan.group_names[plan.group_of[path]], "why": why})
    return rows


def explain_plan(loss_fn, cfg: DPConfig, params, batch, *, rules=None, strategy: str = "gspmd") -> PlanReport:
    """Plan ``loss_fn(params, batch) -> [B]`` as the private gradient would (abstractly: nothing is computed) and
    report, per trainable parameter, how its per-example gradient and norm are obtained. ``rules``: the
    :class:`~dpzero_jax.sharding.ShardingRules` of a ZeRO-3 run (None: unsharded), with its ``strategy`` (the
    trainer's ``TrainConfig.strategy``: ``"gspmd"``, the default, or ``"explicit"``): the program front-end then
    sums a large table the layout splits in pieces where it forms that sum itself (bk; ghost sums its lookups by the
    weight path), and the plan says which. Fused mode under ``explicit`` also book-keeps an untied lookup of such a
    table to that end; under ``gspmd`` it clips that lookup at its site (a tied table, book-kept anyway, is summed in
    pieces under both)."""
    if not isinstance(cfg, DPConfig):
        raise TypeError(f"cfg must be a dpzero_jax.DPConfig, got {type(cfg).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'gspmd' or 'explicit' (TrainConfig.strategy), got {strategy!r}")
    layout = None
    if rules is not None:
        from dpzero_jax import sharding

        if not isinstance(rules, sharding.ShardingRules):
            raise TypeError(f"rules must be a dpzero_jax.sharding.ShardingRules, got {type(rules).__name__}")
        layout = sharding.ShardLayout(rules, params) if rules.zero == 3 else None
    requested, cfg = cfg, engine.resolve_target(cfg)
    plan = engine.make_plan(loss_fn, cfg, params, batch, require_supported=False)
    if cfg.mode == "vmap":
        rows = [{"path": p, "rule": "vmap", "method": "instantiate", "per_example_bytes": 4 * math.prod(np.shape(x)),
                 "group": plan.group_names[plan.group_of[p]], "why": ""}
                for p, x in zip(plan.paths, jax.tree.leaves(params))]
        return PlanReport("layers", "vmap", tuple(rows))
    front_end = engine._front_end(cfg, plan, None)
    if front_end == "program":
        from dpzero_jax.program import explanation
        from dpzero_jax.program import mode as program_mode

        program_plan = program_mode.plan_program(loss_fn, cfg, params, batch, plan.paths, plan.batch_size)
        mode = program_mode.concrete_mode(cfg, program_plan)
        cfg = engine.resolve_for_mode(requested, mode)
        summed_elsewhere = frozenset()
        if mode == "ghost":   # the ghost sites' leaves and the weighted leaves: summed by the weight path
            from dpzero_jax.program import ghost as program_ghost

            ghost_paths = program_ghost.eligible(program_plan)
            # the examples each device holds decide whether a table is weighted (the explicit strategy's rules)
            per_device = program_plan.batch_size if rules is None else max(
                1, program_plan.batch_size // rules.mesh.devices.size)
            summed_elsewhere = program_ghost.weighted(program_plan, ghost_paths, cfg, per_device) | {
                program_plan.analysis.sites[path].view.leaf for path in ghost_paths}
        if mode == "fused":   # a group clipped in its own backward is summed by the weight path: nothing reused
            from dpzero_jax.program import fused as program_fused

            # under GSPMD the engine's fused pass runs without the shard_map layout (program_fused's comment)
            booked = program_fused.local_groups(program_plan, layout if strategy == "explicit" else None)[2]
            summed_elsewhere = frozenset(i for i, path in enumerate(program_plan.paths)
                                         if program_plan.group_of[path] not in booked)
        rows = explanation.explain(program_plan, params, cfg, summed_elsewhere)
        if mode == "fused":   # groups that are not local to one site are book-kept in the fused pass: say why
            for row in rows:
                reason = booked.get(program_plan.group_of[row["path"]])
                if reason:
                    row["why"] = "; ".join(filter(None, (row["why"], f"book-kept in the fused pass: {reason}")))
        if layout is not None:   # tables summed in pieces: say so
            from dpzero_jax.program import zero3

            pieces = {program_plan.paths[s.view.leaf] for s in program_plan.analysis.sites.values()
                      if zero3.sharded_table(program_plan, s, layout)
                      and s.view.leaf not in summed_elsewhere}
            for row in rows:
                if row["path"] in pieces and "in pieces" not in row["why"]:
                    note = (f"its clipped sum formed and reduce-scattered in pieces of at most "
                            f"{layout.sum_chunk_bytes} bytes (ZeRO-3)")
                    row["why"] = "; ".join(filter(None, (row["why"], note)))
        return PlanReport("program", mode, tuple(rows), plan.misplaced)
    cfg = engine.resolve_for_mode(requested, engine.choose_mode(cfg, plan).mode)
    return PlanReport("layers", cfg.mode, tuple(_layer_rows(plan, params, cfg)))
