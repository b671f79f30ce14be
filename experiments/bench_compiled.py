"""The private step as the TPU compiler sees it: memory, FLOPs, bytes and collectives of the compiled program.

No TPU is needed: with ``libtpu`` installed, ``jax.experimental.topologies.get_topology_desc(platform="tpu", ...)``
describes a TPU slice (default ``v5e:2x2``, four chips) whose devices make a ``Mesh``; every candidate step is
``jax.jit(step, in_shardings=..., out_shardings=...).lower(*abstract_args).compile()`` for that slice, ahead of
time, on this (CPU) host. Nothing runs; every number below is read from the compiled TPU program.

What is compared (one data-parallel step: batch sharded over the mesh, parameters replicated, float32 parameters,
``B`` examples per chip; every candidate differentiates the project's own ``lm_objective`` on its GPT-2 model and
returns the per-example losses and the replicated gradient):

* ``nonprivate``   ``jax.value_and_grad`` of the mean per-example loss (the baseline of every ratio);
* ``auto`` / ``bk`` / ``ghost`` / ``vmap``  ``dpzero_jax.private_value_and_grad`` in that mode (all-layer clipping,
                   ``noise_multiplier=1``, ``max_grad_norm=1``, noise included); ``auto`` is resolved by the library
                   on this host (the JSON records what ``choose_mode`` picks for the host and for a v5e chip);
* ``fused``        the same with ``groups="layer-wise"`` (fused mode clips inside each layer: an all-layer group is
                   rejected), as in ``bench_overhead.py``;
* ``bk_fastest``   ``bk`` with ``norm_method="fastest"``;
* ``bk_pallas``    ``bk`` with ``norm_kernel="pallas"`` (the Mosaic TPU kernels of ``dpzero_jax_kernels.ghost_norm``);
* ``jax_privacy``  ``jax_privacy.clipping.clipped_grad`` (``vmap`` over the whole batch, ``keep_batch_dim=True``)
                   on ``sum(loss_fn(params, example))``, plus Gaussian noise on the clipped sum, divided by the batch;
* ``optax``        ``optax.contrib.differentially_private_aggregate`` (its own noise) on
                   ``jax.vmap(jax.value_and_grad(...))`` per-example gradients.

Per candidate (per device; the program is SPMD): ``memory_analysis()`` temporary, argument and output bytes;
``cost_analysis()`` flops, bytes accessed and the compiler's ``optimal_seconds``; every collective of the optimised
HLO (``as_text()``): kind, static count and bytes (the size of its output buffer(s); an op inside a loop body is
counted once); a roofline step time ``max(flops / peak, bytes / HBM bandwidth, collective bytes / ICI bandwidth)``
for v5e and v5p (peaks below); and, for Pallas kernels (``custom-call`` to Mosaic: ``cost_analysis`` counts none of
their work), their FLOPs counted from the traced kernel: the ``dot_general``s of the kernel body times the grid size
(a ``pl.when``-guarded branch is counted as if taken on every grid step, so this is an upper bound: the symmetric
Gram kernel skips about half of its tile pairs).

Temp and peak: ``memory_analysis()`` also reports ``peak_memory_in_bytes`` (the ``peak`` column). Neither it nor
``temp_size_in_bytes`` is what the compiled program allocates: for steps that instantiate per-example gradients the
temporaries count 1.2-1.4 GiB more than the buffer assignment's preallocated temporary buffer (the LM head's
per-example gradient, e.g. ``f32[8, 768, 50304]``), and the peak is below the memory-usage report's HBM total.
``experiments/tpu_buffers.py`` reads both from ``--xla_dump_to`` (``docs/benchmarks/compiled.md``). The issue's
targets are set on the temporaries; all three are reported.

Peaks assumed (Google Cloud TPU documentation, "TPU v5e" and "TPU v5p" pages, per chip): v5e 197 TFLOP/s bf16,
819 GB/s HBM, 16 GiB HBM, ICI 1600 Gbit/s = 200 GB/s; v5p 459 TFLOP/s bf16, 2765 GB/s HBM, 95 GB HBM, ICI 4800
Gbit/s = 600 GB/s. Float32 matmuls at JAX's default precision run as one bf16 MXU pass on TPU, so the bf16 peak is the
relevant one. The v5p estimate reuses the counts of the program compiled for ``--topology`` (v5e by default): it is a
"same program on a faster chip" estimate, not a v5p compile (``--topology v5p:2x2x1`` compiles for v5p).

Ahead-of-time set-up (documented here because it is not obvious)
----------------------------------------------------------------
* ``pip install -e ".[tpu-aot]"`` (or ``jax[tpu]`` at the *same* version as ``jax``, plus ``jax-privacy``) in a
  separate virtual environment: ``libtpu`` changes JAX's start-up (it probes for TPU hardware) and should not be in
  the test environment.
* The script sets ``JAX_PLATFORMS=cpu`` (the host backend: no TPU is probed for) and ``TPU_SKIP_MDS_QUERY=1``
  before importing JAX; ``get_topology_desc`` then still loads libtpu's compiler. libtpu prints warnings about
  ``TPU_ACCELERATOR_TYPE`` / ``TPU_WORKER_HOSTNAMES`` at start-up: harmless for compiling.
* libtpu takes a machine-wide lock (``/tmp/libtpu_lockfile``): one compiling process at a time (a second one fails
  with "Internal error when accessing libtpu multi-process lockfile"; ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` lifts it).
  Compiles are sequential anyway: a GPT-2 small DP step takes 2-6 minutes on a 2-core host.
* The library picks Pallas kernels by ``jax.default_backend()``, which is ``cpu`` here: the script tells
  ``dpzero_jax_kernels.ghost_norm`` that the target is ``tpu`` (otherwise the kernels would be *interpreted*, i.e.
  lowered as ordinary XLA loops, not Mosaic kernels).

How to run
----------
::

    python3 -m venv /work/venv-tpu
    /work/venv-tpu/bin/pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')" \\
        flax optax dp-accounting jax-privacy ...     # or: pip install -e ".[tpu-aot]"
    PYTHONPATH=$PWD /work/venv-tpu/bin/python experiments/bench_compiled.py            # default grid
    PYTHONPATH=$PWD /work/venv-tpu/bin/python experiments/bench_compiled.py --smoke    # one tiny shape
    PYTHONPATH=$PWD /work/venv-tpu/bin/python experiments/bench_compiled.py --full     # every shape + max batch
    PYTHONPATH=$PWD /work/venv-tpu/bin/python experiments/bench_compiled.py --extra --shapes 9 --only nonprivate,auto
                                                                  # one point of the extra grid (gpt2-medium)

Results are cached per (topology, shape, candidate) in ``experiments/results/bench_compiled_tpu.json`` (``--out``):
a rerun compiles only the points that are missing (``--recompute`` ignores the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_steps import (  # noqa: E402  (a sibling module)
    CHIPS,
    DP_CANDIDATES,
    GIB,
    PEERS,
    SHMAP_CANDIDATES,
    Shape,
    is_oom,
    llama,
    measure,
    medium,
    mesh_for,
    require_libtpu,
    resolved_auto,
    small,
    target_tpu_kernels,
)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_compiled_tpu.json")


# ------------------------------------------------------------------------------------------------------------------
# The grid.

SMOKE_SHAPES = [Shape("smoke L1 d64 V512 T32 B2", 1, 64, 2, 32, 2, True, vocab=512)]
# default grid, in the priority order; --full adds FULL_EXTRA and the largest-batch search
DEFAULT_SHAPES = [small(1024, 8), small(1024, 8, n_layer=2), small(1024, 8, tied=False, n_layer=2), small(128, 32)]
FULL_EXTRA = [small(1024, 8, tied=False), small(128, 32, n_layer=2), small(512, 8), small(2048, 4),
              small(1024, 8, lora_rank=8), medium(1024, 8), medium(1024, 4), llama(1024, 4)]

# a cached point older than its candidate's version is compiled again (2: shard_map with check_vma=False)
# 3 (bk_shmap, bk_pallas) / 2 (others): configured with target="tpu", so norm_method="auto" resolves to "fastest"
# +1 for the book-keeping candidates that instantiate: per-example gradients kept as [B, rows, cols] (the TPU
# compiler no longer copies them into the parameter's layout); auto_bf16 3: a dense gradient rounded with
# reduce_precision and normed in the fusion that writes it
VERSIONS = {"bk_shmap": 4, "bk_pallas": 3, "auto": 3, "bk": 3, "bk_fastest": 3, "bk_mixed": 2, "auto_bf16": 3,
            "ghost": 2, "fused": 2, "program_bk": 2, "program_ghost": 2}
# compile order (most wanted first: a GPT-2 small DP compile takes minutes on a small host)
CANDIDATES = ("nonprivate", "auto", *PEERS, "bk", "bk_mixed", "bk_fastest", "ghost", "vmap", "bk_pallas", "bk_shmap",
              "fused", "program_bk", "program_ghost", "auto_bf16")
assert set(CANDIDATES) == {"nonprivate", *DP_CANDIDATES, *SHMAP_CANDIDATES, *PEERS}
SMOKE_CANDIDATES = ("nonprivate", "auto", "bk", "ghost", "vmap", "bk_shmap", "bk_pallas", "jax_privacy", "optax")
MAX_BATCH_MODELS = {"small": small, "medium": medium}
MAX_BATCH_CANDIDATES = ("nonprivate", "auto", "bk", "ghost", "jax_privacy", "optax", "auto_bf16")


# ------------------------------------------------------------------------------------------------------------------
# Cache, grid, table.

def load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def save(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def run_point(data: dict, path: str, topology: str, shape: Shape, candidate: str, mesh, recompute: bool) -> dict:
    entry = data.setdefault("points", {}).setdefault(topology, {}).setdefault(shape.key(), {"shape": shape.name})
    cached = entry.get(candidate)
    stale = cached is not None and cached.get("version", 1) < VERSIONS.get(candidate, 1)
    if cached is not None and not stale and not recompute and cached.get("failed") != "error":
        return entry[candidate]  # a compile error is retried (it may be fixed); an out-of-memory result is kept
    print(f"  compiling {shape.name} / {candidate} ...", flush=True)
    try:
        entry[candidate] = measure(candidate, shape, mesh)
        entry[candidate]["version"] = VERSIONS.get(candidate, 1)
        r = entry[candidate]
        print(f"    lower {r['lower_seconds']} s, compile {r['compile_seconds']} s, "
              f"temp {r['temp_bytes'] / GIB:.2f} GiB",
              flush=True)
    except Exception as error:  # recorded: a configuration that does not compile is a result too
        kind = "oom" if is_oom(error) else "error"
        message = str(error).strip().splitlines()
        entry[candidate] = {"failed": kind, "message": " ".join(message[:3])[:600] if message else repr(error)}
        print(f"    failed ({kind}): {entry[candidate]['message'][:200]}", flush=True)
        if kind == "error" and os.environ.get("BENCH_COMPILED_TRACEBACK"):
            traceback.print_exc()
    save(path, data)
    return entry[candidate]


def fits(result: dict, criterion: str = "compiler") -> bool:
    """Whether a compiled point fits a v5e chip. ``"compiler"``: the TPU compiler accepted it -- it refuses a program
    whose buffers need more than the chip's usable HBM (15.75 of 16 GiB) with RESOURCE_EXHAUSTED, counting what its
    buffer assignment places (its memory-usage report's total: 15.70 GiB for ``auto`` on GPT-2 medium at 6 per chip,
    accepted). ``"total"``: also ``memory_analysis()``'s temp + arguments + outputs - aliases at most 16 GiB, which
    counts some buffers of programs that instantiate per-example gradients twice (17.1 GiB for that same point)."""
    if "failed" in result:
        return False
    return criterion == "compiler" or result["total_bytes"] <= CHIPS["v5e"][2]


FIT_CRITERIA = ("compiler", "total")


def max_batch(data: dict, path: str, topology: str, base: Shape, candidate: str, mesh, recompute: bool,
              limit: int = 256, start: int = 1, criterion: str = "compiler") -> dict:
    """The largest per-chip batch whose compiled program fits a v5e chip (:func:`fits` by ``criterion``): from
    ``start``, doubling while it fits (halving while it does not), then bisection. Every probed point is cached
    like any other."""
    def probe(b):
        return fits(run_point(data, path, topology, dataclasses.replace(base, B=b, name=f"{base.name} (B={b})"),
                              candidate, mesh, recompute), criterion)

    low, high = 0, None          # low fits (0: nothing known to fit), high does not (None: nothing known)
    b = min(start, limit)
    while b >= 1 and not probe(b):
        high, b = b, b // 2
    if b < 1:
        return {"max_batch": 0}
    low = b
    if high is None:
        b = 2 * low
        while b <= limit:
            if probe(b):
                low, b = b, 2 * b
            else:
                high = b
                break
        if high is None:
            return {"max_batch": low, "capped_at": limit}
    while high - low > 1:
        mid = (low + high) // 2
        if probe(mid):
            low = mid
        else:
            high = mid
    return {"max_batch": low}


def _ratio(value, base):
    return f"{value / base:.2f}x" if base and value else "-"


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if value else "-"


def table(data: dict, topology: str, shapes: list[Shape], candidates) -> str:
    lines = []
    for shape in shapes:
        entry = data.get("points", {}).get(topology, {}).get(shape.key())
        if not entry:
            continue
        base = entry.get("nonprivate", {})
        if "failed" in base or not base:
            base = {}
        auto = entry.get("auto_resolves_to")
        lines.append(f"\n**{shape.name}** ({shape.key()}; {topology}, per chip"
                     + (f"; auto resolves to `{auto['host']}` here, `{auto['v5e_chip']}` on a v5e chip" if auto
                        else "") + ")\n")
        lines.append("| candidate | temp GiB | x temp | peak GiB | x peak | args+out GiB | FLOPs (T) | x FLOPs "
                     "| bytes acc. (GB) | x bytes | collectives (count, MB) | v5e ms | v5p ms | x v5e |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        stale = []
        for candidate in candidates:
            r = entry.get(candidate)
            if r is None:
                continue
            if r.get("version", 1) < VERSIONS.get(candidate, 1):   # compiled before the candidate's program changed
                stale.append(candidate)
                continue
            if "failed" in r:
                lines.append(f"| {candidate} | {r['failed']}: {r['message'][:90]} |" + " |" * 12)
                continue
            flops = r["flops"] + r.get("pallas_flops", 0.0)
            flops_text = f"{flops / 1e12:.2f}" + (f" (Pallas {r['pallas_flops'] / 1e12:.2f})"
                                                  if r.get("pallas_calls") else "")
            colls = ", ".join(f"{k} {v['count']}, {v['bytes'] / 1e6:.0f}" for k, v in sorted(r["collectives"].items()))
            bflops = base.get("flops", 0.0)
            lines.append(
                f"| {candidate} | {r['temp_bytes'] / GIB:.2f} | {_ratio(r['temp_bytes'], base.get('temp_bytes'))} "
                f"| {_gib(r.get('peak_bytes'))} | {_ratio(r.get('peak_bytes') or 0, base.get('peak_bytes'))} "
                f"| {(r['argument_bytes'] + r['output_bytes'] - r['alias_bytes']) / GIB:.2f} | {flops_text} "
                f"| {_ratio(flops, bflops)} | {r['bytes_accessed'] / 1e9:.1f} "
                f"| {_ratio(r['bytes_accessed'], base.get('bytes_accessed'))} | {colls or '-'} "
                f"| {r['roofline_ms_v5e']:.1f} | {r['roofline_ms_v5p']:.1f} "
                f"| {_ratio(r['roofline_ms_v5e'], base.get('roofline_ms_v5e'))} |")
        if stale:
            lines.append(f"\nNot shown (cached from an earlier version of their program; recompiled by a rerun): "
                         f"{', '.join(stale)}.")
    if data.get("max_batch", {}).get(topology):
        lines.append("\n**Largest per-chip batch on a v5e chip**: accepted by the TPU compiler / and with "
                     "temp + args + outputs - aliases <= 16 GiB (`fits`)\n")
        lines.append("| shape | " + " | ".join(MAX_BATCH_CANDIDATES) + " |")
        lines.append("|---|" + "---|" * len(MAX_BATCH_CANDIDATES))

        def cell(result: dict | None) -> str:
            if not result:
                return "-"
            return str(result["max_batch"]) + ("+" if result.get("capped_at") else "")
        for name, row in data["max_batch"][topology].items():
            cells = [cell(row.get(c)) + (f" / {cell(row.get(c + '@total'))}" if c + "@total" in row else "")
                     for c in MAX_BATCH_CANDIDATES]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--smoke", action="store_true", help="one tiny shape (seconds)")
    grid.add_argument("--full", action="store_true", help="every shape and the largest-batch search")
    grid.add_argument("--extra", action="store_true",
                      help="every shape (the default grid + the extra shapes), without the largest-batch search")
    parser.add_argument("--max-batch-start", type=int, default=8,
                        help="the per-chip batch the largest-batch search probes first (default 8)")
    parser.add_argument("--max-batch", action="store_true", help="also search the largest per-chip batch")
    parser.add_argument("--max-batch-models", default=None,
                        help="comma-separated models the largest-batch search runs on: small, medium (default: "
                             "small; with --full both)")
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--only", default=None, help="comma-separated candidates")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into the grid")
    parser.add_argument("--recompute", action="store_true", help="ignore cached points")
    parser.add_argument("--table", action="store_true", help="print the table of the cached JSON (no compiling, "
                        "no libtpu needed)")
    args = parser.parse_args(argv)

    if args.table:
        data = load(args.out)
        shapes = SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES + FULL_EXTRA
        candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
        if args.only:
            candidates = tuple(c for c in candidates if c in args.only.split(","))
        print(table(data, args.topology, shapes, candidates))
        return data
    require_libtpu()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # before JAX starts: no TPU hardware is probed for
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    import jax

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target_tpu_kernels()
    mesh = mesh_for(args.topology)
    if args.smoke:
        shapes, candidates = SMOKE_SHAPES, SMOKE_CANDIDATES
    else:
        shapes, candidates = DEFAULT_SHAPES + (FULL_EXTRA if args.full or args.extra else []), CANDIDATES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    if args.only:
        candidates = tuple(c for c in candidates if c in args.only.split(","))
    data = load(args.out)
    data["meta"] = {"jax": jax.__version__, "topology": args.topology, "devices": int(mesh.devices.size),
                    "chips": {k: dict(zip(("peak_flops", "hbm_bytes_per_s", "hbm_bytes", "ici_bytes_per_s"), v))
                              for k, v in CHIPS.items()}}
    try:
        import libtpu  # noqa: F401  (version for the record)
        data["meta"]["libtpu"] = getattr(libtpu, "__version__", "?")
    except Exception:
        pass
    for shape in shapes:
        print(f"{shape.name}:", flush=True)
        entry = data.setdefault("points", {}).setdefault(args.topology, {}).setdefault(shape.key(),
                                                                                      {"shape": shape.name})
        if "auto_resolves_to" not in entry or args.recompute:
            entry["auto_resolves_to"] = resolved_auto(shape)
        for candidate in candidates:
            resolved = entry["auto_resolves_to"]["host"]
            if candidate == resolved and "auto" in entry and "failed" not in entry["auto"] and (
                    candidate not in entry or args.recompute):
                # mode="auto" is DPConfig(mode=<resolved>) with nothing else changed: the same program
                entry[candidate] = {**entry["auto"], "same_program_as": "auto"}
                continue
            run_point(data, args.out, args.topology, shape, candidate, mesh, args.recompute)
    if args.full or args.max_batch:
        models = (args.max_batch_models or ("small,medium" if args.full else "small")).split(",")
        unknown = set(models) - set(MAX_BATCH_MODELS)
        if unknown:
            raise SystemExit(f"--max-batch-models: unknown {sorted(unknown)}, expected some of "
                             f"{list(MAX_BATCH_MODELS)}")
        bases = [MAX_BATCH_MODELS[model](1024, 1) for model in models]
        for base in bases:
            row = data.setdefault("max_batch", {}).setdefault(args.topology, {}).setdefault(base.name, {})
            for candidate in MAX_BATCH_CANDIDATES:
                if args.only and candidate not in args.only.split(","):
                    continue
                for criterion in FIT_CRITERIA:   # row keys: "auto" (the compiler's verdict), "auto@total"
                    key = candidate if criterion == "compiler" else f"{candidate}@{criterion}"
                    if key not in row or args.recompute or row[key].get("criterion") != criterion:
                        row[key] = dict(max_batch(data, args.out, args.topology, base, candidate, mesh,
                                                  args.recompute, start=args.max_batch_start, criterion=criterion),
                                        criterion=criterion)
                        save(args.out, data)
    save(args.out, data)
    print(table(data, args.topology, shapes, candidates))
    return data


if __name__ == "__main__":
    main()
