"""RMM variance during training (paper 002, Figure 4 / Figure 7 analogue): D2_SGD, D2_RMM, alpha, Theorem 2.3.

The BERT-style encoder of ``rmm_memory.py`` (16 patch tokens of scikit-learn's digits + a class token) is trained
without DP, its block layers converted to Gaussian RMM over the flattened rows (``rho = --rate``, default 0.5,
``B = 64`` as in the paper's figure). Every ``--every`` steps, on that step's batch and before the update, the
input ``X`` and output gradient ``Y`` (of the mean loss) of one layer (``--layer``, default the output dense layer
of the last block, as the paper's "dense layer in output of transformer block #7") are captured exactly and give

* ``D2_SGD`` (eq. 9, over the ``B`` examples), ``D2_RMM`` (eq. 11 as printed, ``B_proj = rho n`` of the ``n = B T``
  rows), ``alpha`` (eq. 13) and the two sides of Theorem 2.3 (eq. 12);
* the exact RMM variance ``E_S ||X^T S S^T Y - X^T Y||^2`` of each sketch at the same rate
  (``dz.rmm_diagnostics.rmm_variance``) -- eq. (11) is not the Gaussian variance (see that module).

Output: a table on stdout, ``experiments/results/rmm_variance_<backend>.json`` and ``.png`` (top: the ratio of
eq. (12) with eq. (11) and with the exact Gaussian variance, and its bound; middle: the variances; bottom: alpha).

    python experiments/rmm_variance.py               # ~2 minutes on a 2-core CPU
    python experiments/rmm_variance.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rmm_memory import digits_tokens, in_blocks  # noqa: E402

import dpzero_jax as dz  # noqa: E402
from dpzero_jax import rmm  # noqa: E402
from dpzero_jax import rmm_diagnostics as rd  # noqa: E402
from dpzero_jax.sketch import SKETCHES  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--layer", default=None, help="layer path (default: blocks/<last>/mlp/c_proj)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="60 steps, every 20")
    parser.add_argument("--out", default=None, help="JSON path (the PNG goes next to it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every = 60, 20
    return args


def main(args) -> dict:
    train, test = digits_tokens(args.seed)
    config = dz.models.EncoderConfig(vocab_size=None, token_features=4, max_length=16, hidden_size=args.hidden,
                                     num_layers=args.layers, num_heads=4, intermediate_size=4 * args.hidden)
    layer = args.layer or f"blocks/{args.layers - 1}/mlp/c_proj"
    model = dz.models.Encoder(config, rngs=nnx.Rngs(args.seed))
    rmm_config = rmm.RMMConfig(sketch="gaussian", rate=args.rate, projection="rows")
    rmm.convert_to_rmm(model, rmm_config, where=in_blocks)
    if layer not in rmm.rmm_layers(model):
        raise ValueError(f"--layer {layer!r} is not an RMM layer; choose one of {sorted(rmm.rmm_layers(model))}")
    params, loss_for_key = rmm.keyed_objective(dz.models.classification_objective, model, input_key="tokens")
    _, apply = dz.models.logits_fn(model)
    tx = optax.adam(args.lr)

    @jax.jit
    def step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(loss_for_key(key)(p, batch)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def diagnose(params, batch, key):
        captured = rd.capture_fn(loss_for_key(key), layers=lambda path: path == layer)(params, batch)
        x, g, _, n_in = captured[layer]
        out = {"gaussian": rd.layer_diagnostics(x, g, rmm_config, n_in=n_in)}
        for sketch in SKETCHES[1:]:
            out[sketch] = rd.layer_diagnostics(x, g, rmm_config.replace(sketch=sketch), n_in=n_in)
        return out

    opt_state = tx.init(params)
    rng = np.random.default_rng(args.seed)
    base = jax.random.key(args.seed + 1)
    n = train["label"].shape[0]
    rows, losses = [], []
    print(f"{'step':>5} {'loss':>7} {'D2_SGD':>10} {'D2_RMM(11)':>10} {'exact G':>10} {'exact R':>10} "
          f"{'exact DCT':>10} {'exact DFT':>10} {'alpha':>7} {'ratio(11)':>9} {'ratio':>9} {'bound':>8}")
    for t in range(args.steps + 1):
        index = rng.choice(n, args.batch_size, replace=False)
        batch = {k: jnp.asarray(v[index]) for k, v in train.items()}
        key = jax.random.fold_in(base, t)
        if t % args.every == 0:
            diag = jax.tree.map(float, diagnose(params, batch, key))
            gauss = diag["gaussian"]
            kept = rmm_config.projected_size(args.batch_size * (config.max_length + 1))
            exact_ratio = kept / (args.batch_size - 1) * gauss.variance / gauss.d2_sgd
            row = {"step": t, "loss": float(np.mean(losses[-args.every:])) if losses else None,
                   "d2_sgd": gauss.d2_sgd, "d2_rmm_eq11": gauss.d2_rmm, "alpha": gauss.alpha,
                   "ratio_eq11": gauss.ratio, "ratio_exact_gaussian": exact_ratio, "bound": gauss.bound,
                   "exact_variance": {s: diag[s].variance for s in SKETCHES}}
            rows.append(row)
            v = row["exact_variance"]
            print(f"{t:5d} {row['loss'] or float('nan'):7.3f} {gauss.d2_sgd:10.3e} {gauss.d2_rmm:10.3e} "
                  f"{v['gaussian']:10.3e} {v['rademacher']:10.3e} {v['dct']:10.3e} {v['dft']:10.3e} "
                  f"{gauss.alpha:7.4f} {gauss.ratio:9.2f} {exact_ratio:9.2f} {gauss.bound:8.1f}", flush=True)
        if t == args.steps:
            break
        params, opt_state, loss = step(params, opt_state, batch, key)
        losses.append(float(loss))
    accuracy = float(jnp.mean(jnp.argmax(jax.jit(apply)(params, jnp.asarray(test["tokens"])), -1)
                              == jnp.asarray(test["label"])))
    print(f"test accuracy after {args.steps} steps: {100 * accuracy:.1f}%")
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "argv": sys.argv[1:], "args": vars(args), "layer": layer,
            "model": config.__dict__, "test_accuracy": accuracy, "rows": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    steps = [r["step"] for r in rows]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    top.plot(steps, [r["ratio_eq11"] for r in rows], label="LHS of eq. (12), D2_RMM by eq. (11)")
    top.plot(steps, [r["ratio_exact_gaussian"] for r in rows], label="LHS of eq. (12), exact Gaussian variance")
    top.plot(steps, [r["bound"] for r in rows], "--", label="bound (alpha + 1) / alpha")
    top.set(yscale="log", ylabel="variance ratio", title=f"{result['layer']}, Gaussian RMM, "
            f"rho = {result['args']['rate']}, B = {result['args']['batch_size']}")
    top.legend(fontsize=8)
    middle.plot(steps, [r["d2_sgd"] for r in rows], label="D2_SGD (eq. 9)")
    middle.plot(steps, [r["d2_rmm_eq11"] for r in rows], label="D2_RMM (eq. 11)")
    for sketch in SKETCHES:
        middle.plot(steps, [r["exact_variance"][sketch] for r in rows], ":", label=f"exact, {sketch}")
    middle.set(yscale="log", ylabel="variance")
    middle.legend(fontsize=8)
    bottom.plot(steps, [r["alpha"] for r in rows])
    bottom.set(xlabel="step", ylabel="alpha (eq. 13)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    arguments = parse_args()
    start = time.perf_counter()
    output = main(arguments)
    output["runtime_s"] = time.perf_counter() - start
    suffix = "_quick" if arguments.quick else ""
    path = arguments.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"rmm_variance_{output['backend']}{suffix}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(output, f, indent=2)
    plot(output, path[:-len(".json")] + ".png")
    print(f"wrote {path} and the .png ({output['runtime_s']:.0f} s)")
