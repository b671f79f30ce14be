"""Reading the optimised HLO text of a compiled program (``compiled.as_text()``): its collectives with their bytes,
how often each runs in one step, the FLOPs of its matrix products per step (:func:`matmul_flops`), its large
buffers, and how many distinct kernels XLA:CPU compiles for it (:func:`distinct_fusions`).

Shared by the compiled-program benchmarks (``bench_compiled.py``, ``tpu_aot.py``); plain text parsing, no JAX.

Static and executed counts: an instruction inside a loop body appears once in the text but runs once per iteration.
:func:`parse_collectives` counts the text (static); with ``executed=True`` each instruction is weighted by how many
times its computation runs in one call of the program (:func:`multiplicities`: a ``while`` body times its trip
count, found as :func:`trip_count` says). A loop whose trip count cannot be read is counted once and reported.
"""

from __future__ import annotations

import math
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
# "%name = <shape> <op>(" with <op> a collective, optionally "-start" (async); "-done" halves are skipped
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# a computation's first line ("%name (params) -> shape {", "ENTRY %name ... {") and an instruction calling one
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALL = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bcalls=%?([\w.\-]+)")


def array_bytes(shape_text: str) -> list[int]:
    """Byte sizes of the arrays in an HLO shape (an array or a tuple of arrays)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(shape_text):
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        sizes.append(int(count * _DTYPE_BYTES[dtype]))
    return sizes


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """``({computation name: its instruction lines}, the entry computation's name)`` of an HLO module's text."""
    found: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            found[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            found[current].append(line)
    return found, entry


def distinct_fusions(hlo_text: str) -> int:
    """How many of the computations that the program's fusions call differ other than by their names and metadata:
    the kernels XLA:CPU compiles (it compiles identical ones once, each distinct one at about 10 ms)."""
    comps, _ = computations(hlo_text)
    called = {m.group(2) for line in hlo_text.splitlines() if " fusion(" in line and (m := _CALL.match(line))}
    return len({"\n".join(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line)).strip()
                          for line in comps[name]) for name in called})


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_WHILE = re.compile(r"\swhile\(%?([\w.\-]+)\),\s*condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_KNOWN_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPERANDS = re.compile(r"\s([a-z][\w\-]*)\(([^()]*)\)")
_REFERENCES = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                         r"|\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _definitions(lines: list[str]) -> dict[str, str]:
    return {m.group(1): line for line in lines if (m := _NAME.match(line))}


def _op(line: str) -> tuple[str, list[str]]:
    """``(opcode, operand names)`` of an instruction line (operands printed with or without their shapes)."""
    match = _OPERANDS.search(line.split("=", 1)[1]) if "=" in line else None
    if not match:
        return "", []
    operands = re.sub(r"/\*.*?\*/", "", match.group(2))
    return match.group(1), [part.split()[-1].lstrip("%") for part in operands.split(",") if part.strip()]


def _constant(line: str | None, defs: dict[str, str] | None = None) -> int | None:
    """The integer an instruction holds: a ``constant``, or a ``copy`` / ``bitcast`` of one (looked up in
    ``defs``)."""
    match = re.search(r"\sconstant\((-?\d+)\)", line or "")
    if match:
        return int(match.group(1))
    opcode, operands = _op(line or "")
    if defs is not None and opcode in ("copy", "bitcast") and len(operands) == 1:
        return _constant(defs.get(operands[0]), defs)
    return None


def _tuple_index(line: str | None, defs: dict[str, str]) -> int | None:
    """``k`` of a ``get-tuple-element(...), index=k`` (or a ``copy`` / ``bitcast`` of one)."""
    opcode, operands = _op(line or "")
    if opcode in ("copy", "bitcast") and len(operands) == 1:
        return _tuple_index(defs.get(operands[0]), defs)
    if opcode != "get-tuple-element":
        return None
    match = re.search(r"index=(\d+)", line)
    return int(match.group(1)) if match else None


def _root(lines: list[str]) -> str | None:
    return next((line for line in lines if line.lstrip().startswith("ROOT")), None)


def _resolved(line: str | None, comps: dict[str, list[str]]) -> tuple[str, list[str], str | None]:
    """``(opcode, operand names, called computation)`` of ``line``; a fusion wrapping one instruction (``kLoop``
    fusions of a compare or an add, as XLA:CPU prints loop counters) reads as that instruction, its operands the
    fusion's."""
    return_op, operands = _op(line or "")
    called = re.search(r"\bcalls=%?([\w.\-]+)", line or "")
    if return_op == "fusion" and called and called.group(1) in comps:
        inner_op, _ = _op(_root(comps[called.group(1)]) or "")
        return inner_op, operands, called.group(1)
    return return_op, operands, None


def trip_count(while_line: str, comps: dict[str, list[str]], caller: list[str]) -> int | None:
    """How many times the ``while`` instruction ``while_line`` (an instruction of the computation whose lines are
    ``caller``) runs its body, or ``None`` when it cannot be read.

    From the compiler's ``known_trip_count`` when it records one (XLA:CPU and GPU do); else (the TPU compiler does
    not) from the loop itself: a condition ``counter < N`` (``compare(get-tuple-element(param), index=k),
    constant(N)), direction=LT``, or ``N > counter``), the counter's initial value a constant in the loop's operand
    tuple and the body adding the constant 1 to it: ``N - initial`` iterations. Anything else is ``None``.
    """
    known = _KNOWN_TRIP.search(while_line)
    if known:
        return int(known.group(1))
    match = _WHILE.search(while_line)
    if not match or match.group(2) not in comps or match.group(3) not in comps:
        return None
    operand, condition, body = match.groups()
    cond_defs = _definitions(comps[condition])
    root = _root(comps[condition])
    opcode, operands, called = _resolved(root, comps)
    if opcode != "compare" or len(operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root if called is None else (_root(comps[called]) or ""))
    direction = direction.group(1) if direction else None
    left, right = (cond_defs.get(name) for name in operands)
    if direction == "LT" and _tuple_index(left, cond_defs) is not None and _constant(right, cond_defs) is not None:
        index, bound = _tuple_index(left, cond_defs), _constant(right, cond_defs)
    elif direction == "GT" and _tuple_index(right, cond_defs) is not None and _constant(left, cond_defs) is not None:
        index, bound = _tuple_index(right, cond_defs), _constant(left, cond_defs)
    else:
        return None
    caller_defs = _definitions(caller)
    tuple_op, elements = _op(caller_defs.get(operand, ""))
    if tuple_op != "tuple" or index >= len(elements):
        return None
    initial = _constant(caller_defs.get(elements[index]), caller_defs)
    body_defs = _definitions(comps[body])
    body_op, results = _op(_root(comps[body]) or "")
    if initial is None or body_op != "tuple" or index >= len(results):
        return None
    add_op, add_operands, _ = _resolved(body_defs.get(results[index]), comps)
    if add_op != "add" or len(add_operands) != 2:
        return None
    counter = [name for name in add_operands if _tuple_index(body_defs.get(name), body_defs) == index]
    step = [_constant(body_defs.get(name), body_defs) for name in add_operands if name not in counter]
    if len(counter) != 1 or step != [1]:
        return None
    return max(bound - initial, 0)


def multiplicities(hlo_text: str) -> tuple[dict[str, int], list[str]]:
    """``({computation: how many times it runs in one call of the program}, [the while instructions whose trip count
    could not be read])``. The entry runs once; a computation called by an instruction (``calls=``, ``to_apply=``,
    conditional branches: each counted as if taken) runs as often as its caller; a ``while`` body ``trip count``
    times as often, its condition once more (:func:`trip_count`; an unreadable one counted as 1)."""
    comps, entry = computations(hlo_text)
    edges: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    unknown = []
    for name, lines in comps.items():
        for line in lines:
            loop = _WHILE.search(line)
            if loop:
                trips = trip_count(line, comps, lines)
                if trips is None:
                    unknown.append(_NAME.match(line).group(1) if _NAME.match(line) else line.strip()[:80])
                    trips = 1
                edges[name] += [(loop.group(3), trips), (loop.group(2), trips + 1)]
            for single, several in _REFERENCES.findall(line):
                for callee in ([single] if single else [c.strip().lstrip("%") for c in several.split(",")]):
                    if callee in comps:
                        edges[name].append((callee, 1))
    order, seen = [], set()

    def visit(name):            # post-order from the entry: every callee before its callers (reversed below)
        seen.add(name)
        for callee, _ in edges[name]:
            if callee not in seen:
                visit(callee)
        order.append(name)
    if entry is not None:
        visit(entry)
    counts = dict.fromkeys(comps, 0)
    if entry is not None:
        counts[entry] = 1
    for name in reversed(order):            # every caller before its callees
        for callee, factor in edges[name]:
            counts[callee] += counts[name] * factor
    return counts, unknown


def _counted_collectives(hlo_text: str) -> list[tuple[str | None, re.Match]]:
    """``(computation, instruction match)`` of the collective instructions of an HLO module's text, each logical
    collective once.

    The TPU compiler splits a collective it overlaps with computation (an all-gather feeding a matmul) into three
    fusions -- ``async-collective-start``, the overlapped ``async_collective_fusion`` and ``async-collective-done``
    -- and each fused computation holds a copy of the same instruction (one channel). Only the start's copy is
    counted: the copies in computations called by an ``async-collective-done`` or named ``async_collective_fusion``
    are skipped (counting all three made one gather look like three).
    """
    lines = hlo_text.splitlines()
    copies = set()
    for line in lines:
        call = _CALL.match(line)
        if call and call.group(1).startswith("async-collective-done"):
            copies.add(call.group(2))
    found, computation = [], None
    for line in lines:   # lines outside any computation (a fragment of a module) count too, under None
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if match and computation not in copies and not (computation or "").startswith("async_collective_fusion"):
            found.append((computation, match))
    return found


def parse_collectives(hlo_text: str, executed: bool = False) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` for every collective of an HLO module's text (:func:`_counted_collectives`:
    an async collective split over three fusions counted once).

    bytes: the size of the collective's output buffer(s) on one device. An async ``-start`` op's result is a tuple
    that also holds its operands (``all-gather-start``: ``(operands, outputs)``; ``collective-permute-start``:
    ``(operand, output, context...)``), so only the output part is counted; a combined all-reduce's tuple is summed.
    ``executed=False``: static count (an instruction in a loop body once); ``True``: per call of the program, each
    instruction times the runs of its computation (:func:`multiplicities`).
    """
    runs = multiplicities(hlo_text)[0] if executed else {}
    out: dict[str, dict[str, int]] = {}
    for computation, match in _counted_collectives(hlo_text):
        shape_text, kind, start = match.groups()
        sizes = array_bytes(shape_text)
        if start and kind in ("all-gather", "all-to-all", "reduce-scatter") and len(sizes) >= 2:
            sizes = sizes[len(sizes) // 2:]
        elif start and kind == "collective-permute" and sizes:
            sizes = sizes[1:2] if len(sizes) >= 2 else sizes
        times = runs.get(computation, 1) if executed else 1
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += times
        entry["bytes"] += times * sum(sizes)
    return out


_DIMS = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([\w?]+)_([\w?]+)->([\w?]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _dims(line: str | None) -> list[int] | None:
    """The dimensions of an instruction's (array) result, ``None`` for a tuple or an unknown name."""
    match = _DIMS.match(line or "")
    return None if match is None else [int(d) for d in match.group(1).split(",") if d]


def _window_fields(line: str, rank: int) -> dict[str, list]:
    """A convolution's ``window={size=.. stride=.. pad=lo_hi.. lhs_dilate=.. rhs_dilate=..}``, one entry per spatial
    dimension (defaults: stride, dilations 1, padding 0)."""
    fields = {"size": [1] * rank, "stride": [1] * rank, "pad": [(0, 0)] * rank, "lhs_dilate": [1] * rank,
              "rhs_dilate": [1] * rank}
    match = _WINDOW.search(line)
    for item in (match.group(1).split() if match else []):
        key, _, value = item.partition("=")
        if key == "pad":
            fields["pad"] = [tuple(int(v) for v in part.split("_")) for part in value.split("x")]
        elif key in fields:
            fields[key] = [int(v) for v in value.split("x")]
    return fields


def _valid_taps(out: int, size: int, stride: int, pad_lo: int, base: int, base_dilate: int, dilate: int) -> int:
    """How many (output position, window tap) pairs of one spatial dimension land on an input element, not on padding
    or on a hole of a base-dilated input (the TPU compiler writes batched matrix products as such convolutions:
    a window over the batch axis, padded or dilated so that one tap per position is real)."""
    position = (np.arange(out)[:, None] * stride + np.arange(size)[None, :] * dilate - pad_lo)
    dilated = (base - 1) * base_dilate + 1
    return int(np.count_nonzero((position >= 0) & (position < dilated) & (position % base_dilate == 0)))


def _matmul_flops(line: str, defs: dict[str, str]) -> int:
    """``2 x`` the multiply-adds of a ``dot`` or ``convolution`` instruction (0 for any other line or an operand
    whose shape is not in ``defs``). A dot: output elements times the contracted elements. A convolution: output
    batch x output features x the kernel's input features (of one group) x, per spatial dimension, the (output
    position, window tap) pairs that read a real input element (:func:`_valid_taps`)."""
    opcode, operands = _op(line)
    out = _dims(line)
    if opcode not in ("dot", "convolution") or out is None or len(operands) < 2:
        return 0
    if opcode == "dot":
        lhs, match = _dims(defs.get(operands[0])), _CONTRACTING.search(line)
        if lhs is None or match is None:
            return 0
        return 2 * math.prod(out) * math.prod(lhs[int(d)] for d in match.group(1).split(",") if d)
    lhs, rhs, match = _dims(defs.get(operands[0])), _dims(defs.get(operands[1])), _DIM_LABELS.search(line)
    if lhs is None or rhs is None or match is None:
        return 0
    lhs_labels, rhs_labels, out_labels = match.groups()
    if not (len(lhs_labels) == len(lhs) and len(rhs_labels) == len(rhs) and len(out_labels) == len(out)):
        return 0
    spatial = sorted(label for label in out_labels if label.isdigit())
    window = _window_fields(line, len(spatial))
    taps = 1
    for d, label in enumerate(spatial):
        taps *= _valid_taps(out[out_labels.index(label)], window["size"][d], window["stride"][d],
                            window["pad"][d][0], lhs[lhs_labels.index(label)], window["lhs_dilate"][d],
                            window["rhs_dilate"][d])
    return 2 * out[out_labels.index("b")] * out[out_labels.index("f")] * rhs[rhs_labels.index("i")] * taps


def matmul_flops(hlo_text: str, executed: bool = True) -> int:
    """The FLOPs of the module's matrix products (``dot`` and ``convolution`` instructions, fused or not: ``2 * output
    elements * contracted elements``; elementwise work is not counted). ``executed=True``: each instruction times the
    runs of its computation in one call of the program (:func:`multiplicities`: a scanned layer's products once per
    layer), unlike ``cost_analysis()``, which counts a loop body once; ``False``: every instruction once."""
    comps, _ = computations(hlo_text)
    runs = multiplicities(hlo_text)[0] if executed else {}
    total = 0
    for name, lines in comps.items():
        times = runs.get(name, 0) if executed else 1
        if times:
            defs = _definitions(lines)
            total += times * sum(_matmul_flops(line, defs) for line in lines)
    return total


def loop_trip_counts(hlo_text: str) -> list[int | None]:
    """The trip count of every ``while`` instruction of the module (:func:`trip_count`; ``None``: unreadable)."""
    comps, _ = computations(hlo_text)
    return [trip_count(line, comps, lines) for lines in comps.values() for line in lines if _WHILE.search(line)]


def collective_shapes(hlo_text: str) -> list[str]:
    """The result shapes of the collectives (layouts dropped), in program order: what each one communicates."""
    return [match.group(2) + (match.group(3) or "") + " " + re.sub(r"\{[^}]*\}", "", match.group(1))
            for _, match in _counted_collectives(hlo_text)]


_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
_NOT_MATERIALISED = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "copy-done",
                     "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done"}


def large_buffers(hlo_text: str, threshold_bytes: int) -> dict[str, int]:
    """``{opcode: count}`` of the instructions of the non-fused computations whose output has an array of at least
    ``threshold_bytes`` (a diagnosis: e.g. how many ``[B, T, V]``-sized buffers the step materialises). Fused
    computations (their instructions live in vector registers / VMEM) and aliasing ops are skipped."""
    found: dict[str, int] = {}
    fused = False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            fused = "fused" in name or "fusion" in name
            continue
        if fused:
            continue
        match = _OPCODE.match(line)
        if not match or match.group(2) in _NOT_MATERIALISED:
            continue
        if max(array_bytes(match.group(1)), default=0) >= threshold_bytes:
            found[match.group(2)] = found.get(match.group(2), 0) + 1
    return found
