"""The steps ``bench_compiled.py`` compares, built and compiled ahead of time for a TPU slice, and what is read
from each compiled program.

``build`` makes the model of a :class:`Shape` (the bundled GPT-2 or Llama on Flax layers, optionally with LoRA
adapters); ``make_step`` the candidate's step (``nonprivate``, a ``dpzero_jax`` mode of :data:`DP_CANDIDATES` or
:data:`SHMAP_CANDIDATES`, or a peer: jax_privacy, optax); ``compile_candidate`` lowers and compiles it for a mesh of
TPU devices described by ``jax.experimental.topologies`` (nothing runs); ``measure`` reads memory, FLOPs, bytes,
collectives and a roofline step time from the compiled program, and counts the FLOPs of Pallas kernels from their
traced bodies (``cost_analysis`` sees none). The ahead-of-time set-up (libtpu in its own environment, the host
backend, the libtpu lock) is described in ``bench_compiled.py``; ``tpu_aot.py`` and ``tpu_buffers.py`` reuse these
pieces.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hlo_text import collective_shapes, large_buffers, parse_collectives  # noqa: E402  (a sibling module)

from dpzero_jax.aot import is_oom  # noqa: E402, F401  (JAX-free; bench_compiled imports it from here)

GIB = 1 << 30
# per chip: (peak FLOP/s at bf16, HBM bytes/s, HBM bytes, ICI bytes/s); see the module docstring for the source
CHIPS = {
    "v5e": (197e12, 819e9, 16 * GIB, 200e9),
    "v5p": (459e12, 2765e9, 95e9, 600e9),
}
INSTALL_HINT = ('libtpu is not installed: the TPU compiler is needed for this benchmark. Install the extra in a '
                'separate virtual environment: pip install -e ".[tpu-aot]" (jax[tpu] at the same version as jax, '
                'and jax-privacy).')


# ------------------------------------------------------------------------------------------------------------------
# Pallas kernels: FLOPs counted from the traced kernels.

def _dot_flops(eqn) -> int:
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contract_lhs)


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def _kernel_body_flops(jaxpr) -> int:
    """dot_general FLOPs of one execution of a kernel body (a ``cond``: its most expensive branch)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "cond":
            total += max((_kernel_body_flops(b.jaxpr) for b in eqn.params["branches"]), default=0)
        else:
            subs = list(_sub_jaxprs(eqn))
            scale = eqn.params.get("length", 1) if name == "scan" else 1
            total += scale * sum(_kernel_body_flops(s) for s in subs)
    return total


def pallas_flops(jaxpr, scale: int = 1) -> tuple[int, int]:
    """``(flops, calls)`` of the ``pallas_call``s in a jaxpr: kernel-body dot FLOPs times the grid size (an upper
    bound where the body is guarded by ``pl.when``). A ``scan`` multiplies by its length; a ``while`` counts once."""
    flops = calls = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            grid = eqn.params["grid_mapping"].grid
            flops += scale * math.prod(grid) * _kernel_body_flops(eqn.params["jaxpr"])
            calls += 1
            continue
        inner = scale * (eqn.params.get("length", 1) if name == "scan" else 1)
        subs = list(_sub_jaxprs(eqn))
        if name == "cond":
            subs = subs[:1]  # branches are alternatives; the engine's conds are not around kernels
        for sub in subs:
            f, c = pallas_flops(sub, inner)
            flops, calls = flops + f, calls + c
    return flops, calls


# ------------------------------------------------------------------------------------------------------------------
# Shapes and candidates.

@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    d: int
    heads: int
    T: int
    B: int                     # examples per chip
    tied: bool = True
    vocab: int = 50304
    lora_rank: int = 0         # > 0: LoRA adapters on every dense layer (peft.apply), only they are trained
    family: str = "gpt2"       # "gpt2": the bundled GPT2; "llama": models.Llama (both Flax layers, unrolled)
    kv_heads: int = 0          # llama: key/value heads (grouped-query attention)
    mlp: int = 0               # llama: the SwiGLU MLP's width

    def key(self) -> str:
        prefix = "" if self.family == "gpt2" else f"{self.family}-unrolled-kv{self.kv_heads}-mlp{self.mlp}-"
        return (prefix + f"L{self.n_layer}-d{self.d}-V{self.vocab}-T{self.T}-B{self.B}-"
                f"{'tied' if self.tied else 'untied'}" + (f"-lora{self.lora_rank}" if self.lora_rank else ""))


def small(T=1024, B=8, tied=True, n_layer=12, lora_rank=0, name=None):
    return Shape(name or f"gpt2-small{'' if n_layer == 12 else f'-{n_layer}L'} T{T} B{B}"
                 f"{'' if tied else ' untied'}{f' LoRA{lora_rank}' if lora_rank else ''}",
                 n_layer, 768, 12, T, B, tied, lora_rank=lora_rank)


def medium(T=1024, B=8, tied=True):
    return Shape(f"gpt2-medium T{T} B{B}{'' if tied else ' untied'}", 24, 1024, 16, T, B, tied)


def llama(T=1024, B=4):
    """A Llama-style decoder at GPT-2 small's width: 12 layers, d 768, 12 heads with 4 key/value heads, SwiGLU MLP
    2048, RMSNorm, rotary positions, untied head, vocabulary 32000 (`models.Llama`, Flax layers: the traced-program
    front end). Its layers are unrolled, like the GPT-2 shapes': ``cost_analysis()`` counts the body of a scanned
    layer loop once, not once per layer, so a scanned model's FLOPs and bytes would not be comparable."""
    return Shape(f"llama-style T{T} B{B}", 12, 768, 12, T, B, tied=False, vocab=32000, family="llama", kv_heads=4,
                 mlp=2048)


DP_CANDIDATES = {   # every DP candidate is configured with target="tpu" (the step is compiled for the TPU slice)
    "auto": dict(mode="auto"),
    "bk": dict(mode="bk"),
    "bk_mixed": dict(mode="bk", norm_method="mixed"),
    "bk_fastest": dict(mode="bk", norm_method="fastest"),
    "ghost": dict(mode="ghost"),
    "fused": dict(mode="fused", groups="layer-wise"),
    "vmap": dict(mode="vmap"),
    # the same model planned from its traced program instead of its dz.layers layer calls (dpzero_jax.program)
    "program_bk": dict(mode="bk", front_end="program"),
    "program_ghost": dict(mode="ghost", front_end="program"),
    # auto with the per-example gradients book-keeping instantiates kept in bfloat16 (DPConfig.instantiated_dtype)
    "auto_bf16": dict(instantiated_dtype="bfloat16"),
}
# Mosaic kernels cannot be partitioned by GSPMD: these run the engine per device inside ``jax.shard_map``
# (``clipped_grad_sum`` on the local examples, ``psum`` over the mesh, noise added once), the project's "explicit"
# data-parallel structure; ``bk_shmap`` is the same with XLA norms, to separate the kernel from the partitioning.
SHMAP_CANDIDATES = {
    "bk_shmap": dict(mode="bk"),
    "bk_pallas": dict(mode="bk", norm_kernel="pallas"),
}
PEERS = ("jax_privacy", "optax")


def require_libtpu():
    if importlib.util.find_spec("libtpu") is None:
        raise SystemExit(INSTALL_HINT)


def target_tpu_kernels():
    """The library picks Pallas kernels by ``jax.default_backend()`` (``cpu`` on this host); the program is compiled
    for TPU, so tell ``dpzero_jax_kernels.ghost_norm`` the target (else the kernels would be interpreted as XLA
    loops)."""
    from dpzero_jax_kernels.ghost_norm import api

    if getattr(api._family, "_bench_compiled_target", False):
        return
    original = api._family

    def family(implementation, backend):
        return original(implementation, backend or "tpu")

    family._bench_compiled_target = True
    api._family = family


def build(shape: Shape):
    """``(graphdef, abstract params, abstract rest, trainable filter)`` of the shape's model (no weights made)."""
    import jax
    from flax import nnx

    from dpzero_jax import peft
    from dpzero_jax.models.gpt2 import GPT2, GPT2Config
    from dpzero_jax.models.llama import Llama, LlamaConfig

    if shape.family == "llama":
        if shape.lora_rank:
            raise ValueError(f"{shape.name}: LoRA shapes are GPT-2 only here")
        llama_config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.d, intermediate_size=shape.mlp,
                                   num_hidden_layers=shape.n_layer, num_attention_heads=shape.heads,
                                   num_key_value_heads=shape.kv_heads, max_position_embeddings=max(2048, shape.T),
                                   tie_word_embeddings=shape.tied, scan_layers=False)
        graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Llama(llama_config, rngs=nnx.Rngs(0))),
                                           nnx.Param, ...)
        return graphdef, params, rest, nnx.Param

    config = GPT2Config(vocab_size=shape.vocab, n_positions=max(1024, shape.T), n_embd=shape.d,
                        n_layer=shape.n_layer, n_head=shape.heads, tie_word_embeddings=shape.tied)

    def make():
        model = GPT2(config, rngs=nnx.Rngs(0))
        if shape.lora_rank:
            model, trainable = peft.apply(model, "lora", rank=shape.lora_rank, key=jax.random.key(1))
            return model, trainable
        return model, nnx.Param

    trainable = nnx.Param
    if shape.lora_rank:
        # the filter is a plain object (not an array): build it once abstractly to obtain it
        holder = {}

        def make_keep():
            model, filt = make()
            holder["filter"] = filt
            return model

        model = nnx.eval_shape(make_keep)
        trainable = holder["filter"]
    else:
        model = nnx.eval_shape(lambda: make()[0])
    graphdef, params, rest = nnx.split(model, trainable, ...)
    return graphdef, params, rest, trainable


def make_step(candidate: str, graphdef, trainable, global_batch: int, mesh=None):
    """``step(params, rest, batch, seed) -> (losses [B], grads)`` for one candidate, on ``lm_objective``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dpzero_jax as dz
    from dpzero_jax.models.objectives import lm_objective

    def objective(params, rest):
        _, loss_fn = lm_objective(nnx.merge(graphdef, params, rest), trainable=trainable)
        return loss_fn

    if candidate == "nonprivate":
        def step(params, rest, batch, seed):
            loss_fn = objective(params, rest)

            def mean_loss(p):
                losses = loss_fn(p, batch)
                return jnp.mean(losses), losses

            (_, losses), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
            return losses, grads
        return step

    if candidate in DP_CANDIDATES:
        cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, target="tpu", **DP_CANDIDATES[candidate])

        def step(params, rest, batch, seed):
            losses, grads, _ = dz.private_value_and_grad(objective(params, rest), cfg)(
                params, batch, jax.random.key(seed))
            return losses, grads
        return step

    if candidate in SHMAP_CANDIDATES:
        from jax.sharding import PartitionSpec as P

        from dpzero_jax.engine import clipped_grad_sum

        cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, target="tpu", **SHMAP_CANDIDATES[candidate])
        axis = mesh.axis_names[0]

        def local(params, rest, batch):
            losses, summed, _ = clipped_grad_sum(objective(params, rest), cfg)(params, batch)
            return losses, jax.lax.psum(summed, axis)

        def step(params, rest, batch, seed):
            # check_vma=False as in dpzero_jax.sharding.explicit_gradient: with it on, the engine's (replicated)
            # probes would be marked varying and their cotangents -- the per-example output gradients, [B, T, V] for
            # the head -- all-reduced over the mesh (measured: 54 all-reduces, 5.5 GB at GPT-2 small T1024)
            losses, summed = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(axis)),
                                           out_specs=(P(axis), P()), check_vma=False)(params, rest, batch)
            std = dz.noise.noise_std(cfg.noise_multiplier, (cfg.max_grad_norm,))
            return losses, dz.noise.add_noise_and_normalise(summed, jax.random.key(seed), std, global_batch,
                                                            dz.noise.resolve_rng(cfg.noise_rng, cfg.target))
        return step

    if candidate == "jax_privacy":
        from jax_privacy.clipping import clipped_grad

        def step(params, rest, batch, seed):
            loss_fn = objective(params, rest)
            clipped = clipped_grad(lambda p, example: jnp.sum(loss_fn(p, example)), l2_clip_norm=1.0,
                                   batch_argnums=1, keep_batch_dim=True, return_values=True)
            summed, aux = clipped(params, batch)
            leaves, treedef = jax.tree.flatten(summed)
            keys = jax.random.split(jax.random.key(seed), len(leaves))
            noised = [(g + jax.random.normal(k, g.shape, g.dtype)) / global_batch for g, k in zip(leaves, keys)]
            return aux.values, jax.tree.unflatten(treedef, noised)
        return step

    if candidate == "optax":
        import optax

        def step(params, rest, batch, seed):
            loss_fn = objective(params, rest)

            def example_loss(p, example):
                return loss_fn(p, jax.tree.map(lambda x: x[None], example))[0]

            losses, per_example = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0))(params, batch)
            aggregate = optax.contrib.differentially_private_aggregate(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                                       seed=0)
            state = optax.contrib.DifferentiallyPrivateAggregateState(rng_key=jax.random.key(seed))
            grads, _ = aggregate.update(per_example, state, params)
            return losses, grads
        return step

    raise ValueError(f"unknown candidate {candidate!r}; expected nonprivate, one of {sorted(DP_CANDIDATES)}, "
                     f"{sorted(SHMAP_CANDIDATES)} or {PEERS}")


def mesh_for(topology: str):
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    return Mesh(np.array(topo.devices), ("data",))


def compile_candidate(candidate: str, shape: Shape, mesh):
    """Lower and compile one candidate for the mesh; returns ``(compiled, lowered jaxpr, seconds)``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    graphdef, params, rest, trainable = build(shape)
    n = mesh.devices.size
    global_batch = shape.B * n
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("data"))

    def abstract(tree, sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    args = (abstract(params, replicated), abstract(rest, replicated),
            {"input_ids": jax.ShapeDtypeStruct((global_batch, shape.T), jnp.int32, sharding=sharded)},
            jax.ShapeDtypeStruct((), jnp.uint32, sharding=replicated))
    step = make_step(candidate, graphdef, trainable, global_batch, mesh)
    params_sharding = jax.tree.map(lambda _: replicated, params)
    start = time.perf_counter()
    jitted = jax.jit(step, out_shardings=(sharded, params_sharding))
    jaxpr = jax.make_jaxpr(step)(*args) if candidate.endswith("pallas") else None
    lowered = jitted.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return compiled, jaxpr, (lowered_at - start, time.perf_counter() - lowered_at)


def resolved_auto(shape: Shape) -> dict:
    """What ``mode="auto"`` resolves to on this host and for one v5e chip: the same on the traced-program front end
    (book-keeping, or ghost where sites sit in remat regions; no memory budget)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dpzero_jax as dz
    from dpzero_jax.models.objectives import lm_objective

    graphdef, params, rest, trainable = build(shape)
    batch = {"input_ids": jax.ShapeDtypeStruct((shape.B, shape.T), jnp.int32)}
    cfg = dz.DPConfig(mode="auto", target="tpu")
    found = {}

    def trace(params, rest, batch):
        # every bundled model is built from Flax layers: the traced-program front end, whose auto uses no budget
        _, loss_fn = lm_objective(nnx.merge(graphdef, params, rest), trainable=trainable)
        found["host"] = found["v5e_chip"] = dz.explain_plan(loss_fn, cfg, params, batch).mode
        return 0

    jax.eval_shape(trace, params, rest, batch)
    return found


def peak_bytes(memory) -> int | None:
    """The compiler's own high-water mark of the program's HBM (arguments, outputs and temporaries live at once;
    it can differ from temp + arguments + outputs: module docstring, "temp and peak"); None where not reported."""
    return int(getattr(memory, "peak_memory_in_bytes", 0) or 0) or None


def measure(candidate: str, shape: Shape, mesh) -> dict:
    compiled, jaxpr, seconds = compile_candidate(candidate, shape, mesh)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    collectives = parse_collectives(hlo)
    logits_bytes = shape.B * shape.T * shape.vocab * 4
    result = {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "peak_bytes": peak_bytes(memory),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "generated_code_bytes": int(memory.generated_code_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "transcendentals": float(cost.get("transcendentals", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        # the compiler's own estimate; negative (meaningless) for these programs with libtpu 0.0.42: not used
        "optimal_seconds": float(cost.get("optimal_seconds", 0.0)),
        "collectives": collectives,
        "collective_bytes": int(sum(c["bytes"] for c in collectives.values())),
        "collective_shapes": [text[:400] for text in collective_shapes(hlo)],
        # instructions (outside fusions) with an output of at least half a per-chip f32 [B, T, V] logits buffer
        "logits_sized_buffers": large_buffers(hlo, logits_bytes // 2),
        "lower_seconds": round(seconds[0], 1),
        "compile_seconds": round(seconds[1], 1),
    }
    result["total_bytes"] = (result["temp_bytes"] + result["argument_bytes"] + result["output_bytes"]
                             - result["alias_bytes"])
    if jaxpr is not None:
        kernel_flops, calls = pallas_flops(jaxpr.jaxpr)
        result["pallas_flops"] = float(kernel_flops)
        result["pallas_calls"] = calls
    flops = result["flops"] + result.get("pallas_flops", 0.0)
    for chip, (peak, hbm, _, ici) in CHIPS.items():
        result[f"roofline_ms_{chip}"] = 1e3 * max(flops / peak, result["bytes_accessed"] / hbm,
                                                  result["collective_bytes"] / ici)
    return result

