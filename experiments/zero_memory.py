"""Per-device memory of the compiled DP-ZeRO step against the ZeRO formulas and the planner (issue 4).

For a small GPT-2 (``models.GPT2``, fp32 master weights, Adam) the private step is compiled -- nothing runs -- on
``N = 1, 2, 4, 8`` virtual CPU devices (mesh ``fsdp=N``) for ZeRO stages 1-3 and both strategies. From the
compiled executable it reads, per device:

* **model states**: the bytes of the parameter and optimizer-state *arguments* on one device, from the input
  shardings the compiler settled on (``shard_shape`` of each argument), and ``per-device x N / total``: 1.00 means
  perfectly partitioned (stage 3), larger means replication;
* **arguments**: ``memory_analysis().argument_size_in_bytes`` (model states + this device's slice of the batch);
* **formula**: the ZeRO arguments of this implementation in fp32: stage 3 ``12 Psi / N`` (parameters ``4 Psi`` and
  Adam moments ``8 Psi``, all partitioned; the fp32 gradient, ``4 Psi / N``, is a temporary -- together the paper's
  ``16 Psi / N``), stages 1-2 ``4 Psi + 8 Psi / N``;
* **planner**: ``dpzero plan``'s parameters + optimizer state for the same decoder, devices and stage (fp32);
* **temporaries**: ``memory_analysis().temp_size_in_bytes``, the compiled step's peak working memory beyond its
  arguments and outputs. A second table compares, for the explicit strategy at stage 3, gathering each layer's
  weights just before use (the default) with gathering every weight before the forward pass: the difference is
  the whole parameters that per-layer gathering never holds at once.

    python experiments/zero_memory.py            # prints the table, writes experiments/results/zero_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from dpzero_jax import DPConfig, models, planner, private_value_and_grad, sharding  # noqa: E402

CONFIG = models.GPT2Config(vocab_size=1024, n_positions=64, n_embd=256, n_layer=4, n_head=4)
BATCH, SEQ = 16, 64


def compile_step(strategy: str, zero: int, devices: int, gather_by_layer: bool = True):
    """The compiled private Adam step of :data:`CONFIG` on a ``fsdp=devices`` mesh."""
    model = models.GPT2(CONFIG, rngs=nnx.Rngs(0))
    params, loss_fn = models.lm_objective(model)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    tx = optax.adam(1e-3)
    opt_state = jax.eval_shape(tx.init, params)
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(1, devices)), zero)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=BATCH, noise_rng="partitionable")
    batch = {"input_ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)}
    mask = jax.ShapeDtypeStruct((BATCH,), jnp.bool_)

    if strategy == "explicit":
        explicit = sharding.explicit_private_gradient(loss_fn, dp, rules, params, gather_by_layer=gather_by_layer)

        def gradient(p, b, key, m):
            return explicit(p, b, key, m)[1]
    else:
        private = private_value_and_grad(loss_fn, dp)

        def gradient(p, b, key, m):
            grads = private(p, b, key, m)[1]
            return jax.lax.with_sharding_constraint(grads, rules.grads(p))

    def step(p, o, b, key, m):
        updates, o = tx.update(gradient(p, b, key, m), o, p)
        return optax.apply_updates(p, updates), o

    param_sh, opt_sh = rules.params(params), rules.opt_state(opt_state)
    jitted = jax.jit(step, donate_argnums=(0, 1),
                     in_shardings=(param_sh, opt_sh, rules.batch(batch), rules.replicated, rules.batch(0)),
                     out_shardings=(param_sh, opt_sh))
    compiled = jitted.lower(params, opt_state, batch, jax.random.key(0), mask).compile()
    return compiled, params, opt_state


def _bytes(shape, dtype, sharding_) -> int:
    return math.prod(sharding_.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def measure(strategy: str, zero: int, devices: int, gather_by_layer: bool = True) -> dict:
    compiled, params, opt_state = compile_step(strategy, zero, devices, gather_by_layer)
    state = jax.tree.leaves((params, opt_state))
    shardings = jax.tree.leaves(compiled.input_shardings[0][:2])
    per_device = sum(_bytes(x.shape, x.dtype, s) for x, s in zip(state, shardings, strict=True))
    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in state)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    formula = 12 * n_params / devices if zero == 3 else 4 * n_params + 8 * n_params / devices
    decoder = planner.DecoderConfig("bench", CONFIG.n_layer, CONFIG.n_embd, CONFIG.n_head, CONFIG.vocab_size,
                                    CONFIG.n_positions)
    plan = planner.plan_memory(decoder, devices, BATCH, SEQ, "fp32", zero)
    planned = plan.parameters + plan.optimizer_state
    memory = compiled.memory_analysis()
    return {"strategy": strategy, "zero": zero, "devices": devices, "gather_by_layer": gather_by_layer,
            "params": n_params,
            "model_state_bytes": per_device, "argument_bytes": int(memory.argument_size_in_bytes),
            "temp_bytes": int(memory.temp_size_in_bytes), "formula_bytes": formula, "planner_bytes": planned,
            "partition_ratio": per_device * devices / total, "vs_formula": per_device / formula,
            "vs_planner": per_device / planned}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_memory.json"))
    parser.add_argument("--devices", default="1,2,4,8")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    rows = []
    header = (f"{'strategy':9} {'zero':>4} {'N':>2} {'state MiB':>10} {'args MiB':>9} {'formula':>8} "
              f"{'planner':>8} {'xN/total':>8} {'/formula':>8} {'/planner':>8} {'temp MiB':>9}")
    print(f"GPT-2 {CONFIG.n_layer}x{CONFIG.n_embd}, vocab {CONFIG.vocab_size}, batch {BATCH} x {SEQ}, fp32 Adam")
    print(header)
    print("-" * len(header))
    mib = 2.0**20
    for strategy in ("explicit", "gspmd"):
        for zero in (1, 2, 3):
            for devices in (int(d) for d in args.devices.split(",")):
                row = measure(strategy, zero, devices)
                rows.append(row)
                print(f"{strategy:9} {zero:>4} {devices:>2} {row['model_state_bytes'] / mib:>10.2f} "
                      f"{row['argument_bytes'] / mib:>9.2f} {row['formula_bytes'] / mib:>8.2f} "
                      f"{row['planner_bytes'] / mib:>8.2f} {row['partition_ratio']:>8.3f} "
                      f"{row['vs_formula']:>8.3f} {row['vs_planner']:>8.3f} {row['temp_bytes'] / mib:>9.2f}",
                      flush=True)
    param_mib = rows[0]["params"] * 4 / mib
    print(f"\nexplicit, stage 3: temporaries when each layer gathers its weights just before use vs gathering every "
          f"weight first (fp32 parameters {param_mib:.2f} MiB)")
    header = f"{'N':>2} {'by layer MiB':>13} {'all first MiB':>14} {'saved MiB':>10} {'saved / params':>15}"
    print(header)
    print("-" * len(header))
    gathers = []
    for devices in (int(d) for d in args.devices.split(",")):
        if devices == 1:
            continue
        by_layer = next(r for r in rows if (r["strategy"], r["zero"], r["devices"]) == ("explicit", 3, devices))
        upfront = measure("explicit", 3, devices, gather_by_layer=False)
        gathers.append(upfront)
        saved = (upfront["temp_bytes"] - by_layer["temp_bytes"]) / mib
        print(f"{devices:>2} {by_layer['temp_bytes'] / mib:>13.2f} {upfront['temp_bytes'] / mib:>14.2f} "
              f"{saved:>10.2f} {saved / param_mib:>15.3f}", flush=True)
    rows.extend(gathers)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": CONFIG.__dict__, "batch": BATCH, "seq": SEQ,
                                          "backend": jax.default_backend(), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
