"""Adaptive clipping: group thresholds that track a quantile of the per-example gradient norms, privately.

Andrew, Thakkar, McMahan and Ramaswamy (2021), "Differentially Private Learning with Adaptive Clipping". Everything
privacy-relevant of the method is in this module: the threshold update, the noised count and the split of the noise
budget between the count and the gradient.

**The count.** At step ``t`` with thresholds ``C_t = (C_1..C_M)`` (one per parameter group) and the Poisson batch
``S_t``, example ``i`` reports, for every group ``m``, ``b_{m,i} = 1{||g_{m,i}|| <= C_m}`` (0 as well when a group
norm is not finite: the example is dropped from the gradient, and counts as clipped). The step releases the
centred, noised counts

    ``c~_m = sum_{i in S_t} (b_{m,i} - 1/2) + N(0, sigma_b^2)``                                  (one per group)

and the fraction estimate ``b~_m = c~_m / n + 1/2`` where ``n`` is the *expected* batch size (public). Adding or
removing one example moves each centred count by exactly 1/2, so the count vector has L2 sensitivity ``sqrt(M)/2``
and its noise multiplier is

    ``z_b = sigma_b / (sqrt(M) / 2) = 2 sigma_b / sqrt(M)``.                                      (paper, sec. 3.1)

(Centring is what halves the sensitivity; its ``n/2`` is added back with the public ``n``, so ``b~_m`` is an
unbiased estimate of the fraction of unclipped examples under Poisson sampling.)

**The update** (geometric, paper eq. 3): ``C_m <- C_m * exp(-eta * (b~_m - gamma))`` with the target quantile
``gamma`` and the learning rate ``eta``. At a fixed point ``E[b~_m] = gamma``: ``C_m`` is the ``gamma``-quantile of
the group's norms. The update reads only the released ``b~`` (post-processing).

**The noise split.** The same step also releases the clipped gradient sum, sensitivity ``||C_t||``, with noise
``z_g * ||C_t|| * N(0, I)``. Both are Gaussian mechanisms on the same Poisson batch, so together they are one
Gaussian mechanism on the concatenated vector: scaling the gradient coordinates by ``1 / (z_g ||C_t||)`` and the
count coordinates by ``1 / sigma_b`` makes the noise ``N(0, I)`` and each example's contribution a vector of norm
at most ``sqrt(z_g^-2 + z_b^-2)`` (reached: an example whose gradient is clipped moves the counts by exactly 1/2
each). The step is therefore exactly one Poisson-subsampled Gaussian with noise multiplier

    ``sigma = (z_g^-2 + z_b^-2)^(-1/2)``,     i.e.     ``z_g = (sigma^-2 - z_b^-2)^(-1/2)``,

which with ``M = 1`` is the paper's ``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``. A run with adaptive
clipping at total ``sigma`` is accounted exactly as a fixed-threshold run at ``sigma`` (same epsilon); its gradient
gets the slightly larger ``z_g``. It needs ``z_b > sigma``. :class:`dpzero_jax.accounting.PrivacyLedger` records
``sigma``, ``z_b`` and ``z_g`` per entry, and its ``dp_event`` is the composition of the two Gaussians inside one
Poisson sampling; ``tests/test_adaptive_clipping.py`` checks with ``dp_accounting`` that it equals ``sigma``'s.
Under replace-one adjacency (fixed-size batches) both sensitivities double (``2 ||C||``, and 1 for each count),
so the same split holds for the halved multipliers.

**The update's scale** (``normalize_update``, on by default). The privatised gradient handed to the optimiser is
divided by ``||C_t||``, the threshold vector's norm at the step. The clipped sum scales with the thresholds (an
example clipped at ``C`` contributes ``C`` times a unit vector) and so does its noise, ``z_g ||C_t||``: without the
division, a run started from a badly chosen ``C_0`` (say 100 where the norms are near 1) first takes steps whose
noise is a hundred times that of the steps after the thresholds have settled, and a stateful optimiser keeps them
(Adam's second moment remembers them for ~1 / (1 - b2) steps, shrinking every later step). Divided, the noise the
optimiser sees is ``z_g N(0, I)`` per coordinate at every step whatever the thresholds, and the learning rate is in
units of the threshold (as with a fixed threshold of 1). ``||C_t||`` is released (it is computed from earlier
released counts), so the division is post-processing: no privacy cost. ``experiments/adaptive_clipping_digits.py``
measures the effect.

The count noise is drawn from ``fold_in(noise_key, COUNT_KEY)``; the gradient's leaves use ``fold_in(noise_key, j)``
for small ``j`` and RMM sketches ``fold_in(noise_key, 2^31 - 1)``, so the draws are independent.

The arithmetic of the split needs no JAX (the accountant and ``dpzero privacy`` use it); the functions on arrays
import it when called.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

COUNT_KEY = 2**31 - 2   # fold_in index of the count noise in a step's noise key
DEFAULT_LEARNING_RATE = 0.2   # the paper's eta
DEFAULT_COUNT_NOISE_FRACTION = 1.0 / 20.0   # the paper's sigma_b = expected batch / 20


def count_noise_multiplier(count_noise_std: float, n_groups: int) -> float:
    """``z_b = 2 sigma_b / sqrt(M)``: the noise multiplier of the centred count vector (sensitivity ``sqrt(M)/2``)."""
    _positive("count_noise_std", count_noise_std)
    if isinstance(n_groups, bool) or not isinstance(n_groups, numbers.Integral) or n_groups < 1:
        raise ValueError(f"n_groups must be a positive int, got {n_groups!r}")
    return 2.0 * float(count_noise_std) / math.sqrt(n_groups)


def gradient_noise_multiplier(noise_multiplier: float, count_multiplier: float) -> float:
    """``z_g = (sigma^-2 - z_b^-2)^(-1/2)``: the gradient's share of a step of total noise multiplier ``sigma``."""
    _positive("noise_multiplier", noise_multiplier)
    _positive("count_noise_multiplier", count_multiplier)
    if not count_multiplier > noise_multiplier:
        raise ValueError(
            f"the count's noise multiplier z_b = 2 sigma_b / sqrt(M) = {count_multiplier:.6g} must exceed the total "
            f"noise multiplier sigma = {noise_multiplier:.6g}: the gradient would need z_g = (sigma^-2 - z_b^-2)^-1/2 "
            f"= infinity. Raise the count noise (clip_count_noise / --clip-count-noise) above "
            f"sigma * sqrt(M) / 2 (the paper uses expected batch / 20)")
    return float((noise_multiplier ** -2 - count_multiplier ** -2) ** -0.5)


def joint_noise_multiplier(gradient_multiplier: float, count_multiplier: float) -> float:
    """``(z_g^-2 + z_b^-2)^(-1/2)``: the one Gaussian equivalent to both mechanisms on the same batch."""
    _positive("gradient_noise_multiplier", gradient_multiplier)
    _positive("count_noise_multiplier", count_multiplier)
    return float((gradient_multiplier ** -2 + count_multiplier ** -2) ** -0.5)


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """The quantile-tracking rule: ``target_quantile`` gamma in (0, 1), ``learning_rate`` eta > 0,
    ``count_noise_std`` sigma_b > 0 (the std of the noise on each centred count) and ``expected_batch_size`` n
    (the divisor of the counts; public). ``normalize_update``: the privatised gradient is divided by ``||C_t||``
    before the optimiser (:func:`normalize_update`; see the module docstring)."""

    target_quantile: float
    count_noise_std: float
    expected_batch_size: float
    learning_rate: float = DEFAULT_LEARNING_RATE
    normalize_update: bool = True

    def __post_init__(self):
        q = self.target_quantile
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 < q < 1:
            raise ValueError(f"target_quantile (--clip-quantile) must be in (0, 1), got {q!r}")
        _positive("learning_rate (--clip-lr)", self.learning_rate)
        _positive("count_noise_std (--clip-count-noise)", self.count_noise_std)
        _positive("expected_batch_size", self.expected_batch_size)
        if not isinstance(self.normalize_update, bool):
            raise ValueError(f"normalize_update must be True or False, got {self.normalize_update!r}")

    def count_noise_multiplier(self, n_groups: int) -> float:
        return count_noise_multiplier(self.count_noise_std, n_groups)

    def gradient_noise_multiplier(self, noise_multiplier: float, n_groups: int) -> float:
        return gradient_noise_multiplier(noise_multiplier, self.count_noise_multiplier(n_groups))


def unclipped_counts(norms: jax.Array, thresholds: jax.Array, mask: jax.Array) -> jax.Array:
    """``[M]`` float32 ``sum_i mask_i (b_{m,i} - 1/2)``: the centred counts before noise.

    norms: ``[B]`` or ``[B, M]`` per-example group norms (``DPStats.norms``); thresholds: ``[M]``; mask: ``[B]``.
    """
    import jax.numpy as jnp

    thresholds = jnp.asarray(thresholds, jnp.float32)
    norms = jnp.asarray(norms, jnp.float32).reshape(norms.shape[0], -1)
    if norms.shape[1] != thresholds.shape[0]:
        raise ValueError(f"norms have {norms.shape[1]} groups but there are {thresholds.shape[0]} thresholds")
    below = jnp.logical_and(jnp.isfinite(norms), norms <= thresholds[None, :]).astype(jnp.float32)   # [B, M]
    member = jnp.asarray(mask).astype(bool)[:, None]
    return jnp.sum(jnp.where(member, below - 0.5, 0.0), axis=0)


def noised_fraction(norms, thresholds, mask, key: jax.Array, rule: AdaptiveClipping) -> jax.Array:
    """``[M]`` ``b~ = (sum_i (b_i - 1/2) + sigma_b N(0, I)) / n + 1/2``, the noise from ``fold_in(key, COUNT_KEY)``
    (``key``: the step's noise key)."""
    import jax
    import jax.numpy as jnp

    counts = unclipped_counts(norms, thresholds, mask)
    noise = rule.count_noise_std * jax.random.normal(jax.random.fold_in(key, COUNT_KEY), counts.shape, jnp.float32)
    return (counts + noise) / rule.expected_batch_size + 0.5


def update_thresholds(thresholds, fraction, rule: AdaptiveClipping) -> jax.Array:
    """``[M]`` ``C * exp(-eta (b~ - gamma))`` (the geometric update)."""
    import jax.numpy as jnp

    thresholds = jnp.asarray(thresholds, jnp.float32)
    return thresholds * jnp.exp(-rule.learning_rate * (jnp.asarray(fraction, jnp.float32) - rule.target_quantile))


def adapt(thresholds, norms, mask, key: jax.Array, rule: AdaptiveClipping) -> tuple[jax.Array, jax.Array]:
    """One step of the rule: ``(next thresholds [M], released fraction b~ [M])`` from this step's thresholds, the
    per-example norms it clipped with (``[B]`` or ``[B, M]``), the batch mask ``[B]`` and the step's noise key."""
    fraction = noised_fraction(norms, thresholds, mask, key, rule)
    return update_thresholds(thresholds, fraction, rule), fraction


def normalize_update(grads, thresholds, rule: AdaptiveClipping):
    """The privatised gradient (any pytree) divided by ``||C_t||`` (``thresholds``: ``[M]``, the ones the step clipped
    with) when ``rule.normalize_update``, else unchanged. Post-processing of released values."""
    if not rule.normalize_update:
        return grads
    import jax
    import jax.numpy as jnp

    scale = jax.lax.rsqrt(jnp.sum(jnp.square(jnp.asarray(thresholds, jnp.float32))))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
