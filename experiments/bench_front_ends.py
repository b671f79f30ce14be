"""The two front ends on the same model: GPT-2 from ``dz.layers`` layers planned from its layer calls
(``front_end="layers"``) and from its traced program (``front_end="program"``), and the bundled GPT-2 (Flax's own
layers: ``nnx.Embed``, ``nnx.Linear``, ``nnx.LayerNorm``, as a user writes a model; the program front-end, the only
one such a model has), each against its own non-DP step.

Same loss, same batch, same config (``noise_multiplier=1``, ``groups="all-layer"``, ``norm_method="auto"``); the
only difference is where the plan comes from. Per candidate: XLA compile time, ``cost_analysis()`` FLOPs and bytes,
``memory_analysis()`` temporary bytes, and the median step time over ``--rounds`` interleaved rounds, all against
the non-private step (``jax.value_and_grad`` of the mean loss) of the same process.

Default workload: W3 of ``bench_overhead.py`` (vocab 8192, untied head, 4 layers, width 256, 4 heads, T 128, B 16).
``--gpt2-small``: ``bench_overhead.py``'s GPT-2 small workload (vocab 50257, 12 layers, width 768, T 256, B 32,
bfloat16 parameters and computation; ``bk`` only), for a GPU.

``--model vit``: the bundled ViT (standard Flax layers: ``nnx.Conv`` patches, ``nnx.Linear`` /
``nnx.LayerNorm``, a bare class token and position table; the program front-end) against the same
ViT written here from ``dz.layers`` layers (:class:`DPLayerViT`: the layers front-end; and, as ``dz.layers program bk``,
planned from its traced program), each against its own non-DP step (ViT-S-like: 32 x 32 images, patches 4, width
128, 4 layers, B 32).

Run::

    python experiments/bench_front_ends.py            # writes experiments/results/bench_front_ends_cpu.json
    python experiments/bench_front_ends.py --model vit   # writes experiments/results/bench_front_ends_vit_cpu.json
    python experiments/bench_front_ends.py --quick    # a tiny model (smoke test)
    python experiments/bench_front_ends.py --gpt2-small   # on a GPU: writes bench_front_ends_gpu_gpt2small.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--tpu" in sys.argv:   # before JAX starts: the host backend, no TPU hardware probed for (bench_compiled.py)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dpzero_jax as dz  # noqa: E402
from dpzero_jax.models.transformer import DP_LAYERS, Block  # noqa: E402


class DPLayerViT(nnx.Module):
    """:class:`dpzero_jax.models.ViT`'s computation from ``dz.layers`` layers: ``image [B, H, W, C] -> logits``."""

    def __init__(self, c: dz.models.ViTConfig, *, rngs: nnx.Rngs):
        d = c.hidden_size
        self.patch_embed = dz.layers.PatchEmbed(c.patch_size, c.num_channels, d, rngs=rngs)
        self.cls_token = dz.layers.Embed(1, d, rngs=rngs)
        self.position = dz.layers.Embed(c.num_patches + 1, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, c.num_attention_heads, c.intermediate_size, causal=False,
                                      approximate_gelu=False, eps=c.layer_norm_eps, layers=DP_LAYERS, rngs=rngs)
                                for _ in range(c.num_hidden_layers)])
        self.ln = dz.layers.LayerNorm(d, eps=c.layer_norm_eps)
        self.head = dz.layers.Linear(d, c.num_classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patch_embed(images)                                          # [B, N, d]
        batch, length = x.shape[:2]
        x = jnp.concatenate([self.cls_token(jnp.zeros((batch, 1), jnp.int32)), x], axis=1)
        x = x + self.position(jnp.broadcast_to(jnp.arange(length + 1), (batch, length + 1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))


def _gpt2_candidates(quick: bool, gpt2_small: bool = False):
    """``({name: (fn, args, baseline name)}, title)`` for the bundled GPT-2 (Flax layers: the program front-end) and
    the same model from ``dz.layers`` layers (``dz.layers ...``: both front ends), each against its own non-DP step."""
    dtype = jnp.float32
    if quick:
        vocab, layers, width, heads, seq, batch_size = 64, 2, 32, 2, 16, 4
    elif gpt2_small:   # bench_overhead.py's --gpt2-small workload (for a GPU)
        vocab, layers, width, heads, seq, batch_size, dtype = 50257, 12, 768, 12, 256, 32, jnp.bfloat16
    else:
        vocab, layers, width, heads, seq, batch_size = 8192, 4, 256, 4, 128, 16
    config = dz.models.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                                  tie_word_embeddings=False)
    batch = {"input_ids": jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch_size, seq)), jnp.int32)}
    key = jax.random.key(0)
    modes = ("bk",) if gpt2_small else ("bk", "ghost")
    candidates = {}
    compute = None if dtype == jnp.float32 else dtype     # a 16-bit model computes in 16 bits (not only stores)
    for label, model, front_ends in (("", dz.models.GPT2(config, rngs=nnx.Rngs(0), dtype=compute), ("program",)),
                                     ("dz.layers ", dz.models.GPT2(config, rngs=nnx.Rngs(0), layers=DP_LAYERS,
                                                               dtype=compute), ("layers", "program"))):
        params, loss_fn = dz.models.lm_objective(model)
        params = jax.tree.map(lambda x: x.astype(dtype), params)
        base = f"{label}non-DP"
        candidates[base] = (jax.jit(jax.value_and_grad(lambda p, b, f=loss_fn: jnp.mean(f(p, b)))), (params, batch),
                            base)
        for front_end in front_ends:
            for mode in modes:
                cfg = dz.DPConfig(noise_multiplier=1.0, mode=mode, front_end=front_end,
                                  expected_batch_size=batch_size)
                candidates[f"{label}{front_end} {mode}"] = (jax.jit(dz.private_value_and_grad(loss_fn, cfg)),
                                                            (params, batch, key), base)
    title = (f"GPT-2 vocab {vocab}, {layers} layers, width {width}, T {seq}, B {batch_size} (untied head), "
             f"{jnp.dtype(dtype).name} parameters")
    return candidates, title


def _vit_candidates(quick: bool, tpu_chips: int = 0):
    """The bundled ViT (Flax layers) and :class:`DPLayerViT`, each with its own non-DP step; for a TPU slice of
    ``tpu_chips`` chips, ViT-B/16 at 224 x 224 with 32 images per chip."""
    if tpu_chips:
        config = dz.models.ViTConfig(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072, num_classes=1000)
        batch_size = 32 * tpu_chips
    elif quick:
        config = dz.models.ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
        batch_size = 4
    else:
        config = dz.models.ViTConfig(image_size=32, patch_size=4, hidden_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, intermediate_size=512)
        batch_size = 32
    shape = (batch_size, config.image_size, config.image_size, config.num_channels)
    if tpu_chips:
        batch = {"image": jax.ShapeDtypeStruct(shape, jnp.float32),
                 "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}
    else:
        rng = np.random.default_rng(0)
        batch = {"image": jnp.asarray(rng.standard_normal(shape), jnp.float32),
                 "label": jnp.asarray(rng.integers(0, config.num_classes, batch_size), jnp.int32)}
    key = jax.random.key(0)
    candidates = {}
    build = nnx.eval_shape if tpu_chips else (lambda make: make())
    for label, model in (("flax", build(lambda: dz.models.ViT(config, rngs=nnx.Rngs(0)))),
                         ("dz.layers", build(lambda: DPLayerViT(config, rngs=nnx.Rngs(0))))):
        params, loss_fn = dz.models.classification_objective(model)
        base = f"{label} non-DP"
        candidates[base] = (jax.jit(jax.value_and_grad(lambda p, b, f=loss_fn: jnp.mean(f(p, b)))), (params, batch),
                            base)
        # compiled for a TPU from this host: the TPU's settings (norm rule, noise), not the host backend's
        target = "tpu" if tpu_chips else None
        for mode in ("auto", "bk", "ghost", "vmap"):
            cfg = dz.DPConfig(noise_multiplier=1.0, mode=mode, expected_batch_size=batch_size, target=target)
            candidates[f"{label} {mode}"] = (jax.jit(dz.private_value_and_grad(loss_fn, cfg)), (params, batch, key),
                                             base)
        if label == "dz.layers":   # the same layers planned from the traced program: the front end's own share
            cfg = dz.DPConfig(noise_multiplier=1.0, mode="bk", front_end="program", expected_batch_size=batch_size,
                              target=target)
            candidates["dz.layers program bk"] = (jax.jit(dz.private_value_and_grad(loss_fn, cfg)),
                                                  (params, batch, key), base)
    title = (f"ViT {config.image_size}x{config.image_size}, patches {config.patch_size}, width {config.hidden_size}, "
             f"{config.num_hidden_layers} layers, B {batch_size}{f' on {tpu_chips} TPU chips' if tpu_chips else ''}: "
             "Flax layers (program front-end) and dz.layers layers "
             "(layers front-end), each against its own non-DP step")
    return candidates, title


DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_front_ends_cpu.json")


def _on_mesh(tree, mesh):
    """Abstract arguments for ``mesh``: arrays with a leading batch axis (the batch's) split over ``data``, the
    parameters and the key replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params, batch, *key = tree
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def abstract(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    out = (jax.tree.map(lambda x: abstract(x, replicated), params), jax.tree.map(lambda x: abstract(x, split), batch))
    return out + tuple(abstract(jax.eval_shape(lambda k=k: k), replicated) for k in key)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpt2-small", action="store_true",
                        help="GPT-2 small (vocab 50257, 12 layers, width 768, T 256, B 32, bfloat16; for a GPU)")
    parser.add_argument("--model", choices=("gpt2", "vit"), default="gpt2")
    parser.add_argument("--tpu", metavar="TOPOLOGY", default=None,
                        help="compile for a TPU slice (e.g. v5e:2x2; needs libtpu, no TPU): compiled sizes only, "
                             "ViT-B/16 (--model vit only), data parallel")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.tpu and args.model != "vit":
        parser.error("--tpu compiles the ViT comparison only (--model vit)")
    if args.gpt2_small and (args.quick or args.model != "gpt2"):
        parser.error("--gpt2-small is GPT-2's full-size workload: not with --quick or --model vit")
    if args.model == "gpt2" and args.out == DEFAULT_OUT and (args.gpt2_small or jax.default_backend() != "cpu"):
        args.out = DEFAULT_OUT.replace("_cpu", f"_{jax.default_backend()}{'_gpt2small' if args.gpt2_small else ''}")
    if args.model == "vit" and args.out == DEFAULT_OUT:
        suffix = f"vit_tpu_{args.tpu.replace(':', '_')}" if args.tpu else "vit_cpu"
        args.out = DEFAULT_OUT.replace("front_ends_cpu", f"front_ends_{suffix}")
    mesh = None
    if args.tpu:
        from bench_compiled import mesh_for, require_libtpu

        require_libtpu()
        mesh = mesh_for(args.tpu)
        candidates, title = _vit_candidates(args.quick, tpu_chips=mesh.devices.size)
        candidates = {name: (fn, _on_mesh(fn_args, mesh), base) for name, (fn, fn_args, base) in candidates.items()}
    elif args.model == "vit":
        candidates, title = _vit_candidates(args.quick)
    else:
        candidates, title = _gpt2_candidates(args.quick, args.gpt2_small)
    rows, compiled = {}, {}
    print(title)
    for name, (fn, fn_args, _) in candidates.items():
        start = time.perf_counter()
        compiled[name] = fn.lower(*fn_args).compile()
        cost = compiled[name].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows[name] = {"compile_s": time.perf_counter() - start, "flops": float(cost.get("flops", 0)),
                      "bytes": float(cost.get("bytes accessed", 0)),
                      "temp_bytes": int(compiled[name].memory_analysis().temp_size_in_bytes)}
        if mesh is None:
            jax.block_until_ready(compiled[name](*fn_args))
    rounds = 0 if mesh is not None else args.rounds   # compiled for TPU: not run
    times = {name: [] for name in candidates}
    for r in range(rounds):
        names = list(candidates)[r % len(candidates):] + list(candidates)[:r % len(candidates)]
        for name in names:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*candidates[name][1]))
            times[name].append(time.perf_counter() - start)
    print(f"{'candidate':<18} {'compile s':>9} {'x FLOPs':>8} {'x bytes':>8} {'x temp':>7} {'step ms':>9} "
          f"{'x step':>7}")
    for name, row in rows.items():
        base_name = candidates[name][2]
        base = rows[base_name]
        row["baseline"] = base_name
        row["step_s"] = statistics.median(times[name]) if rounds else None
        row["step_ratio"] = (statistics.median(t / b for t, b in zip(times[name], times[base_name])) if rounds
                             else None)
        step_ms, step_ratio = (1e3 * row["step_s"], row["step_ratio"]) if rounds else (float("nan"), float("nan"))
        print(f"{name:<18} {row['compile_s']:>9.1f} {row['flops'] / base['flops']:>8.3f} "
              f"{row['bytes'] / base['bytes']:>8.3f} {row['temp_bytes'] / base['temp_bytes']:>7.3f} "
              f"{step_ms:>9.1f} {step_ratio:>7.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"backend": args.tpu or jax.default_backend(), "model": args.model, "quick": args.quick,
                   "rounds": args.rounds, "title": title, "rows": rows, "load_avg": os.getloadavg()}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
