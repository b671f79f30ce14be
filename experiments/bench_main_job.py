"""The main job at the speed of its step: ``dpzero train`` on the digits default, DP against non-DP.

What is measured
----------------
Three runs of the real command line (``python -m dpzero_jax train``, each in its own process, one after the other)
on the digits (MLP, batch 256 -- the default when measured, pinned --, log every 10 steps, checkpoint every 50,
evaluation every 50):

* ``--epsilon E`` (sigma calibrated; default E = 50, the issue's example),
* ``--noise-multiplier S`` (default S = 1.5896, the sigma ``--epsilon 50`` calibrated before this change),
* ``--no-dp`` (the baseline: same sampler and step count, no clipping, no noise, no accounting).

Per run: wall time of the process (start to exit, so JAX start-up and compilation are in it), the trainer's own
``runtime_s``, the epsilon and batch cap it reports, and the accounting time it measured (``accounting_s`` in
``summary.json``: calibration / planning before training, the logged rows, the final epsilon) divided by the number
of logged rows. Resident memory of the child process (``VmRSS`` in ``/proc/PID/status``) is sampled every 0.5 s
together with the number of rows already in ``metrics.jsonl`` (so each sample has a step).

Targets (printed, and stored in the JSON): wall time of each DP run at most 1.5x the non-DP run's. With
``--repeats R`` the three runs are done in R rounds and each keeps its fastest round (all walls in the JSON).

``--soak`` instead runs one DP run of 100,000 steps (``--noise-multiplier 5``, ``--keep-checkpoints 3``) and
reports the resident memory at step 5,000 and at the end (target: within 5%), the step time of the first and the
last 10,000 steps from the metrics' timestamps (target: within 20%), and the number of checkpoint directories left
(target: ``--keep-checkpoints``).

How to run
----------
::

    cd /work/main && . .venv/bin/activate
    python experiments/bench_main_job.py                 # 3 runs of 3,000 steps; JSON to experiments/results/
    python experiments/bench_main_job.py --steps 300     # a quick look
    python experiments/bench_main_job.py --soak          # 100,000 steps (about half an hour on 2 cores)

``--tree DIR`` runs another checkout's ``dpzero_jax`` (``PYTHONPATH=DIR``), e.g. the code before this change.
The machine's 1-minute load average is printed before and after: on a shared machine a load above the number of
cores means the timings were disturbed; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _rows_written(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:   # a line being written
            break
    return rows


def run_train(flags: list[str], out: Path, tree: Path, interval: float = 0.5) -> dict:
    """Run ``python -m dpzero_jax train FLAGS --out OUT``; sample its RSS; return timings, summary and samples."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "dpzero_jax", "train", *flags, "--out", str(out), "--no-progress"]
    start = time.perf_counter()
    # cwd=tree too: `python -m` puts the working directory first on sys.path
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[dict] = []
    metrics = out / "metrics.jsonl"

    def sample():
        last_step = 0
        while proc.poll() is None:
            rss = _rss_mb(proc.pid)
            if metrics.exists():
                size = metrics.stat().st_size
                if size:   # the last complete row's step, read from the file's tail
                    with open(metrics, "rb") as f:
                        f.seek(max(0, size - 4096))
                        lines = [ln for ln in f.read().decode(errors="ignore").splitlines() if ln.strip()]
                    for ln in reversed(lines):
                        try:
                            last_step = json.loads(ln)["step"]
                            break
                        except (json.JSONDecodeError, KeyError):
                            continue
            if rss is not None:
                samples.append({"t": time.perf_counter() - start, "step": last_step, "rss_mb": rss})
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"flags": flags, "wall_s": wall, "stdout": stdout.strip(), "summary": summary, "rss": samples}


def _load() -> float:
    return os.getloadavg()[0]


def bench(args) -> dict:
    tree = Path(args.tree).resolve()
    common = ["--steps", str(args.steps), "--batch-size", "256"]   # the default when measured (now 512)
    runs = {"epsilon": common + ["--epsilon", str(args.epsilon)],
            "noise-multiplier": common + ["--noise-multiplier", str(args.noise_multiplier)],
            "no-dp": common + ["--no-dp"]}
    results, walls = {}, {name: [] for name in runs}
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="bench_main_job_") as tmp:
        for rep in range(args.repeats):   # rounds of the three runs; the fastest of each is kept
            for name, flags in runs.items():
                print(f"running {name} (round {rep + 1}): dpzero train {' '.join(flags)}", flush=True)
                r = run_train(flags, Path(tmp) / f"{name}-{rep}", tree)
                walls[name].append(r["wall_s"])
                if r["wall_s"] == min(walls[name]):
                    results[name] = r
        for name, flags in runs.items():
            r = results[name]
            s = r["summary"]
            acc = s.get("accounting_s") or {}
            rows = acc.get("row_count") or 0
            results[name] = {
                "flags": flags, "wall_s": r["wall_s"], "runtime_s": s["runtime_s"], "epsilon": s["epsilon"],
                "noise_multiplier": s["noise_multiplier"], "batch_cap": s.get("batch_cap"),
                "truncation_charge": s.get("truncation_charge"), "accounting_s": acc,
                "accounting_ms_per_row": 1000 * acc["rows"] / rows if rows else None,
                "rss_first_mb": r["rss"][0]["rss_mb"] if r["rss"] else None,
                "rss_peak_mb": max((x["rss_mb"] for x in r["rss"]), default=None),
                "rss_last_mb": r["rss"][-1]["rss_mb"] if r["rss"] else None, "summary_line": r["stdout"],
                "wall_s_all_rounds": walls[name]}
    base = results["no-dp"]["wall_s"]
    for name in ("epsilon", "noise-multiplier"):
        results[name]["ratio_to_no_dp"] = results[name]["wall_s"] / base
    targets = {name: results[name]["ratio_to_no_dp"] <= 1.5 for name in ("epsilon", "noise-multiplier")}
    return {"steps": args.steps, "tree": str(tree), "load_before": load_before, "load_after": _load(),
            "cpus": os.cpu_count(), "runs": results, "targets_ratio_le_1.5": targets}


def print_table(data: dict) -> None:
    print(f"\ndigits default, {data['steps']} steps, {data['cpus']} CPUs, load {data['load_before']:.1f} -> "
          f"{data['load_after']:.1f}")
    print(f"{'run':18s} {'wall s':>8s} {'x no-dp':>8s} {'epsilon':>9s} {'cap':>5s} {'plan s':>7s} "
          f"{'ms/row':>8s} {'final s':>8s} {'RSS MB':>8s}")
    for name, r in data["runs"].items():
        acc = r["accounting_s"] or {}
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
        ratio = "1.00" if name == "no-dp" else f"{r['ratio_to_no_dp']:.2f}"
        per_row = "-" if r["accounting_ms_per_row"] is None else f"{r['accounting_ms_per_row']:.1f}"
        print(f"{name:18s} {r['wall_s']:8.1f} {ratio:>8s} {eps:>9s} {str(r['batch_cap'] or '-'):>5s} "
              f"{acc.get('plan', 0):7.2f} {per_row:>8s} {acc.get('final', 0):8.2f} "
              f"{(r['rss_peak_mb'] or 0):8.0f}")
    for name, ok in data["targets_ratio_le_1.5"].items():
        print(f"target: {name} wall <= 1.5x no-dp: {'PASS' if ok else 'FAIL'}")


def soak(args) -> dict:
    tree = Path(args.tree).resolve()
    steps = args.soak_steps
    flags = ["--steps", str(steps), "--noise-multiplier", str(args.soak_noise_multiplier), "--keep-checkpoints", "3",
             "--checkpoint-every", "1000", "--log-every", "100", "--eval-every", "5000"]
    with tempfile.TemporaryDirectory(prefix="bench_soak_") as tmp:
        out = Path(tmp) / "soak"
        print(f"soak: dpzero train {' '.join(flags)}", flush=True)
        r = run_train(flags, out, tree, interval=2.0)
        kept = sorted(p.name for p in (out / "checkpoints").iterdir())
        rows = _rows_written(out / "metrics.jsonl")
    samples = r["rss"]
    at = next((x for x in samples if x["step"] >= min(5000, steps // 2)), samples[0])
    # training only: rows 100 steps apart, so samples showing step <= steps - 200 precede the last row, whose
    # epsilon (dp_accounting from scratch at full resolution) and the final evaluation are reported apart
    training = [x for x in samples if 0 < x["step"] <= steps - 200]
    end = training[-1] if training else samples[-1]
    final_peak = max((x["rss_mb"] for x in samples if x["t"] > end["t"]), default=None)
    # step time over the first and the last tenth of the run, from the samples' (time, step) pairs
    def rate(lo: int, hi: int) -> float | None:
        pts = [x for x in training if lo <= x["step"] <= hi]
        if len(pts) < 2 or pts[-1]["step"] == pts[0]["step"]:
            return None
        return 1000 * (pts[-1]["t"] - pts[0]["t"]) / (pts[-1]["step"] - pts[0]["step"])
    tenth = steps // 10
    first, last = rate(tenth // 2, tenth + tenth // 2), rate(steps - tenth - tenth // 2, steps - tenth // 2)
    data = {"steps": steps, "flags": flags, "wall_s": r["wall_s"], "summary_line": r["stdout"],
            "rss_at_step": {"step": at["step"], "rss_mb": at["rss_mb"]},
            "rss_end": {"step": end["step"], "rss_mb": end["rss_mb"]},
            "rss_growth_pct": 100 * (end["rss_mb"] / at["rss_mb"] - 1), "rss_peak_after_training_mb": final_peak,
            "step_ms_first_tenth": first, "step_ms_last_tenth": last, "checkpoints_kept": kept,
            "rows": len(rows), "epsilon": r["summary"]["epsilon"],
            "rss_samples": samples[:: max(1, len(samples) // 400)]}
    data["targets"] = {"rss_within_5pct": abs(data["rss_growth_pct"]) <= 5,
                       "step_time_flat_20pct": first is not None and last is not None and last <= 1.2 * first,
                       "checkpoints_bounded": len([k for k in kept if k.isdigit()]) <= 3}
    print(f"RSS at step {at['step']}: {at['rss_mb']:.0f} MB; at step {end['step']}: {end['rss_mb']:.0f} MB "
          f"({data['rss_growth_pct']:+.1f}%)")
    print(f"step time: {first} ms (first tenth) vs {last} ms (last tenth); checkpoints kept: {kept}")
    for name, ok in data["targets"].items():
        print(f"target: {name}: {'PASS' if ok else 'FAIL'}")
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three runs; the fastest is kept")
    parser.add_argument("--epsilon", type=float, default=50.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.5896)
    parser.add_argument("--tree", default=str(ROOT), help="checkout whose dpzero_jax runs (default: this one)")
    parser.add_argument("--soak", action="store_true", help="one 100,000-step DP run: memory, step time, disk")
    parser.add_argument("--soak-steps", type=int, default=100_000)
    parser.add_argument("--soak-noise-multiplier", type=float, default=5.0)
    parser.add_argument("--json", help="output file (default experiments/results/bench_main_job[_soak].json)")
    args = parser.parse_args(argv)
    data = soak(args) if args.soak else bench(args)
    if not args.soak:
        print_table(data)
    path = Path(args.json) if args.json else RESULTS / ("bench_main_job_soak.json" if args.soak
                                                        else "bench_main_job.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"JSON in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
