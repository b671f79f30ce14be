"""Where XLA's compile time goes: seconds per HLO pass, summed per section of a logged run.

XLA logs every pass it runs, with its time, when a script runs with

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 python experiments/bench_overhead.py ... 2>&1 > run.log

(lines such as ``hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 27.2 s (...)``). This script reads such a
log and sums the times of each pass per *section*: a section starts at each line that matches ``--marker`` (by
default the ``compiling NAME`` lines that ``bench_overhead.py`` and ``profile_step.py`` print before each
candidate's compile), so that the non-private step's passes and the private step's come out side by side. Lines
before the first marker go to a section named ``start``. A section holds everything compiled until the next
marker -- small helper computations too, which is why the non-private section often counts many more pass calls.

    python experiments/xla_pass_times.py run.log [--top 20] [--out passes.json]

Prints one row per pass (seconds and calls per section; the passes with the largest time in any section first)
and the total of each section; ``--out`` writes the same numbers as JSON. Used on an H200 for
``docs/benchmarks/gpu.md``.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys

PASS_TIME = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (ns|us|ms|s)\b")
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
DEFAULT_MARKER = r"^\s*compiling (\S+)"


def pass_times(lines, marker: str = DEFAULT_MARKER) -> dict[str, dict[str, dict[str, float]]]:
    """``{section: {pass: {"seconds": s, "calls": n}}}`` from the lines of a log, sections in the order met."""
    marker_re = re.compile(marker)
    sections: dict[str, dict[str, dict[str, float]]] = {}
    current = "start"
    for line in lines:
        found = marker_re.search(line)
        if found:
            current = found.group(1) if found.groups() else found.group(0).strip()
            while current in sections:   # a name met twice gets its own section
                current += "'"
            sections[current] = {}
            continue
        timed = PASS_TIME.search(line)
        if timed:
            name, value, unit = timed.groups()
            entry = sections.setdefault(current, {}).setdefault(name, {"seconds": 0.0, "calls": 0})
            entry["seconds"] += float(value) * UNIT_SECONDS[unit]
            entry["calls"] += 1
    return {name: passes for name, passes in sections.items() if passes}


def table(sections: dict[str, dict[str, dict[str, float]]], top: int) -> str:
    names = list(sections)
    if not names:
        return "no 'HLO pass: NAME time:' lines found (was TF_CPP_VMODULE=hlo_pass_pipeline=1 set?)"
    largest = collections.Counter()
    for passes in sections.values():
        for name, entry in passes.items():
            largest[name] = max(largest[name], entry["seconds"])
    order = [name for name, _ in largest.most_common(top)]
    width = max(len(n) for n in order + ["pass"])
    head = f"{'pass':<{width}}" + "".join(f"  {s[:14]:>14} s  calls" for s in names)
    rows = [head, "-" * len(head)]
    for name in order:
        entries = [sections[s].get(name, {"seconds": 0.0, "calls": 0}) for s in names]
        cells = "".join(f"  {e['seconds']:16.2f}  {e['calls']:5d}" for e in entries)
        rows.append(f"{name:<{width}}{cells}")
    rows.append(f"{'all passes':<{width}}" + "".join(
        f"  {sum(e['seconds'] for e in sections[s].values()):16.2f}  {sum(e['calls'] for e in sections[s].values()):5d}"
        for s in names))
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a log written with TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1")
    parser.add_argument("--marker", default=DEFAULT_MARKER,
                        help="regular expression of the lines that start a section (group 1: its name)")
    parser.add_argument("--top", type=int, default=20, help="passes listed (default 20)")
    parser.add_argument("--out", help="JSON output path")
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as log:
        sections = pass_times(log, args.marker)
    print(table(sections, args.top))
    if args.out:   # passes under a millisecond in a section are left out of the JSON (their sum is kept)
        kept = {section: {name: entry for name, entry in passes.items() if entry["seconds"] >= 1e-3}
                for section, passes in sections.items()}
        totals = {section: {"seconds": sum(e["seconds"] for e in passes.values()),
                            "calls": sum(e["calls"] for e in passes.values())} for section, passes in sections.items()}
        with open(args.out, "w") as out:
            json.dump({"log": args.log, "marker": args.marker, "totals": totals, "sections": kept}, out, indent=1)
        print(f"wrote {args.out}")
    return 0 if sections else 1


if __name__ == "__main__":
    sys.exit(main())
