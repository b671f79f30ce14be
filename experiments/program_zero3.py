"""ZeRO-3 layer-by-layer gathering on the traced-program front-end: compiled memory, collectives and FLOPs.

A GPT-2-style decoder written with flax.linen's standard layers (``experiments/bench_depth.py``'s model, width 256,
T 16, vocabulary 512; blocks unrolled or ``nn.scan``-ned, ``nn.remat`` optional), 16 examples on a ``data=2,fsdp=4``
mesh of 8 CPU devices, every leaf of 1024 elements or more split over ``fsdp``. For each engine mode the explicit
strategy's clipped-sum step is compiled twice: gathering each leaf at its uses (``gather_by_layer=True``: the
program front-end's :mod:`dpzero_jax.program.zero3`) and gathering every weight first (``False``). Reported per
device: temporary bytes (``memory_analysis()``), all-gathers and reduce-scatters in the optimised HLO, FLOPs, and
the clipped sum's largest deviation from the whole-weight step's (relative to its largest entry).

Run::

    python experiments/program_zero3.py            # writes experiments/results/program_zero3_cpu.json
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_depth  # noqa: E402

from dpzero_jax import DPConfig, sharding  # noqa: E402
from dpzero_jax.engine import clipped_grad_sum  # noqa: E402

LAYERS, CASES = 4, [("bk", "unrolled"), ("bk", "scan"), ("bk", "scan+remat"), ("ghost", "unrolled"),
                    ("ghost", "scan+remat"), ("fused", "scan"), ("auto", "scan+remat")]


def compile_step(loss_fn, params, batch, mode: str, by_layer: bool):
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(2, 4)), 3)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=bench_depth.BATCH, mode=mode,
                  front_end="program")
    clipped = clipped_grad_sum(loss_fn, dp, layout=sharding.ShardLayout(rules, params) if by_layer else None)
    summed = sharding.explicit_gradient(lambda p, b, m: clipped(p, b, m)[:2], rules, params,
                                        gather_by_layer=by_layer)
    step = jax.jit(lambda p, b, m: summed(p, b, m)[1],
                   in_shardings=(rules.params(params), rules.batch(batch), rules.batch(0)),
                   out_shardings=rules.grads(params))
    mask = jnp.ones((bench_depth.BATCH,), bool)
    executable = step.lower(params, batch, mask).compile()
    text = executable.as_text()
    return step(params, batch, mask), {
        "temp_bytes": int(executable.memory_analysis().temp_size_in_bytes),
        "all_gathers": text.count(" all-gather("), "reduce_scatters": text.count(" reduce-scatter("),
        "flops": float(executable.cost_analysis().get("flops", 0.0))}


def main():
    bench_depth.WIDTH, bench_depth.HEADS, bench_depth.SEQ, bench_depth.BATCH, bench_depth.VOCAB = 256, 4, 16, 16, 512
    rows = []
    print(f"{'mode':6s} {'blocks':11s} {'temp by use':>12s} {'temp first':>11s} {'saved/params':>12s} "
          f"{'gathers':>9s} {'FLOPs ratio':>11s} {'max dev':>8s}")
    for mode, structure in CASES:
        params, batch, loss_fn = bench_depth.setup(LAYERS, structure != "unrolled", structure.endswith("remat"))
        param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
        (by_use, a), (first, b) = (compile_step(loss_fn, params, batch, mode, flag) for flag in (True, False))
        scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(first))
        deviation = max(float(jnp.max(jnp.abs(x - y))) for x, y in
                        zip(jax.tree.leaves(by_use), jax.tree.leaves(first))) / scale
        row = {"mode": mode, "blocks": structure, "layers": LAYERS, "param_bytes": param_bytes, "by_use": a,
               "gather_first": b, "saved_over_params": (b["temp_bytes"] - a["temp_bytes"]) / param_bytes,
               "flops_ratio": a["flops"] / b["flops"], "max_deviation": deviation}
        rows.append(row)
        print(f"{mode:6s} {structure:11s} {a['temp_bytes'] / 2**20:10.2f}MB {b['temp_bytes'] / 2**20:9.2f}MB "
              f"{row['saved_over_params']:12.2f} {a['all_gathers']:4d}/{b['all_gathers']:<4d} "
              f"{row['flops_ratio']:11.3f} {deviation:8.1e}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "program_zero3_cpu.json")
    with open(out, "w") as f:
        json.dump({"meta": {"width": 256, "seq": 16, "vocab": 512, "batch": 16, "mesh": "data=2,fsdp=4",
                            "jax": jax.__version__}, "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
