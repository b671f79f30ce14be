"""Public pieces for a user's own training loop, shaped like their JAX neighbours.

* :func:`clipped_grad` -- the clipped SUM of per-example gradients with its L2 sensitivity (cf. ``jax.grad``,
  ``jax_privacy``'s ``clipped_grad``);
* :func:`gaussian_privatizer` -- the Gaussian mechanism and the division by the expected batch size as an
  ``optax.GradientTransformation``, so a DP step reads ``optax.chain(privatizer, optax.adamw(...))``;
* :func:`nnx_private_step` -- a ``(model, optimizer, batch, key)`` step for ``flax.nnx`` and ``nnx.Optimizer``.

Nothing here clips or draws noise by itself: clipping is :mod:`dpzero_jax.clipping` (through the engine's modes)
and the noise is :func:`dpzero_jax.noise.privatize`, the same call :func:`dpzero_jax.private_value_and_grad` makes.

A loop with the privatizer::

    grad_fn = jax.jit(dz.clipped_grad(loss_fn, cfg))
    tx = optax.chain(dz.gaussian_privatizer(sigma, cfg.max_grad_norm, expected_batch_size, key), optax.adamw(1e-3))
    opt_state = tx.init(params)
    for batch, mask in batches:
        out = grad_fn(params, batch, mask)
        updates, opt_state = tx.update(out.grad_sum, opt_state, params)
        params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpzero_jax import clipping, engine, noise
from dpzero_jax.config import DPConfig

Array = jax.Array


class ClippedGrad(NamedTuple):
    """What :func:`clipped_grad` returns.

    grad_sum: pytree like ``params``, ``sum_i mask_i C_{m,i} grad L_i`` (per group ``m``; no noise, no division).
    l2_sensitivity: float32 scalar ``||(R_1..R_M)||``: adding or removing one example moves ``grad_sum`` by at most
        this much in L2 (:func:`dpzero_jax.clipping.l2_sensitivity`; twice this under replace-one adjacency).
    thresholds: ``[M]`` the group thresholds ``R_m``.
    stats: :class:`dpzero_jax.DPStats` -- per-example norms and clip factors (``[B]``, or ``[B, M]`` with ``M > 1``
        groups), ``num_nonfinite``, ``num_included``.
    losses: ``[B]`` per-example losses.
    aux: the second output of ``loss_fn`` with ``has_aux=True`` (as ``loss_fn`` returned it), else ``None``.
    """

    grad_sum: Any
    l2_sensitivity: Array
    thresholds: Array
    stats: engine.DPStats
    losses: Array
    aux: Any = None


def clipped_grad(loss_fn: Callable, cfg: DPConfig, has_aux: bool = False) -> Callable:
    """The clipped sum of per-example gradients of ``loss_fn(params, batch) -> losses [B]``, sensitivity attached.

    Returns ``fn(params, batch, mask=None, *, thresholds=None) -> ClippedGrad``; ``mask``: ``[B]`` bool (padding of
    a Poisson batch; masked examples contribute nothing); ``thresholds``: ``[M]`` group thresholds for this call (a
    traced array is fine: adaptive clipping, :mod:`dpzero_jax.adaptive_clipping`), else the configured ones; the
    sensitivity follows them. The clipping follows ``cfg`` (``max_grad_norm``, ``clip_fn``, ``groups``,
    ``group_thresholds``, ``mode``, ...); ``cfg.noise_multiplier`` and ``cfg.expected_batch_size`` are NOT used --
    noise and normalisation are the privatizer's (:func:`gaussian_privatizer`). With ``has_aux=True`` ``loss_fn``
    returns ``(losses [B], aux)`` (aux: any pytree; computed by one extra plain forward call, see
    :func:`dpzero_jax.engine.split_aux`). Works under ``jax.jit``.
    """
    if not isinstance(cfg, DPConfig):
        raise TypeError(f"cfg must be a dpzero_jax.DPConfig, got {type(cfg).__name__}")
    losses_fn, aux_of = engine.split_aux(loss_fn, has_aux)

    def fn(params, batch, mask=None, *, thresholds=None) -> ClippedGrad:
        plan, result, stats = engine._clip(losses_fn, cfg, params, batch, mask, thresholds=thresholds)
        thresholds = jnp.asarray(plan.thresholds, jnp.float32)
        aux = aux_of(params, batch) if aux_of is not None else None
        return ClippedGrad(result.clipped_sum, clipping.l2_sensitivity(thresholds), thresholds, stats,
                           result.losses, aux)

    return fn


class GaussianPrivatizerState(NamedTuple):
    """State of :func:`gaussian_privatizer`: the base PRNG key (never changes) and the number of updates done
    (int32 scalar). Update ``t`` (0-based) draws its noise from ``jax.random.fold_in(key, t)``."""

    key: Array
    count: Array


def _positive(name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, jax.Array)) or jnp.ndim(value) != 0:
        raise ValueError(f"gaussian_privatizer: {name} must be a real scalar, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"gaussian_privatizer: {name} must be {'>= 0' if allow_zero else '> 0'} and finite, "
                         f"got {value!r}")
    return value


def gaussian_privatizer(noise_multiplier: float, l2_sensitivity: float, expected_batch_size: float,
                        key: Array, *, noise_rng: str = "auto") -> optax.GradientTransformation:
    """The Gaussian mechanism on a clipped gradient sum, as an ``optax.GradientTransformation``.

    ``update(grad_sum, state) -> ((grad_sum + std * N(0, I)) / expected_batch_size, state')`` leaf by leaf, with
    ``std = noise_multiplier * l2_sensitivity`` (float32) and the noise of update ``t`` drawn from
    ``jax.random.fold_in(key, t)`` by :func:`dpzero_jax.noise.privatize` -- the call
    :func:`dpzero_jax.private_value_and_grad` makes with its ``key``. Hence, by construction, update ``t`` equals
    ``private_value_and_grad(loss_fn, cfg)(params, batch, jax.random.fold_in(key, t), mask)[1]`` when the config
    has the same ``noise_multiplier``, ``expected_batch_size`` and ``noise_rng`` and ``l2_sensitivity`` is
    :attr:`ClippedGrad.l2_sensitivity` (``cfg.max_grad_norm`` with one group) -- bit for bit. It is also the
    trainer's convention (step keys ``fold_in(base, step)``).

    noise_multiplier: sigma (0: no noise, only the division). l2_sensitivity: the clipped sum's sensitivity
    ``||(R_1..R_M)||`` -- pass :attr:`ClippedGrad.l2_sensitivity` or the thresholds' norm; the noise is calibrated
    to it, so it must not be smaller than the clipping's. expected_batch_size: the divisor (the expected, not the
    realised, batch size: ``sampling_rate * N`` under Poisson sampling). key: a PRNG key (typed or raw ``uint32[2]``),
    kept in the state; the state's ``count`` picks each update's key. noise_rng: ``"blocked"``,
    ``"partitionable"`` or ``"auto"`` (by ``jax.default_backend()``; :func:`dpzero_jax.noise.resolve_rng`).
    Shapes: updates are any pytree of float arrays; the output has the same structure, shapes and dtypes.

    Accounting: every update is one application of the Gaussian mechanism with this ``noise_multiplier``; record it
    in a :class:`dpzero_jax.accounting.PrivacyLedger` (or use :func:`dpzero_jax.accounting.epsilon`).
    """
    noise_multiplier = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
    sensitivity = jnp.float32(_positive("l2_sensitivity", l2_sensitivity))
    expected_batch_size = _positive("expected_batch_size", expected_batch_size)
    if noise_rng not in noise.NOISE_RNG_OPTIONS:
        raise ValueError(f"gaussian_privatizer: noise_rng must be one of {noise.NOISE_RNG_OPTIONS}, got {noise_rng!r}")
    if not (isinstance(key, jax.Array) and (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                            or (key.dtype == jnp.uint32 and key.shape == (2,)))):
        raise ValueError(f"gaussian_privatizer: key must be a PRNG key (jax.random.key or PRNGKey), got "
                         f"{getattr(key, 'dtype', type(key).__name__)} {getattr(key, 'shape', '')}")

    def init(params):
        del params
        return GaussianPrivatizerState(key, jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        del params
        for leaf in jax.tree.leaves(updates):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(f"gaussian_privatizer: updates must be floating point, got a {leaf.dtype} leaf of "
                                 f"shape {leaf.shape}")
        step_key = jax.random.fold_in(state.key, state.count)
        noised = noise.privatize(updates, step_key, noise_multiplier, sensitivity, expected_batch_size, noise_rng)
        return noised, GaussianPrivatizerState(state.key, state.count + 1)

    return optax.GradientTransformation(init, update)


def nnx_private_step(loss_fn: Callable, cfg: DPConfig, *, has_aux: bool = False, wrt: Any = None,
                     jit: bool = True) -> Callable:
    """A DP training step for ``flax.nnx``: ``step(model, optimizer, batch, key, mask=None) -> (losses [B], stats)``
    (``((losses, aux), stats)`` with ``has_aux``).

    ``loss_fn(model, batch) -> losses [B]`` (or ``(losses, aux)``). The step splits ``model`` into the ``wrt``
    parameters (default ``nnx.Param``; the optimizer's ``wrt`` must be the same filter) and the rest, computes
    :func:`dpzero_jax.private_value_and_grad` with noise key ``key`` (clipping, noise and division as ``cfg``
    says), and applies ``optimizer.update(model, grads)`` in place -- ``optimizer`` is an ``nnx.Optimizer`` over any
    optax transformation (without a privatizer: the gradient is already private). ``jit=True`` wraps it in
    ``nnx.jit``. ``cfg.mode="vmap"`` is needed for layers other than ``dpzero_jax.layers``'s.

    The other way round also works: ``nnx.Optimizer(model, optax.chain(gaussian_privatizer(...), tx), wrt=...)``
    holds the privatizer's key in its state, and a step of your own applies ``optimizer.update(model, grad_sum)``
    with :func:`clipped_grad`'s sum.
    """
    from flax import nnx

    wrt = nnx.Param if wrt is None else wrt

    def step(model, optimizer, batch, key, mask=None):
        graphdef, params, rest = nnx.split(model, wrt, ...)
        merged = merged_loss(loss_fn, graphdef)

        def params_loss(params, batch):
            return merged(params, batch, rest)

        values, grads, stats = engine.private_value_and_grad(params_loss, cfg, has_aux=has_aux)(
            params, batch, key, mask)
        optimizer.update(model, grads)
        return values, stats

    return nnx.jit(step) if jit else step


def merged_loss(loss_fn: Callable, graphdef) -> Callable:
    """``loss(params, batch, rest) -> loss_fn(nnx.merge(graphdef, params, rest), batch)``: an NNX model's loss on
    its split state, as the private steps trace it. A model that updates its own state while it computes the loss
    -- ``nnx.Dropout`` drawing from its ``Rngs`` stream, ``nnx.BatchNorm`` updating batch statistics, in training
    mode -- cannot: the engine traces the loss abstractly and per example, and Flax refuses the update there
    (``TraceContextError``); the error says so instead."""
    from flax import errors as flax_errors
    from flax import nnx

    def loss(params, batch, rest):
        try:
            return loss_fn(nnx.merge(graphdef, params, rest), batch)
        except flax_errors.TraceContextError as error:
            raise ValueError(
                "the model updates its own state while computing the loss (e.g. nnx.Dropout drawing from its "
                "Rngs, or nnx.BatchNorm updating batch statistics, in training mode); the private step traces the "
                "loss per example and cannot carry such updates. Use model.eval() (or deterministic=True / "
                "use_running_average=True) for those layers, or remove them: batch statistics mix examples, which "
                "per-example clipping cannot bound") from error
    return loss
