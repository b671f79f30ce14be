"""The engine: exact clipped per-example gradient sums in four modes on one registry of layer rules.

Entry points (re-exported by the package): :func:`private_value_and_grad`, :func:`per_example_grad_norms`,
:func:`make_plan`.

A call first *plans* (one abstract trace of the loss under a :class:`~dpzero_jax.tape.DiscoveryTape`): which layer
calls use which trainable leaves, shapes, tied weights, the parameter groups -- and it fails with the parameter's
path if a trainable leaf is used outside a supported layer. Then a mode computes, per example ``i`` and group ``m``,
the norm of the group's gradient and the clipped sum ``sum_i C_{m,i} g_{m,i}``:

* ``bk``    book-keeping: one backward pass to the layer outputs (no parameter gradients by autodiff), norms and
            clipped sums from the captured layer inputs and output gradients;
* ``ghost`` one forward, two pullbacks: norms through per-layer sinks, then the clipped sum through per-layer ports;
* ``fused`` one pullback; each layer (each site of the traced program) clips its own local groups in its custom
            backward;
* ``vmap``  per-example gradients by ``jax.vmap(jax.grad)``, ``microbatch_size`` examples at a time (the reference);
* ``auto``  the mode the cost model (:func:`choose_mode`) picks for this backend and these shapes.

Each mode is a file of :mod:`dpzero_jax.modes` (the program front-end's in :mod:`dpzero_jax.program`); the plan and
the helpers the modes share are in :mod:`dpzero_jax.layer_plan`. Noise and normalisation are in
:mod:`dpzero_jax.noise`, the clip functions and groups in :mod:`dpzero_jax.clipping`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import clipping, noise
from dpzero_jax.config import DPConfig
from dpzero_jax.layer_plan import (  # noqa: F401  (DPStats, Plan, make_plan, ...: re-exported, the engine's API)
    DPStats,
    Plan,
    UnsupportedParameterError,
    _batch_size,
    _call_params,
    _Clipped,
    _leaf_ids,
    _microbatches,
    check_inputs,
    leaf_paths,
    make_plan,
    misplaced_note,
    used_inputs,
    whole_shapes,
)
from dpzero_jax.modes.bk import _bk, bk_forward  # noqa: F401  (bk_forward: re-exported)
from dpzero_jax.modes.fused import _fused
from dpzero_jax.modes.ghost import _ghost
from dpzero_jax.modes.vmap import _vmap
from dpzero_jax_kernels import ghost_norm

Array = jax.Array

MODES: dict[str, Callable[..., _Clipped]] = {"bk": _bk, "ghost": _ghost, "fused": _fused, "vmap": _vmap}


def choose_mode(cfg: DPConfig, plan: Plan, backend: str | None = None,
                memory_budget_bytes: int | None = None) -> DPConfig:
    """The cost model behind ``mode="auto"``: a config with a concrete mode for this plan.

    Book-keeping needs no parameter gradient from autodiff and computes the clipped sum with the same
    contractions as the non-private weight gradient; its extra work is the norms (ghost or instantiated, whichever
    ``norm_method`` picks per layer). Measured on this project's CPU benchmark it is the fastest exact mode on
    every workload (per-example gradients one example at a time pay ``B`` full parameter-sized writes and reads:
    1.2-2.4x the non-private step). Its extra memory is at most the output gradient of every trainable layer, kept
    until the norms are known; when that exceeds ``memory_budget_bytes`` the ``ghost`` mode, which keeps none, is
    chosen instead.

    The default budget is a quarter of a GPU's memory when the target (``backend``, else ``cfg.target``) is this
    process's backend, and none (always ``bk``) on a CPU and on a TPU. On a TPU the compiler schedules the kept
    gradients away: compiled for a v5e chip (``experiments/bench_compiled.py``, GPT-2 small, T 1024, tied table)
    ``ghost`` holds as many temporaries as ``bk`` at 8 per chip (11.40 against 11.38 GiB) and 0.12 GiB fewer at 16
    (14.57 against 14.69 GiB), for 1.29x the FLOPs, while the output gradients count 4.4 GB at 8 per chip -- the
    quarter-of-memory rule picked ``ghost`` there for nothing. Pass ``mode="ghost"`` for the last example per chip
    (17 against 16 there). Programs with remat regions get ``ghost`` on the traced-program front-end whatever the
    target (book-keeping would keep what remat recomputes).
    """
    if cfg.mode != "auto":
        return cfg
    backend = backend or cfg.target or jax.default_backend()
    if memory_budget_bytes is None and backend == "gpu" and backend == jax.default_backend():
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        memory_budget_bytes = None if limit is None else limit // 4
    kept_output_grads = sum(math.prod(r.output_shape) * np.dtype(r.output_dtype).itemsize for r in plan.records)
    if memory_budget_bytes is not None and kept_output_grads > memory_budget_bytes:
        return cfg.replace(mode="ghost")
    return cfg.replace(mode="bk")


def resolve_target(cfg: DPConfig, mode: str | None = None) -> DPConfig:
    """``cfg`` with its target-dependent ``"auto"`` settings made concrete for ``cfg.target`` (``None``:
    ``jax.default_backend()``): ``norm_method`` and ``norm_kernel``; ``mode`` is :func:`choose_mode`'s (``mode``:
    the concrete mode once known, else ``cfg.mode``).

    ``norm_method="auto"`` is ``"fastest"`` for a TPU, ``"mixed"`` for a GPU, and on a CPU ``"fastest"`` for
    book-keeping, ``"mixed"`` for ghost and fused: the time rule counts an instantiated gradient as reused for the
    clipped sum, which only book-keeping does (measured on the CPU's overhead benchmark, neither rule is faster for
    ghost on both W2 and W3: 1.07 / 1.04x its non-private step with the time rule, 1.12 / 0.97x with the space
    rule; ghost and fused apply the time rule without reuse, ``pergrad.use_ghost(..., reuse=False)``, since their
    sums come from the weight path). Compiled for a v5e slice
    (``experiments/bench_compiled.py``, GPT-2 small, T 1024, 8 examples per chip, tied table), the time rule
    instantiates the long-sequence weights and the tied table and reuses them for the clipped sum: temporaries
    1.25x the non-private step's, FLOPs 1.00x, bytes accessed 1.25x, against 1.42x / 1.35x / 1.39x for the space
    rule. On the CPU (``experiments/bench_overhead.py``'s W2 and W3, where sequences are long against the widths; W1
    picks the same forms under both rules) it takes book-keeping's gradient from 0.99-1.01x to 0.88-0.92x the
    non-private one on the layers front-end and from 1.03-1.07x to 0.93-0.95x on the program front-end (GPT-2 from
    Flax layers), for up to 1.1x the space rule's temporaries. A gradient that book-keeping keeps for the sum is
    instantiated only within twice the operands its ghost norm keeps (``norm_rules.INSTANTIATION_MEMORY_BOUND``):
    without that bound ViT-B/16 at 32 images per v5e chip held 3.73x the non-private step's temporaries, with it
    1.60x (``docs/benchmarks/front_ends.md``). On GPUs the time rule was not measured, and
    the space rule keeps the per-example buffers small where device memory is the limit; ``"mixed"`` is the choice
    on a CPU too when memory is (the instantiated per-example gradients are ``B x`` their weights).
    """
    target = cfg.target or jax.default_backend()
    method = cfg.norm_method
    if method == "auto":
        book_keeping = (mode or cfg.mode) not in ("ghost", "fused")
        method = "fastest" if target == "tpu" or (target == "cpu" and book_keeping) else "mixed"
    return cfg.replace(norm_method=method, norm_kernel=ghost_norm.resolve(cfg.norm_kernel, target))


def resolve_for_mode(requested: DPConfig, mode: str) -> DPConfig:
    """``requested`` (the user's config) with its concrete ``mode`` and the target settings for that mode."""
    return resolve_target(requested, mode).replace(mode=mode)


def _check_mask(mask, batch_size):
    if mask is None:
        return jnp.ones((batch_size,), bool)
    mask = jnp.asarray(mask)
    if mask.shape != (batch_size,):
        raise ValueError(f"mask must have shape [B] = ({batch_size},), got {mask.shape}")
    if jnp.issubdtype(mask.dtype, jnp.inexact):
        raise TypeError(f"mask must be a boolean (or 0/1 integer) [B] array, True where the example counts; got "
                        f"dtype {mask.dtype} (it includes or excludes examples, it does not weight them)")
    return mask.astype(bool)


def _configured_front_end(cfg: DPConfig) -> str:
    """``"vmap"`` (the layers front-end's reference mode, any model), ``"layers"``, ``"program"`` or ``"auto"`` (the
    plan decides) from the config alone; refuses per-iteration scan groups with a mode or front-end that cannot
    compute them."""
    if cfg.scan_groups == "per-iteration" and cfg.mode not in ("fused", "auto"):
        raise ValueError(f"DPConfig.scan_groups='per-iteration' is computed by mode='fused' (or 'auto'), not "
                         f"mode={cfg.mode!r}")
    if cfg.mode == "vmap":
        return "vmap"
    if cfg.scan_groups == "per-iteration":
        if cfg.front_end == "layers":
            raise ValueError("DPConfig.scan_groups='per-iteration' splits the groups of scanned, stacked parameters; "
                             "it needs the traced-program front-end (front_end='auto' or 'program')")
        return "program"
    return cfg.front_end


def _front_end(cfg: DPConfig, plan: Plan, layout) -> str:
    """``"layers"`` or ``"program"`` for this config and plan; refuses what the program front-end cannot do."""
    wanted = _configured_front_end(cfg)
    if wanted == "vmap":
        return "layers"  # differentiates the loss itself: any model
    if wanted == "auto":
        wanted = "program" if plan.outside else "layers"
    if wanted == "layers":
        if plan.outside:
            raise UnsupportedParameterError(
                f"trainable parameters used outside a supported DP layer: {list(plan.outside)}"
                f"{misplaced_note(plan.misplaced)}, and DPConfig.front_end='layers'. Use front_end='auto' or "
                "'program' (any JAX model, mode 'bk', 'ghost', 'fused' or 'auto'), build the model from dpzero_jax "
                "layers, or use mode='vmap'.")
        return "layers"
    return "program"


def _program_clip(cfg: DPConfig, plan, params, batch, mask, layout=None) -> _Clipped:
    """Book-keeping, ghost or fused clipping on the traced program (:mod:`dpzero_jax.program`),
    ``microbatch_size`` at a time; with a ZeRO-3 ``layout`` on the shards, gathered at each use
    (:mod:`dpzero_jax.program.zero3`)."""
    from dpzero_jax.program import fused as program_fused
    from dpzero_jax.program import ghost as program_ghost
    from dpzero_jax.program import mode as program_mode

    run = {"ghost": program_ghost.program_ghost, "fused": program_fused.program_fused}.get(cfg.mode,
                                                                                          program_mode.program_bk)
    chunk = cfg.microbatch_size or plan.batch_size
    leaves = jax.tree.leaves(params)

    def cast(grads):
        return jax.tree.unflatten(jax.tree.structure(params),
                                  [g.astype(leaf.dtype) for g, leaf in zip(jax.tree.leaves(grads), leaves)])

    if chunk >= plan.batch_size:
        losses, grads, norms, coef = run(cfg, plan, params, batch, mask, layout=layout)
        return _Clipped(losses, cast(grads), norms, coef)
    chunks, chunk_mask, unsplit = _microbatches(batch, mask, chunk)

    def step(acc, inputs):
        losses, grads, norms, coef = run(cfg, plan, params, *inputs, layout=layout)
        return jax.tree.map(jnp.add, acc, grads), (losses, norms, coef)

    init = jax.tree.map(lambda leaf: jnp.zeros(np.shape(leaf), jnp.float32), params)
    acc, (losses, norms, coef) = jax.lax.scan(step, init, (chunks, chunk_mask))
    return _Clipped(unsplit(losses), cast(acc), unsplit(norms), unsplit(coef))


def _with_thresholds(plan, thresholds):
    """``plan`` with the group thresholds ``thresholds [M]`` (a traced array allowed: adaptive clipping,
    :mod:`dpzero_jax.adaptive_clipping`) in place of the configured ones; ``plan`` itself when None."""
    if thresholds is None:
        return plan
    thresholds = jnp.asarray(thresholds, jnp.float32)
    if thresholds.shape != (len(plan.group_names),):
        raise ValueError(f"thresholds must have shape [M] = ({len(plan.group_names)},) (one per group "
                         f"{plan.group_names}), got {thresholds.shape}")
    return dataclasses.replace(plan, thresholds=thresholds)


def _plan_and_run(loss_fn: Callable, cfg: DPConfig, params, batch, mask, layout=None, thresholds=None):
    """Plan with the configured front-end and run the mode: ``(plan, concrete config, clipped result)``.
    ``thresholds``: ``[M]`` group thresholds replacing the plan's (see :func:`_with_thresholds`)."""
    from dpzero_jax.program import mode as program_mode

    requested, cfg = cfg, resolve_target(cfg)
    plan_params = params if layout is None else whole_shapes(params, layout)
    program_plan, settled = _program_plan_first(loss_fn, cfg, plan_params, batch)
    if not settled:
        plan = _with_thresholds(make_plan(loss_fn, cfg, plan_params, batch, require_supported=False), thresholds)
        if _front_end(cfg, plan, layout) == "layers":
            mask = _check_mask(mask, plan.batch_size)
            concrete = resolve_for_mode(requested, choose_mode(cfg, plan).mode)
            return plan, concrete, MODES[concrete.mode](loss_fn, concrete, plan, params, batch, mask, layout=layout)
        if program_plan is None:
            program_plan = program_mode.plan_program(loss_fn, cfg, plan_params, batch, plan.paths, plan.batch_size)
    mask = _check_mask(mask, program_plan.batch_size)
    if thresholds is not None and program_plan.iterations:
        raise ValueError("thresholds given at call time (adaptive clipping) are not supported with "
                         "DPConfig.scan_groups='per-iteration'")
    program_plan = _with_thresholds(program_plan, thresholds)
    concrete = resolve_for_mode(requested, program_mode.concrete_mode(cfg, program_plan))
    return program_plan, concrete, _program_clip(concrete, program_plan, params, batch, mask, layout)


def _program_plan_first(loss_fn: Callable, cfg: DPConfig, params, batch):
    """``(program front-end plan or None, settled)``: where the program front-end may compute this config, its plan
    (one trace of the single-example loss), and whether that trace alone settles the front-end -- with
    ``front_end="program"``, per-iteration scan groups, or ``"auto"`` when no ``dpzero_jax`` layer is called and
    some parameter is used (each used leaf is then outside the layers: :func:`_front_end` would pick the program).
    Otherwise :func:`~dpzero_jax.layer_plan.make_plan` traces the loss for the layer tapes and :func:`_front_end`
    decides. Planning a standard model so traces its loss once instead of twice (the first trace of a loss in a
    process costs about what tracing the non-private step does)."""
    wanted = _configured_front_end(cfg)
    if wanted in ("vmap", "layers"):
        return None, False
    from dpzero_jax.program import mode as program_mode

    paths, batch_size = check_inputs(params, batch)
    if wanted == "program":
        return program_mode.plan_program(loss_fn, cfg, params, batch, paths, batch_size), True
    try:
        program_plan = program_mode.plan_program(loss_fn, cfg, params, batch, paths, batch_size)
    except Exception:   # noqa: BLE001 -- e.g. a loss that only traces on the whole batch: the layer tapes may take it
        return None, False   # (if the program front-end is chosen after all, its second trace raises the error)
    used = used_inputs(program_plan.closed)[:len(paths)]
    return program_plan, program_plan.layer_calls == 0 and any(used)


def _clip(loss_fn: Callable, cfg: DPConfig, params, batch, mask, layout=None,
          thresholds=None) -> tuple[Plan, _Clipped, DPStats]:
    """Plan, run the configured mode, and summarise: ``(plan, clipped result, stats)``. With a ``layout`` the plan
    is traced on the whole parameters' shapes (``layout.full``) and the mode on the shards. ``thresholds``: ``[M]``
    group thresholds given at call time (None: the configured ones); the returned plan carries them."""
    plan, _, result = _plan_and_run(loss_fn, cfg, params, batch, mask, layout, thresholds)
    mask = _check_mask(mask, plan.batch_size)
    nonfinite = jnp.logical_and(mask, jnp.logical_not(jnp.logical_and(
        jnp.isfinite(result.losses), jnp.all(jnp.isfinite(result.norms), axis=1))))
    squeeze = (lambda x: x[:, 0]) if result.norms.shape[1] == 1 else (lambda x: x)
    stats = DPStats(squeeze(result.norms), squeeze(result.coef), jnp.sum(nonfinite).astype(jnp.int32),
                    jnp.sum(jnp.logical_and(mask, jnp.logical_not(nonfinite))).astype(jnp.int32))
    return plan, result, stats


def clipped_grad_sum(loss_fn: Callable, cfg: DPConfig, *, layout=None) -> Callable:
    """The clipped per-example gradient SUM, no noise and no normalisation: ``fn(params, batch, mask=None) ->
    (losses [B], sum_i mask_i C_i grad L_i, stats: DPStats)`` (``cfg.noise_multiplier`` and
    ``expected_batch_size`` are not used). The building block of :func:`private_value_and_grad` and of the
    sharded strategies, which sum it over devices before adding noise once. ``thresholds``: ``[M]`` group
    thresholds for this call (a traced array is fine: adaptive clipping), else the configured ``R / sqrt(M)`` or
    ``group_thresholds``.

    ``layout`` (a :class:`~dpzero_jax.tape.ParamLayout`, inside ``jax.shard_map``): ``params`` are this device's
    shards; each layer gathers its weights just before use and the sum comes back as the owners' shards reduced over
    the ``fsdp`` axis (:class:`dpzero_jax.sharding.ShardLayout`). Not with ``mode="vmap"``.
    """
    if not isinstance(cfg, DPConfig):
        raise TypeError(f"cfg must be a dpzero_jax.DPConfig, got {type(cfg).__name__}")

    def clipped(params, batch, mask=None, *, thresholds=None):
        _, result, stats = _clip(loss_fn, cfg, params, batch, mask, layout, thresholds)
        return result.losses, result.clipped_sum, stats

    return clipped


def split_aux(loss_fn: Callable, has_aux: bool) -> tuple[Callable, Callable | None]:
    """``(losses-only loss, aux function or None)`` for ``loss_fn(params, batch) -> (losses [B], aux)``.

    The engine traces and differentiates the losses-only function; the aux comes from one more plain call of
    ``loss_fn`` on the same inputs (no tape, no gradient; under ``jax.jit`` it is dead code when unused).
    """
    if not has_aux:
        return loss_fn, None

    def losses_only(params, batch):
        out = loss_fn(params, batch)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            got = (f"a {type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else
                   f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else type(out).__name__)
            raise ValueError(f"has_aux=True: loss_fn must return a pair (losses [B], aux), got {got}")
        return out[0]

    def aux_of(params, batch):
        return loss_fn(params, batch)[1]

    return losses_only, aux_of


def private_value_and_grad(loss_fn: Callable, cfg: DPConfig, *, has_aux: bool = False,
                           clipped_sum_hook: Callable | None = None) -> Callable:
    """Transform ``loss_fn(params, batch) -> [B]`` into a differentially private gradient function.

    Returns ``fn(params, batch, key, mask=None) -> (losses [B], grads, stats: DPStats)`` with
    ``grads = (sum_i mask_i C_i grad L_i + sigma ||R|| N(0, I)) / expected_batch_size`` (paper 000, eq. 1), where
    the clip factors ``C_{m,i}`` are taken per group. ``key`` is the PRNG key of the noise (required, even with
    ``noise_multiplier=0``, so that the call signature never changes). Works under ``jax.jit``.

    ``loss_fn`` must compute each example's loss from that example alone -- no batch statistics (a batch norm in
    training mode), no mean or contrastive term over the batch inside it: ``grad L_i`` is what is clipped, and the
    sensitivity of the sum assumes that example ``i`` changes only its own term. ``mode="vmap"`` and the
    traced-program front-end evaluate it on one example at a time (a batch of one), so a loss that couples the
    examples is computed there as if each example were alone; through the ``dpzero_jax.layers`` layers' tapes, one
    example's gradient would carry the other examples' terms, and the clipping would no longer bound the sum's
    sensitivity. The engine does not check it: :func:`dpzero_jax.loss_check.check_per_example_loss` does, on a batch.

    ``thresholds``: ``[M]`` group thresholds for this call (a traced array is fine), in place of the configured
    ones; the noise scale follows them (``sigma * ||thresholds||``). Adaptive clipping
    (:mod:`dpzero_jax.adaptive_clipping`) passes its current thresholds here.

    ``has_aux=True``: ``loss_fn`` returns ``(losses [B], aux)`` and ``fn`` returns ``((losses, aux), grads, stats)``
    (as ``jax.value_and_grad(..., has_aux=True)`` does); see :func:`split_aux` for how the aux is computed.

    ``clipped_sum_hook(clipped_sum, key, plan) -> clipped_sum``: the one seam of a privacy audit
    (:mod:`dpzero_jax.audit`), called between the clipped sum and the noise with the noise key and the plan (its
    ``paths``, ``group_of`` and ``thresholds``); it adds the clipped contributions of the step's gradient canaries
    exactly, as examples of the batch would. ``None`` (default): nothing is added.
    """
    if not isinstance(cfg, DPConfig):
        raise TypeError(f"cfg must be a dpzero_jax.DPConfig, got {type(cfg).__name__}")
    losses_fn, aux_of = split_aux(loss_fn, has_aux)

    def private_grad(params, batch, key, mask=None, *, thresholds=None):
        if (cfg.noise_multiplier > 0 or clipped_sum_hook is not None) and not hasattr(key, "dtype"):
            raise TypeError(f"key must be a JAX PRNG key (jax.random.key(seed)): the noise is drawn from it; got "
                            f"{type(key).__name__}")
        plan, result, stats = _clip(losses_fn, cfg, params, batch, mask, thresholds=thresholds)
        divisor = cfg.expected_batch_size or plan.batch_size
        clipped_sum = result.clipped_sum
        if clipped_sum_hook is not None:
            clipped_sum = clipped_sum_hook(clipped_sum, key, plan)
        grads = noise.privatize(clipped_sum, key, cfg.noise_multiplier, clipping.l2_sensitivity(plan.thresholds),
                                divisor, noise.resolve_rng(cfg.noise_rng, cfg.target))
        if aux_of is not None:
            return (result.losses, aux_of(params, batch)), grads, stats
        return result.losses, grads, stats

    return private_grad


def per_example_grad_norms(loss_fn: Callable, params, batch, *, norm_method: str = "mixed",
                           mode: str = "bk", norm_kernel: str = "auto", front_end: str = "auto") -> Array:
    """``[B]`` exact L2 norms of the per-example gradients over all parameters (no clipping, no noise).

    ``mode="bk"`` uses the layer rules, or the traced program when parameters are used outside ``dpzero_jax``
    layers (``front_end``, as in :class:`DPConfig`); ``mode="ghost"`` needs ``dpzero_jax`` layers; ``mode="vmap"``
    computes per-example gradients. ``norm_kernel``: as in :class:`DPConfig`.
    """
    if mode not in ("bk", "ghost", "vmap"):
        raise ValueError(f"per_example_grad_norms: mode must be 'bk', 'ghost' or 'vmap', got {mode!r}")
    cfg = DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode=mode, norm_method=norm_method,
                   norm_kernel=norm_kernel, front_end=front_end)
    _, _, result = _plan_and_run(loss_fn, cfg, params, batch, None)
    return result.norms[:, 0]


def autotune(loss_fn: Callable, cfg: DPConfig, params, batch, key, *, mask=None, candidates=None,
             repeats: int = 3) -> DPConfig:
    """Time the exact candidates once compiled on these inputs and return the fastest as a concrete config.

    The alternative to ``choose_mode``'s cost model when a few extra compilations are affordable: candidates are
    ``bk``, ``ghost``, ``fused`` (when the groups allow it), ``vmap`` with microbatch 1 and the whole batch, or the
    given list of configs. Each is compiled, run once to warm up, then timed ``repeats`` times (median).
    """
    if cfg.mode != "auto":
        return cfg
    batch_size = _batch_size(batch)
    if candidates is None:
        candidates = [cfg.replace(mode="bk"), cfg.replace(mode="ghost"), cfg.replace(mode="fused"),
                      cfg.replace(mode="vmap", microbatch_size=1),
                      cfg.replace(mode="vmap", microbatch_size=batch_size)]
    best, best_time = None, math.inf
    failed = []
    for candidate in candidates:
        fn = jax.jit(private_value_and_grad(loss_fn, candidate))
        try:
            jax.block_until_ready(fn(params, batch, key, mask))
        except (ValueError, UnsupportedParameterError) as error:
            failed.append(f"{candidate.mode}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            continue  # e.g. fused with groups spanning layers
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(params, batch, key, mask))
            times.append(time.perf_counter() - start)
        elapsed = float(np.median(times))
        if elapsed < best_time:
            best, best_time = candidate, elapsed
    if best is None:
        raise ValueError("autotune: no candidate mode could run on this model and config")
    if best.mode == "vmap" and failed and all(c.mode == "vmap" for c in candidates
                                              if not any(f.startswith(c.mode + ":") for f in failed)):
        import warnings

        warnings.warn("autotune: falling back to mode='vmap' (per-example gradients instantiated: the slowest and "
                      "largest mode) because the other modes cannot run on this model: " + "; ".join(failed),
                      RuntimeWarning, stacklevel=2)
    return best
