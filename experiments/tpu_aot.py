"""TPU-pod evidence by ahead-of-time compilation: large-model ZeRO-3 Adam steps, DP against non-DP, on TPU slices.

No TPU is needed: libtpu compiles for a TPU topology on this CPU host (the set-up, its environment variables and the
libtpu lock are described in ``experiments/bench_compiled.py``; the HLO is read by ``experiments/hlo_text.py``).
Nothing runs; every number is read from the compiled TPU program of one training step.

Models (the project's own classes, real shapes, layers stacked and scanned, built by ``nnx.eval_shape``: no weight
is ever materialised):

* ``gpt2-xl``    ``GPT2Config`` 48 layers, d 1600, 25 heads, vocab 50257, T 1024 (1.56B parameters);
* ``gptj-6b``    GPT-J-6B's shape on the project's GPT-2 block: 28 layers, d 4096, 16 heads, MLP 16384, vocab 50400,
                 untied head, T 2048 (6.05B; GPT-J's rotary / parallel block are not modelled: the sizes are);
* ``llama2-7b``  ``LlamaConfig`` 32 layers, d 4096, MLP 11008, 32 heads, vocab 32000, T 2048 (6.74B);
* ``llama2-70b`` 80 layers, d 8192, MLP 28672, 64 heads / 8 KV heads, vocab 32000, T 2048 (69B), LoRA rank 8 on
                 q/k/v/o/gate/up/down (``peft.apply``); the frozen base weights are bf16 arguments of the step.

Not in the default run (``--cases``), the largest sizes: ``llama2-70b``, the 70B shape fully fine-tuned on
``v5p:4x4x8``, and ``gpt3-175b``, GPT-3's shape on the GPT-2 block (96 layers, d 12288, 96 heads, vocab 50257,
T 2048; 175B) on ``v5p:8x8x8`` (512 chips); ``--topology`` compiles them for another slice (the compiler refuses a
step larger than the chip: recorded with the bytes it needed).

The step (as ``dpzero_jax.train.Trainer`` builds it): gradient, cast to the fp32 master, constrained to the ZeRO-3
gradient layout, ``optax.adam`` update; parameters and Adam moments sharded by ``sharding.ShardingRules(zero=3)``
(fp32), activations bf16 (the model's ``dtype``), ``B`` examples per chip. ``nonprivate``: ``jax.value_and_grad`` of
the masked mean loss; ``dp``: ``private_value_and_grad`` with ``mode="auto"`` (``target="tpu"``, partitionable
noise). Strategy ``gspmd``: one ``jax.jit`` with the rules' shardings, the gradient traced in
``dpzero_jax.spmd.batch_sharded`` as the trainer does (activations split over the batch); ``gspmd-nohint``: the same
without it (what XLA's partitioner does unhinted); ``explicit``: ``sharding.explicit_*_gradient`` in ``shard_map``,
each weight gathered at its uses and again in the backward pass (the scanned models are planned by the program
front-end: one layer's slice of each stacked weight per iteration, :mod:`dpzero_jax.program.zero3`).
Mesh ``(data, fsdp)``: ``fsdp`` is the largest divisor of the device count for which every weight has a dimension
it divides (:func:`largest_fsdp`; GPT-2 XL's d = 1600 = 2^6 x 25 allows 64, so on 256 chips the mesh is data=4 x
fsdp=64: model states sharded 64 ways, batch over all 256).

Per point: ``memory_analysis()`` (argument / output / alias / temporary bytes per device; with ``--buffers`` also the
compiler's buffer assignment, read from its ``--xla_dump_to`` files as ``tpu_buffers.py`` does), ``cost_analysis()``
FLOPs, every collective of the optimised HLO (kind, count, bytes) and the largest ones by shape. Collectives twice:
as the program text holds them (static: one in the layer scan's body counted once) and per executed step (each
times the trip counts of the loops around it, read from the loops' conditions: ``hlo_text.multiplicities``; the
trip counts are recorded). ``cost_analysis()``'s FLOPs are static: a loop body's once; the matrix products' FLOPs
per executed step are also read from the HLO (``hlo_text.matmul_flops``: ``dot`` and ``convolution``
instructions, each times its computation's runs; elementwise work not counted). A point the
compiler refuses (a program larger than the chip's HBM) is recorded with the compiler's message and the used /
available bytes it states; ``--topology`` (e.g. ``v5p:4x4x8``: 95 GB chips) recompiles the same step where it fits.
The Pallas TPU kernels of ``dpzero_jax_kernels.ghost_norm`` are compiled (Mosaic, not interpreted) at GPT-2 XL widths
on one chip of the slice (``--kernels``).

::

    PYTHONPATH=$PWD ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/venv-tpu/bin/python experiments/tpu_aot.py          # all
    ... experiments/tpu_aot.py --cases gpt2-xl --variants nonprivate,dp --strategies gspmd
    ... experiments/tpu_aot.py --cases gpt2-xl --strategies gspmd --remat none   # recorded as gpt2-xl+remat-none
    ... experiments/tpu_aot.py --table          # the table of the JSON (no libtpu)

Results are cached per point in ``experiments/results/tpu_aot.json`` (``--recompute`` ignores the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_liveness  # noqa: E402  (JAX-free: reads the dumped program)
from bench_compiled import load, save  # noqa: E402  (a sibling script, imported without JAX)
from compiled_steps import CHIPS, peak_bytes, require_libtpu  # noqa: E402
from hlo_text import array_bytes, collective_shapes, loop_trip_counts, matmul_flops, parse_collectives  # noqa: E402
from tpu_aot_tables import buffer_table, gib, kernel_table, table  # noqa: E402
from tpu_buffers import read_dump  # noqa: E402

from dpzero_jax.aot import is_oom, refusal  # noqa: E402, F401  (JAX-free; refusal: tests read it here)
from dpzero_jax.shard_layout import DEFAULT_MIN_SHARD_ELEMENTS  # noqa: E402  (JAX-free: the library's rule)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tpu_aot.json")
VARIANTS = ("nonprivate", "dp")
# not in the default run: layer-wise clipping with each layer of the scanned stack its own group
# (DPConfig(groups="layer-wise", scan_groups="per-iteration"), computed by mode="fused": one backward pass); dp with
# the per-example gradients it book-keeps (a tied table, under remat's ghost) kept in bfloat16; dp and dp-layerwise
# with the space rule for the norms (norm_method="mixed"; auto is the time rule on a TPU); dp-layerwise with the
# per-example gradients fused book-keeps (a tied table's group) in bfloat16
EXTRA_VARIANTS = ("dp-layerwise", "dp-bf16", "dp-mixed", "dp-layerwise-mixed", "dp-layerwise-bf16")
# gspmd-nohint: the gspmd step traced without dpzero_jax.spmd.batch_sharded (what the partitioner does unhinted)
STRATEGIES = ("gspmd", "explicit", "gspmd-nohint")


@dataclasses.dataclass(frozen=True)
class Case:
    """One model on one TPU topology. ``config``: keyword arguments of ``GPT2Config`` / ``LlamaConfig``."""

    name: str
    family: str                 # "gpt2" | "llama"
    config: tuple               # ((key, value), ...): hashable
    T: int
    B: int                      # examples per chip
    topology: str
    lora_rank: int = 0          # > 0: LoRA on the default targets, base weights frozen (bf16 arguments)
    strategies: tuple = STRATEGIES


GPT2_XL = dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25)
GPTJ_6B = dict(vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, n_inner=16384,
               tie_word_embeddings=False)
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096)
LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096)
GPT3_175B = dict(vocab_size=50257, n_positions=2048, n_embd=12288, n_layer=96, n_head=96)
CASES = {
    "gpt2-xl": Case("gpt2-xl", "gpt2", tuple(GPT2_XL.items()), 1024, 1, "v5e:16x16",
                    strategies=("gspmd", "explicit", "gspmd-nohint")),
    "gptj-6b": Case("gptj-6b", "gpt2", tuple(GPTJ_6B.items()), 2048, 1, "v5e:16x16",
                    strategies=("gspmd", "explicit")),
    "llama2-7b": Case("llama2-7b", "llama", tuple(LLAMA2_7B.items()), 2048, 1, "v5e:16x16",
                      strategies=("gspmd", "explicit")),
    "llama2-70b-lora": Case("llama2-70b-lora", "llama", tuple(LLAMA2_70B.items()), 2048, 1, "v5p:4x4x8",
                            lora_rank=8, strategies=("gspmd", "explicit")),
    # the largest sizes: full fine-tuning of the 70B shape, and GPT-3's 175B shape (not in the default run)
    "llama2-70b": Case("llama2-70b", "llama", tuple(LLAMA2_70B.items()), 2048, 1, "v5p:4x4x8",
                       strategies=("gspmd", "explicit")),
    "gpt3-175b": Case("gpt3-175b", "gpt2", tuple(GPT3_175B.items()), 2048, 1, "v5p:8x8x8",
                      strategies=("gspmd", "explicit")),
}
DEFAULT_CASES = ("gpt2-xl", "gptj-6b", "llama2-7b", "llama2-70b-lora")


# ------------------------------------------------------------------------------------------------------------------
# Pure parts (no JAX): mesh choice, refusals, collectives, table.

def largest_fsdp(shapes, devices: int, min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS) -> int:
    """The largest divisor ``f`` of ``devices`` such that every shape of at least ``min_shard_elements`` elements
    has a dimension divisible by ``f`` (so ``sharding.weight_spec`` shards every weight ``f`` ways, none is left
    replicated). ``shapes``: tuples of ints."""
    big = [tuple(s) for s in shapes if math.prod(s) >= min_shard_elements]
    for f in sorted((d for d in range(1, devices + 1) if devices % d == 0), reverse=True):
        if all(any(size % f == 0 for size in shape) for shape in big):
            return f
    return 1


def largest_collectives(hlo_text: str, count: int = 6) -> list[dict]:
    """The ``count`` collectives of an HLO module with the largest output buffers: ``{"op", "bytes"}`` (the op with
    its result shape, layouts dropped), largest first."""
    found = [{"op": text[:300], "bytes": sum(array_bytes(text.split(" ", 1)[1] if " " in text else ""))}
             for text in collective_shapes(hlo_text)]
    return sorted(found, key=lambda item: -item["bytes"])[:count]


# ------------------------------------------------------------------------------------------------------------------
# Building and compiling (JAX with libtpu).

def build(case: Case, remat: str):
    """``(graphdef, abstract params, abstract frozen, trainable filter)`` (:func:`dpzero_jax.aot.abstract_model`);
    LoRA cases: the whole frozen base as bf16, its norm scales too."""
    import jax
    import jax.numpy as jnp

    from dpzero_jax import aot
    from dpzero_jax.models.gpt2 import GPT2Config
    from dpzero_jax.models.llama import LlamaConfig

    config = (GPT2Config if case.family == "gpt2" else LlamaConfig)(**dict(case.config), scan_layers=True, remat=remat)
    graphdef, params, frozen, trainable = aot.abstract_model(config, jnp.bfloat16, case.lora_rank)
    if case.lora_rank:
        frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
                              if jnp.issubdtype(x.dtype, jnp.floating) else x, frozen)
    return graphdef, params, frozen, trainable


def make_mesh(case: Case, *trees):
    import jax
    from jax.experimental import topologies

    from dpzero_jax import sharding

    devices = topologies.get_topology_desc(platform="tpu", topology_name=case.topology).devices
    fsdp = largest_fsdp([x.shape for x in jax.tree.leaves(trees)], len(devices))
    return sharding.make_mesh(sharding.MeshShape(data=len(devices) // fsdp, fsdp=fsdp), devices=devices)


def make_step(case: Case, variant: str, strategy: str, graphdef, trainable, params, rules, global_batch: int):
    """``step(params, opt_state, batch, key, mask, frozen) -> (params, opt_state, loss)``: the trainer's step
    (:func:`dpzero_jax.aot.training_step`) with the variant's gradient."""
    import dpzero_jax as dz
    from dpzero_jax import aot

    cfg = None
    if variant != "nonprivate":
        cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, mode="auto", target="tpu",
                          expected_batch_size=global_batch, noise_rng="partitionable")
    if variant in ("dp-layerwise", "dp-layerwise-mixed", "dp-layerwise-bf16"):
        cfg = cfg.replace(mode="fused", groups="layer-wise", scan_groups="per-iteration")
    if variant in ("dp-mixed", "dp-layerwise-mixed"):
        cfg = cfg.replace(norm_method="mixed")
    if variant in ("dp-bf16", "dp-layerwise-bf16"):
        cfg = cfg.replace(instantiated_dtype="bfloat16")
    return aot.training_step(graphdef, params, trainable, rules, cfg, strategy)


def compile_point(case: Case, variant: str, strategy: str, remat: str):
    """Lower and compile one step; returns ``(compiled, mesh, seconds (lower, compile))``."""
    from dpzero_jax import aot, sharding

    graphdef, params, frozen, trainable = build(case, remat)
    mesh = make_mesh(case, params, frozen)
    rules = sharding.ShardingRules(mesh, zero=3)
    global_batch = case.B * mesh.devices.size
    step, tx = make_step(case, variant, strategy, graphdef, trainable, params, rules, global_batch)
    lowered, lower_seconds = aot.lower_step(step, tx, rules, params, frozen, global_batch, case.T)
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, mesh, (lower_seconds, time.perf_counter() - start)


def measure(case: Case, variant: str, strategy: str, remat: str, dump: str | None = None) -> dict:
    """One point's figures; with ``dump`` (the directory ``--xla_dump_to`` names) also its buffer assignment."""
    compiled, mesh, seconds = compile_point(case, variant, strategy, remat)
    buffers = take_dump(dump) if dump else {}
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    collectives = parse_collectives(hlo)
    per_step = parse_collectives(hlo, executed=True)
    return {
        "mesh": f"data={mesh.shape['data']},fsdp={mesh.shape['fsdp']}",
        "temp_bytes": int(memory.temp_size_in_bytes),
        "peak_bytes": peak_bytes(memory),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "matmul_flops_per_step": matmul_flops(hlo),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "collectives": collectives,
        "collective_bytes": int(sum(c["bytes"] for c in collectives.values())),
        "collectives_per_step": per_step,
        "collective_bytes_per_step": int(sum(c["bytes"] for c in per_step.values())),
        "loop_trip_counts": loop_trip_counts(hlo),
        "largest_collectives": largest_collectives(hlo),
        "lower_seconds": round(seconds[0], 1),
        "compile_seconds": round(seconds[1], 1),
        **buffers,
    }


def start_dump() -> str:
    """A fresh directory the compiler dumps each step into (``--xla_dump_to``; call before JAX starts: XLA reads its
    flags once)."""
    dump = tempfile.mkdtemp(prefix="tpu_aot_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step").strip()
    return dump


def take_dump(dump: str) -> dict:
    """The last compiled step's buffer assignment (:func:`tpu_buffers.read_dump`), what is live at its replayed
    peak (:func:`hlo_liveness.summary`, ``liveness``) and the compiler's own list at its peak
    (:func:`hlo_liveness.compiler_peak`, ``compiler_peak``); the dump is emptied for the next."""
    buffers = read_dump(dump)
    buffers["liveness"] = hlo_liveness.summary(hlo_liveness.replay(dump))
    buffers["compiler_peak"] = hlo_liveness.compiler_peak(dump)
    clear_dump(dump)
    return buffers


def clear_dump(dump: str) -> None:
    for entry in os.listdir(dump):
        path = os.path.join(dump, entry)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def run_point(data: dict, path: str, case: Case, variant: str, strategy: str, remat: str, recompute: bool,
              dump: str | None = None) -> dict:
    points = data.setdefault("points", {})
    key = f"{case.name}/{strategy}/{variant}"
    if key in points and not recompute and points[key].get("failed") != "error":
        return points[key]
    print(f"compiling {key} on {case.topology} ...", flush=True)
    try:
        result = measure(case, variant, strategy, remat, dump)
        print(f"  temp {gib(result['temp_bytes'])} GiB, args {gib(result['argument_bytes'])} GiB, collectives "
              f"{result['collective_bytes'] / 1e6:.0f} MB static, "
              f"{result['collective_bytes_per_step'] / 1e9:.2f} GB per step, compile {result['compile_seconds']} s",
              flush=True)
    except Exception as error:  # a refusal is a result: recorded with the compiler's reason
        if dump:
            clear_dump(dump)   # a refused compile's files must not be read as the next point's
        text = str(error).strip()
        result = {"failed": "oom" if is_oom(error) else "error", "message": " ".join(text.split())[:3000]}
        result.update(refusal(text))
        print(f"  failed ({result['failed']}): {result['message'][:300]}", flush=True)
    result.update(topology=case.topology, remat=remat, T=case.T, examples_per_chip=case.B)
    points[key] = result
    save(path, data)
    return result


# GPT-2 XL widths: left [B, T, rows] (block input), right [B, T, cols] (output gradient), one example per chip
KERNEL_SHAPES = {"attn_qkv": (1600, 4800), "mlp_fc": (1600, 6400), "mlp_proj": (6400, 1600)}


def compile_kernels(topology: str, T: int = 1024, B: int = 1) -> dict:
    """Each Mosaic TPU kernel (``pallas_tpu``: Gram norm, ids Gram norm, instantiated norm, weighted sum) compiled
    for one chip of ``topology`` at GPT-2 XL widths, bf16 inputs; ``mosaic_calls``: the ``tpu_custom_call``s of the
    compiled HLO (a kernel lowered to plain XLA has none)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from dpzero_jax_kernels.ghost_norm import api

    device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    place = SingleDeviceSharding(device)

    def struct(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=place)

    ops = {}
    for name, (rows, cols) in KERNEL_SHAPES.items():
        left, right = struct((B, T, rows)), struct((B, T, cols))
        ops[f"gram/{name}"] = (lambda a, b: api.gram_sq_norm(a, b, implementation="pallas_tpu", interpret=False),
                               (left, right))
        ops[f"instantiated/{name}"] = (
            lambda a, b: api.instantiated_sq_norm(a, b, implementation="pallas_tpu", interpret=False), (left, right))
        ops[f"weighted_sum/{name}"] = (
            lambda a, b, c: api.weighted_sum(a, b, c, implementation="pallas_tpu", interpret=False),
            (left, right, struct((B,), jnp.float32)))
    ops["gram_ids/wte"] = (lambda a, b: api.gram_sq_norm(a, b, left_is_ids=True, implementation="pallas_tpu",
                                                         interpret=False),
                           (struct((B, T), jnp.int32), struct((B, T, 1600))))
    results = {}
    for name, (fn, args) in ops.items():
        shapes = " x ".join(f"{a.dtype}{list(a.shape)}" for a in args)
        try:
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            hlo = compiled.as_text()
            results[name] = {"shapes": shapes, "mosaic_calls": hlo.count("tpu_custom_call"),
                             "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                             "compile_seconds": round(time.perf_counter() - start, 1)}
        except Exception as error:
            results[name] = {"shapes": shapes, "failed": "error", "message": " ".join(str(error).split())[:1000]}
        print(f"kernel {name}: {results[name]}", flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {tuple(CASES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS + EXTRA_VARIANTS)} "
                             f"(default: {','.join(VARIANTS)})")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--topology", default=None, help="compile every case for this topology instead of its own "
                        "(e.g. v5p:4x4x8 where v5e refuses); recorded under '<case>@<topology>'")
    parser.add_argument("--remat", default="block", choices=("none", "block", "dots"))
    parser.add_argument("--kernels", action="store_true", help="compile the Pallas TPU kernels only")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the JSON's tables (no compiling, no libtpu)")
    parser.add_argument("--buffers", action="store_true", help="also read each step's buffer assignment from the "
                        "compiler's dump (--xla_dump_to): its preallocated temporary buffer and HBM total")
    args = parser.parse_args(argv)
    data = load(args.out)
    dump = None
    if not args.table:
        require_libtpu()
        if args.buffers:
            dump = start_dump()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        import jax

        data["meta"] = {"jax": jax.__version__, "chips": {k: {"hbm_bytes": v[2]} for k, v in CHIPS.items()}}
        if args.kernels:
            data["kernels"] = compile_kernels(args.topology or "v5e:16x16")
            save(args.out, data)
        else:
            for name in args.cases.split(","):
                case = CASES[name]
                if args.topology:
                    case = dataclasses.replace(case, name=f"{case.name}@{args.topology}", topology=args.topology)
                if args.remat != "block":   # the default is recorded under the case's own name
                    case = dataclasses.replace(case, name=f"{case.name}+remat-{args.remat}")
                for strategy in args.strategies.split(","):
                    if strategy not in case.strategies:
                        continue
                    for variant in args.variants.split(","):
                        run_point(data, args.out, case, variant, strategy, args.remat, args.recompute, dump)
    if dump:
        shutil.rmtree(dump, ignore_errors=True)
    print(table(data.get("points", {})))
    buffers = buffer_table(data.get("points", {}))
    if buffers:
        print()
        print(buffers)
    if data.get("kernels"):
        print()
        print(kernel_table(data["kernels"]))
    return data


if __name__ == "__main__":
    main()
