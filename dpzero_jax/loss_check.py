"""A check that ``loss_fn(params, batch) -> [B]`` computes each example's loss from that example alone.

The sensitivity of the clipped gradient sum assumes that example ``i`` changes only its own term ``L_i``
(:func:`dpzero_jax.private_value_and_grad`). A loss with batch statistics (a batch norm in training mode), a mean
over the batch or a contrastive term couples the examples: through the ``dpzero_jax.layers`` layers' tapes one
example's clipped gradient then carries the others' terms, and the traced-program front-end and ``mode="vmap"``
(which evaluate the loss on one example at a time) train a different loss than the one written, without a word.
The engine cannot see this from the program, so it is checked on data, by :func:`check_per_example_loss`:

1. **values**: ``loss_fn(params, batch)[i]`` against ``loss_fn(params, batch[i:i+1])[0]`` for every example, the
   latter evaluated as the engine's per-example front-ends do (``jax.vmap`` over batches of one);
2. **gradients**: ``grad sum_i w_i L_i`` of the batched loss against the same weighted sum of the single-example
   losses, with random weights ``w`` (one backward pass each, compiled with the values of 1): a term that couples
   the examples only in its gradient (its value zero, e.g. ``m - stop_gradient(m)`` with ``m`` a batch mean) shows
   there.

Examples whose loss is not finite are left out of the gradient check (the engine gives them coefficient 0); a
non-finite loss on one side and a finite one on the other fails the value check. Where a finite loss has a
non-finite gradient (a square root at 0), the two gradients are compared where both are finite and must be
non-finite at the same places. A loss that draws random numbers (dropout) differs between a batch and one example
without coupling them: check it with the randomness turned off. One batch is evidence, not a proof: a loss that
couples examples only on some inputs passes on others.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax.engine import split_aux
from dpzero_jax.layer_plan import check_inputs, check_losses
from dpzero_jax.modes.vmap import one_example_loss

SHOWN = 3   # examples or leaves named in the error message


class CoupledLossError(ValueError):
    """``loss_fn`` couples the examples of the batch (raised by :func:`check_per_example_loss`)."""


def single_example_losses(loss_fn: Callable) -> Callable:
    """``fn(params, batch) -> [B]``: each example's loss computed on a batch of one (``jax.vmap`` over examples),
    as ``mode="vmap"`` and the traced-program front-end evaluate ``loss_fn``."""
    return jax.vmap(one_example_loss(loss_fn), in_axes=(None, 0))


def check_per_example_loss(loss_fn: Callable, params, batch, *, has_aux: bool = False, rtol: float | None = None,
                           atol: float = 1e-6, key: jax.Array | None = None) -> None:
    """Raise :class:`CoupledLossError` (a ``ValueError``) if ``loss_fn`` couples the examples of ``batch`` (see the
    module docstring); return ``None`` if each example's loss and its gradient are the same on the batch and alone.

    params: the pytree ``loss_fn`` differentiates, batch: a pytree of arrays ``[B, ...]`` with at least two
    examples, ``has_aux``: ``loss_fn`` returns ``(losses [B], aux)`` (the aux is not compared) -- as for
    :func:`dpzero_jax.private_value_and_grad`. ``rtol`` / ``atol``: how far the batched and the single-example
    evaluations may differ from floating-point reordering alone (losses elementwise; gradients by the norm of their
    difference against ``rtol * ||gradient|| + atol``, leaf by leaf); ``rtol`` by default ``max(1e-4, 4 eps)`` of
    the narrowest floating-point type among the losses and the parameters (1e-4 in float32, 0.031 in bfloat16,
    0.0039 in float16). ``key``: the PRNG key of the gradient check's weights (default ``jax.random.key(0)``).
    Costs two compiles of the forward and backward pass, at the batch's size and at a batch of one (two more when
    some loss is not finite): run it once, on a real batch, before training (:class:`~dpzero_jax.PrivateTrainer`
    does, unless ``check_loss=False``).
    """
    loss_fn, _ = split_aux(loss_fn, has_aux)
    paths, batch_size = check_inputs(params, batch)
    if batch_size < 2:
        raise ValueError(f"check_per_example_loss needs a batch of at least 2 examples to see coupling; got "
                         f"{batch_size}")
    out_avals = [jax.typeof(x) for x in jax.tree.leaves(jax.eval_shape(loss_fn, params, batch))]
    check_losses(out_avals, batch_size)
    if rtol is None:
        dtypes = [out_avals[0].dtype, *(jnp.result_type(x) for x in jax.tree.leaves(params))]
        rtol = max(1e-4, 4 * max(float(jnp.finfo(d).eps) for d in dtypes))
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol!r}, atol={atol!r}")
    per_example = single_example_losses(loss_fn)
    key = jax.random.key(0) if key is None else key

    def weighted(losses_of):   # (losses [B], grad sum_i w_i L_i): one compile gives both
        def objective(p, b, w):
            losses = losses_of(p, b)
            return jnp.sum(w * losses.astype(jnp.float32)), losses
        return jax.jit(jax.grad(objective, has_aux=True))

    weights = jax.random.normal(key, (batch_size,), jnp.float32)
    grad_batch, batched = weighted(loss_fn)(params, batch, weights)
    grad_alone, alone = weighted(per_example)(params, batch, weights)
    batched, alone = np.asarray(batched, np.float64), np.asarray(alone, np.float64)
    _compare_values(batched, alone, rtol, atol)
    finite = np.flatnonzero(np.isfinite(alone))
    if finite.size == 0:
        return
    if finite.size < batch_size:   # the non-finite examples left out (their gradients would be NaN on both sides)
        subset = jax.tree.map(lambda x: jnp.asarray(x)[finite], batch)
        grad_batch, _ = weighted(loss_fn)(params, subset, weights[finite])
        grad_alone, _ = weighted(per_example)(params, subset, weights[finite])
    _compare_gradients(paths, jax.tree.leaves(grad_batch), jax.tree.leaves(grad_alone), rtol, atol)


def _compare_values(batched: np.ndarray, alone: np.ndarray, rtol: float, atol: float) -> None:
    close = np.isclose(batched, alone, rtol=rtol, atol=atol, equal_nan=True)
    close &= np.isfinite(batched) == np.isfinite(alone)
    if close.all():
        return
    bad = np.flatnonzero(~close)
    shown = ", ".join(f"example {i}: {batched[i]:.6g} on the batch, {alone[i]:.6g} alone" for i in bad[:SHOWN])
    raise CoupledLossError(
        f"loss_fn couples the examples of the batch: {bad.size} of {batched.size} per-example losses differ when "
        f"the example is evaluated alone ({shown}{', ...' if bad.size > SHOWN else ''}). Each example's loss must "
        "depend on that example only -- no batch statistics (a batch norm in training mode), no mean or "
        "contrastive term over the batch -- or the clipping does not bound the gradient sum's sensitivity. (Random "
        "draws inside the loss, e.g. dropout from a fixed key, also differ between the batch and one example: "
        "check a deterministic version of the loss.)")


def _compare_gradients(paths, from_batch, from_alone, rtol: float, atol: float) -> None:
    worst = []
    for path, a, b in zip(paths, from_batch, from_alone):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        finite = np.isfinite(a) & np.isfinite(b)   # a finite loss may still have a non-finite gradient (sqrt at 0)
        if (np.isfinite(a) != np.isfinite(b)).any():
            worst.append((np.inf, path, np.inf, float(np.linalg.norm(b[finite]))))
            continue
        gap, scale = float(np.linalg.norm((a - b)[finite])), float(np.linalg.norm(b[finite]))
        if not gap <= rtol * scale + atol:
            worst.append((gap / max(scale, 1e-30), path, gap, scale))
    if not worst:
        return
    worst.sort(reverse=True)
    shown = ", ".join(f"{path!r}: |difference| {gap:.3g} against |gradient| {scale:.3g}"
                      for _, path, gap, scale in worst[:SHOWN])
    raise CoupledLossError(
        f"loss_fn couples the examples of the batch through its gradient: a weighted sum of the per-example losses "
        f"has a different gradient on the batch than with each example alone for {len(worst)} parameter(s) "
        f"({shown}{', ...' if len(worst) > SHOWN else ''}); the losses' values agree, so a term over the batch "
        "whose value is zero (e.g. m - stop_gradient(m) with m a batch mean) still moves every example's gradient")

