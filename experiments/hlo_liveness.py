"""What a TPU-compiled step holds at its peak: the dumped program's buffer liveness replayed, loop bodies included.

The compiler's own live-range dump (``*live-range.txt``) follows the entry computation only: a ``while`` loop -- the
scan over a model's blocks, where a remat step's backward runs -- is one instruction there, its body's buffers
unseen. This replays the whole module from the files ``--xla_dump_to`` writes for a compiled step:

* the schedule: ``*after_optimizations.txt`` (``is_scheduled=true``: each computation's instructions in execution
  order), flattened as the heap simulator does, a ``while`` / ``conditional`` / ``call``'s computations (and an
  async start's) placed before the instruction itself;
* the values: ``*buffer-assignment-values.txt`` (each value's positions and uses) and their sizes in HBM from
  ``*after_optimizations-buffer-assignment.txt`` (memory space 0; on-chip values left out);
* the buffers: the values of one ``while`` loop's index (its operand, the body's parameter and root, the
  condition's parameter) share one buffer, as do an instruction's output and the operand it aliases
  (``output_to_operand_aliasing``), or the same-sized operand whose last use it is (the compiler writes such outputs
  in place); every parameter allocation is live throughout.

A buffer is live from its first position to its last position or use in the flattened schedule; the peak is the
largest sum. On the steps of ``experiments/planner_vs_tpu.py`` it equals the compiler's ``peak_memory_in_bytes``
within 1% (125 of 140 dumped steps of it and ``tpu_aot.py``; LoRA on the 70B shape 0.96; of the Gemma and Llama-3
presets and Llama shapes on 128-256 chips 0.71-1.01: an all-reduce's in-place reuse guessed wrong; Gemma-2B's and
Gemma-7B's sizes behind a vocabulary-sharded head, DP, 0.93-1.34: it holds fp32 per-example table gradients the
compiler's peak does not; the explicit strategy's GPT-2 XL variants 1.02-1.04), and it lists what is live there --
the evidence
:mod:`dpzero_jax.step_memory`'s formulas were written from::

    python experiments/hlo_liveness.py DUMP_DIR [--top 25] [--within REGEX] [--compiler]

``--within`` reports the largest moment inside computations matching ``REGEX`` (e.g. a scan body) instead;
``--compiler`` the compiler's own list at its peak (:func:`compiler_peak`), each share named by the JAX operation
that made it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import itertools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_text  # noqa: E402  (a sibling module: JAX-free HLO text helpers)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer: its first value's defining ``name`` and ``shape``, ``size`` in bytes, live ``[start, end]`` in
    the flattened schedule, the ``computation`` that defines it, ``parameter`` for an argument allocation."""

    name: str
    shape: str
    size: int
    start: int
    end: int
    computation: str
    parameter: bool


@dataclasses.dataclass(frozen=True)
class Replay:
    """The replayed program: ``peak_bytes`` at ``schedule[peak_at]``, the ``arguments`` (parameter allocations)
    within it, and every buffer."""

    peak_bytes: int
    peak_at: int
    instruction: str
    computation: str
    arguments: int
    buffers: tuple[Buffer, ...]
    live: tuple[int, ...]
    schedule: tuple[str, ...]
    computation_of: dict

    def live_at(self, time: int) -> list[Buffer]:
        """The buffers live at ``time``, largest first."""
        return sorted((b for b in self.buffers if b.start <= time <= b.end), key=lambda b: -b.size)

    def peak_within(self, pattern: str) -> int:
        """The schedule position of the largest live total inside computations whose name matches ``pattern``."""
        times = [t for t, name in enumerate(self.schedule) if re.search(pattern, self.computation_of[name])]
        if not times:
            raise ValueError(f"no computation matches {pattern!r}")
        return max(times, key=lambda t: self.live[t])


def _one(directory: str, suffix: str) -> str:
    found = sorted(glob.glob(os.path.join(directory, f"*{suffix}")))
    if not found:
        raise FileNotFoundError(f"no *{suffix} in {directory} (compile with --xla_dump_to={directory})")
    with open(found[-1]) as f:
        return f.read()


def _closing(text: str) -> int:
    """The index of the parenthesis closing ``text``'s first."""
    depth = 0
    for index, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            return index
    raise ValueError(f"unbalanced parentheses in {text[:80]!r}")


def _parse_program(text: str):
    """``(computations {name: [(instruction, opcode, called, operands, aliasing)]}, roots, entry)``; the
    computations split by :func:`hlo_text.computations`."""
    lines_of, entry = hlo_text.computations(text)
    computations, roots = {name: [] for name in lines_of}, {}
    for current, lines in lines_of.items():
        for line in lines:
            _parse_instruction(line, current, computations, roots)
    return computations, roots, entry


def _parse_instruction(line: str, current: str, computations: dict, roots: dict) -> None:
    """Append ``line``'s instruction to ``computations[current]`` (its root to ``roots``)."""
    found = re.match(r"^\s+(ROOT )?%(\S+) = (.*)$", line)
    if not found:
        return
    name, rest = found.group(2), found.group(3)
    if rest.startswith("("):            # a tuple shape: skip to its closing parenthesis
        after = rest[_closing(rest) + 1:].lstrip()
    else:
        after = rest.partition(" ")[2]
    opcode = after.split("(")[0]
    called = []
    if opcode == "while":
        called = [re.search(rf"{key}=%([\w.\-]+)", after).group(1) for key in ("condition", "body")]
    elif opcode == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", after)
        called = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                  [re.search(rf"{key}=%([\w.\-]+)", after).group(1) for key in ("true_computation",
                                                                                "false_computation")])
    elif opcode == "call":
        called = [re.search(r"to_apply=%([\w.\-]+)", after).group(1)]
    elif opcode.startswith("async") and opcode.endswith("-start") and "calls=%" in after:
        called = [re.search(r"calls=%([\w.\-]+)", after).group(1)]
    operands = re.findall(r"%([\w.\-]+)", after.split("),")[0])
    aliasing = re.findall(r"\{([\d,]*)\}: \((\d+), \{([\d,]*)\}\)",
                          (re.search(r"output_to_operand_aliasing=\{.*?\}\}?,", after) or [""])[0])
    computations[current].append((name, opcode, called, operands, aliasing))
    if found.group(1):
        roots[current] = name


def replay(directory: str, module: str = "jit_step") -> Replay:
    """Replay the last module named ``module`` (a jitted function's: ``jit_<name>``) dumped in ``directory``."""
    computations, roots, entry = _parse_program(_one(directory, f"{module}.*after_optimizations.txt"))
    assignment = _one(directory, f"{module}.*after_optimizations-buffer-assignment.txt")
    values_text = _one(directory, f"{module}.*buffer-assignment-values.txt")

    schedule, time, computation_of = [], {}, {}

    def flatten(computation):
        for name, _, called, _, _ in computations[computation]:
            for inner in called:
                flatten(inner)
            time[name], computation_of[name] = len(schedule), computation
            schedule.append(name)
    flatten(entry)
    instructions = {name: (opcode, called, operands, aliasing)
                    for rows in computations.values() for name, opcode, called, operands, aliasing in rows}

    size, shape = {}, {}
    value = r"value: <(\d+) (\S+?)(?:\{[\d,]*\})?(?: \(phi\))? @(\d+)> \(size=(\d+),offset=\d+\): (\S+)"
    for found in re.finditer(value, assignment):
        if found.group(3) == "0":          # memory space 0: HBM
            size[int(found.group(1))] = int(found.group(4))
            shape[int(found.group(1))] = found.group(5).split("{")[0]
    parameter_allocation = {}
    for found in re.finditer(r"^allocation (\d+): size (\d+), (.*)\n((?: value:.*\n)+)", assignment, re.M):
        if "parameter" in found.group(3):
            for v in re.findall(r"value: <(\d+) ", found.group(4)):
                parameter_allocation[int(v)] = (int(found.group(1)), int(found.group(2)))

    values, at = {}, collections.defaultdict(list)
    for record in re.split(r"^<", values_text, flags=re.M)[1:]:
        head = re.match(r"(\d+) (\S+?)(?:\{[\d,]*\})?(?: \(phi\))? @\d+>", record)
        positions_text, _, uses_text = record.partition(" uses:")
        positions = re.findall(r"^  (\S+)(?: (\{[\d,]*\}))?$", positions_text, re.M)
        uses = re.findall(r"^  (\S+), operand", uses_text, re.M)
        vid = int(head.group(1))
        values[vid] = (head.group(2), [p for p, _ in positions], uses)
        for p, index in positions:
            at[(p, index or "{}")].append(vid)

    parent = {}

    def find(x):
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    def union(a, b):
        parent[find(a)] = find(b)

    params_of = {c: [n for n, op, *_ in rows if op == "parameter"] for c, rows in computations.items()}
    loop_key = {}
    for rows in computations.values():
        for name, opcode, called, operands, _ in rows:
            if opcode == "while":
                condition, body = called
                for member in [name, operands[0], roots[body]] + params_of[body] + params_of[condition]:
                    loop_key[member] = name
    for (position, index), vids in at.items():
        if position in loop_key:
            for vid in vids:
                union(vid, ("loop", loop_key[position], index))
    for name, (_, _, operands, aliasing) in instructions.items():
        for out_index, operand, in_index in aliasing:
            sources = at.get((operands[int(operand)], "{" + in_index + "}"), []) if int(operand) < len(operands) else []
            for vid in at.get((name, "{" + out_index + "}"), []) if sources else []:
                union(vid, sources[0])
    for vid, (allocation, _) in parameter_allocation.items():
        union(vid, ("parameter", allocation))

    groups = collections.defaultdict(list)
    for vid in values:
        if vid in size:
            groups[find(vid)].append(vid)
    buffers = []
    for vids in groups.values():
        times = [time[p] for v in vids for p in values[v][1] + values[v][2] if p in time]
        if not times:
            continue
        first = values[vids[0]][0]
        params = [parameter_allocation[v][1] for v in vids if v in parameter_allocation]
        start, end = (0, len(schedule) - 1) if params else (min(times), max(times))
        buffers.append(Buffer(first, shape[vids[0]], max(params) if params else max(size[v] for v in vids), start,
                              end, computation_of.get(first, "?"), bool(params)))
    buffers = _share_in_place(buffers, instructions, time)

    delta = [0] * (len(schedule) + 1)
    for b in buffers:
        delta[b.start] += b.size
        delta[b.end + 1] -= b.size
    live = tuple(itertools.accumulate(delta[:-1]))
    peak_at = max(range(len(live)), key=live.__getitem__)
    return Replay(live[peak_at], peak_at, schedule[peak_at], computation_of[schedule[peak_at]],
                  sum(b.size for b in buffers if b.parameter), tuple(buffers), live, tuple(schedule), computation_of)


def _share_in_place(buffers: list[Buffer], instructions: dict, time: dict) -> list[Buffer]:
    """An output written over a same-sized operand whose last use is its instruction: the operand's buffer ends
    just before (the compiler reuses it)."""
    by_name = collections.defaultdict(list)
    for index, b in enumerate(buffers):
        by_name[b.name].append(index)
    out = list(buffers)
    for j, b in enumerate(buffers):
        if b.parameter or b.name not in time or time[b.name] != b.start:
            continue
        for operand in instructions[b.name][2]:
            shared = next((i for i in by_name.get(operand, []) if i != j and not out[i].parameter
                           and out[i].end == b.start and out[i].size == b.size and out[i].start < b.start), None)
            if shared is not None:
                out[shared] = dataclasses.replace(out[shared], end=b.start - 1)
                break
    return out


def summary(result: Replay, top: int = 12, time: int | None = None) -> dict:
    """``{peak_bytes, arguments, instruction, computation, largest: [[name, shape, bytes, computation], ...]}``
    at the peak (or at ``time``)."""
    time = result.peak_at if time is None else time
    live = [b for b in result.live_at(time) if not b.parameter]
    return {"peak_bytes": result.live[time], "arguments": result.arguments,
            "instruction": result.schedule[time], "computation": result.computation_of[result.schedule[time]],
            "largest": [[b.name, b.shape, b.size, b.computation] for b in live[:top]]}


# a first-level share of the peak breakdown: "      ├── jit(step)/.../scatter-add (63.2%, total: 2 097 152 004 bytes"
_FIRST_LEVEL_SHARE = re.compile(r" {6}[\u251c\u2514]\u2500\u2500 (.+) \([\d.]+%, total: ([\d ]+) bytes")


def compiler_peak(directory: str, module: str = "jit_step", top: int = 12) -> dict:
    """The compiler's own account of its peak, from ``*live-range.txt``'s ``Live ranges at N (peak)`` and ``Stack
    trace breakdown for peak usage`` sections: ``{bytes, values: [[value, bytes], ...], sources: [[label, bytes],
    ...]}``, largest first (``top`` of each). The values are the entry computation's (a loop body's own buffers are
    inside the ``while``'s share of the breakdown); ``sources`` names each first-level share by the JAX operation
    that made it (``transpose(jvp(jit(_take)))/scatter-add``: a lookup's gradient). Where the peak is in the entry
    computation this is the list the replay's can be checked against (an all-reduce written in place or not); where
    ``bytes`` is below the compiled ``peak_memory_in_bytes``, the peak is inside a loop body this list does not open
    (the replay's :func:`summary` then)."""
    text = _one(directory, f"{module}.*live-range.txt")
    values, sources, total, section = [], [], None, None
    for line in text.splitlines():
        stripped = line.strip()
        if re.match(r"Live ranges at \d+ \(peak\):", stripped):
            section = "values"
        elif stripped.startswith("Stack trace breakdown for peak usage:"):
            section, total = "sources", int(re.sub(r"\D", "", stripped.split(":", 1)[1]))
        elif section == "values":
            match = re.match(r"(\S+): (\d+) bytes", stripped)
            if match:
                values.append([match.group(1), int(match.group(2))])
            else:
                section = None
        elif section == "sources":
            match = _FIRST_LEVEL_SHARE.match(line)
            if match:
                sources.append([match.group(1), int(match.group(2).replace(" ", ""))])
    if total is None:
        raise ValueError(f"no peak section in {directory}'s live-range dump")
    return {"bytes": total, "values": sorted(values, key=lambda v: -v[1])[:top],
            "sources": sorted(sources, key=lambda v: -v[1])[:top]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump", help="the --xla_dump_to directory of one compiled step")
    parser.add_argument("--module", default="jit_step", help="the dumped module's name (default jit_step)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--within", help="the largest moment inside computations matching this regular expression")
    parser.add_argument("--compiler", action="store_true",
                        help="the compiler's own peak list (*live-range.txt) instead of the replay")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.compiler:
        report = compiler_peak(args.dump, args.module, args.top)
        print(json.dumps(report, indent=1) if args.json else "\n".join(
            [f"{report['bytes'] / 2**30:.3f} GiB at the compiler's peak"]
            + [f"  {nbytes / 2**20:9.1f} MiB  {name}" for name, nbytes in report["values"]]
            + ["by source:"] + [f"  {nbytes / 2**20:9.1f} MiB  {name}" for name, nbytes in report["sources"]]))
        return report
    result = replay(args.dump, args.module)
    report = summary(result, args.top, result.peak_within(args.within) if args.within else None)
    if args.json:
        print(json.dumps(report, indent=1))
        return report
    mib = 2**20
    print(f"{report['peak_bytes'] / 2**30:.3f} GiB live at {report['instruction']} ({report['computation']}); "
          f"arguments {report['arguments'] / 2**30:.3f} GiB; {len(result.schedule)} instructions")
    for name, buffer_shape, nbytes, computation in report["largest"]:
        print(f"  {nbytes / mib:9.1f} MiB  {buffer_shape:32s} {name:44s} {computation}")
    return report


if __name__ == "__main__":
    main()
