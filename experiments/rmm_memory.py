"""RMM linear layers: memory, step time and accuracy of a BERT-style encoder trained on digits (paper 002, Tables 3-4).

What is measured
----------------
A small encoder (``dz.models.Encoder``: 16 tokens = the 2x2 patches of scikit-learn's bundled 8x8 digits, a class
token, bidirectional pre-LN blocks) is trained from scratch with Adam, once with exact linear layers and once per
sketch (``gaussian``, ``rademacher``, ``dct``, ``dft``) and rate ``rho`` (default 1, 0.5, 0.2, 0.1) with every
``Linear`` / ``DenseGeneral`` of the blocks converted to RMM (``dz.rmm.convert_to_rmm``; the token embedding and
the classification head stay exact). Two settings:

* ``non-DP``: ``jax.grad`` of the mean loss, RMM over the flattened ``B x T`` rows (``projection="rows"``, the
  paper's layer);
* ``DP``: ``dz.private_value_and_grad`` (``--dp-mode``, default ``ghost``; noise multiplier ``--sigma``, threshold
  1, all-layer clipping), RMM over each example's tokens with one sketch per batch (``projection="tokens"``).

Per configuration:

* **memory**: XLA's compiled memory of the jitted training step (``memory_analysis()``): ``temp`` (scratch: the
  activations kept for the backward pass live here) and its ratio to the exact step of the same setting;
* **time**: all steps of a setting are compiled, then run round-robin for ``--rounds`` rounds (one step each per
  round); ``x exact`` is the median over rounds of the step time over the exact step's time *in the same round*,
  ``x rho=1`` the same against the sketch's ``rho = 1`` step;
* **accuracy**: test accuracy after ``--steps`` training steps (batches drawn with a fixed seed, a fresh sketch
  key ``fold_in(key, step)`` every step), one seed.

XLA:CPU schedules for concurrency by default; ``--scheduler memory`` sets ``XLA_FLAGS=
--xla_cpu_enable_concurrency_optimized_scheduler=false`` (before JAX starts) to get XLA's memory-minimising
scheduler instead. Memory numbers depend on this choice; docs/benchmarks/rmm_memory.md reports both.

How to run::

    python experiments/rmm_memory.py                      # ~5 minutes on a 2-core CPU
    python experiments/rmm_memory.py --scheduler memory
    python experiments/rmm_memory.py --quick              # smoke test

JSON goes to ``--out`` (default ``experiments/results/rmm_memory_<backend>_<scheduler>_<settings>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sketches", default="gaussian,rademacher,dct,dft")
    parser.add_argument("--rates", default="1,0.5,0.2,0.1")
    parser.add_argument("--settings", default="non-DP,DP")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="training steps per configuration (accuracy)")
    parser.add_argument("--rounds", type=int, default=7, help="round-robin timing rounds")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sigma", type=float, default=0.5, help="noise multiplier of the DP setting")
    parser.add_argument("--dp-mode", default="ghost")
    parser.add_argument("--scheduler", choices=("default", "memory"), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 sketches, 2 rates, 20 steps, 3 rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.sketches, args.rates, args.steps, args.rounds = "gaussian,dct", "1,0.2", 20, 3
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.scheduler == "memory":   # must precede JAX's backend initialisation
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dpzero_jax as dz  # noqa: E402
from dpzero_jax import rmm  # noqa: E402

MiB = 2**20


def digits_tokens(seed: int = 0):
    """Train / test ``{"tokens": float32 [N, 16, 4], "label": int32 [N]}``: the 2x2 patches of each digit."""
    train, test = dz.data.load_digits(seed=seed)

    def tokens(images):
        n = images.shape[0]
        patches = images.reshape(n, 4, 2, 4, 2).transpose(0, 1, 3, 2, 4).reshape(n, 16, 4)
        return np.ascontiguousarray(patches, np.float32)

    return ({"tokens": tokens(train["image"]), "label": train["label"]},
            {"tokens": tokens(test["image"]), "label": test["label"]})


def encoder_config(args) -> dz.models.EncoderConfig:
    return dz.models.EncoderConfig(vocab_size=None, token_features=4, max_length=16, hidden_size=args.hidden,
                                   num_layers=args.layers, num_heads=4, intermediate_size=4 * args.hidden)


def in_blocks(path: str, _layer) -> bool:
    return path.startswith("blocks/")


class Config:
    """One training configuration: its step function, compiled step, state and results."""

    def __init__(self, name: str, setting: str, sketch: str | None, rate: float | None, args, train):
        self.name, self.setting, self.sketch, self.rate = name, setting, sketch, rate
        model = dz.models.Encoder(encoder_config(args), rngs=nnx.Rngs(args.seed))
        if sketch is not None:
            projection = "rows" if setting == "non-DP" else "tokens"
            rmm.convert_to_rmm(model, rmm.RMMConfig(sketch=sketch, rate=rate, projection=projection), where=in_blocks)
        params, loss_for_key = rmm.keyed_objective(dz.models.classification_objective, model, input_key="tokens")
        _, self.apply = dz.models.logits_fn(model)
        self.tx = optax.adam(args.lr)
        dp_cfg = dz.DPConfig(noise_multiplier=args.sigma, max_grad_norm=1.0, mode=args.dp_mode,
                             expected_batch_size=args.batch_size)
        tx = self.tx

        def step(params, opt_state, batch, key):
            sketch_key, noise_key = jax.random.split(key)
            loss_fn = loss_for_key(sketch_key)
            if setting == "non-DP":
                loss, grads = jax.value_and_grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)
            else:
                losses, grads, _ = dz.private_value_and_grad(loss_fn, dp_cfg)(params, batch, noise_key)
                loss = jnp.mean(losses)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.init = (params, self.tx.init(params))
        example = {k: v[:args.batch_size] for k, v in train.items()}
        start = time.perf_counter()
        self.compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*self.init, example, jax.random.key(0)).compile()
        self.compile_s = time.perf_counter() - start
        memory = self.compiled.memory_analysis()
        self.temp = memory.temp_size_in_bytes
        self.args_bytes = memory.argument_size_in_bytes
        self.state = jax.tree.map(jnp.array, self.init)
        self.times: list[float] = []

    def run(self, batch, key):
        start = time.perf_counter()
        params, opt_state, loss = self.compiled(*self.state, batch, key)
        jax.block_until_ready(loss)
        self.state = (params, opt_state)
        return time.perf_counter() - start, float(loss)


def train_and_evaluate(config: Config, train, test, args) -> dict:
    config.state = jax.tree.map(jnp.array, config.init)
    rng = np.random.default_rng(args.seed)
    n = train["label"].shape[0]
    base = jax.random.key(args.seed + 1)
    losses = []
    for step in range(args.steps):
        index = rng.choice(n, args.batch_size, replace=False)
        batch = {k: jnp.asarray(v[index]) for k, v in train.items()}
        _, loss = config.run(batch, jax.random.fold_in(base, step))
        losses.append(loss)
    logits = jax.jit(config.apply)(config.state[0], jnp.asarray(test["tokens"]))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(test["label"])))
    return {"test_accuracy": accuracy, "final_train_loss": float(np.mean(losses[-10:]))}


def time_round_robin(configs: list[Config], batch, rounds: int) -> None:
    for config in configs:          # warm-up
        config.run(batch, jax.random.key(0))
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            config.times.append(config.run(batch, jax.random.key(r))[0])


def paired_ratio(times, reference) -> float:
    return float(statistics.median(t / s for t, s in zip(times, reference)))


def main(args) -> dict:
    train, test = digits_tokens(args.seed)
    sketches = [s for s in args.sketches.split(",") if s]
    rates = [float(r) for r in args.rates.split(",") if r]
    settings = [s for s in args.settings.split(",") if s]
    batch = {k: jnp.asarray(v[:args.batch_size]) for k, v in train.items()}
    results = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
               "python": platform.python_version(), "cpus": os.cpu_count(), "scheduler": args.scheduler,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv[1:], "args": vars(args),
               "model": {**encoder_config(args).__dict__, "batch_size": args.batch_size,
                         "tokens": "16 patches of 2x2 pixels + class token"},
               "settings": {}}
    for setting in settings:
        print(f"\n== {setting} ({'rows' if setting == 'non-DP' else 'tokens'} projection"
              f"{'' if setting == 'non-DP' else f', mode {args.dp_mode}, sigma {args.sigma}'}) ==", flush=True)
        configs = [Config("exact", setting, None, None, args, train)]
        for sketch in sketches:
            for rate in rates:
                configs.append(Config(f"{sketch} {rate:g}", setting, sketch, rate, args, train))
        time_round_robin(configs, batch, args.rounds)
        exact = configs[0]
        rows = []
        for config in configs:
            full = next((c for c in configs if c.sketch == config.sketch and c.rate == 1.0), None)
            row = {"name": config.name, "sketch": config.sketch, "rate": config.rate,
                   "temp_MiB": config.temp / MiB, "args_MiB": config.args_bytes / MiB,
                   "x_temp": config.temp / exact.temp, "median_step_ms": 1e3 * statistics.median(config.times),
                   "x_time": paired_ratio(config.times, exact.times),
                   "x_time_rho1": paired_ratio(config.times, full.times) if full is not None else None,
                   "compile_s": config.compile_s}
            row.update(train_and_evaluate(config, train, test, args) if args.steps else {})
            rows.append(row)
            rho1 = "-" if row["x_time_rho1"] is None else f"{row['x_time_rho1']:.2f}"
            print(f"{row['name']:>16}  temp {row['temp_MiB']:7.2f} MiB  x mem {row['x_temp']:.3f}  "
                  f"step {row['median_step_ms']:7.1f} ms  x time {row['x_time']:.2f}  x rho=1 {rho1}  "
                  f"acc {100 * row.get('test_accuracy', float('nan')):.1f}%", flush=True)
        results["settings"][setting] = rows
    return results


if __name__ == "__main__":
    start = time.perf_counter()
    output = main(ARGS)
    output["runtime_s"] = time.perf_counter() - start
    suffix = "_" + ARGS.settings.replace(",", "_").replace("-", "").lower() + ("_quick" if ARGS.quick else "")
    path = ARGS.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"rmm_memory_{output['backend']}_{ARGS.scheduler}{suffix}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(output, f, indent=2)
    print(f"\nwrote {path} ({output['runtime_s']:.0f} s)")
