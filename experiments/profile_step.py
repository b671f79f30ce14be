"""Where the private step's extra time goes: device time per source file, private step against the non-private one.

``bench_overhead.py`` says *how much* slower the private training step is; this script says *where*. It builds the
same full training steps as ``bench_overhead.py`` (its workloads, or with ``--depth`` the scanned decoder of
``bench_depth.py``; ``optax.adamw``, donated state): the non-private ``jax.value_and_grad`` step and one private
candidate per ``--modes`` entry. Each is compiled, warmed up and then

* **timed**: ``--steps`` steps per candidate, round-robin, median step time and its ratio to the non-private step;
* **profiled**: ``--profile-steps`` steps under ``jax.profiler.trace``; every executed operation of the step's XLA
  program (a GPU kernel on a GPU, a thunk on the CPU) carries the name of its HLO instruction (the profiler's
  ``hlo_op`` stat), and the compiled HLO gives that instruction's ``source_file:source_line`` metadata -- the Python
  line that emitted it (for a backward operation: the forward line it transposes; for a fusion: its root). The
  device time is summed per *source file* (operations from autodiff's transpose tagged ``(backward)``) and divided
  by the number of profiled steps.

The table then shows, per source file, milliseconds per step in the non-private and in each private step, and the
difference: the engine's own modules (``pergrad``, ``clipping``, ``noise``, ``dpzero_jax/program/*``) hold what
private training adds; the model's own files (``flax/...``, the script's) its forward and backward, which the
program front-end re-emits under each traced operation's own source information (until 2026-11-28 they were
attributed to ``dpzero_jax/program/interpret.py``); optax's files show the update both steps do. Operations
with no source metadata (copies and layout changes XLA inserted, collectives) are grouped as ``(no source)``. The
largest operations of each private step are listed by instruction too.

On a GPU the sum is kernel time on the device's streams; operations that overlap (several streams) are counted
each, so the column sums can exceed the step time. On the CPU the sum is thunk time on XLA's threads (parallel
thunks also counted each). Set ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` on a GPU if kernels come back
without ``hlo_op`` (CUDA graphs can hide them from the profiler); the script prints how many profiled operations
it could not attribute.

How to run
----------
::

    python experiments/profile_step.py --quick                   # smoke test on the CPU, ~1 minute
    python experiments/profile_step.py --gpt2-small --modes auto  # on a GPU (bench_overhead's GPT-2 small workload)
    python experiments/profile_step.py --depth 48                 # bench_depth's decoder, 48 scanned blocks

Results: ``--out`` (default ``experiments/results/profile_step_<backend>[_quick|_gpt2small].json``); ``--trace-dir``
keeps the raw profiles (``*.xplane.pb``, readable by XProf / TensorBoard).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_overhead  # noqa: E402
import overhead_steps as overhead  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_SOURCE_FILE = re.compile(r'source_file="([^"]*)"')
_SOURCE_LINE = re.compile(r"source_line=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_STACK_FRAME = re.compile(r"stack_frame_id=(\d+)")
NO_SOURCE = "(no source)"


def _stack_frame_table(hlo_text: str) -> dict[int, tuple[str, int]]:
    """``{stack_frame_id: (file, line)}`` of the innermost frame, from the ``FileNames`` / ``FileLocations`` /
    ``StackFrames`` tables that newer XLA prints at the head of a module (metadata then names a ``stack_frame_id``
    instead of ``source_file``)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is None:
            continue
        match = re.match(r"^(\d+) (.*)$", line)
        if not match:
            if line.startswith("%") or line.startswith("ENTRY") or line.startswith("HloModule"):
                current = None
            continue
        current[int(match.group(1))] = match.group(2)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        file_id = re.search(r"file_name_id=(\d+)", v)
        line_no = re.search(r"\bline=(\d+)", v)
        locations[k] = (files.get(int(file_id.group(1)), NO_SOURCE) if file_id else NO_SOURCE,
                        int(line_no.group(1)) if line_no else 0)
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", v)
        frames[k] = locations.get(int(location.group(1)), (NO_SOURCE, 0)) if location else (NO_SOURCE, 0)
    return frames


def instruction_sources(hlo_text: str) -> dict[str, tuple[str, int, str]]:
    """``{instruction name: (source file, source line, op_name)}`` from a compiled module's text (every computation,
    fused ones included: a kernel may be named after an instruction inside a fusion's computation). The source is
    the metadata's ``source_file`` / ``source_line`` or, in newer XLA, its ``stack_frame_id``'s innermost frame."""
    frames = _stack_frame_table(hlo_text)
    sources = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        file_match = _SOURCE_FILE.search(line)
        line_match = _SOURCE_LINE.search(line)
        frame_match = _STACK_FRAME.search(line)
        op_match = _OP_NAME.search(line)
        if file_match:
            source = (file_match.group(1), int(line_match.group(1)) if line_match else 0)
        elif frame_match:
            source = frames.get(int(frame_match.group(1)), (NO_SOURCE, 0))
        else:
            source = (NO_SOURCE, 0)
        sources[match.group(1)] = (*source, op_match.group(1) if op_match else "")
    return sources


def short_file(path: str) -> str:
    """A source path from the package it lives in down: ``dpzero_jax/program/mode.py``, ``flax/nnx/nn/linear.py``."""
    if path == NO_SOURCE:
        return path
    parts = path.replace("\\", "/").split("/")
    for anchor in ("dpzero_jax", "flax", "optax", "jax", "experiments", "tests"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return parts[-1]


def profiled_ops(trace_dir: str, module_name: str) -> tuple[list[tuple[str, float]], str]:
    """``([(hlo_op, seconds)], where)`` for every executed operation of the module named ``module_name`` found in
    the profile under ``trace_dir``: device-plane events when the profile has any (a GPU), else host events (the
    CPU's thunks)."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"no *.xplane.pb written under {trace_dir}")
    device, host = [], []
    for path in files:
        for plane in ProfileData.from_file(path).planes:
            target = device if plane.name.startswith("/device:") else host
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    op, module = stats.get("hlo_op"), stats.get("hlo_module")
                    if op is None or (module is not None and not str(module).startswith(module_name)):
                        continue
                    target.append((str(op), event.duration_ns * 1e-9))
    return (device, "device") if device else (host, "host")


def profile_candidate(candidate, batch, key, steps: int, trace_dir: str) -> dict:
    """Device time per source file (seconds per step) of ``steps`` steps of ``candidate`` under the profiler."""
    sources = instruction_sources(candidate.compiled.as_text())
    module_name = "jit_" + re.sub(r"\W", "_", getattr(candidate.step, "__name__", "step"))
    os.makedirs(trace_dir, exist_ok=True)
    jax.profiler.start_trace(trace_dir)
    try:
        for _ in range(steps):
            overhead.run_step(candidate, batch, key)
    finally:
        jax.profiler.stop_trace()
    ops, where = profiled_ops(trace_dir, module_name)
    per_file: dict[str, float] = collections.defaultdict(float)
    per_op: dict[str, float] = collections.defaultdict(float)
    unattributed = 0
    for op, seconds in ops:
        source = sources.get(op)
        if source is None:
            unattributed += 1
            name = NO_SOURCE
        else:
            # the backward of a line is tagged: transposed (autodiff) operations name the forward line
            name = short_file(source[0]) + (" (backward)" if "transpose(" in source[2] else "")
        per_file[name] += seconds / steps
        label = op if source is None else f"{op} [{short_file(source[0])}:{source[1]}]"
        per_op[label] += seconds / steps
    return {"where": where, "events": len(ops), "unattributed_events": unattributed,
            "module": module_name, "seconds_per_step_by_file": dict(per_file),
            "seconds_per_step_by_op": dict(sorted(per_op.items(), key=lambda kv: -kv[1])),
            "profiled_seconds_per_step": sum(per_file.values())}


def depth_workload(layers: int, batch_size: int | None = None, seq: int | None = None):
    """``bench_depth.py``'s scanned decoder (flax.linen, ``nn.scan`` over ``layers`` blocks, width 64; by default
    T 64, B 4): ``(title, params, loss_fn, batch, batch size)``."""
    import bench_depth
    batch_size, seq = batch_size or bench_depth.BATCH, seq or bench_depth.SEQ
    params, batch, loss_fn = bench_depth.setup(layers, scan=True, batch_size=batch_size, seq=seq)
    title = (f"bench_depth decoder: {layers} scanned blocks, width {bench_depth.WIDTH}, T {seq}, "
             f"B {batch_size}, vocab {bench_depth.VOCAB} (tied), float32")
    return title, params, loss_fn, batch, batch_size


def run(workload, names: list[str], steps: int, profile_steps: int, trace_root: str, norm_kernel: str,
        depth: int | None = None, depth_batch: int | None = None, depth_seq: int | None = None) -> dict:
    if depth is None:
        title, batch_size = workload.describe(), workload.batch_size
        params, loss_fn, batch = overhead.make_workload(workload)
        if workload.dtype != "float32":
            params = overhead.cast(params, jnp.dtype(workload.dtype))
    else:
        title, params, loss_fn, batch, batch_size = depth_workload(depth, depth_batch, depth_seq)
    print(f"\n=== {title}", flush=True)
    optimizer = optax.adamw(1e-4)
    key = jax.random.key(42)
    candidates = overhead.make_steps(loss_fn, optimizer, names, batch_size, workload.norm_method, norm_kernel)
    for candidate in candidates:
        candidate.step.__name__ = "step_" + re.sub(r"\W", "_", candidate.name)
        print(f"  compiling {candidate.name:<9} ({candidate.description}"
              f"{', norm_kernel=' + norm_kernel if candidate.cfg else ''})", flush=True)
        overhead.compile_candidate(candidate, params, optimizer, batch, key)
        print(f"    lower {candidate.result['trace_lower_s']:.1f} s + compile "
              f"{candidate.result['xla_compile_s']:.1f} s", flush=True)
        for _ in range(2):
            overhead.run_step(candidate, batch, key)
    for r in range(steps):
        for candidate in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
            candidate.times.append(overhead.run_step(candidate, batch, key)[0])
    for candidate in candidates:
        print(f"  profiling {candidate.name}", flush=True)
        try:
            candidate.result["profile"] = profile_candidate(
                candidate, batch, key, profile_steps, os.path.join(trace_root, candidate.name))
        except Exception as error:  # keep the timings when the profiler fails
            print(f"    profiling failed: {type(error).__name__}: {error}", flush=True)
            candidate.result["profile"] = {"error": f"{type(error).__name__}: {error}", "events": 0,
                                           "unattributed_events": 0, "seconds_per_step_by_file": {},
                                           "seconds_per_step_by_op": {}, "profiled_seconds_per_step": 0.0}
    base = statistics.median(candidates[0].times)
    rows = []
    for candidate in candidates:
        median = statistics.median(candidate.times)
        paired = statistics.median(t / b for t, b in zip(candidate.times, candidates[0].times))
        rows.append({"candidate": candidate.name, "config": candidate.description, "median_s": median,
                     "time_ratio": median / base, "paired_ratio": paired, "times_s": candidate.times,
                     **candidate.result})
        candidate.state = candidate.compiled = None
    described = ({k: getattr(workload, k) for k in workload.__dataclass_fields__} if depth is None
                 else {"depth": depth, "batch": batch_size, "seq": batch["ids"].shape[1],
                       "norm_method": workload.norm_method})
    return {"workload": described, "title": title, "candidates": rows}


def print_tables(result: dict, top: int) -> None:
    rows = result["candidates"]
    print("\n  candidate  median ms  x non-DP (paired)  lower+compile s  profiled ms/step  events  unattributed")
    for row in rows:
        profile = row["profile"]
        print(f"  {row['candidate']:<9}  {row['median_s'] * 1e3:9.2f}  {row['paired_ratio']:17.3f}  "
              f"{row['trace_lower_s']:6.1f}+{row['xla_compile_s']:6.1f}  "
              f"{profile['profiled_seconds_per_step'] * 1e3:16.2f}"
              f"  {profile['events']:6d}  {profile['unattributed_events']:12d}")
    files = sorted({f for row in rows for f in row["profile"]["seconds_per_step_by_file"]},
                   key=lambda f: -max(row["profile"]["seconds_per_step_by_file"].get(f, 0.0) for row in rows))
    base = rows[0]["profile"]["seconds_per_step_by_file"]
    header = "  ".join(f"{row['candidate'] + ' ms':>12}" for row in rows)
    extra = "  ".join(f"{'+' + row['candidate'] + ' ms':>12}" for row in rows[1:])
    print(f"\n  {'source file':<44}  {header}  {extra}")
    for name in files:
        values = [row["profile"]["seconds_per_step_by_file"].get(name, 0.0) for row in rows]
        if max(values) < 1e-5:
            continue
        deltas = "  ".join(f"{(v - base.get(name, 0.0)) * 1e3:12.3f}" for v in values[1:])
        print(f"  {name[-44:]:<44}  " + "  ".join(f"{v * 1e3:12.3f}" for v in values) + f"  {deltas}")
    for row in rows[1:]:
        print(f"\n  largest operations of {row['candidate']} (ms per step):")
        for label, seconds in list(row["profile"]["seconds_per_step_by_op"].items())[:top]:
            print(f"    {seconds * 1e3:8.3f}  {label}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="auto", help="private candidates (bench_overhead's names), comma-separated")
    parser.add_argument("--quick", action="store_true", help="bench_overhead's tiny workload (a smoke test)")
    parser.add_argument("--gpt2-small", action="store_true", help="GPT-2 small, T 256, B 32, bfloat16 (a GPU)")
    parser.add_argument("--workload", default="W3", help="a bench_overhead workload (W1, W2, W3) otherwise")
    parser.add_argument("--depth", type=int, default=None,
                        help="bench_depth.py's decoder scanned over this many blocks instead (issue 14's L = 48)")
    parser.add_argument("--batch", type=int, default=None, help="with --depth: examples per step (default 4)")
    parser.add_argument("--seq", type=int, default=None, help="with --depth: tokens per example (default 64)")
    parser.add_argument("--norm-method", default="auto", help="DPConfig.norm_method of every private candidate")
    parser.add_argument("--norm-kernel", default="auto", choices=("auto", "xla", "pallas"),
                        help="DPConfig.norm_kernel of every private candidate")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per candidate")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps per candidate")
    parser.add_argument("--top", type=int, default=15, help="operations listed per private candidate")
    parser.add_argument("--trace-dir", default=None, help="keep the raw profiles here (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in overhead.DP_CANDIDATES]
    if unknown:
        parser.error(f"unknown modes {unknown}; expected some of {overhead.DP_CANDIDATES}")
    if (args.batch or args.seq) and args.depth is None:
        parser.error("--batch and --seq set the --depth decoder's shape; give --depth too")
    if args.steps < 1 or args.profile_steps < 1:
        parser.error("--steps and --profile-steps must be >= 1")
    workload = (overhead.QUICK if args.quick else overhead.GPT2_SMALL if args.gpt2_small
                else overhead.WORKLOADS.get(args.workload))
    if workload is None:
        parser.error(f"unknown workload {args.workload!r}; expected one of {list(overhead.WORKLOADS)}")
    workload = dataclasses.replace(workload, norm_method=args.norm_method)
    backend = jax.default_backend()
    version = bench_overhead.library_version()
    print(bench_overhead.describe_version(version))
    print(f"backend={backend} device={jax.devices()[0].device_kind} jax={jax.__version__} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="profile_step_")
    result = run(workload, names, args.steps, args.profile_steps, trace_root, args.norm_kernel, args.depth,
                 args.batch, args.seq)
    result["norm_kernel"] = args.norm_kernel
    print_tables(result, args.top)
    suffix = ("_quick" if args.quick else "_gpt2small" if args.gpt2_small else
              f"_depth{args.depth}" + (f"_b{args.batch or 4}_t{args.seq or 64}" if args.batch or args.seq else "")
              if args.depth else f"_{workload.name}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"profile_step_{backend}{suffix}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as handle:
        json.dump({"library": version, "backend": backend, "device": jax.devices()[0].device_kind,
                   "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), **result}, handle, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
