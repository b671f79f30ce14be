"""Overhead of the private training step over the non-private one: step time and memory, per engine mode.

What is measured
----------------
For each workload (a GPT-2-style decoder, untied LM head) the script builds, in one process, these candidates,
each a *full jitted training step* ``(params, opt_state, batch, key) -> (params, opt_state, loss)`` with the same
``optax.adamw`` update:

* ``non-DP``    ``jax.value_and_grad`` of the mean per-example loss (the baseline);
* ``auto``      ``dz.private_value_and_grad`` with ``mode="auto"`` (the mode it resolves to is printed);
* ``bk``        book-keeping;
* ``ghost``     ghost norm, two pullbacks;
* ``fused``     per-layer clipping inside the custom backward -- run with ``groups="layer-wise"`` (fused mode needs
                every clipping group inside one layer); all other DP candidates use ``groups="all-layer"``;
* ``vmap-mb1``, ``vmap-mb4``, ``vmap-mbB``  per-example gradients by ``vmap(grad)``, 1, 4 and B examples at a time
                (``vmap-mb4`` is skipped when ``B == 4``: it would be ``vmap-mbB``).

DP candidates use ``noise_multiplier=1.0, max_grad_norm=1.0, clip_fn="abadi"`` (the noise is part of the step).
Parameters and optimizer state are donated (``--no-donate`` turns this off for every candidate); each candidate
threads its own copy of the training state.

Per candidate the script reports

* **time**: every candidate is compiled (``jit(...).lower(...).compile()``) and warmed up,
  then the candidates are run *round-robin* -- one step of each per round, the order rotated every round -- for
  ``--rounds`` rounds; each step is timed with ``jax.block_until_ready`` on its outputs. The table shows the median
  (and the minimum) step time, ``x time`` = median / non-DP median and ``x paired`` = the median over rounds of
  (step time / non-DP step time *of the same round*). The paired ratio cancels slow drifts of the machine's speed
  (other processes, frequency scaling) that hit every candidate of a round alike; the time targets use it. The
  1-minute load average before and after each workload is printed: on a shared machine, a load above the number of
  cores means the timings were disturbed. ``CPU ms`` is the median *process CPU time* of a step (all threads, user +
  system, ``time.process_time``) and ``x CPU`` its ratio to non-DP: less sensitive than wall-clock time to other
  processes competing for the cores (but it counts XLA's worker threads spinning); wall-clock time stays primary.
* **XLA memory** of the compiled step from ``compiled.memory_analysis()``: ``temp`` (scratch) and ``temp+args``
  (scratch + inputs: parameters, optimizer state, batch), and its ratio to the non-DP step. With donation the outputs
  alias the inputs, so ``temp+args`` is XLA's estimate of the step's peak; output and alias sizes are in the JSON.
* **process RSS** (host memory), measured right after the candidate's compile + first step: ``maxRSS`` is
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, a *process-wide high-water mark* (it never decreases, so a value
  only tells something when it grows past the previous candidates'), and ``RSS now`` the current resident set
  (psutil, when installed). On GPU they measure host memory only; device memory is ``memory_stats()`` (JSON).
* **compile time**: ``lower`` (tracing, including the engine's planning trace) + XLA ``compile``, in seconds; the JSON
  also has XLA's static ``cost_analysis()`` (flops, bytes accessed -- a ``scan`` body, as in vmap mode, is counted
  once, not once per iteration).

Targets (printed with PASS / FAIL at the end and stored in the JSON):

* CPU only: ``auto`` step time (paired ratio) <= 1.03x non-DP on every workload; ``bk`` <= 1.10x on W1 and W3;
* compiled ``temp+args`` <= 1.1x non-DP for ``ghost`` and ``fused``, <= 1.3x for ``bk``;
* ``auto``'s first-step trace + compile (``lower`` + ``compile``) <= 2x non-DP's on W3.

Workloads (vocab 8192, untied head, 4 layers): W1 ``n_embd=512, n_head=8, T=64, B=16``; W2 ``n_embd=256,
n_head=4, T=512, B=4``; W3 ``n_embd=256, n_head=4, T=128, B=16``. ``--quick`` replaces them by one tiny workload
(a smoke test); ``--gpt2-small`` by GPT-2 small (124M + untied head, vocab 50257, T=256, B=32, bfloat16
parameters and computation -- for a GPU; falls back to the float32 model with a note if the library rejects
bfloat16). Before 2026-11-28 the bfloat16 workload computed in float32 (parameters stored in bfloat16, each cast up
at its use: Flax's ``Embed`` keeps the dtype it was built with).

How to run
----------
::

    cd /work/main && . .venv/bin/activate
    python experiments/bench_overhead.py --quick                # smoke test, ~1 minute on CPU
    python experiments/bench_overhead.py                        # W1, W2, W3 (10-25 minutes on a 2-core CPU)
    python experiments/bench_overhead.py --workloads W1 --modes auto,bk --rounds 11
    python experiments/bench_overhead.py --gpt2-small           # on a GPU
    python experiments/bench_overhead.py --layers dz.layers --modes auto  # GPT-2 from dz.layers (the layers front-end)
    python experiments/bench_overhead.py --norm-method mixed   # another per-layer norm rule for every DP candidate

Results go to ``--out`` (default ``experiments/results/bench_overhead_<backend>.json``; ``_quick`` /
``_gpt2small`` are appended for the presets). The workloads, the steps and how each is compiled and timed are in
``overhead_steps.py``; this script runs the rounds, checks the targets and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import optax

import dpzero_jax as dz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead_steps import (  # noqa: E402  (a sibling module)
    DP_CANDIDATES,
    GPT2_SMALL,
    QUICK,
    WORKLOADS,
    MiB,
    Workload,
    cast,
    check_dtype,
    compile_candidate,
    cost_fields,
    device_memory,
    host_memory,
    make_steps,
    make_workload,
    memory_fields,
    resolve_auto,
    run_step,
)

# Targets: (candidate, metric, bound, workloads it applies to (None: all), CPU only).
TARGETS = (
    ("auto", "time", 1.03, None, True),
    ("bk", "time", 1.10, ("W1", "W3"), True),
    ("ghost", "memory", 1.10, None, False),
    ("fused", "memory", 1.10, None, False),
    ("bk", "memory", 1.30, None, False),
    ("auto", "compile", 2.0, ("W3",), False),    # the first step's trace (planning included) + XLA compile
)


def bench_workload(workload: Workload, names: list[str], rounds: int, warmup: int, donate: bool) -> dict:
    print(f"\n=== {workload.describe()}", flush=True)
    load_before = os.getloadavg()[0]
    params, loss_fn, batch = make_workload(workload)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optimizer = optax.adamw(1e-4)
    key = jax.random.key(42)
    notes = []
    if "fused" in names:
        notes.append("fused runs with groups='layer-wise' (all other DP modes: groups='all-layer')")
    if workload.batch_size == 4 and "vmap-mb4" in names and "vmap-mbB" in names:
        names = [n for n in names if n != "vmap-mb4"]
        notes.append("vmap-mb4 skipped: B = 4, so it is vmap-mbB")
    candidates = make_steps(loss_fn, optimizer, names, workload.batch_size, workload.norm_method)

    dtype = workload.dtype
    if dtype != "float32":
        cast_params = cast(params, jnp.dtype(dtype))
        error = check_dtype(candidates, cast_params, optimizer.init(cast_params), batch, key)
        if error is None:
            params = cast_params
        else:   # the float32 model throughout (the one built above computes in the 16-bit dtype)
            notes.append(f"{dtype} parameters not supported ({error[:300]}); ran float32 instead")
            params, loss_fn, batch = make_workload(dataclasses.replace(workload, dtype="float32"))
            candidates = make_steps(loss_fn, optimizer, names, workload.batch_size, workload.norm_method)
            dtype = "float32"
    for candidate in candidates:
        if candidate.name == "auto":
            candidate.description += f" -> {resolve_auto(loss_fn, candidate.cfg, params, batch)}"

    # Compile and warm up each candidate in turn (host memory measured after its first step).
    donate_argnums = (0, 1) if donate else ()
    alive = []
    for candidate in candidates:
        print(f"  compiling {candidate.name:<9} ({candidate.description})", flush=True)
        try:
            compile_candidate(candidate, params, optimizer, batch, key, donate_argnums)
            candidate.result.update(memory_fields(candidate.compiled))
            candidate.result["xla_cost"] = cost_fields(candidate.compiled)
            candidate.result["first_step_s"] = run_step(candidate, batch, key)[0]
            candidate.result["host_after_first_step"] = host_memory()
            candidate.result["device_after_first_step"] = device_memory()
            for _ in range(warmup - 1):
                run_step(candidate, batch, key)
            alive.append(candidate)
        except Exception as error:
            candidate.result["error"] = f"{type(error).__name__}: {error}"
            candidate.state = candidate.compiled = None
            print(f"    FAILED: {candidate.result['error'][:500]}", flush=True)
            traceback.print_exc()

    # Round-robin timing, the order rotated every round.
    for r in range(rounds):
        order = alive[r % len(alive):] + alive[:r % len(alive)]
        for candidate in order:
            wall, cpu = run_step(candidate, batch, key)
            candidate.times.append(wall)
            candidate.cpu_times.append(cpu)
        print(f"  round {r + 1}/{rounds}: " + " ".join(f"{c.name}={c.times[-1] * 1e3:.0f}ms" for c in alive),
              flush=True)
    for candidate in alive:
        candidate.state = candidate.compiled = None  # free the training state before the next workload
    load_after = os.getloadavg()[0]

    baseline = candidates[0].result
    base_times = candidates[0].times
    base_time = statistics.median(base_times) if base_times else None
    rows = []
    for candidate in candidates:
        row = {"candidate": candidate.name, "config": candidate.description, **candidate.result,
               "times_s": candidate.times, "cpu_times_s": candidate.cpu_times}
        if candidate.times:
            row["median_s"] = statistics.median(candidate.times)
            row["min_s"] = min(candidate.times)
            row["time_ratio"] = row["median_s"] / base_time if base_time else None
            row["cpu_median_s"] = statistics.median(candidate.cpu_times)
            if candidates[0].cpu_times:
                row["cpu_ratio"] = row["cpu_median_s"] / statistics.median(candidates[0].cpu_times)
            if len(base_times) == len(candidate.times):
                row["paired_ratios"] = [t / b for t, b in zip(candidate.times, base_times)]
                row["paired_ratio"] = statistics.median(row["paired_ratios"])
        for key_, ratio in (("temp_plus_args_bytes", "memory_ratio"), ("temp_bytes", "temp_ratio"),
                            ("compile_s", "compile_ratio")):
            if row.get(key_) is not None and baseline.get(key_):
                row[ratio] = row[key_] / baseline[key_]
        rows.append(row)
    return {"workload": dataclasses.asdict(workload), "dtype_used": dtype, "n_params": int(n_params),
            "notes": notes, "load_avg_1min": {"before": load_before, "after": load_after}, "candidates": rows}


# ----------------------------------------------------------------------------------------------------------------
# Reporting.

def _fmt(value, spec, scale=1.0, missing="-"):
    return missing if value is None else format(value * scale, spec)


def print_table(result: dict) -> None:
    w = result["workload"]
    print(f"\n{w['name']}: n_layer={w['n_layer']} n_embd={w['n_embd']} n_head={w['n_head']} T={w['seq_len']} "
          f"B={w['batch_size']} vocab={w['vocab_size']} params={result['dtype_used']} ({result['n_params']:,})")
    for note in result["notes"]:
        print(f"  note: {note}")
    load = result["load_avg_1min"]
    print(f"  1-min load average: {load['before']:.2f} before, {load['after']:.2f} after ({os.cpu_count()} cores)")
    header = ("candidate", "median ms", "min ms", "x time", "x paired", "CPU ms", "x CPU", "temp MiB",
              "temp+args MiB", "x mem", "maxRSS MiB*", "RSS now MiB*", "lower+compile s", "x compile")
    lines = []
    for row in result["candidates"]:
        host = row.get("host_after_first_step") or {}
        lines.append((row["candidate"], _fmt(row.get("median_s"), ".1f", 1e3), _fmt(row.get("min_s"), ".1f", 1e3),
                      _fmt(row.get("time_ratio"), ".3f"), _fmt(row.get("paired_ratio"), ".3f"),
                      _fmt(row.get("cpu_median_s"), ".0f", 1e3), _fmt(row.get("cpu_ratio"), ".3f"),
                      _fmt(row.get("temp_bytes"), ".1f", 1 / MiB),
                      _fmt(row.get("temp_plus_args_bytes"), ".1f", 1 / MiB), _fmt(row.get("memory_ratio"), ".3f"),
                      _fmt(host.get("max_rss_bytes"), ".0f", 1 / MiB), _fmt(host.get("rss_now_bytes"), ".0f", 1 / MiB),
                      f"{_fmt(row.get('trace_lower_s'), '.1f')}+{_fmt(row.get('xla_compile_s'), '.1f')}",
                      _fmt(row.get("compile_ratio"), ".2f")))
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    print("  " + "  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header)))
    print("  " + "  ".join("-" * width for width in widths))
    for line in lines:
        print("  " + "  ".join(x.ljust(widths[0]) if i == 0 else x.rjust(widths[i]) for i, x in enumerate(line)))
    for row in result["candidates"]:
        error = f"   ERROR: {row['error'][:200]}" if "error" in row else ""
        print(f"  {row['candidate']:<9} {row['config']}{error}")
    print("  x time = median / non-DP median; x paired = median over rounds of (time / non-DP time that round);\n"
          "  CPU ms = median process CPU time per step (all threads); x CPU = its ratio to non-DP;\n"
          "  x mem = XLA temp+args / non-DP temp+args (compiled memory_analysis); x compile = (lower + compile) /\n"
          "  non-DP's: the first step's trace (the engine's planning included) and XLA compile.\n"
          "  * host RSS after the candidate's compile + first step; maxRSS is the process-wide high-water mark "
          "(monotone across candidates and workloads).")


def check_targets(results: list[dict], backend: str) -> list[dict]:
    checks = []
    for candidate, metric, bound, workloads, cpu_only in TARGETS:
        label = f"{candidate} {metric} <= {bound:.2f}x non-DP" + (" (CPU)" if cpu_only else "")
        if workloads:
            label += " on " + ", ".join(workloads)
        for result in results:
            name = result["workload"]["name"]
            if workloads and name not in workloads:
                continue
            row = next((r for r in result["candidates"] if r["candidate"] == candidate), None)
            if row is None:
                continue
            ratio = row.get({"time": "paired_ratio", "memory": "memory_ratio", "compile": "compile_ratio"}[metric])
            if cpu_only and backend != "cpu":
                status = "n/a (CPU target)"
            elif ratio is None:
                status = "FAIL (not measured)"
            else:
                status = "PASS" if ratio <= bound else "FAIL"
            checks.append({"target": label, "workload": name, "candidate": candidate, "metric": metric,
                           "bound": bound, "ratio": ratio, "status": status,
                           "ratio_of_medians": row.get("time_ratio") if metric == "time" else None})
    return checks


def print_targets(checks: list[dict]) -> None:
    print("\nTargets")
    width = max((len(c["target"]) for c in checks), default=10)
    for c in checks:
        extra = f"   (ratio of medians {_fmt(c['ratio_of_medians'], '.3f')}x)" if c["metric"] == "time" else ""
        print(f"  {c['target']:<{width}}  {c['workload']:<10}  {_fmt(c['ratio'], '.3f'):>6}x  {c['status']:<4}{extra}")
    print("  (time: paired ratio, see the tables; memory: XLA temp+args ratio; compile: lower + XLA compile of the "
          "step, i.e. the first step's trace and compile)")


def library_version() -> dict:
    """The git commit of the checkout and a hash of the uncommitted changes to the library (it is installed editable,
    so a benchmark measures whatever ``dpzero_jax/`` holds when the process starts)."""
    package = os.path.dirname(os.path.abspath(dz.__file__))
    root = os.path.dirname(package)

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    diff = git("diff", "HEAD", "--", "dpzero_jax")
    return {"path": package, "commit": git("rev-parse", "--short", "HEAD").strip() or None,
            "dirty": bool(diff), "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def describe_version(version: dict) -> str:
    dirty = f" + uncommitted library changes (diff {version['diff_sha1']})" if version["dirty"] else ""
    return f"dpzero_jax {dz.__version__} from {version['path']} at commit {version['commit']}{dirty}"


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    parser.add_argument("--modes", default=",".join(DP_CANDIDATES),
                        help=f"DP candidates, comma-separated, from {','.join(DP_CANDIDATES)} ('vmap' = all three "
                             "vmap variants); the non-DP baseline always runs")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 7 on CPU, 20 on GPU, "
                        "2 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate after compiling (>= 1)")
    parser.add_argument("--quick", action="store_true", help="one tiny workload: a smoke test")
    parser.add_argument("--gpt2-small", action="store_true", help="GPT-2 small, T=256, B=32, bf16 (for a GPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter and compute dtype override")
    parser.add_argument("--layers", choices=("flax", "dz.layers"), default="flax",
                        help="the bundled GPT2 (Flax's layers: the traced-program front-end) or the same model from "
                             "dz.layers layers (GPT2(layers=DP_LAYERS): the layers front-end)")
    parser.add_argument("--norm-method", default="auto", choices=("auto", "mixed", "fastest", "ghost", "instantiate"),
                        help="DPConfig.norm_method of every DP candidate (default auto: the backend's rule)")
    parser.add_argument("--no-donate", dest="donate", action="store_false",
                        help="do not donate params and optimizer state (applies to every candidate)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.quick and args.gpt2_small:
        parser.error("--quick and --gpt2-small are exclusive")
    modes = []
    for mode in filter(None, (m.strip() for m in args.modes.split(","))):
        expanded = [m for m in DP_CANDIDATES if m.startswith("vmap")] if mode == "vmap" else [mode]
        for m in expanded:
            if m not in DP_CANDIDATES:
                parser.error(f"unknown mode {m!r}; expected some of {DP_CANDIDATES} or 'vmap'")
            if m not in modes:
                modes.append(m)
    args.modes = modes
    if args.quick:
        args.workloads = [QUICK]
    elif args.gpt2_small:
        args.workloads = [GPT2_SMALL]
    else:
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown:
            parser.error(f"unknown workloads {unknown}; expected some of {list(WORKLOADS)}")
        args.workloads = [WORKLOADS[w] for w in names]
    if args.dtype:
        args.workloads = [dataclasses.replace(w, dtype=args.dtype) for w in args.workloads]
    args.workloads = [dataclasses.replace(w, layers=args.layers, norm_method=args.norm_method) for w in args.workloads]
    if args.warmup < 1:
        parser.error("--warmup must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    rounds = args.rounds or (2 if args.quick else 7 if backend == "cpu" else 20)
    suffix = "_quick" if args.quick else "_gpt2small" if args.gpt2_small else ""
    out = args.out or os.path.join("experiments", "results", f"bench_overhead_{backend}{suffix}.json")
    device = jax.local_devices()[0]
    version = library_version()
    print(describe_version(version))
    print(f"backend={backend} device={device.device_kind} ({jax.device_count()} device(s)) jax={jax.__version__} "
          f"cpus={os.cpu_count()} rounds={rounds} warmup={args.warmup} donate={args.donate}")

    results = [bench_workload(w, args.modes, rounds, args.warmup, args.donate) for w in args.workloads]
    for result in results:
        print_table(result)
    checks = check_targets(results, backend)
    print_targets(checks)
    version_after = library_version()
    if version_after != version:
        print(f"\nWARNING: the library changed during the run: {describe_version(version)} at the start, "
              f"{describe_version(version_after)} at the end (modules are imported once, at the start).")

    report = {"library": version, "library_at_end": version_after, "backend": backend, "device": device.device_kind,
              "jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(), "rounds": rounds,
              "warmup": args.warmup, "donate": args.donate, "argv": sys.argv[1:], "workloads": results,
              "targets": checks}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
