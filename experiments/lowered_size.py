"""How large a training step's program is when lowered for another backend, and how much of it is the noise's
Threefry: no device needed.

JAX lowers a program for any platform it knows (``jit(...).trace(...).lower(lowering_platforms=...)``), so this runs
on a CPU. Each candidate of ``bench_overhead.py`` (the non-private step and the private ones, with
``DPConfig.target`` set to the platform's backend so the engine plans as it would there) is lowered to StableHLO;
the script counts its operations with every ``func.call`` inlined (what XLA sees after its call inliner), and the
share of them inside JAX's Threefry functions: on CUDA or TPU each Threefry call (a ``fold_in``, a draw of
``jax.random.normal``) is lowered unrolled (about 230 operations a call; on a CPU a rolled loop), and the
partitionable noise called it twice per gradient leaf until the keys were derived together and the small leaves
drawn by shape (``dpzero_jax.noise._noised_partitionable``). Written for ``docs/benchmarks/gpu.md``: the private
GPT-2-small step compiled ~3.9x longer than the non-private one on an H200, most of the excess in XLA's fusion
passes.

    python experiments/lowered_size.py --gpt2-small [--platform cuda] [--modes auto,vmap-mbB] [--out size.json]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import re
import sys

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead_steps as overhead  # noqa: E402  (a sibling module)

TARGET_OF_PLATFORM = {"cuda": "gpu", "rocm": "gpu", "tpu": "tpu", "cpu": "cpu"}
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$\-]+)\(", re.M)
_OP = re.compile(r"^\s*(?:%[\w#:.\-, %]+ = )?\"?[a-z_]+\.[\w.]+\"?[ (<{]", re.M)
_CALL = re.compile(r"call @([\w.$\-]+)\(")


def function_sizes(text: str) -> tuple[dict[str, int], dict[str, collections.Counter]]:
    """``({function: operations in its body}, {function: Counter(callee: calls)})`` of a StableHLO module's text;
    operations are the dialects' (``stablehlo.add``, ``chlo.erf_inv``, ...), not calls or returns."""
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(text)] + [(len(text), None)]
    sizes, callees = {}, {}
    for (start, name), (end, _) in zip(starts, starts[1:]):
        body = text[start:end].split("\n", 1)[1] if "\n" in text[start:end] else ""
        sizes[name] = len(_OP.findall(body))
        callees[name] = collections.Counter(_CALL.findall(body))
    return sizes, callees


def inlined_size(text: str, root: str = "main", marker: str = "threefry") -> tuple[int, int, int]:
    """``(operations of ``root`` with every call inlined, of which inside functions named with ``marker``, calls
    of such functions from outside them)``."""
    sizes, callees = function_sizes(text)

    @functools.cache
    def total(name: str, inside: bool) -> tuple[int, int, int]:
        entered = int(marker in name and not inside)
        inside = inside or marker in name
        ops, marked = sizes.get(name, 0), (sizes.get(name, 0) if inside else 0)
        for callee, calls in callees.get(name, {}).items():
            sub_ops, sub_marked, sub_entered = total(callee, inside)
            ops, marked, entered = ops + calls * sub_ops, marked + calls * sub_marked, entered + calls * sub_entered
        return ops, marked, entered

    return total(root, False)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def measure(workload: overhead.Workload, modes: list[str], platform: str) -> list[dict]:
    params, loss_fn, batch = overhead.make_workload(workload)
    optimizer = optax.adamw(1e-3)
    args = (abstract(params), abstract(jax.eval_shape(optimizer.init, params)), abstract(batch),
            jax.eval_shape(lambda: jax.random.key(0)))
    rows = []
    # the engine plans for the platform's backend, as it would there
    for candidate in overhead.make_steps(loss_fn, optimizer, modes, workload.batch_size,
                                         target=TARGET_OF_PLATFORM[platform]):
        lowered = jax.jit(candidate.step).trace(*args).lower(lowering_platforms=(platform,))
        ops, threefry, calls = inlined_size(lowered.as_text())
        rows.append({"candidate": candidate.name, "config": candidate.description, "operations": ops,
                     "threefry_operations": threefry, "threefry_calls": calls})
    base = rows[0]["operations"]
    for row in rows:
        row["x_operations"] = row["operations"] / base
        row["threefry_share"] = row["threefry_operations"] / row["operations"]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default="cuda", choices=sorted(TARGET_OF_PLATFORM))
    parser.add_argument("--modes", default="auto,vmap-mbB", help="private candidates (bench_overhead's names)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--gpt2-small", action="store_true", help="GPT-2 small, T 256, B 32, bfloat16")
    shape.add_argument("--quick", action="store_true", help="bench_overhead's tiny workload")
    shape.add_argument("--workload", choices=sorted(overhead.WORKLOADS), help="a bench_overhead workload")
    parser.add_argument("--out", help="JSON output path")
    args = parser.parse_args(argv)
    workload = (overhead.GPT2_SMALL if args.gpt2_small else overhead.QUICK if args.quick
                else overhead.WORKLOADS[args.workload or "W3"])
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in overhead.DP_CANDIDATES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(overhead.DP_CANDIDATES)}")
    rows = measure(workload, modes, args.platform)
    print(f"{workload.describe()}, lowered for {args.platform}; operations with every call inlined")
    print(f"  {'candidate':<10} {'operations':>11} {'x non-DP':>9} {'in Threefry':>12} {'share':>6} "
          f"{'Threefry calls':>15}")
    for row in rows:
        print(f"  {row['candidate']:<10} {row['operations']:>11} {row['x_operations']:>9.2f} "
              f"{row['threefry_operations']:>12} {row['threefry_share']:>6.1%} {row['threefry_calls']:>15}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"workload": dataclasses.asdict(workload), "platform": args.platform, "jax": jax.__version__,
                       "rows": rows}, out, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
