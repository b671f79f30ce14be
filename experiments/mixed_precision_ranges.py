"""Magnitude ranges of the quantities of DP training, and what fp16 / bf16 make of them (paper 000, Table 3).

Paper 000 argues that DP mixed-precision training must not scale the loss: per-example clipping already
normalises the gradient, and a scaled loss overflows the ghost-norm factors in fp16. Its Table 3 (ViT-large on
CIFAR-100) lists the ranges of activations, output gradients, ``vec(A A^T)``, ``vec(B B^T)``, clip factors and
parameter gradients with and without loss scaling. This script measures the same on a small GPT-2.

What is done
------------
1. A ``dpzero_jax.models.GPT2`` (byte-level, vocab 256) is trained for ``--steps`` DP-Adam steps (book-keeping,
   all-layer clipping, ``--clip-fn``, ``R = 1``, noise multiplier 1) on text bundled with Python: the source files
   of a few standard-library modules, read as bytes (no download).
2. On a held-out batch of ``--batch`` windows, everything is computed in **fp32**:

   * ``activation``: the inputs ``a`` of every linear layer (QKV, attention output, MLP in/out, tied LM head),
     captured with the book-keeping tape (:class:`dpzero_jax.tape.CaptureTape`, the one ``mode="bk"`` uses);
   * ``output grad``: ``g = dL/ds`` of those layers' outputs for ``L = S * sum_i L_i`` (``S``: loss scale);
   * ``vec(AA^T)``, ``vec(BB^T)``: the per-example Grams ``a_i a_i^T`` and ``g_i g_i^T`` (``[T, T]`` per example and
     layer) of the ghost norm;
   * ``clip factor``: ``C_i`` of each example from its gradient norm over all parameters (``||S g_i||``);
   * ``param grad (not scaled down)``: ``sum_i S g_i`` (standard) or ``sum_i C_i S g_i`` (DP), over all parameters;
   * ``param grad (scaled down)``: the same divided by ``S`` -- right for standard training, wrong for DP (the clip
     factor already removed ``S``).

   Per-example gradients are ``jax.vmap(jax.grad)`` of the per-example loss (an independent reference, not the
   engine's norms).
3. Each quantity's range is ``min`` and ``max`` of ``|x|`` over its non-zero entries (log10). Then the fp32 values are
   cast to fp16 and to bf16 and the fraction of non-zero entries that become ``inf`` (overflow) or ``0``
   (underflow) is counted. Rows: standard / DP, each without scaling (``S = 1``) and with ``S = --loss-scale``
   (default ``2^16``, the usual initial dynamic loss scale).

This is the *representability* of each fp32 value in 16 bits, not a 16-bit training run: in a real fp16 step the
Grams and norms are accumulated in fp32 (this library does), the activations and output gradients are fp16.

Run: ``python experiments/mixed_precision_ranges.py`` (2-4 minutes on a 2-core CPU); results in
``experiments/results/mixed_precision_ranges.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import dpzero_jax as dz
from dpzero_jax import engine
from dpzero_jax import tape as tape_lib
from dpzero_jax.models.transformer import DP_LAYERS

STDLIB_FILES = ("argparse.py", "dataclasses.py", "functools.py", "inspect.py", "typing.py", "this.py")
QUANTITIES = ("activation", "output grad", "vec(AA^T)", "vec(BB^T)", "clip factor", "param grad (not scaled down)",
              "param grad (scaled down)")


def corpus() -> tuple[np.ndarray, list[str]]:
    """Bytes of a few standard-library source files (uint8 ``[n]``) and their names."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [name for name in STDLIB_FILES if (root / name).is_file()]
    data = b"\n".join((root / name).read_bytes() for name in names)
    return np.frombuffer(data, np.uint8).astype(np.int32), names


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> jnp.ndarray:
    """``int32 [len(starts), length]`` windows of the byte stream."""
    return jnp.asarray(np.stack([data[s:s + length] for s in starts]))


def train(config: dz.models.GPT2Config, data: np.ndarray, steps: int, batch: int, seq: int, clip_fn: str,
          seed: int):
    """``steps`` DP-Adam steps on random windows of the first 90% of ``data``; returns ``(params, loss_fn, losses)``."""
    model = dz.models.GPT2(config, rngs=nnx.Rngs(seed), layers=DP_LAYERS)   # capture() reads the layers' tape
    params, loss_fn = dz.models.lm_objective(model)
    dp = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, clip_fn=clip_fn, mode="bk")
    private_grad = dz.private_value_and_grad(loss_fn, dp)
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, ids, key):
        losses, grads, _ = private_grad(params, {"input_ids": ids}, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

    rng = np.random.default_rng(seed)
    opt_state, losses = optimizer.init(params), []
    train_end = int(0.9 * len(data)) - seq
    for i in range(steps):
        ids = windows(data, rng.integers(0, train_end, batch), seq)
        params, opt_state, loss = step(params, opt_state, ids, jax.random.fold_in(jax.random.key(seed), i))
        losses.append(float(loss))
    return params, loss_fn, losses


def capture(loss_fn, params, batch):
    """``[(a [B, T, d_in], g [B, T, d_out])]`` of every linear-layer call, fp32, for the loss ``sum_i L_i``."""
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0)
    plan = dz.make_plan(loss_fn, cfg, params, batch)
    linear = [r for r in plan.records if r.rule.name == "linear"]
    leaf_ids = {id(leaf): path for leaf, path in zip(jax.tree.leaves(params), engine.leaf_paths(params))}
    probes = {r.index: jnp.zeros(r.output_shape, r.output_dtype) for r in linear}

    def forward(probes):
        tape = tape_lib.CaptureTape(leaf_ids, probes)
        with tape_lib.active(tape):
            losses = loss_fn(params, batch)
        return losses, {index: x for index, (x, _) in tape.calls.items()}

    losses, pullback, inputs = jax.vjp(forward, probes, has_aux=True)
    (output_grads,) = pullback(jnp.ones_like(losses))
    size = losses.shape[0]
    return [(inputs[r.index].reshape(size, -1, math.prod(r.input_shape[2:])).astype(jnp.float32),
             output_grads[r.index].reshape(size, -1, math.prod(r.output_shape[2:])).astype(jnp.float32))
            for r in linear]


def per_example_grads(loss_fn, params, batch) -> list[jnp.ndarray]:
    """``[B, *shape]`` per-example gradients of every parameter (``jax.vmap(jax.grad)``)."""

    def example_loss(params, ids):
        return loss_fn(params, {"input_ids": ids[None]})[0]

    grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(params, batch["input_ids"])
    return [g.astype(jnp.float32) for g in jax.tree.leaves(grads)]


def clip_factors(norms: jnp.ndarray, clip_fn: str, threshold: float = 1.0, gamma: float = 0.01) -> jnp.ndarray:
    if clip_fn == "abadi":
        return jnp.minimum(1.0, threshold / norms)
    if clip_fn == "automatic":
        return threshold / (norms + gamma)
    raise ValueError(f"--clip-fn must be abadi or automatic, got {clip_fn!r}")


def stats(values: list[np.ndarray]) -> dict:
    """Range of ``|x|`` over non-zero entries and what fp16 / bf16 do to those entries."""
    flat = np.concatenate([np.abs(np.asarray(v, np.float32)).ravel() for v in values])
    nonzero = flat[flat > 0]
    out = {"count": int(nonzero.size), "min": float(nonzero.min()), "max": float(nonzero.max()),
           "log10_min": float(np.log10(nonzero.min())), "log10_max": float(np.log10(nonzero.max())),
           # the bulk, for comparison with the paper's rounded ranges: 0.1% and 99.9% quantiles
           "log10_q001": float(np.log10(np.quantile(nonzero, 0.001))),
           "log10_q999": float(np.log10(np.quantile(nonzero, 0.999)))}
    for name, dtype in (("fp16", jnp.float16), ("bf16", jnp.bfloat16)):
        cast = np.asarray(jnp.asarray(nonzero).astype(dtype).astype(jnp.float32))
        out[f"{name}_inf"] = float(np.mean(np.isinf(cast)))
        out[f"{name}_zero"] = float(np.mean(cast == 0))
        # below the smallest normal number: kept, with fewer significant bits
        out[f"{name}_subnormal"] = float(np.mean((cast != 0) & (np.abs(cast) < float(jnp.finfo(dtype).tiny))))
    return out


def measure(loss_fn, params, batch, loss_scale: float, clip_fn: str) -> dict:
    """``{row: {quantity: stats}}`` for the four rows of Table 3."""
    layers = capture(loss_fn, params, batch)
    grads = per_example_grads(loss_fn, params, batch)
    norms = jnp.sqrt(sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1) for g in grads))
    activations = [a for a, _ in layers]
    gram_a = [jnp.einsum("btd,bsd->bts", a, a) for a, _ in layers]
    gram_g = [jnp.einsum("btp,bsp->bts", g, g) for _, g in layers]
    rows = {}
    for dp in (False, True):
        for scale in (1.0, loss_scale):
            coef = clip_factors(scale * norms, clip_fn) if dp else jnp.ones_like(norms)
            summed = [jnp.einsum("b,b...->...", coef * scale, g) for g in grads]
            row = {"activation": stats(activations),
                   "output grad": stats([scale * g for _, g in layers]),
                   "vec(AA^T)": stats(gram_a) if dp else None,
                   "vec(BB^T)": stats([scale**2 * m for m in gram_g]) if dp else None,
                   "clip factor": stats([coef]) if dp else None,
                   "param grad (not scaled down)": stats(summed),
                   "param grad (scaled down)": stats([s / scale for s in summed])}
            name = f"{'DP' if dp else 'standard'} {'w/' if scale != 1 else 'w/o'} scaling"
            rows[name] = row
    return rows


def _cell(s: dict | None) -> str:
    if s is None:
        return "N/A"
    if s["min"] == s["max"]:
        return f"{s['log10_min']:.1f}"
    return f"{s['log10_min']:.1f} ~ {s['log10_max']:.1f}"


def _lossy(s: dict | None, name: str) -> str:
    if s is None:
        return "-"
    inf, zero = s[f"{name}_inf"], s[f"{name}_zero"]
    return "-" if inf == 0 and zero == 0 else f"{100 * inf:.3g}% inf, {100 * zero:.3g}% 0"


def format_tables(rows: dict, loss_scale: float) -> str:
    header = "| row (loss scale " + f"{loss_scale:g}) | " + " | ".join(QUANTITIES) + " |"
    rule = "|" + "---|" * (len(QUANTITIES) + 1)
    ranges = [header, rule] + [f"| {name} | " + " | ".join(_cell(row[q]) for q in QUANTITIES) + " |"
                               for name, row in rows.items()]
    out = ["log10 of min ~ max of |x| over non-zero entries, fp32:", *ranges, ""]
    for name in ("fp16", "bf16"):
        out += [f"cast to {name}: fraction of non-zero entries that overflow (inf) or underflow (0):", header, rule]
        out += [f"| {row_name} | " + " | ".join(_lossy(row[q], name) for q in QUANTITIES) + " |"
                for row_name, row in rows.items()]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="examples of the measured batch")
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="DP-Adam training steps before measuring")
    parser.add_argument("--loss-scale", type=float, default=2.0**16)
    parser.add_argument("--clip-fn", choices=("abadi", "automatic"), default="automatic",
                        help="automatic (paper 000's Table 3 has clip factors above 1) or abadi")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "mixed_precision_ranges.json"))
    args = parser.parse_args(argv)

    start = time.time()
    data, files = corpus()
    config = dz.models.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.d_model, n_layer=args.layers,
                                  n_head=args.heads)
    params, loss_fn, losses = train(config, data, args.steps, args.train_batch, args.seq, args.clip_fn, args.seed)
    held_out = np.random.default_rng(args.seed + 1).integers(int(0.9 * len(data)), len(data) - args.seq, args.batch)
    batch = {"input_ids": windows(data, held_out, args.seq)}
    rows = measure(loss_fn, params, batch, args.loss_scale, args.clip_fn)
    text = format_tables(rows, args.loss_scale)
    print(f"GPT2 {args.layers} layers, d_model {args.d_model}, {args.heads} heads, T {args.seq}, byte vocab; "
          f"{args.steps} DP-Adam steps ({args.clip_fn} clipping, R 1, sigma 1) on {len(data):,} bytes of "
          f"{', '.join(files)}: training loss {losses[0]:.3f} -> {losses[-1]:.3f}; measured on {args.batch} "
          f"held-out windows\n")
    print(text)
    device = f"{jax.devices()[0].platform} ({platform.machine()}, {os.cpu_count()} cores)"
    result = {"config": vars(args), "device": device,
              "jax": jax.__version__, "python": platform.python_version(), "files": files, "bytes": int(len(data)),
              "train_losses": losses, "rows": rows, "seconds": time.time() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"({time.time() - start:.0f} s; JSON in {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
