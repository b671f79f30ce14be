"""The Markdown tables of ``tpu_aot.py``'s compiled points: per-device memory, FLOPs and collectives with DP against
the same case's non-private step (:func:`table`), the buffer assignment beside ``memory_analysis()``
(:func:`buffer_table`), the issue's targets per case and strategy (:func:`targets_table`), and the Pallas TPU kernels
compiled through the same path (:func:`kernel_table`). Plain text from the cached JSON: no JAX."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_steps import GIB  # noqa: E402  (a sibling module; imports JAX only inside its functions)


def gib(value) -> str:
    return f"{value / GIB:.2f}"


def table(points: dict) -> str:
    """A Markdown table of the compiled points: per device temp / argument / output GiB, TFLOPs, collective MB, and
    DP against the same case's non-private step (temp and collective-bytes ratios)."""
    lines = ["| case | topology | mesh | strategy | step | temp GiB | args GiB | out GiB | TFLOPs (static) | "
             "collectives, static (count, MB) | DP/non-DP temp | DP/non-DP coll. bytes, static | collective GB per "
             "step | DP/non-DP coll. bytes per step | matmul TFLOPs per step | DP/non-DP matmul FLOPs per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(points):
        r = points[key]
        case, strategy, variant = key.split("/")
        base = points.get(f"{case}/{strategy}/nonprivate", {})
        head = f"| {case} | {r.get('topology', '-')} | {r.get('mesh', '-')} | {strategy} | {variant} |"
        if "failed" in r:
            used = (f" (needs {gib(r['used_bytes'])} of {gib(r['hbm_bytes'])} GiB)" if "used_bytes" in r else "")
            lines.append(head + f" {r['failed']}{used}: {r['message'][:120]} |" + " |" * 10)
            continue
        colls = ", ".join(f"{k} {v['count']}, {v['bytes'] / 1e6:.0f}" for k, v in sorted(r["collectives"].items()))
        ratio_temp = ratio_coll = ratio_step = "-"
        per_step = r.get("collective_bytes_per_step")
        if variant != "nonprivate" and "temp_bytes" in base:
            ratio_temp = f"{r['temp_bytes'] / max(base['temp_bytes'], 1):.2f}x"
            ratio_coll = f"{r['collective_bytes'] / max(base['collective_bytes'], 1):.2f}x"
            if per_step is not None and base.get("collective_bytes_per_step"):
                ratio_step = f"{per_step / base['collective_bytes_per_step']:.2f}x"
        step_gb = "-" if per_step is None else f"{per_step / 1e9:.1f}"
        mm, mm_base = r.get("matmul_flops_per_step"), base.get("matmul_flops_per_step")
        mm_tf = "-" if mm is None else f"{mm / 1e12:.1f}"
        ratio_mm = f"{mm / mm_base:.2f}x" if mm and mm_base and variant != "nonprivate" else "-"
        lines.append(head + f" {gib(r['temp_bytes'])} | {gib(r['argument_bytes'])} | {gib(r['output_bytes'])} "
                     f"| {r['flops'] / 1e12:.1f} | {colls or '-'} | {ratio_temp} | {ratio_coll} | {step_gb} "
                     f"| {ratio_step} | {mm_tf} | {ratio_mm} |")
    return "\n".join(lines)


TARGET_CASES = {"gpt2-xl": "GPT-2 XL, 256 v5e", "gptj-6b": "GPT-J-6B shape, 256 v5e",
                "llama2-7b": "Llama-2-7B shape, 256 v5e", "llama2-70b-lora": "Llama-2-70B shape, LoRA, 128 v5p",
                "llama2-70b": "Llama-2-70B shape, 128 v5p", "gpt3-175b": "GPT-3 175B shape, 512 v5p"}


def targets_table(points: dict, planner: dict | None = None) -> str:
    """One row per case and strategy: the non-private step's temporaries (``memory_analysis()``) and collective bytes
    per executed step, and the DP steps' against them -- ``dp`` (``auto``, one all-layer group) and
    ``dp-layerwise`` (one group per layer and scan iteration) -- temporaries ratio / collectives ratio.
    ``planner``: ``{(case, strategy): text}`` for the last column (the planner against the compiler's peak)."""
    lines = ["| model, chips | strategy | non-DP: temp GiB, collectives GB a step | DP `auto`: temp x, collectives x "
             "| DP layer-wise: temp x, collectives x | planner / peak, non-DP / DP |",
             "|---|---|---|---|---|---|"]
    for case, label in TARGET_CASES.items():
        for strategy in ("gspmd", "explicit"):
            base = points.get(f"{case}/{strategy}/nonprivate")
            if not base or "failed" in base:
                continue
            cells = [f"{gib(base['temp_bytes'])}, {base['collective_bytes_per_step'] / 1e9:.1f}"]
            for variant in ("dp", "dp-layerwise"):
                r = points.get(f"{case}/{strategy}/{variant}")
                if not r or "failed" in r:
                    cells.append("-")
                    continue
                cells.append(f"{r['temp_bytes'] / base['temp_bytes']:.2f}x, "
                             f"{r['collective_bytes_per_step'] / base['collective_bytes_per_step']:.2f}x")
            cells.append((planner or {}).get((case, strategy), "-"))
            lines.append(f"| {label} | {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def buffer_table(points: dict) -> str:
    """The points compiled with ``--buffers``: the compiler's buffer assignment (its preallocated temporary buffer,
    and the HBM total it checks against the chip: that buffer + arguments + outputs) beside ``memory_analysis()``'s
    temporaries, each against the same case's non-private step."""
    lines = ["| case | strategy | step | preallocated temp GiB | x | HBM total GiB | x | memory_analysis temp GiB "
             "| x |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(points):
        r = points[key]
        if "preallocated_temp_bytes" not in r:
            continue
        case, strategy, variant = key.split("/")
        base = points.get(f"{case}/{strategy}/nonprivate", {})
        cells = []
        for field in ("preallocated_temp_bytes", "default_space_bytes", "temp_bytes"):
            ratio = f"{r[field] / base[field]:.2f}x" if variant != "nonprivate" and field in base else "-"
            cells.append(f"{gib(r[field])} | {ratio}")
        lines.append(f"| {case} | {strategy} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def kernel_table(kernels: dict) -> str:
    lines = ["| kernel | shapes | Mosaic custom-calls | temp MiB | compile s |", "|---|---|---|---|---|"]
    for name, r in sorted(kernels.items()):
        if "failed" in r:
            lines.append(f"| {name} | {r.get('shapes', '-')} | {r['failed']}: {r['message'][:120]} | | |")
        else:
            lines.append(f"| {name} | {r['shapes']} | {r['mosaic_calls']} | {r['temp_bytes'] / 2**20:.1f} "
                         f"| {r['compile_seconds']} |")
    return "\n".join(lines)
