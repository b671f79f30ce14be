"""Batch sampling for DP-SGD with static shapes.

Static shapes
    A jitted training step recompiles for every new input shape. Poisson sampling gives a random batch size, so
    :class:`PoissonSampler` always returns ``capacity`` slots: ``indices`` int32 ``[capacity]`` and ``mask`` bool
    ``[capacity]``. Slots past the realised batch hold index 0 with ``mask=False``; the step must zero their
    contribution (e.g. multiply per-example clipped gradients by ``mask``). One compile serves the whole run.

Overflow
    By default ``capacity`` is the smallest ``c`` with ``P(Binomial(N + 1, q) > c) <= 1e-9`` (N + 1: the larger of two
    neighbouring datasets); the exact tail probabilities for the capacity in use are ``overflow_probability`` and
    ``truncation_probability``. When more than ``capacity`` examples are drawn,
    ``overflow="error"`` raises :class:`SamplingOverflowError`; ``overflow="truncate"`` keeps a uniformly random subset
    of size ``capacity``. Truncation CHANGES THE MECHANISM (it is no longer pure Poisson sampling, so the
    ``PoissonSampledDpEvent`` accounting is not exact for that step); every batch carries ``overflowed`` so the
    trainer can record it in the privacy ledger.

Accounting (which event each sampler corresponds to)
    * :class:`PoissonSampler`     -> ``PoissonSampledDpEvent(q, ...)``
    * :class:`FixedSizeSampler`   -> ``SampledWithoutReplacementDpEvent(N, B, ...)``
    * :class:`ShuffledEpochs`     -> no formal event (accountants assume Poisson or uniform sampling); a warning is
      emitted on construction.

Determinism and resuming
    Sampling is a pure function of the key (and ``step`` for :class:`ShuffledEpochs`); there is no global RNG state.
    The trainer passes ``jax.random.fold_in(base_key, step)`` to the Poisson / fixed-size samplers, so resuming at
    step ``t`` simply means re-deriving that key: the batch is bit-identical to the one of the original run.
    Draws use a NumPy ``Generator`` seeded from the key's raw bits (host-side, cheap, exact for any ``N``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import jax
import numpy as np
from scipy import stats

__all__ = [
    "Batch",
    "FixedSizeSampler",
    "PoissonSampler",
    "SamplingOverflowError",
    "ShuffledEpochs",
    "gather",
]

DEFAULT_OVERFLOW_TARGET = 1e-9


class SamplingOverflowError(RuntimeError):
    """More examples were Poisson-selected than the sampler's static capacity (``overflow="error"``)."""


@dataclass(frozen=True)
class Batch:
    """A sampled batch. Unpacks as ``indices, mask, realised_size = batch``.

    indices: int32 ``[slots]``; mask: bool ``[slots]`` (True = real example); realised_size: ``int(mask.sum())``;
    overflowed: True if truncation happened; num_selected: examples drawn before any truncation.
    """

    indices: np.ndarray
    mask: np.ndarray
    realised_size: int
    overflowed: bool = False
    num_selected: int = 0

    def __iter__(self):
        return iter((self.indices, self.mask, self.realised_size))


def _rng(key, tag: int, *extra: int) -> np.random.Generator:
    """NumPy Generator deterministically seeded from a JAX key (typed or raw uint32), a domain tag and extras."""
    key = jax.numpy.asarray(key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    bits = np.asarray(key).astype(np.uint32).ravel().tolist()
    return np.random.default_rng([tag, *bits, *extra])


def _check_size(dataset_size: int) -> int:
    if isinstance(dataset_size, bool) or int(dataset_size) != dataset_size or dataset_size < 1:
        raise ValueError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    return int(dataset_size)


def _check_batch(batch_size: int, n: int) -> int:
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be an integer with 1 <= batch_size <= dataset_size={n}, got {batch_size!r}")
    return int(batch_size)


def _pad(selected: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    indices = np.zeros(slots, np.int32)
    mask = np.zeros(slots, bool)
    indices[: selected.size] = selected
    mask[: selected.size] = True
    return indices, mask


class PoissonSampler:
    """Each example is included independently with probability ``q``; output padded to ``capacity`` slots.

    Args:
        dataset_size: N >= 1.
        sampling_rate: q with 0 < q <= 1.
        capacity: number of static slots (1 <= capacity); default: the smallest multiple of ``capacity_multiple``
            with P(Bin(N + 1, q) > c) <= ``overflow_target``.
        overflow: "truncate" (keep a uniform random subset of size capacity; changes the mechanism, flagged via
            ``Batch.overflowed``) or "error" (raise :class:`SamplingOverflowError`).
        overflow_target: bound on the per-step overflow probability used to choose the default capacity.
        capacity_multiple: the default capacity is rounded up to a multiple of this (e.g. the number of devices
            the batch is split over).
    Attributes:
        overflow_probability: exact P(Binomial(N, q) > capacity).
        truncation_probability: exact P(Binomial(N + 1, q) > capacity), the overflow probability on the larger of
            two add/remove-neighbouring datasets: what the privacy ledger charges per step
            (:mod:`dpzero_jax.accounting`, "Truncated Poisson batches").
    """

    def __init__(self, dataset_size: int, sampling_rate: float, capacity: int | None = None,
                 overflow: Literal["truncate", "error"] = "truncate",
                 overflow_target: float = DEFAULT_OVERFLOW_TARGET, capacity_multiple: int = 1):
        self.dataset_size = n = _check_size(dataset_size)
        q = float(sampling_rate)
        if not (0.0 < q <= 1.0) or math.isnan(q):
            raise ValueError(f"sampling_rate must satisfy 0 < q <= 1, got {sampling_rate!r}")
        self.sampling_rate = q
        if overflow not in ("truncate", "error"):
            raise ValueError(f"overflow must be 'truncate' or 'error', got {overflow!r}")
        self.overflow = overflow
        if not 0 < overflow_target < 1:
            raise ValueError(f"overflow_target must be in (0, 1), got {overflow_target!r}")
        if isinstance(capacity_multiple, bool) or int(capacity_multiple) != capacity_multiple or capacity_multiple < 1:
            raise ValueError(f"capacity_multiple must be an integer >= 1, got {capacity_multiple!r}")
        if capacity is None:
            c = int(stats.binom.isf(overflow_target, n + 1, q))
            while c > 0 and stats.binom.sf(c - 1, n + 1, q) <= overflow_target:  # guard isf rounding
                c -= 1
            while stats.binom.sf(c, n + 1, q) > overflow_target:
                c += 1
            c = max(1, min(c, n + 1))  # N + 1 slots never overflow, even on the larger neighbour
            capacity = -(-c // capacity_multiple) * capacity_multiple
        elif isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self.overflow_probability = float(stats.binom.sf(self.capacity, n, q))
        self.truncation_probability = float(stats.binom.sf(self.capacity, n + 1, q))

    @classmethod
    def for_privacy_budget(cls, dataset_size: int, sampling_rate: float, steps: int, delta: float,
                           final_epsilon: float, capacity_multiple: int = 1) -> PoissonSampler:
        """The sampler whose cap a DP run of ``steps`` that ends at ``final_epsilon`` can afford.

        The per-step truncation probability is bounded by
        :func:`dpzero_jax.accounting.plan_overflow_target`, so that the charge for truncated batches,
        ``steps * eta * (1 + e^eps)``, stays below ``TRUNCATION_SHARE`` (1e-3) of ``delta`` for every epsilon the
        run reaches; when no positive bound is representable (an epsilon near 700) the cap is ``N + 1`` slots,
        which never truncate. The trainer and ``dpzero privacy --dataset-size`` both size the cap here."""
        from dpzero_jax import accounting

        n = _check_size(dataset_size)
        target = accounting.plan_overflow_target(steps, delta, final_epsilon)
        if target > 0:
            return cls(n, sampling_rate, overflow_target=target, capacity_multiple=capacity_multiple)
        return cls(n, sampling_rate, capacity=-(-(n + 1) // capacity_multiple) * capacity_multiple)

    def sample(self, key) -> Batch:
        """Pure function of ``key``. Returns Batch(indices int32 [capacity], mask bool [capacity], realised_size)."""
        rng = _rng(key, 0x504F)
        selected = np.flatnonzero(rng.random(self.dataset_size) < self.sampling_rate)
        selected = rng.permutation(selected)  # random order within the batch
        num_selected = int(selected.size)
        overflowed = num_selected > self.capacity
        if overflowed:
            if self.overflow == "error":
                raise SamplingOverflowError(
                    f"Poisson sample selected {num_selected} examples > capacity {self.capacity} "
                    f"(P(overflow) = {self.overflow_probability:.3g})")
            selected = selected[: self.capacity]  # uniformly random subset, since the order is random
        indices, mask = _pad(selected, self.capacity)
        return Batch(indices, mask, int(selected.size), overflowed, num_selected)


class FixedSizeSampler:
    """Exactly ``batch_size`` distinct examples drawn uniformly without replacement each step.

    Accounted with ``SampledWithoutReplacementDpEvent(dataset_size, batch_size, ...)``.
    """

    def __init__(self, dataset_size: int, batch_size: int):
        self.dataset_size = _check_size(dataset_size)
        self.batch_size = _check_batch(batch_size, self.dataset_size)

    def sample(self, key) -> Batch:
        """Pure function of ``key``. Returns Batch(indices int32 [B], mask bool [B] all True, B)."""
        rng = _rng(key, 0x4653)
        idx = rng.choice(self.dataset_size, size=self.batch_size, replace=False).astype(np.int32)
        return Batch(idx, np.ones(self.batch_size, bool), self.batch_size, False, self.batch_size)


class ShuffledEpochs:
    """Classic shuffled epochs: one permutation per epoch, cut into ``ceil(N / B)`` batches of ``B`` slots.

    The final batch of an epoch is padded (index 0, mask False) when B does not divide N. NOT formally private:
    no accountant event matches this sampling scheme.
    """

    def __init__(self, dataset_size: int, batch_size: int):
        self.dataset_size = _check_size(dataset_size)
        self.batch_size = _check_batch(batch_size, self.dataset_size)
        self.steps_per_epoch = -(-self.dataset_size // self.batch_size)
        warnings.warn("ShuffledEpochs has no formal DP guarantee: privacy accountants assume Poisson or uniform "
                      "sampling; use PoissonSampler or FixedSizeSampler for accounted training.",
                      UserWarning, stacklevel=2)

    def sample(self, key, step: int) -> Batch:
        """Pure function of (``key``, ``step``); ``key`` is the BASE key (same every step), not a per-step key.

        Returns Batch(indices int32 [B], mask bool [B], realised_size).
        """
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        epoch, pos = divmod(int(step), self.steps_per_epoch)
        perm = _rng(key, 0x5345, epoch).permutation(self.dataset_size)
        chunk = perm[pos * self.batch_size: (pos + 1) * self.batch_size]
        indices, mask = _pad(chunk, self.batch_size)
        return Batch(indices, mask, int(chunk.size), False, int(chunk.size))


def gather(dataset: dict[str, np.ndarray], indices) -> dict[str, np.ndarray]:
    """Gather a batch: ``{k: v[indices]}``; each ``v`` has shape ``[N, ...]``, result ``[len(indices), ...]``.

    Padded slots (index 0) gather example 0; callers must apply the mask.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}")
    sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in dataset.items()}
    if len(set(sizes.values())) > 1 or None in sizes.values():
        raise ValueError(f"dataset arrays must share a leading dimension, got {sizes}")
    if idx.size and sizes and (idx.min() < 0 or idx.max() >= next(iter(sizes.values()))):
        raise ValueError("indices out of range for the dataset")
    return {k: v[idx] for k, v in dataset.items()}
