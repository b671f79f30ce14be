"""The training steps ``bench_overhead.py`` compares and how one is measured: the GPT-2 workloads (``W1``-``W3``, the
quick smoke shape, GPT-2 small for a GPU), the non-private ``jax.value_and_grad`` step and one private step per
candidate (``dpzero_jax.private_value_and_grad`` in a mode, then ``optax``), each compiled with its trace, lower
and XLA compile times, its compiled memory and cost, and one timed step. Shared with ``profile_step.py``.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import dpzero_jax as dz
from dpzero_jax import engine

try:
    import psutil
except ImportError:  # optional: only the current-RSS column needs it
    psutil = None

MiB = 2**20
BASELINE = "non-DP"
DP_CANDIDATES = ("auto", "bk", "ghost", "fused", "vmap-mb1", "vmap-mb4", "vmap-mbB")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    batch_size: int
    vocab_size: int = 8192
    dtype: str = "float32"
    layers: str = "flax"           # "flax": the bundled GPT2 (Flax's layers); "dz.layers": GPT2(layers=DP_LAYERS)
    norm_method: str = "auto"      # DPConfig.norm_method of every DP candidate

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("layers", self.layers), ("norm_method", self.norm_method))
                        if v != Workload.__dataclass_fields__[k].default)
        return (f"{self.name}: n_layer={self.n_layer} n_embd={self.n_embd} n_head={self.n_head} T={self.seq_len} "
                f"B={self.batch_size} vocab={self.vocab_size} (untied head) params={self.dtype}{extra}")


WORKLOADS = {
    "W1": Workload("W1", n_layer=4, n_embd=512, n_head=8, seq_len=64, batch_size=16),
    "W2": Workload("W2", n_layer=4, n_embd=256, n_head=4, seq_len=512, batch_size=4),
    "W3": Workload("W3", n_layer=4, n_embd=256, n_head=4, seq_len=128, batch_size=16),
}
QUICK = Workload("quick", n_layer=2, n_embd=64, n_head=4, seq_len=32, batch_size=4, vocab_size=512)
GPT2_SMALL = Workload("gpt2-small", n_layer=12, n_embd=768, n_head=12, seq_len=256, batch_size=32,
                      vocab_size=50257, dtype="bfloat16")


# ----------------------------------------------------------------------------------------------------------------
# Candidates.

@dataclasses.dataclass
class Candidate:
    name: str
    description: str
    step: Callable                        # (params, opt_state, batch, key) -> (params, opt_state, loss)
    cfg: dz.DPConfig | None = None
    state: Any = None                     # this candidate's (params, opt_state)
    compiled: Any = None
    times: list[float] = dataclasses.field(default_factory=list)
    cpu_times: list[float] = dataclasses.field(default_factory=list)
    result: dict = dataclasses.field(default_factory=dict)


def dp_config(name: str, batch_size: int, norm_method: str = "auto", norm_kernel: str = "auto",
              target: str | None = None) -> dz.DPConfig:
    """The private candidate ``name``'s config; ``target``: ``DPConfig.target`` (None: this process's backend)."""
    common = dict(noise_multiplier=1.0, max_grad_norm=1.0, clip_fn="abadi", norm_method=norm_method,
                  norm_kernel=norm_kernel, target=target)
    if name in ("auto", "bk", "ghost"):
        return dz.DPConfig(**common, groups="all-layer", mode=name)
    if name == "fused":
        return dz.DPConfig(**common, groups="layer-wise", mode="fused")
    microbatch = {"vmap-mb1": 1, "vmap-mb4": 4, "vmap-mbB": batch_size}[name]
    return dz.DPConfig(**common, groups="all-layer", mode="vmap", microbatch_size=microbatch)


def describe_config(cfg: dz.DPConfig) -> str:
    extra = f", microbatch={cfg.microbatch_size}" if cfg.mode == "vmap" else ""
    return f"mode={cfg.mode}, groups={cfg.groups}{extra}"


def make_steps(loss_fn, optimizer, names: list[str], batch_size: int, norm_method: str = "auto",
               norm_kernel: str = "auto", target: str | None = None) -> list[Candidate]:
    def non_dp_step(params, opt_state, batch, key):
        del key  # same signature as the DP steps
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def dp_step(cfg):
        private_grad = dz.private_value_and_grad(loss_fn, cfg)

        def step(params, opt_state, batch, key):
            losses, grads, _ = private_grad(params, batch, key)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

        return step

    candidates = [Candidate(BASELINE, "jax.value_and_grad(mean loss)", non_dp_step)]
    for name in names:
        cfg = dp_config(name, batch_size, norm_method, norm_kernel, target)
        candidates.append(Candidate(name, describe_config(cfg), dp_step(cfg), cfg))
    return candidates


def resolve_auto(loss_fn, cfg: dz.DPConfig, params, batch) -> str:
    """What ``mode="auto"`` picks for this backend and these shapes, and on which front end (the engine's own
    choice, as :func:`dpzero_jax.explain_plan` reports it: a model not built from ``dz.layers`` layers is planned from
    its traced program)."""
    try:
        report = dz.explain_plan(loss_fn, cfg, params, batch)
        if report.mode == "vmap":
            resolved = engine.choose_mode(cfg, dz.make_plan(loss_fn, cfg, params, batch, require_supported=False))
            return f"vmap (microbatch={resolved.microbatch_size})"
    except Exception as error:  # an internal helper: report, do not fail the benchmark
        return f"? ({type(error).__name__}: {error})"
    return report.mode + ("" if report.front_end == "layers" else " (program front-end)")


# ----------------------------------------------------------------------------------------------------------------
# Measurements.

def memory_fields(compiled) -> dict:
    try:
        analysis = compiled.memory_analysis()
    except Exception as error:  # some backends do not implement it
        return {"memory_analysis_error": repr(error)}
    if analysis is None:
        return {"memory_analysis_error": "memory_analysis() returned None"}
    fields = {}
    for key in ("temp", "argument", "output", "alias", "generated_code"):
        value = getattr(analysis, f"{key}_size_in_bytes", None)
        fields[f"{key}_bytes"] = None if value is None else int(value)
    if fields["temp_bytes"] is not None and fields["argument_bytes"] is not None:
        fields["temp_plus_args_bytes"] = fields["temp_bytes"] + fields["argument_bytes"]
    return fields


def cost_fields(compiled) -> dict | None:
    """XLA's static cost estimate (flops, bytes accessed) -- loop bodies (vmap's scan) are counted once."""
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None
    return {k: float(cost[k]) for k in ("flops", "transcendentals", "bytes accessed") if k in cost}


def host_memory() -> dict:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    fields = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}
    if psutil is not None:
        fields["rss_now_bytes"] = psutil.Process(os.getpid()).memory_info().rss
    return fields


def device_memory() -> dict | None:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    return {k: int(v) for k, v in stats.items() if k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def compile_candidate(candidate: Candidate, params, optimizer, batch, key, donate_argnums=(0, 1)) -> None:
    """Give ``candidate`` its own training state and its compiled step; ``trace_lower_s`` (tracing, the engine's
    planning included), ``xla_compile_s`` and their sum ``compile_s`` go to its ``result``."""
    candidate.state = (jax.tree.map(jnp.copy, params), optimizer.init(params))
    start = time.perf_counter()
    lowered = jax.jit(candidate.step, donate_argnums=donate_argnums).lower(*candidate.state, batch, key)
    lowered_at = time.perf_counter()
    candidate.compiled = lowered.compile()
    candidate.result["trace_lower_s"] = lowered_at - start
    candidate.result["xla_compile_s"] = time.perf_counter() - lowered_at
    candidate.result["compile_s"] = time.perf_counter() - start


def run_step(candidate: Candidate, batch, key) -> tuple[float, float]:
    """One step; ``(wall-clock seconds, process CPU seconds)``."""
    params, opt_state = candidate.state
    start, start_cpu = time.perf_counter(), time.process_time()
    params, opt_state, loss = jax.block_until_ready(candidate.compiled(params, opt_state, batch, key))
    elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    candidate.state = (params, opt_state)
    if not bool(jnp.isfinite(loss)):
        raise FloatingPointError(f"{candidate.name}: non-finite loss {float(loss)}")
    return elapsed, elapsed_cpu


def make_workload(workload: Workload, seed: int = 0):
    config = dz.models.GPT2Config(vocab_size=workload.vocab_size, n_positions=workload.seq_len,
                                  n_embd=workload.n_embd, n_layer=workload.n_layer, n_head=workload.n_head,
                                  tie_word_embeddings=False)
    # A 16-bit workload computes in that dtype: Flax's Embed fixes its dtype when it is built (float32 here), so
    # casting the parameters afterwards alone would leave the whole model computing in float32.
    compute = None if workload.dtype == "float32" else workload.dtype
    if workload.layers == "dz.layers":   # the same computation and parameters from dz.layers
        from dpzero_jax.models.transformer import DP_LAYERS
        model = dz.models.GPT2(config, rngs=nnx.Rngs(seed), layers=DP_LAYERS, dtype=compute)
    else:
        model = dz.models.GPT2(config, rngs=nnx.Rngs(seed), dtype=compute)
    params, loss_fn = dz.models.lm_objective(model)
    ids = jax.random.randint(jax.random.key(seed + 1), (workload.batch_size, workload.seq_len), 0,
                             workload.vocab_size, dtype=jnp.int32)
    return params, loss_fn, {"input_ids": ids}


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def check_dtype(candidates, params, opt_state, batch, key) -> str | None:
    """``None`` if every candidate traces with these parameter dtypes, else the first error."""
    for candidate in candidates:
        try:
            jax.eval_shape(candidate.step, params, opt_state, batch, key)
        except Exception as error:
            return f"{candidate.name}: {type(error).__name__}: {error}"
    return None
