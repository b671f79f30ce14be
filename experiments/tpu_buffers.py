"""The TPU compiler's own buffer assignment of `bench_compiled.py`'s steps: what the program allocates.

`memory_analysis().temp_size_in_bytes` counts some buffers of steps that keep or instantiate per-example gradients
more than once (docs/benchmarks/compiled.md, "Temporaries against the compiler's peak"). This script compiles
each point in its own process with `--xla_dump_to` and reads, from the dumped buffer assignment, the size of the
*preallocated temporary buffer* (the one block the program's temporaries live in) and, from the memory-usage
report, the default memory space's total (that buffer + arguments + outputs: what the chip must hold, which the
compiler checks against the usable HBM). Needs libtpu (the `tpu-aot` extra):

    PYTHONPATH=$PWD /work/venv-tpu/bin/python experiments/tpu_buffers.py            # the default points
    PYTHONPATH=$PWD /work/venv-tpu/bin/python experiments/tpu_buffers.py --table    # print the cached JSON

Prints a table and writes `results/tpu_buffers.json`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tpu_buffers.json")
CANDIDATES = ("nonprivate", "auto", "jax_privacy", "optax", "auto_bf16")
# (model, T, per-chip batch): the headline shape and GPT-2 medium at 4 per chip
POINTS = (("small", 1024, 8), ("medium", 1024, 4))
GIB = 2**30
PREALLOCATED = re.compile(r"^allocation \d+: size (\d+), preallocated-temp:", re.M)
TOTAL = re.compile(r"^Memory Space: default.*\nTotal bytes: (\d+)", re.M)


def read_dump(directory: str) -> dict:
    """``{"preallocated_temp_bytes", "default_space_bytes"}`` of the step's dumped buffer assignment (the last
    ``jit_step`` module: the compile of the step itself)."""
    assignment = sorted(glob.glob(os.path.join(directory, "*jit_step*after_optimizations-buffer-assignment.txt")))
    report = sorted(glob.glob(os.path.join(directory, "*jit_step*after_optimizations-memory-usage-report.txt")))
    if not assignment or not report:
        raise RuntimeError(f"no buffer assignment of the step was dumped in {directory}")
    with open(assignment[-1]) as f:
        sizes = [int(s) for s in PREALLOCATED.findall(f.read())]   # colour 0 (HBM) has no "color" field
    with open(report[-1]) as f:
        total = TOTAL.search(f.read())
    return {"preallocated_temp_bytes": max(sizes), "default_space_bytes": int(total.group(1))}


def compile_in_child(model: str, T: int, B: int, candidate: str) -> dict:
    """Compile one point in a child process with the dump enabled; the child prints memory_analysis() as JSON."""
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={directory}", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        code = ("import json, sys; sys.path.insert(0, 'experiments'); import compiled_steps as bc; "
                f"shape = bc.{model}({T}, {B}); compiled = bc.compile_candidate({candidate!r}, shape, "
                "bc.mesh_for('v5e:2x2'))[0]; m = compiled.memory_analysis(); "
                "print('RESULT', json.dumps({'temp_bytes': m.temp_size_in_bytes, 'argument_bytes': "
                "m.argument_size_in_bytes, 'output_bytes': m.output_size_in_bytes, 'peak_bytes': bc.peak_bytes(m)}))")
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode or not lines:
            raise RuntimeError(f"{model} T{T} B{B} {candidate}: {run.stderr.strip().splitlines()[-1:]}")
        return {**json.loads(lines[-1][len("RESULT "):]), **read_dump(directory)}


def _cells(row: dict, base: dict, key: str) -> str:
    """``GiB | ratio to the non-private step``."""
    ratio = f"{row[key] / base[key]:.2f}x" if base.get(key) else "-"
    return f"{row[key] / GIB:.2f} | {ratio}"


def table(data: dict) -> str:
    lines = ["| point | candidate | preallocated temp GiB | x | chip total GiB | x | memory_analysis temp GiB | x |",
             "|---|---|---|---|---|---|---|---|"]
    for point, rows in data.items():
        base = rows.get("nonprivate", {})
        for candidate, row in rows.items():
            lines.append(f"| {point} | {candidate} | {_cells(row, base, 'preallocated_temp_bytes')} | "
                         f"{_cells(row, base, 'default_space_bytes')} | {_cells(row, base, 'temp_bytes')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--table", action="store_true", help="print the cached JSON's table (no compiling)")
    parser.add_argument("--only", default=",".join(CANDIDATES), help="comma-separated candidates")
    args = parser.parse_args(argv)
    data = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    if not args.table:
        for model, T, B in POINTS:
            point = f"gpt2-{model} T{T} B{B}"
            for candidate in args.only.split(","):
                print(f"compiling {point} / {candidate} ...", flush=True)
                data.setdefault(point, {})[candidate] = compile_in_child(model, T, B, candidate)
                with open(args.out, "w") as f:
                    json.dump(data, f, indent=1)
    print(table(data))
    return data


if __name__ == "__main__":
    main()
