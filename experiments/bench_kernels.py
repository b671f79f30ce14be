"""Per-example norm kernels vs their XLA forms: compiled temp memory everywhere, time where the kernels run natively.

What is measured
----------------
For one layer of width ``d`` (input) and ``p`` (output), ``B`` examples of ``T`` positions, bfloat16 activations
``a [B, T, d]`` and output gradients ``g [B, T, p]`` (and int ids ``[B, T]`` for the embedding form), four ops, each in
its XLA form (what the engine runs with ``norm_kernel="xla"``) and through ``dpzero_jax_kernels.ghost_norm`` with
``implementation="pallas"``:

* ``gram``          ghost norm ``<a a^T, g g^T>``; XLA builds two ``[B, T, T]`` float32 Grams;
* ``embedding``     ``sum_{t,s} 1{id_t == id_s} <g_t, g_s>``; XLA builds ``[B, T, T]`` (equality and Gram);
* ``instantiated``  ``||a_i^T g_i||^2``; XLA builds ``[B, d, p]``;
* ``weighted_sum``  the clipped sum ``sum_i c_i a_i^T g_i`` (engine's XLA path: masked float32 copies, one einsum).

Per op and ``T``: ``temp`` = ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted op (XLA's scratch: the
buffers the op needs beyond its inputs and outputs), and the median time of ``--repeats`` runs when the backend runs
the kernels natively (TPU, or GPU -- the GPU kernels take 16-bit inputs). On CPU the kernels only run in Pallas'
interpreter: their time means nothing and is not measured, and their ``temp`` is the interpreter's (it pads and
carries the operands through a loop over the grid), an upper bound on what a native kernel needs (``O(tile^2)``
VMEM / SMEM per example, outside XLA's accounting).

XLA:CPU (jax 0.10) hands dot + multiply + reduce chains to YNNPACK as one library fusion whose workspace XLA does
not account (``temp`` 0 even where the ``[B, T, T]`` products are formed). On CPU both forms are therefore compiled
with that fusion off (``xla_cpu_experimental_ynn_fusion_type=""``: XLA's own buffers, the memory the issue is about);
the default compile's ``temp`` is kept in the JSON as ``xla_temp_bytes_default``.

The ``mixed`` column says which form the engine's mixed rule picks for a dense ``d x p`` weight with XLA
(``2 T^2 < d p``) and with the kernels (``T (d + p) < 2 d p``).

How to run
----------
::

    python experiments/bench_kernels.py                 # T 512, 2048, 8192; d = p = 1024; B = 4
    python experiments/bench_kernels.py --quick         # T 128, 256; d = p = 256; B = 2 (smoke test)

Prints a markdown table and writes ``experiments/results/bench_kernels_<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpzero_jax import pergrad  # noqa: E402
from dpzero_jax_kernels import ghost_norm  # noqa: E402
from dpzero_jax_kernels.ghost_norm import pallas_tpu, reference  # noqa: E402

MiB = 2 ** 20


def ops(coef):
    """``{op: (xla_fn, kernel_fn, input names)}``."""
    return {
        "gram": (reference.gram_sq_norm, lambda a, g: ghost_norm.gram_sq_norm(a, g), ("a", "g")),
        "embedding": (reference.embed_gram_sq_norm, lambda i, g: ghost_norm.gram_sq_norm(i, g, left_is_ids=True),
                      ("ids", "g")),
        "instantiated": (reference.instantiated_sq_norm, lambda a, g: ghost_norm.instantiated_sq_norm(a, g),
                         ("a", "g")),
        "weighted_sum": (lambda a, g: pergrad.weighted_sum([pergrad.Outer(a, g, a.shape[2], (a.shape[2], g.shape[2]))],
                                                           coef, "xla"),
                         lambda a, g: ghost_norm.weighted_sum(a, g, coef), ("a", "g")),
    }


NO_LIBRARY_FUSION = {"xla_cpu_experimental_ynn_fusion_type": ""}


def temp_bytes(fn, *args, compiler_options=None) -> tuple[int, float]:
    start = time.perf_counter()
    compiled = jax.jit(fn, compiler_options=compiler_options).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - start


def tpu_working_set_bytes(op: str, positions: int, d: int, p: int, itemsize: int) -> int:
    """What one Mosaic TPU kernel instance holds in VMEM with the default blocks of ``pallas_tpu``: double-buffered
    input blocks, the float32 scratch and the output block (computed, not measured)."""
    tile_t = min(pallas_tpu.DEFAULT_BLOCK_T, positions)
    k_d, k_p = min(pallas_tpu.DEFAULT_BLOCK_K, d), min(pallas_tpu.DEFAULT_BLOCK_K, p)
    chunk_t = min(pallas_tpu.DEFAULT_BLOCK_REDUCE, positions)
    out_d, out_p = min(pallas_tpu.DEFAULT_BLOCK_OUT, d), min(pallas_tpu.DEFAULT_BLOCK_OUT, p)
    lanes_out = 2 * pallas_tpu.LANES * 4
    if op == "gram":
        return 2 * 2 * tile_t * (k_d + k_p) * itemsize + 2 * tile_t * tile_t * 4 + lanes_out
    if op == "embedding":
        return 2 * 2 * tile_t * (pallas_tpu.LANES * 4 // itemsize + k_p) * itemsize + tile_t * tile_t * 4 + lanes_out
    if op == "instantiated":
        return 2 * chunk_t * (out_d + out_p) * itemsize + out_d * out_p * 4 + lanes_out
    return 2 * chunk_t * (out_d + out_p) * itemsize + 2 * out_d * out_p * 4


def median_time(fn, args, repeats: int) -> float:
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--p", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ops", nargs="+", default=["gram", "embedding", "instantiated", "weighted_sum"])
    parser.add_argument("--quick", action="store_true", help="T 128 256, d = p = 256, B = 2")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.T, args.d, args.p, args.B = [128, 256], 256, 256, 2
    backend = jax.default_backend()
    native = backend in ("tpu", "gpu")
    device = jax.devices()[0].device_kind
    rng = np.random.default_rng(0)
    coef = jnp.asarray(rng.uniform(0.1, 1.0, args.B), jnp.float32)
    rows = []
    for positions in args.T:
        inputs = {"a": jnp.asarray(rng.standard_normal((args.B, positions, args.d)), jnp.bfloat16),
                  "g": jnp.asarray(rng.standard_normal((args.B, positions, args.p)), jnp.bfloat16),
                  "ids": jnp.asarray(rng.integers(0, args.vocab, (args.B, positions)), jnp.int32)}
        dense = [pergrad.Outer(jax.ShapeDtypeStruct(inputs["a"].shape, jnp.bfloat16),
                               jax.ShapeDtypeStruct(inputs["g"].shape, jnp.bfloat16), args.d, (args.d, args.p))]
        mixed = {k: "ghost" if pergrad.use_ghost(dense, "mixed", k) else "instantiate" for k in ("xla", "pallas")}
        for op in args.ops:
            xla_fn, kernel_fn, names = ops(coef)[op]
            op_args = [inputs[n] for n in names]
            uses_kernel = ghost_norm.has_kernel({"embedding": "gram"}.get(op, op), *op_args[-1:])
            options = NO_LIBRARY_FUSION if backend == "cpu" else None
            xla_temp, xla_compile = temp_bytes(xla_fn, *op_args, compiler_options=options)
            kernel_temp, kernel_compile = temp_bytes(kernel_fn, *op_args, compiler_options=options)
            row = {"op": op, "T": positions, "B": args.B, "d": args.d, "p": args.p, "xla_temp_bytes": xla_temp,
                   "kernel_temp_bytes": kernel_temp, "compiler_options": options, "kernel_is_pallas": uses_kernel,
                   "tpu_kernel_vmem_bytes": tpu_working_set_bytes(op, positions, args.d, args.p, 2),
                   "kernel_native": native and uses_kernel, "xla_compile_s": xla_compile,
                   "kernel_compile_s": kernel_compile, "mixed_rule": mixed}
            if backend == "cpu":
                row["xla_temp_bytes_default"] = temp_bytes(xla_fn, *op_args)[0]
            if native:
                row["xla_time_s"] = median_time(xla_fn, op_args, args.repeats)
                row["kernel_time_s"] = median_time(kernel_fn, op_args, args.repeats)
                reference_value = np.asarray(jax.jit(xla_fn)(*op_args), np.float64)
                kernel_value = np.asarray(jax.jit(kernel_fn)(*op_args), np.float64)
                row["max_rel_diff"] = float(np.max(np.abs(kernel_value - reference_value))
                                            / max(np.max(np.abs(reference_value)), 1e-30))
            rows.append(row)
            print(f"  {op:13s} T={positions:5d}  XLA temp {xla_temp / MiB:9.1f} MiB  kernel temp "
                  f"{kernel_temp / MiB:9.1f} MiB  (compile {xla_compile:.1f} s / {kernel_compile:.1f} s)", flush=True)

    print()
    print(f"Device: {device} ({backend}), jax {jax.__version__}, B={args.B}, d={args.d}, p={args.p}, bfloat16 inputs")
    print()
    print("| op | T | XLA temp (MiB) | kernel temp (MiB) | TPU kernel VMEM (MiB) | XLA time (ms) | kernel time (ms) "
          "| mixed: XLA / kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        xla_ms = f"{r['xla_time_s'] * 1e3:.2f}" if "xla_time_s" in r else "-"
        kernel_ms = f"{r['kernel_time_s'] * 1e3:.2f}" if "kernel_time_s" in r else "-"
        if not r["kernel_is_pallas"]:
            kernel_ms += " (XLA fallback)"
        print(f"| {r['op']} | {r['T']} | {r['xla_temp_bytes'] / MiB:.1f} | {r['kernel_temp_bytes'] / MiB:.1f} | "
              f"{r['tpu_kernel_vmem_bytes'] / MiB:.2f} | {xla_ms} | {kernel_ms} | "
              f"{r['mixed_rule']['xla']} / {r['mixed_rule']['pallas']} |")
    if not native:
        print("\nTimes: not measured -- on this backend the kernels run only in Pallas' interpreter. Kernel temp is "
              "the interpreter's (padded operand copies and loop carries); TPU kernel VMEM is computed from the "
              "default blocks.")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"bench_kernels_{backend}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": device, "backend": backend, "jax": jax.__version__, "host": platform.node(),
                   "native_kernels": native, "config": vars(args), "rows": rows}, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
