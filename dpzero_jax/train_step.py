"""The trainer's compiled training step (used by :class:`dpzero_jax.train.Trainer`).

:func:`build_step` returns ONE jitted function ``step(params, opt_state, batch, noise_key, mask, frozen,
clip_state)`` that computes the gradient of the batch -- private (:func:`dpzero_jax.private_value_and_grad`, or the
``explicit`` strategy's ``shard_map``: :func:`explicit_gradient`), or with ``no_dp`` the plain mean loss over the
realised batch -- casts it to the fp32 master dtype, lays it out as the ZeRO stage says and applies the optax update.
Under a mesh it is jitted with the ZeRO stage's in / out shardings; the parameters and optimizer state are donated.

Also here: how host values become global arrays (:func:`to_global`), the cast of a batch's floating inputs to the
compute dtype and the frozen variables' storage dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpzero_jax import adaptive_clipping, models, sharding
from dpzero_jax.config import DPConfig
from dpzero_jax.engine import private_value_and_grad
from dpzero_jax.train_config import PRECISIONS, TrainConfig


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """What :func:`build_step` returns: the jitted ``step`` and, under a mesh, the parameters' and optimizer
    state's shardings it was jitted with (None without a mesh)."""

    step: Callable
    param_shardings: Any = None
    opt_shardings: Any = None


def to_global(value, sharding):
    """A global ``jax.Array`` with ``sharding`` from a value every process holds in full (host or device): each
    process transfers only the slices of its own devices (works across processes, unlike ``device_put``)."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return jnp.copy(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)   # already global: reshard collectively
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def cast_inputs(batch: dict, dtype) -> dict:
    """Floating-point inputs (images) in the compute dtype; integer arrays (token ids, masks, labels) unchanged."""
    return {k: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in batch.items()}


def matrices_in(frozen, dtype):
    """``frozen`` with its floating matrices (2-D and up: kernels, embedding tables) stored in ``dtype``.

    For the Llama family under ``--precision bf16|fp16``: built with that compute ``dtype``, its ``nnx.Linear`` /
    ``nnx.Embed`` layers cast every weight to it at use, so a frozen base model stored so gives the same logits with
    half the bytes (the trained parameters keep their fp32 masters). Vectors (norm scales, biases) stay as they are.
    GPT-2 and BERT sum their embeddings in fp32 before the cast, so theirs stay fp32 (not the same result)."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 else x
    return jax.tree.map(cast, frozen)


def frozen_arguments(cfg: TrainConfig, model, trainable, rules: sharding.ShardingRules | None):
    """``(by_argument, frozen, frozen_shardings)``: the model's frozen variables as the jitted functions take them.

    The frozen variables (a PEFT base model) enter the jitted functions as (sharded) arguments, not as constants
    folded into the program; a Llama in half precision holds its frozen matrices in it (:func:`matrices_in`). Under
    the explicit strategy they enter its ``shard_map`` as shards too, each gathered where the traced program uses
    it (:class:`dpzero_jax.frozen_shards.FrozenShards`). RMM's keyed loss (whose frozen state holds the step's sketch
    keys) keeps them captured: then ``by_argument`` is False and ``frozen`` is ``{}``. ``frozen_shardings``: None
    without a mesh (``rules``)."""
    by_argument = cfg.rmm == "none"
    frozen = models.frozen_state(model, trainable) if by_argument else {}
    if cfg.precision != "fp32" and isinstance(model, models.Llama):
        frozen = matrices_in(frozen, PRECISIONS[cfg.precision])
    shardings = None if rules is None else rules.params(frozen)
    frozen = jax.tree.map(jnp.asarray, frozen) if rules is None else jax.tree.map(to_global, frozen, shardings)
    return by_argument, frozen, shardings


def bind_frozen(fn, by_argument: bool):
    """``fn(params, x, frozen=...)`` -> ``bound(params, x, frozen)``: the frozen variables passed in when they are
    an argument of the jitted functions (``by_argument``), else ignored (``fn`` captured them)."""
    if not by_argument:
        return lambda params, x, frozen: fn(params, x)
    return lambda params, x, frozen: fn(params, x, frozen=frozen)


def explicit_gradient(loss_fn, dp_cfg: DPConfig | None, rules: sharding.ShardingRules, init_params, *,
                      adaptive: bool = False):
    """``gradient(params, batch, key, mask)`` of the ``explicit`` strategy (:mod:`dpzero_jax.sharding`): the
    private gradient for a ``dp_cfg``, the mean gradient for None (``no_dp``)."""
    if dp_cfg is None:
        return sharding.explicit_mean_gradient(loss_fn, rules, init_params)
    return sharding.explicit_private_gradient(loss_fn, dp_cfg, rules, init_params, adaptive=adaptive)


def build_step(cfg: TrainConfig, tx: optax.GradientTransformation, *, loss_fn, apply_fn, inputs, init_params,
               train_data: dict, rules: sharding.ShardingRules | None, frozen_by_argument: bool, frozen_shardings,
               noise_multiplier: float | None, adaptive: adaptive_clipping.AdaptiveClipping | None = None,
               canaries=None, loss_for_key=None) -> CompiledStep:
    """The jitted training step of a run.

    ``loss_fn(params, batch, frozen=None) -> losses [B]`` and ``apply_fn(params, x, frozen=None) -> logits``: the
    model's objective and forward (``frozen`` passed only when ``frozen_by_argument``); ``loss_for_key(noise_key)``:
    the step's loss when it depends on the step (RMM sketches), else ``loss_fn``. ``inputs``: the batch key(s) the
    model reads (``"image"``, ``"input_ids"`` or a tuple of keys). ``noise_multiplier``: the gradient's sigma (with
    adaptive clipping its share of the run's sigma; unused with ``no_dp``). ``canaries``: a privacy audit's seam
    (its ``insert`` becomes the engine's ``clipped_sum_hook``). ``rules``: the ZeRO stage's shardings, None without a
    mesh; ``frozen_shardings`` those of the frozen variables.

    The step: ``step(params, opt_state, batch, noise_key, mask [S], frozen, clip_state) -> (params, opt_state, loss,
    accuracy or perplexity, clip_state, fraction)``, ``S`` the batch's slots; ``clip_state`` is ``()`` or adaptive
    clipping's thresholds ``[M]``, returned updated with the released unclipped fractions ``[M]`` (else ``()``).
    """
    if loss_for_key is None:
        def loss_for_key(noise_key):
            return loss_fn

    def bind(fn):
        return bind_frozen(fn, frozen_by_argument)

    if cfg.no_dp:
        def gradient(params, batch, key, mask, frozen):
            def mean_loss(p):
                losses = bind(loss_for_key(key))(p, batch, frozen)
                w = mask.astype(losses.dtype)
                return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1.0), losses
            (_, losses), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
            return losses, grads
    else:
        dp_cfg = cfg.dp_config(noise_multiplier, expected_batch_size=cfg.batch_size, noise_rng="partitionable")

        hook = None if canaries is None else canaries.insert

        def gradient(params, batch, key, mask, frozen, *clip):   # clip: (thresholds [M],) with adaptive clipping
            loss = functools.partial(bind(loss_for_key(key)), frozen=frozen)
            losses, grads, stats = private_value_and_grad(loss, dp_cfg, clipped_sum_hook=hook)(
                params, batch, key, mask, thresholds=clip[0] if clip else None)
            return (losses, grads, stats.norms) if clip else (losses, grads)

    if rules is not None and cfg.strategy == "explicit":
        explicit = explicit_gradient(loss_fn, None if cfg.no_dp else dp_cfg, rules, init_params,
                                     adaptive=adaptive is not None)

        def gradient(params, batch, key, mask, frozen, *clip):   # frozen: sharded arguments of the shard_map
            return explicit(params, batch, key, mask, *clip, **({"frozen": frozen} if frozen_by_argument else {}))

    compute_dtype = PRECISIONS[cfg.precision]
    lm = cfg.task == "causal-lm"

    def model_inputs(batch):
        return batch[inputs] if isinstance(inputs, str) else {k: batch[k] for k in inputs}

    grad_shardings = None if rules is None else rules.grads(init_params)
    step_apply = bind(apply_fn)  # the training batch's accuracy after the update
    if rules is not None and cfg.strategy == "explicit":  # gathers layer by layer, as the gradient does
        explicit_apply = sharding.explicit_apply(apply_fn, rules, init_params)

        def step_apply(params, x, frozen):
            return explicit_apply(params, x, **({"frozen": frozen} if frozen_by_argument else {}))

    # GSPMD: the scanned models' activations split over the batch, each weight gathered where used, large tables'
    # clipped sums in pieces (spmd.py)
    hint = rules.gspmd_hint if rules is not None and cfg.strategy == "gspmd" else contextlib.nullcontext

    def step(params, opt_state, batch, noise_key, mask, frozen, clip_state):
        """``frozen``: the model's frozen variables (or ``{}``); ``clip_state``: ``()``, or adaptive clipping's
        thresholds ``[M]`` (returned updated, with the released unclipped fractions ``[M]``)."""
        batch = cast_inputs(batch, compute_dtype)
        with hint():
            if adaptive is None:
                losses, grads = gradient(params, batch, noise_key, mask, frozen)
                fraction = ()
            else:
                losses, grads, norms = gradient(params, batch, noise_key, mask, frozen, clip_state)
        if adaptive is not None:   # the update in units of the thresholds it was clipped with, then the rule
            grads = adaptive_clipping.normalize_update(grads, clip_state, adaptive)
            clip_state, fraction = adaptive_clipping.adapt(clip_state, norms, mask, noise_key, adaptive)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)  # fp32 master gradient
        if grad_shardings is not None:  # the ZeRO stage's gradient layout (reduce-scatter to the owners)
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        w = mask.astype(jnp.float32)
        count = jnp.maximum(jnp.sum(w), 1.0)
        loss = jnp.sum(jnp.where(mask, losses.astype(jnp.float32), 0.0)) / count
        if lm:  # causal LM: the batch's perplexity exp(loss) in place of an accuracy
            return params, opt_state, loss, jnp.exp(loss), clip_state, fraction
        correct = jnp.argmax(step_apply(params, model_inputs(batch), frozen), -1) == batch["label"]  # updated
        return params, opt_state, loss, jnp.sum(correct * w) / count, clip_state, fraction

    if rules is None:
        return CompiledStep(jax.jit(step, donate_argnums=(0, 1)))
    # GSPMD: one jit with the ZeRO stage's shardings; XLA inserts all-gathers and reduce-scatters
    opt_shape = jax.eval_shape(tx.init, init_params)
    batch_shape = {k: v[:1] for k, v in train_data.items()}
    param_shardings = rules.params(init_params)
    opt_shardings = rules.opt_state(opt_shape)
    jitted = jax.jit(step, donate_argnums=(0, 1),
                     in_shardings=(param_shardings, opt_shardings, rules.batch(batch_shape), rules.replicated,
                                   rules.batch(0), frozen_shardings, rules.replicated),
                     out_shardings=(param_shardings, opt_shardings, rules.replicated, rules.replicated,
                                    rules.replicated, rules.replicated))
    return CompiledStep(jitted, param_shardings, opt_shardings)
