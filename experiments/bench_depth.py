"""Depth: compile time, step time and compiled memory of the private gradient of scanned (and unrolled) decoders.

The model is a GPT-2-style decoder written with flax.linen's standard layers (``nn.Embed`` with a tied head,
``nn.LayerNorm``, ``nn.DenseGeneral`` attention projections, ``nn.Dense`` MLP), its blocks either scanned
(``nn.scan``, optionally ``nn.remat`` around each block) or unrolled (a Python loop). The private gradient is
``dz.private_value_and_grad`` with ``mode="auto"``: these models use no ``dpzero_jax`` layer, so the traced-program
front-end plans it (book-keeping on the program; scans stay scans).

Per depth ``L`` and layout the script measures, in one process:

* **compile**: ``jit(f).lower(args).compile()`` wall time (trace + planning + XLA), non-DP and DP: the median of
  ``--compile-rounds`` compiles of each, every one after ``jax.clear_caches()`` (as the first step of a new process),
  the candidates alternating; the ratio is the median over rounds of DP / non-DP of the same round (one compile each
  moved 1.41-1.80x at L = 48 from run to run on the 2-core machine; single rounds 1.25-1.76x, so 5 by default);
* **step**: the median over ``--rounds`` interleaved rounds of the DP step / the non-DP step of the same round
  (45 by default: single rounds spread 0.95-1.10x at L = 48, and the medians of five successive 21-round blocks
  of one process 1.009-1.033x, so a 15- or 21-round median moved about +-0.03 from run to run);
* **noise floor**: the Gaussian noise alone (``dz.noise.privatize`` of a gradient-shaped tree, jitted, timed in
  the same rounds), as a fraction of the non-DP step: every DP-SGD step draws one normal per parameter, so no
  engine's step ratio can be below ``1 + noise``; ``x step - noise`` is the rest (norms, clipped sums, layout).
  Its compile time, jitted by itself, is stored too (``compile_noise_ratio``: of the non-DP compile, paired per
  round), as a rough share of the DP compile's excess (inside the step its kernels are compiled with the rest);
* **memory**: ``compiled.memory_analysis().temp_size_in_bytes`` of the DP step against the non-DP step; on the
  ``scan+remat`` row (``nn.remat`` around every block, at the first depth) also of ``mode="ghost"`` (what ``auto``
  picks there: its norms come out of the rematerialised backward) and ``mode="bk"`` (which keeps every site's
  operands).

The non-DP step is ``jax.value_and_grad`` of the mean per-example loss. Targets from the issue (printed, stored):
at ``L = 48`` scanned, compile ratio <= 1.5 and step ratio <= 1.05.

Run::

    python experiments/bench_depth.py                 # L = 12, 24, 48 scanned and unrolled, remat memory
    python experiments/bench_depth.py --quick         # L = 2, 4 (a smoke test)
    python experiments/bench_depth.py --depths 12 48 --unrolled --batch 16 --seq 128 \
        --out experiments/results/bench_depth_cpu_b16_t128.json     # 8x the tokens per step

Writes ``experiments/results/bench_depth_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dpzero_jax as dz  # noqa: E402

WIDTH, HEADS, SEQ, BATCH, VOCAB = 64, 4, 64, 4, 256


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _=None):
        y = nn.LayerNorm()(h)
        q, k, v = (nn.DenseGeneral((HEADS, WIDTH // HEADS), name=n)(y) for n in ("query", "key", "value"))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        h = h + nn.DenseGeneral(WIDTH, axis=(-2, -1), name="out")(y)
        y = nn.Dense(4 * WIDTH)(nn.LayerNorm()(h))
        return h + nn.Dense(WIDTH)(jax.nn.gelu(y)), None


class Decoder(nn.Module):
    layers: int
    scan: bool = True
    remat: bool = False
    seq: int = SEQ

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, WIDTH)
        h = embed(ids) + self.param("position", nn.initializers.normal(0.02), (self.seq, WIDTH))
        block = nn.remat(Block) if self.remat else Block
        if self.scan:
            h, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)()(h)
        else:
            for _ in range(self.layers):
                h, _ = block()(h)
        return embed.attend(nn.LayerNorm()(h))


def setup(layers: int, scan: bool, remat: bool = False, batch_size: int = BATCH, seq: int = SEQ):
    model = Decoder(layers, scan, remat, seq)
    rng = np.random.default_rng(0)
    batch = {"ids": jnp.asarray(rng.integers(0, VOCAB, (batch_size, seq)), jnp.int32)}
    params = jax.jit(model.init)(jax.random.key(0), batch["ids"])["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["ids"])[:, :-1]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][:, 1:, None], -1)[..., 0], axis=-1)

    return params, batch, loss_fn


class Compiled(NamedTuple):
    """One candidate of :func:`compiled_pair`: its executable, the arguments it runs on, and its trace + lower +
    compile time (median over rounds, and each round's)."""
    executable: object
    args: tuple
    seconds: float
    rounds_s: list


def compiled_pair(params, batch, loss_fn, modes=("auto",), compile_rounds: int = 3) -> dict[str, Compiled]:
    """``{"nondp": ..., "dp": (auto), "ghost": ..., "noise": (the noise alone)}``, each a :class:`Compiled`. Every
    round compiles every candidate afresh, each after ``jax.clear_caches()`` (the first step of a new process: its
    traces, lowerings and XLA compile all redone), the candidates' order rotated from round to round."""
    batch_size = batch["ids"].shape[0]
    key = jax.random.key(1)

    def nondp():
        return jax.jit(jax.value_and_grad(lambda p, b: jnp.mean(loss_fn(p, b))))

    def private(mode):
        cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, mode=mode, expected_batch_size=batch_size)
        return lambda: jax.jit(dz.private_value_and_grad(loss_fn, cfg))

    def noise_only():
        return jax.jit(lambda grads, key: dz.noise.privatize(grads, key, 1.0, 1.0, batch_size))

    candidates = [("nondp", nondp, (params, batch))]
    candidates += [("dp" if mode == "auto" else mode, private(mode), (params, batch, key)) for mode in modes]
    candidates.append(("noise", noise_only, (params, key)))
    times = {name: [] for name, _, _ in candidates}
    compiled = {}
    for r in range(compile_rounds):
        for name, make, args in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
            jax.clear_caches()
            start = time.perf_counter()
            compiled[name] = make().lower(*args).compile()
            times[name].append(time.perf_counter() - start)
    return {name: Compiled(compiled[name], args, statistics.median(times[name]), times[name])
            for name, _, args in candidates}


def round_ratios(times, base_times) -> list[float]:
    """Each round's compile time / the baseline's of the same round."""
    return [t / base for t, base in zip(times, base_times)]


def compile_ratio(pair, name: str) -> float:
    """The median over rounds of ``name``'s compile time / the non-DP one's of the same round."""
    return statistics.median(round_ratios(pair[name].rounds_s, pair["nondp"].rounds_s))


def step_ratio(pair, rounds: int) -> tuple[float, float, float, float, list]:
    """(median paired DP/non-DP ratio, median non-DP seconds, median DP seconds, median paired noise/non-DP, every
    round's DP/non-DP ratio)."""
    pair = {name: pair[name] for name in ("nondp", "dp", "noise")}
    for candidate in pair.values():
        jax.block_until_ready(candidate.executable(*candidate.args))
    ratios, noise, times = [], [], {"nondp": [], "dp": [], "noise": []}
    for r in range(rounds):
        order = ("nondp", "dp", "noise") if r % 2 == 0 else ("noise", "dp", "nondp")
        this = {}
        for name in order:
            candidate = pair[name]
            start = time.perf_counter()
            jax.block_until_ready(candidate.executable(*candidate.args))
            this[name] = time.perf_counter() - start
            times[name].append(this[name])
        ratios.append(this["dp"] / this["nondp"])
        noise.append(this["noise"] / this["nondp"])
    return (statistics.median(ratios), statistics.median(times["nondp"]), statistics.median(times["dp"]),
            statistics.median(noise), ratios)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--unrolled", type=int, nargs="*", default=None,
                        help="depths to also run unrolled (default: the same as --depths; the flag alone: none)")
    parser.add_argument("--rounds", type=int, default=45, help="interleaved timed rounds (median reported)")
    parser.add_argument("--compile-rounds", type=int, default=5,
                        help="compiles of every candidate, each from cleared caches (median reported)")
    parser.add_argument("--quick", action="store_true", help="L = 2, 4 and 5 rounds (smoke test)")
    parser.add_argument("--batch", type=int, default=BATCH, help="examples per step (the issue's shape: 4)")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per example (the issue's shape: 64)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_depth_cpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.depths, args.rounds, args.compile_rounds = [2, 4], 5, 1
    unrolled = args.depths if args.unrolled is None else args.unrolled
    rows = []
    header = f"{'layout':<10} {'L':>3} {'compile non-DP s':>16} {'compile DP s':>12} {'x compile':>9} " \
             f"{'step non-DP ms':>14} {'step DP ms':>10} {'x step':>7} {'x noise':>7} {'temp non-DP MiB':>15} " \
             f"{'temp DP MiB':>11} " \
             f"{'x temp':>7}"
    print(f"backend {jax.default_backend()}, width {WIDTH}, T {args.seq}, B {args.batch}, vocab {VOCAB}, tied head")
    print(header)
    cases = [("scan", L, False) for L in args.depths] + [("scan+remat", L, True) for L in args.depths[:1]] + \
        [("unrolled", L, False) for L in unrolled]
    for layout, layers, remat in cases:
        params, batch, loss_fn = setup(layers, scan=layout != "unrolled", remat=remat, batch_size=args.batch,
                                       seq=args.seq)
        pair = compiled_pair(params, batch, loss_fn, ("auto", "ghost", "bk") if remat else ("auto",),
                             args.compile_rounds)
        ratio, t_nondp, t_dp, noise, ratio_rounds = step_ratio(pair, args.rounds)
        mem = {name: pair[name].executable.memory_analysis() for name in pair}
        temp = {name: getattr(m, "temp_size_in_bytes", 0) if m is not None else 0 for name, m in mem.items()}
        row = {"layout": layout, "layers": layers, "compile_nondp_s": pair["nondp"].seconds,
               "compile_dp_s": pair["dp"].seconds,
               "compile_ratio": compile_ratio(pair, "dp"), "compile_nondp_rounds_s": pair["nondp"].rounds_s,
               "compile_dp_rounds_s": pair["dp"].rounds_s, "compile_noise_s": pair["noise"].seconds,
               "compile_noise_ratio": compile_ratio(pair, "noise"), "step_nondp_s": t_nondp, "step_dp_s": t_dp,
               "step_ratio_paired": ratio, "step_ratio_rounds": ratio_rounds, "noise_ratio_paired": noise,
               "step_ratio_minus_noise": ratio - noise,
               "temp_nondp_bytes": temp["nondp"], "temp_dp_bytes": temp["dp"],
               "temp_ratio": temp["dp"] / max(temp["nondp"], 1)}
        if "ghost" in temp:
            row.update(temp_ghost_bytes=temp["ghost"], temp_ghost_ratio=temp["ghost"] / max(temp["nondp"], 1),
                       compile_ghost_s=pair["ghost"].seconds, temp_bk_bytes=temp["bk"],
                       temp_bk_ratio=temp["bk"] / max(temp["nondp"], 1))
        rows.append(row)
        print(f"{layout:<10} {layers:>3} {row['compile_nondp_s']:>16.2f} {row['compile_dp_s']:>12.2f} "
              f"{row['compile_ratio']:>9.2f} {1e3 * t_nondp:>14.1f} {1e3 * t_dp:>10.1f} {ratio:>7.3f} {noise:>7.3f} "
              f"{temp['nondp'] / 2**20:>15.1f} {temp['dp'] / 2**20:>11.1f} {row['temp_ratio']:>7.2f}", flush=True)
        for mode in ("ghost", "bk"):
            if mode in temp:
                print(f"{'  ' + mode:<10} {layers:>3} {'':>16} {pair[mode].seconds:>12.2f} {'':>9} {'':>14} {'':>10} "
                      f"{'':>7} {'':>7} {temp['nondp'] / 2**20:>15.1f} {temp[mode] / 2**20:>11.1f} "
                      f"{temp[mode] / max(temp['nondp'], 1):>7.2f}")
    deepest = max(args.depths)
    target = [r for r in rows if r["layout"] == "scan" and r["layers"] == deepest]
    targets = {}
    if target:
        targets = {f"scan L={deepest} compile <= 1.5x": target[0]["compile_ratio"] <= 1.5,
                   f"scan L={deepest} step <= 1.05x": target[0]["step_ratio_paired"] <= 1.05}
        for name, ok in targets.items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
        per_round = round_ratios(target[0]["compile_dp_rounds_s"], target[0]["compile_nondp_rounds_s"])
        if len(per_round) > 1:
            print(f"      compile ratio per round: {min(per_round):.2f}-{max(per_round):.2f}x over {len(per_round)} "
                  f"rounds (the median decides; compile times move by about 0.3 s from run to run on a shared "
                  f"2-core host)")
        step_rounds = sorted(target[0]["step_ratio_rounds"])
        if len(step_rounds) > 4:
            tenth = len(step_rounds) // 10
            print(f"      step ratio per round: {step_rounds[tenth]:.3f}-{step_rounds[-1 - tenth]:.3f}x (10th-90th "
                  f"percentile of {len(step_rounds)} rounds; the median decides)")
        floor = 1 + target[0]["noise_ratio_paired"]
        print(f"      the noise alone puts any DP-SGD step at >= {floor:.3f}x here; the rest of the DP step is "
              f"{target[0]['step_ratio_minus_noise']:.3f}x")
        print(f"      the noise alone, jitted by itself, compiles in {target[0]['compile_noise_ratio']:.2f}x the "
              f"non-DP step's compile time")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"backend": jax.default_backend(), "width": WIDTH, "seq": args.seq, "batch": args.batch,
                   "vocab": VOCAB, "rounds": args.rounds, "compile_rounds": args.compile_rounds, "rows": rows,
                   "targets": targets,
                   "load_avg": os.getloadavg()}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
