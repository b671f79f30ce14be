"""The planner's Llama-family presets against the TPU compiler: ``dpzero plan --compile`` for each, on one slice.

For each preset (default: Mistral-7B, Llama-3-8B, Qwen2-7B, Gemma-7B; held out of the planner's formulas until
2026-11-30, when Gemma-7B's and Llama-3-8B's dumps showed the vocabulary-sharded head's moments) the plan and the
compiled non-private and DP steps (:func:`dpzero_jax.planner.compile_plan`: the trainer's ZeRO step, remat
``block``, one sequence per chip) on ``--topology`` (default v5e:16x16, 256 chips, fsdp over all of them), printed
as a table and written as JSON. Needs libtpu (the ``tpu-aot`` extra, its own environment)::

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 /work/venv-tpu/bin/python \\
        experiments/planner_presets_tpu.py [--models mistral-7b,gemma-7b] [--seq 2048]

``--cached`` compiles nothing (no libtpu needed): it prints the recorded compiled figures of ``--out`` against
today's planner (the planner columns recomputed; the JSON is left as it is).

A preset is compiled as the project's Llama with the preset's sizes (Gemma's embedding scaling and soft-caps are not
in a preset: ``docs/planner.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dpzero_jax import planner

DEFAULT_MODELS = ("mistral-7b", "llama-3-8b", "qwen2-7b", "gemma-7b")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planner_presets_tpu.json")
GiB = 2**30


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--topology", default="v5e:16x16")
    parser.add_argument("--chips", type=int, default=256, help="the topology's chip count (default 256)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--cached", action="store_true", help="compile nothing: the recorded compiles of --out "
                                                                  "against today's planner")
    args = parser.parse_args(argv)
    if args.cached:
        with open(args.out) as f:
            recorded = json.load(f)
        rows = []
        for row in recorded["rows"]:
            plan = planner.plan_memory(row["model"], row["devices"], row["devices"], recorded["seq"], "bf16", 3,
                                       remat="block")
            rows.append(_row(row["model"], row, plan.total if row["private"] else plan.total_non_dp))
        _print(rows)
        return recorded
    rows = []
    for model in args.models.split(","):
        plan = planner.plan_memory(model, args.chips, args.chips, args.seq, "bf16", 3, remat="block")
        for compiled in planner.compile_plan(model, plan, args.topology):
            rows.append(_row(model, compiled.to_dict(), plan.total if compiled.private else plan.total_non_dp))
    _print(rows)
    result = {"topology": args.topology, "seq": args.seq, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def _row(model: str, compiled: dict, planned: int) -> dict:
    """One table row: the compiled figures (``CompiledMemory.to_dict()``) and the planner's total against them."""
    total, peak = compiled["total_bytes"], compiled["peak_bytes"]
    return {**compiled, "model": model, "planned_bytes": planned,
            "planned_over_compiled": planned / total if total else None,
            "planned_over_peak": planned / peak if peak else None}


def _print(rows: list[dict]) -> None:
    print("| model | step | compiled GiB (total per chip) | peak GiB | planner GiB | planner / compiled | "
          "planner / peak | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        total = "refused" if r["total_bytes"] is None else f"{r['total_bytes'] / GiB:.3f}"
        ratio = "-" if r["planned_over_compiled"] is None else f"{r['planned_over_compiled']:.2f}"
        peak = "-" if not r["peak_bytes"] else f"{r['peak_bytes'] / GiB:.3f}"
        over_peak = "-" if r["planned_over_peak"] is None else f"{r['planned_over_peak']:.2f}"
        print(f"| {r['model']} | {'dp' if r['private'] else 'nonprivate'} | {total} | {peak} "
              f"| {r['planned_bytes'] / GiB:.3f} | {ratio} | {over_peak} | {r['fits']} |")


if __name__ == "__main__":
    sys.exit(main() and 0)
