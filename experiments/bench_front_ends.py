"""The two front ends on the same model: the bundled GPT-2 (``dz.nn`` layers) planned from its layer calls
(``front_end="layers"``) and from its traced program (``front_end="program"``).

Same loss, same batch, same config (``noise_multiplier=1``, ``groups="all-layer"``, ``norm_method="mixed"``); the
only difference is where the plan comes from. Per candidate: XLA compile time, ``cost_analysis()`` FLOPs and bytes,
``memory_analysis()`` temporary bytes, and the median step time over ``--rounds`` interleaved rounds, all against
the non-private step (``jax.value_and_grad`` of the mean loss) of the same process.

Default workload: W3 of ``bench_overhead.py`` (vocab 8192, untied head, 4 layers, width 256, 4 heads, T 128, B 16).

Run::

    python experiments/bench_front_ends.py            # writes experiments/results/bench_front_ends_cpu.json
    python experiments/bench_front_ends.py --quick    # a tiny model (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dpzero_jax as dz  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_front_ends_cpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        vocab, layers, width, heads, seq, batch_size = 64, 2, 32, 2, 16, 4
    else:
        vocab, layers, width, heads, seq, batch_size = 8192, 4, 256, 4, 128, 16
    config = dz.models.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                                  tie_word_embeddings=False)
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(0)))
    batch = {"input_ids": jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch_size, seq)), jnp.int32)}
    key = jax.random.key(0)
    candidates = {"non-DP": (jax.jit(jax.value_and_grad(lambda p, b: jnp.mean(loss_fn(p, b)))), (params, batch))}
    for front_end in ("layers", "program"):
        for mode in ("bk", "ghost"):
            cfg = dz.DPConfig(noise_multiplier=1.0, mode=mode, front_end=front_end, expected_batch_size=batch_size)
            candidates[f"{front_end} {mode}"] = (jax.jit(dz.private_value_and_grad(loss_fn, cfg)),
                                                 (params, batch, key))
    rows, compiled = {}, {}
    print(f"GPT-2 vocab {vocab}, {layers} layers, width {width}, T {seq}, B {batch_size} (untied head)")
    for name, (fn, fn_args) in candidates.items():
        start = time.perf_counter()
        compiled[name] = fn.lower(*fn_args).compile()
        cost = compiled[name].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows[name] = {"compile_s": time.perf_counter() - start, "flops": float(cost.get("flops", 0)),
                      "bytes": float(cost.get("bytes accessed", 0)),
                      "temp_bytes": int(compiled[name].memory_analysis().temp_size_in_bytes)}
        jax.block_until_ready(compiled[name](*fn_args))
    times = {name: [] for name in candidates}
    for r in range(args.rounds):
        names = list(candidates)[r % len(candidates):] + list(candidates)[:r % len(candidates)]
        for name in names:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*candidates[name][1]))
            times[name].append(time.perf_counter() - start)
    base = rows["non-DP"]
    base_time = statistics.median(times["non-DP"])
    print(f"{'candidate':<14} {'compile s':>9} {'x FLOPs':>8} {'x bytes':>8} {'x temp':>7} {'step ms':>9} "
          f"{'x step':>7}")
    for name, row in rows.items():
        row["step_s"] = statistics.median(times[name])
        row["step_ratio"] = row["step_s"] / base_time
        print(f"{name:<14} {row['compile_s']:>9.1f} {row['flops'] / base['flops']:>8.3f} "
              f"{row['bytes'] / base['bytes']:>8.3f} {row['temp_bytes'] / base['temp_bytes']:>7.3f} "
              f"{1e3 * row['step_s']:>9.1f} {row['step_ratio']:>7.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"backend": jax.default_backend(), "quick": args.quick, "rounds": args.rounds, "rows": rows,
                   "load_avg": os.getloadavg()}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
