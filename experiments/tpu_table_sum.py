"""An embedding table's float32 gradient sum under ZeRO-3 on a TPU pod, compiled ahead of time: how the TPU
compiler places its reduction, and what forming it in row chunks saves (``docs/benchmarks/tpu_aot.md``, "Why those
two layer-wise steps hold more").

On each chip of a ``data x fsdp`` mesh, ``N`` token ids and their ``[N, D]`` float32 rows (the coefficient-scaled
output gradients of an embedding lookup) are scatter-added into a zeroed ``f32[V, D]`` table, which is then reduced
to its owners: ``psum_scatter`` on the column axis (the ZeRO-3 layout of a table split on ``D``) over the whole mesh,
or (``--split fsdp``, a width that does not divide over every chip) over ``fsdp`` followed by a ``psum`` over
``data``, as ``dpzero_jax.sharding`` reduces.
Variants of the same sum:

* ``whole``: the table formed, then reduced -- what autodiff's transpose of a lookup and the ZeRO-3 gather's
  transpose produce in the private steps;
* ``barrier``: the same with an ``optimization_barrier`` between the scatter and the reduction;
* ``slices K``: the whole table formed, then reduced in ``K`` row slices;
* ``chunks K``: each of ``K`` row chunks formed (the ids in its range scatter-added into its own zeros,
  ``mode="drop"``) and reduced on its own.

Each is compiled for the topology (``libtpu`` needed: the ``tpu-aot`` extra) and read with ``memory_analysis()``
(temporaries, peak) and its optimised HLO (the collectives). Run::

    python experiments/tpu_table_sum.py                          # GPT-J's table on v5e:16x16 (data 4, fsdp 64)
    python experiments/tpu_table_sum.py --rows 50257 --cols 1600 --split fsdp   # GPT-2 XL's
    python experiments/tpu_table_sum.py --quick                  # a small table on v5e:2x2

Writes ``experiments/results/tpu_table_sum.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

MIB = 2**20


def table_sum(variant: str, pieces: int, rows: int, split: str):
    """``fn(ids [N], grads [N, D]) -> this chip's [rows, D / shards] column shard of the reduced sum``; ``split``:
    ``"all"`` (the columns split over every chip) or ``"fsdp"`` (over ``fsdp``, the sum then added over ``data``)."""
    def whole(ids, grads):
        return jnp.zeros((rows, grads.shape[1]), jnp.float32).at[ids].add(grads)

    def reduce(table):
        if split == "all":
            return jax.lax.psum_scatter(table, ("data", "fsdp"), scatter_dimension=1, tiled=True)
        return jax.lax.psum(jax.lax.psum_scatter(table, "fsdp", scatter_dimension=1, tiled=True), "data")

    def fn(ids, grads):
        if variant == "whole":
            return reduce(whole(ids, grads))
        if variant == "barrier":
            return reduce(jax.lax.optimization_barrier(whole(ids, grads)))
        bounds = [(k * rows // pieces, (k + 1) * rows // pieces) for k in range(pieces)]
        if variant == "slices":
            table = whole(ids, grads)
            return jnp.concatenate([reduce(table[lo:hi]) for lo, hi in bounds])
        if variant == "chunks":
            return jnp.concatenate([reduce(jnp.zeros((hi - lo, grads.shape[1]), jnp.float32)
                                           .at[ids - lo].add(grads, mode="drop")) for lo, hi in bounds])
        raise ValueError(f"unknown variant {variant!r}")
    return fn


def compile_variant(variant: str, pieces: int, topology: str, data: int, rows: int, cols: int, tokens: int,
                    split: str = "all") -> dict:
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.asarray(devices).reshape(data, -1), ("data", "fsdp"))
    axes = ("data", "fsdp")
    shards = mesh.size if split == "all" else mesh.shape["fsdp"]
    if cols % shards:
        raise ValueError(f"--cols {cols} must split over {shards} {'chips' if split == 'all' else 'fsdp shards'}")
    batch = NamedSharding(mesh, P(axes))
    ids = jax.ShapeDtypeStruct((mesh.size * tokens,), jnp.int32, sharding=batch)
    grads = jax.ShapeDtypeStruct((mesh.size * tokens, cols), jnp.float32, sharding=batch)
    step = jax.jit(jax.shard_map(table_sum(variant, pieces, rows, split), mesh=mesh, in_specs=(P(axes), P(axes)),
                                 out_specs=P(None, axes if split == "all" else "fsdp")))
    compiled = step.lower(ids, grads).compile()
    memory = compiled.memory_analysis()
    collectives = re.findall(r"\s(all-reduce|reduce-scatter|all-gather)(?:-start)?\(", compiled.as_text())
    return {"variant": variant, "pieces": pieces, "temp_bytes": int(memory.temp_size_in_bytes),
            "peak_bytes": int(memory.peak_memory_in_bytes), "collectives": collectives}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:16x16")
    parser.add_argument("--data", type=int, default=4, help="the mesh's data axis (fsdp: the other chips)")
    parser.add_argument("--rows", type=int, default=50400, help="table rows (vocabulary)")
    parser.add_argument("--cols", type=int, default=4096, help="table columns (width)")
    parser.add_argument("--tokens", type=int, default=2048, help="ids per chip")
    parser.add_argument("--split", choices=("all", "fsdp"), default="all",
                        help="the table's columns split over every chip, or over fsdp (then summed over data)")
    parser.add_argument("--pieces", type=int, nargs="+", default=[4, 8], help="K of the slices and chunks variants")
    parser.add_argument("--quick", action="store_true", help="a [4096, 512] table on v5e:2x2 (data 1)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "tpu_table_sum.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.topology, args.data, args.rows, args.cols, args.tokens, args.pieces = "v5e:2x2", 1, 4096, 512, 256, [4]
    table = args.rows * args.cols * 4
    print(f"f32[{args.rows}, {args.cols}] table ({table / MIB:.1f} MiB) on {args.topology}, data {args.data}, "
          f"columns split over {args.split}, {args.tokens} ids a chip")
    print(f"{'variant':<10} {'K':>3} {'temp MiB':>9} {'peak MiB':>9} {'peak / table':>12}  collectives")
    rows = []
    plan = [("whole", 1), ("barrier", 1)] + [(v, k) for k in args.pieces for v in ("slices", "chunks")]
    for variant, pieces in plan:
        row = compile_variant(variant, pieces, args.topology, args.data, args.rows, args.cols, args.tokens,
                              args.split)
        rows.append(row)
        kinds = ", ".join(f"{n} {c}" for c, n in sorted({c: row["collectives"].count(c)
                                                          for c in set(row["collectives"])}.items()))
        print(f"{variant:<10} {pieces:>3} {row['temp_bytes'] / MIB:>9.1f} {row['peak_bytes'] / MIB:>9.1f} "
              f"{row['peak_bytes'] / table:>12.2f}  {kinds}", flush=True)
    data = {"topology": args.topology, "data": args.data, "split": args.split, "rows": args.rows, "cols": args.cols,
            "tokens": args.tokens, "table_bytes": table, "jax": jax.__version__, "results": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
