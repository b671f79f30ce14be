"""The memory planner against the TPU compiler: ``dpzero plan --remat block|none`` vs compiled per-chip bytes.

For each ZeRO-3 step of ``experiments/tpu_aot.py`` (strategy ``gspmd``, remat ``block`` unless the spec says
``remat=none``, bf16 activations, fp32 parameters and Adam moments, one sequence per chip), the compiled per-chip
bytes -- ``memory_analysis()``'s arguments (fp32 parameters and moments) plus temporaries (gradients, activations,
everything else) -- against the planner's total (model states + temporaries [+ DP extra]) for the same model,
devices, ZeRO partition (the mesh's ``fsdp`` axis), batch and sequence length.

Compiled figures come from ``experiments/results/tpu_aot.json`` (the cached points, no libtpu needed) and from
``--compile`` specs, compiled here with libtpu (set-up: ``experiments/bench_compiled.py``) for shapes not in the
cache (every spec cached in ``--out`` is compared too), e.g. a held-out variant::

    PYTHONPATH=$PWD ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/venv-tpu/bin/python experiments/planner_vs_tpu.py \\
        --compile "llama2-7b@v5e:8x8:num_hidden_layers=16,T=1024"

A spec is ``case@topology[:key=value,...]``: a case of ``tpu_aot.CASES``, a TPU topology, and overrides of its
model config (``GPT2Config`` / ``LlamaConfig`` keyword arguments), of ``T`` / ``B``, or ``remat=none`` (the models'
remat policy; default ``block``). Compiled points are cached in ``--out`` (default
``experiments/results/planner_vs_tpu.json``). The cached case ``gpt2-xl+remat-none`` is ``tpu_aot.py``'s GPT-2 XL
step without remat.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import tpu_aot  # noqa: E402  (a sibling script; imports JAX only to compile)
import tpu_aot_tables  # noqa: E402

from dpzero_jax import planner  # noqa: E402

GIB = 2**30
DEFAULT_OUT = os.path.join(HERE, "results", "planner_vs_tpu.json")
_GPT2_KEYS = {"n_layer": "n_layer", "n_embd": "d_model", "n_head": "n_head", "vocab_size": "vocab",
              "n_positions": "n_ctx", "n_inner": "d_ff", "tie_word_embeddings": "tied"}
_LLAMA_KEYS = {"num_hidden_layers": "n_layer", "hidden_size": "d_model", "num_attention_heads": "n_head",
               "vocab_size": "vocab", "max_position_embeddings": "n_ctx", "intermediate_size": "d_ff",
               "num_key_value_heads": "n_kv_head", "tie_word_embeddings": "tied", "head_dim": "head_dim"}


def decoder_config(case: tpu_aot.Case) -> planner.DecoderConfig:
    """The planner's config of a ``tpu_aot`` case (its ``GPT2Config`` / ``LlamaConfig`` keyword arguments)."""
    keys = _GPT2_KEYS if case.family == "gpt2" else _LLAMA_KEYS
    fields = {keys[k]: v for k, v in case.config}
    if case.family == "llama":
        fields.update(family="llama", tied=fields.get("tied", False))
    return planner.DecoderConfig(name=case.name, **fields)


def _split_spec(spec: str) -> tuple[str, str, dict[str, str]]:
    """``case@topology[:key=value,...]`` -> ``(case, topology, {key: value})``."""
    name, _, rest = spec.partition("@")
    topology, _, overrides = rest.rpartition(":") if rest.count(":") >= 2 else (rest, "", "")
    if name not in tpu_aot.CASES or not topology:
        raise ValueError(f"bad spec {spec!r}: expected case@topology[:key=value,...] with a case of "
                         f"{tuple(tpu_aot.CASES)}")
    return name, topology, dict(item.partition("=")[::2] for item in filter(None, overrides.split(",")))


def parse_spec(spec: str) -> tpu_aot.Case:
    """``case@topology[:key=value,...]`` -> a ``tpu_aot.Case`` (config / ``T`` / ``B`` overridden; ``remat`` is
    :func:`spec_remat`'s)."""
    name, topology, overrides = _split_spec(spec)
    case = tpu_aot.CASES[name]
    config, extra = dict(case.config), {}
    for key, value in overrides.items():
        if key == "tie_word_embeddings":
            config[key] = bool(int(value))
        elif key != "remat":
            (extra if key in ("T", "B") else config)[key] = int(value)
    return dataclasses.replace(case, name=spec, config=tuple(config.items()), topology=topology, **extra)


def spec_remat(spec: str) -> str:
    """The remat policy a spec asks for: ``remat=none`` among its overrides, else ``block``."""
    remat = _split_spec(spec)[2].get("remat", "block")
    if remat not in ("block", "none"):
        raise ValueError(f"bad spec {spec!r}: remat must be block or none (the policies the planner models)")
    return remat


def compile_spec(case: tpu_aot.Case, variant: str, dump: str | None = None, remat: str = "block") -> dict:
    compiled, mesh, seconds = tpu_aot.compile_point(case, variant, "gspmd", remat)
    memory = compiled.memory_analysis()
    return {"mesh": f"data={mesh.shape['data']},fsdp={mesh.shape['fsdp']}", "topology": case.topology, "remat": remat,
            "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
            "peak_bytes": tpu_aot.peak_bytes(memory),
            "T": case.T, "examples_per_chip": case.B, "compile_seconds": round(seconds[1], 1),
            **(tpu_aot.take_dump(dump) if dump else {})}


def compare(case: tpu_aot.Case, points: dict) -> list[dict]:
    """Rows ``{case, mesh, variant, compiled, planner, ratio, allocated, allocated_ratio, peak, peak_ratio}`` (GiB)
    for the compiled points of ``case``; ``allocated`` (None without a buffer assignment): the compiler's HBM total,
    arguments + its preallocated temporary buffer (the outputs alias the donated arguments); ``peak`` (None where
    not recorded): the compiler's high-water mark of live bytes, ``peak_memory_in_bytes``."""
    rows = []
    config = decoder_config(case)
    for variant in ("nonprivate", "dp"):
        point = points.get(variant)
        if not point or "failed" in point:
            continue
        shape = dict(item.split("=") for item in point["mesh"].split(","))
        devices = int(shape["data"]) * int(shape["fsdp"])
        plan = planner.plan_memory(config, devices, devices * point["examples_per_chip"], point["T"], "bf16", 3,
                                   remat=point.get("remat", "block"), shards=int(shape["fsdp"]),
                                   peft="lora" if case.lora_rank else None, lora_rank=case.lora_rank or 8)
        compiled = point["argument_bytes"] + point["temp_bytes"]
        mine = plan.total if variant == "dp" else plan.total_non_dp
        allocated, peak = point.get("default_space_bytes"), point.get("peak_bytes")
        rows.append({"case": case.name, "mesh": point["mesh"], "variant": variant, "compiled": compiled / GIB,
                     "planner": mine / GIB, "ratio": mine / compiled,
                     "allocated": allocated / GIB if allocated else None,
                     "allocated_ratio": mine / allocated if allocated else None,
                     "peak": peak / GIB if peak else None, "peak_ratio": mine / peak if peak else None})
    return rows


def targets(points: dict) -> str:
    """:func:`tpu_aot_tables.targets_table` with the planner's column: its figure over the compiler's peak for the
    non-private and the ``auto`` DP step -- of the ``gspmd`` strategy, which its formulas describe, and of the
    ``explicit`` one, which they do not (marked so)."""
    ratios = {}
    for name in tpu_aot_tables.TARGET_CASES:
        for strategy in ("gspmd", "explicit"):
            rows = compare(tpu_aot.CASES[name], {v: points.get(f"{name}/{strategy}/{v}") for v in ("nonprivate", "dp")})
            if len(rows) == 2 and all(r["peak_ratio"] for r in rows):
                ratios[(name, strategy)] = " / ".join(f"{r['peak_ratio']:.2f}" for r in rows) + (
                    " (not modelled)" if strategy == "explicit" else "")
    return tpu_aot_tables.targets_table(points, ratios)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="gpt2-xl,gptj-6b,llama2-7b,llama2-70b-lora,gpt2-xl+remat-none",
                        help="cached tpu_aot cases to compare")
    parser.add_argument("--compile", action="append", default=[], help="case@topology[:key=value,...] to compile")
    parser.add_argument("--variants", default="nonprivate,dp")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--buffers", action="store_true", help="also record each compiled step's buffer assignment "
                        "(tpu_aot.py --buffers)")
    parser.add_argument("--targets", action="store_true", help="print the issue's targets per case and strategy "
                        "(tpu_aot.json; the planner against the gspmd steps' peaks) and stop")
    args = parser.parse_args(argv)
    cached = tpu_aot.load(os.path.join(HERE, "results", "tpu_aot.json")).get("points", {})
    if args.targets:
        print(targets(cached))
        return []
    rows = []
    for name in filter(None, args.cases.split(",")):
        points = {v: cached.get(f"{name}/gspmd/{v}") for v in ("nonprivate", "dp")}
        case = tpu_aot.CASES[name.split("+")[0]]
        rows += compare(dataclasses.replace(case, name=name), points)
    data = tpu_aot.load(args.out)
    if args.compile:
        if importlib.util.find_spec("libtpu") is None:
            raise SystemExit("--compile needs libtpu (see experiments/bench_compiled.py)")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    dump = tpu_aot.start_dump() if args.compile and args.buffers else None
    for spec in list(data.get("points", {})) + [s for s in args.compile if s not in data.get("points", {})]:
        case = parse_spec(spec)
        points = data.setdefault("points", {}).setdefault(spec, {})
        for variant in args.variants.split(","):
            if spec in args.compile and (variant not in points or args.recompute):
                print(f"compiling {spec} {variant} ...", flush=True)
                points[variant] = compile_spec(case, variant, dump, spec_remat(spec))
                tpu_aot.save(args.out, data)
        rows += compare(case, points)
    if dump:
        shutil.rmtree(dump, ignore_errors=True)
    print("| case | mesh | step | compiled GiB (args + temp) | planner GiB | planner / compiled | allocated GiB "
          "(args + preallocated temp) | planner / allocated | peak GiB | planner / peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        allocated = (f"{r['allocated']:.3f} | {r['allocated_ratio']:.2f}" if r["allocated"] is not None else "- | -")
        peak = f"{r['peak']:.3f} | {r['peak_ratio']:.2f}" if r["peak"] is not None else "- | -"
        print(f"| {r['case']} | {r['mesh']} | {r['variant']} | {r['compiled']:.3f} | {r['planner']:.3f} "
              f"| {r['ratio']:.2f} | {allocated} | {peak} |")
    return rows


if __name__ == "__main__":
    main()
