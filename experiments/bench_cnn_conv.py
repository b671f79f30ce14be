"""The bundled CNN's private step with its convolution kernels as factored ``conv`` sites against the same step with
them as ``local`` sites (per-example kernel gradients instantiated through the convolution's own VJP, as before
the conv rule), paired in one process.

The ``local`` variant is compiled with the conv rule switched off (``dpzero_jax.program.conv.supported`` patched
to refuse every convolution while the step is traced); everything else -- model, batch, config -- is the same.
Per candidate: the median step time over ``--rounds`` interleaved rounds, and its ratio to the non-private step
(``jax.value_and_grad`` of the mean loss) of the same process, and the compiled step's temporary bytes
(``memory_analysis()``).

Default workload: ``CNNConfig()`` (8x8x1 digits, widths 16 and 32) at B 256, the ``dpzero train --model cnn``
batch. Run::

    python experiments/bench_cnn_conv.py            # writes experiments/results/bench_cnn_conv_cpu.json
    python experiments/bench_cnn_conv.py --quick    # B 16, 3 rounds (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dpzero_jax as dz  # noqa: E402
from dpzero_jax.program import conv  # noqa: E402


@contextlib.contextmanager
def conv_rule(enabled: bool):
    """While tracing: convolutions as ``conv`` sites (``enabled``) or as ``local`` sites (the rule refused)."""
    original = conv.supported
    if not enabled:
        conv.supported = lambda eqn, param_operand: False
    try:
        yield
    finally:
        conv.supported = original


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_cnn_conv_cpu.json"))
    args = parser.parse_args(argv)
    batch_size, rounds = (16, 3) if args.quick else (args.batch_size, args.rounds)
    model = dz.models.CNN(dz.models.CNNConfig(), rngs=nnx.Rngs(0))
    params, loss_fn = dz.models.classification_objective(model)
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"image": jax.random.normal(kx, (batch_size, 8, 8, 1)),
             "label": jax.random.randint(ky, (batch_size,), 0, 10)}
    key = jax.random.key(0)
    nonprivate = jax.jit(jax.value_and_grad(lambda p, b: jnp.mean(loss_fn(p, b))))
    compiled = {"non-DP": (nonprivate.lower(params, batch).compile(), (params, batch))}
    plans = {}
    for mode in ("bk", "ghost"):
        cfg = dz.DPConfig(noise_multiplier=1.0, mode=mode, norm_method="mixed", expected_batch_size=batch_size)
        for enabled, label in ((False, "local"), (True, "conv")):
            with conv_rule(enabled):
                step = jax.jit(dz.private_value_and_grad(loss_fn, cfg))
                compiled[f"{mode} {label}"] = (step.lower(params, batch, key).compile(), (params, batch, key))
                rows = dz.explain_plan(loss_fn, cfg, params, batch).rows
            plans[f"{mode} {label}"] = {r["path"]: f"{r['rule']}/{r['method']}" for r in rows
                                        if r["path"].startswith("conv") and r["path"].endswith("kernel")}
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for fn, fn_args in compiled.values():
        jax.block_until_ready(fn(*fn_args))       # warm-up
    for _ in range(rounds):                        # interleaved: every candidate once per round
        for name, (fn, fn_args) in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    temp = {name: int(fn.memory_analysis().temp_size_in_bytes) for name, (fn, _) in compiled.items()}
    base = median["non-DP"]
    print(f"CNN (8x8x1, widths 16/32), B {batch_size}, {rounds} interleaved rounds, {jax.default_backend()}")
    print(f"{'step':<12} {'median ms':>10} {'x non-DP':>9} {'temp MiB':>9}  conv kernels")
    for name, value in median.items():
        print(f"{name:<12} {1e3 * value:>10.2f} {value / base:>9.2f} {temp[name] / 2**20:>9.2f}  "
              f"{plans.get(name, '')}")
    for mode in ("bk", "ghost"):
        print(f"{mode}: conv / local = {median[f'{mode} conv'] / median[f'{mode} local']:.2f}")
    result = {"batch_size": batch_size, "rounds": rounds, "backend": jax.default_backend(),
              "median_s": median, "temp_bytes": temp,
              "ratio_to_nonprivate": {n: v / base for n, v in median.items()}, "plans": plans}
    if not args.quick:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
