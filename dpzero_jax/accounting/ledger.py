"""``PrivacyLedger``: every composed DP event of a run, JSON round-trip, and its epsilon composed from scratch (see
:mod:`dpzero_jax.accounting`)."""

from __future__ import annotations

import functools
import json
import math
import numbers
from typing import Any

import dp_accounting

from dpzero_jax.accounting.calibration import (
    SAMPLINGS,
    _check_accountant,
    _check_delta,
    _check_noise,
    _check_rate,
    _check_steps,
    _from_scratch_epsilon,
    _mechanism_key,
    entries_event,
)
from dpzero_jax.accounting.truncation import certified_epsilon


@functools.lru_cache(maxsize=256)
def _ledger_epsilon(entries: tuple, delta: float, accountant: str) -> float:
    """Epsilon of a ledger given as a hashable tuple of its entries, composed from scratch by ``dp_accounting``."""
    key = _mechanism_key(entries)
    mass = math.fsum(dict(e).get("truncation_probability", 0.0) * dict(e)["count"] for e in entries)
    return certified_epsilon(lambda d: _from_scratch_epsilon(key, d, accountant), mass, delta)


class PrivacyLedger:
    """Record of every composed DP event; consecutive identical events are merged into one entry with a count.

    ``overflowed_steps``: steps whose Poisson batch was actually truncated (already covered by the entries'
    ``truncation_probability``; listed so a reviewer sees that it happened).
    """

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.overflowed_steps: list[int] = []

    def record(self, noise_multiplier: float, sampling_rate: float | None = None, steps: int = 1,
               sampling: str = "poisson", dataset_size: int | None = None, batch_size: int | None = None,
               truncation_probability: float = 0.0, count_noise_multiplier: float | None = None) -> None:
        """Record ``steps`` logical steps. ``fixed-size`` needs ``dataset_size`` and ``batch_size``.

        ``truncation_probability``: per-step probability that a Poisson batch exceeded the static capacity and was
        truncated (module doc); 0 for exact Poisson sampling.

        ``count_noise_multiplier`` (adaptive clipping, :mod:`dpzero_jax.adaptive_clipping`): each step also released
        the noised counts of unclipped examples with this noise multiplier ``z_b`` on the same batch. Then
        ``noise_multiplier`` is the step's total sigma, the gradient's share ``z_g = (sigma^-2 - z_b^-2)^-1/2`` is
        recorded with it (``gradient_noise_multiplier``), and :meth:`dp_event` composes both Gaussians inside one
        sampling event -- exactly a Gaussian at sigma, which is what the epsilon is computed from.
        """
        sigma, steps = _check_noise(noise_multiplier), _check_steps(steps)
        split = {}
        if count_noise_multiplier is not None:
            from dpzero_jax import adaptive_clipping

            z_b = _check_noise(count_noise_multiplier)
            split = {"count_noise_multiplier": z_b,
                     "gradient_noise_multiplier": adaptive_clipping.gradient_noise_multiplier(sigma, z_b)}
        if not isinstance(truncation_probability, numbers.Real) or not 0 <= truncation_probability < 1:
            raise ValueError(f"truncation_probability must be in [0, 1), got {truncation_probability!r}")
        if sampling == "poisson":
            if sampling_rate is None:
                raise ValueError("sampling_rate is required for sampling='poisson'")
            entry = {"sampling": sampling, "noise_multiplier": sigma, "sampling_rate": _check_rate(sampling_rate)}
            if truncation_probability > 0:
                entry["truncation_probability"] = float(truncation_probability)
        elif sampling == "fixed-size":
            if dataset_size is None or batch_size is None:
                raise ValueError("dataset_size and batch_size are required for sampling='fixed-size'")
            if truncation_probability:
                raise ValueError("truncation_probability applies to Poisson sampling only")
            n, m = _check_steps(dataset_size, "dataset_size"), _check_steps(batch_size, "batch_size")
            if not 0 < m <= n:
                raise ValueError(f"batch_size must be in [1, dataset_size={n}], got {m}")
            if sampling_rate is not None and not math.isclose(_check_rate(sampling_rate), m / n, rel_tol=1e-9):
                raise ValueError(f"sampling_rate={sampling_rate} does not equal batch_size / dataset_size = {m / n}")
            entry = {"sampling": sampling, "noise_multiplier": sigma, "dataset_size": n, "batch_size": m}
        else:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
        entry.update(split)
        if steps == 0:
            return
        last = self.entries[-1] if self.entries else None
        if last is not None and {k: v for k, v in last.items() if k != "count"} == entry:
            last["count"] += steps
        else:
            self.entries.append({**entry, "count": steps})

    def record_overflow(self, step: int) -> None:
        """Note that the batch of ``step`` was truncated (its probability is already in the entries)."""
        self.overflowed_steps.append(_check_steps(step, "step"))

    @property
    def steps(self) -> int:
        return sum(e["count"] for e in self.entries)

    @property
    def truncation_mass(self) -> float:
        """``sum_t eta_t``: total-variation distance between the run and exact Poisson sampling."""
        return math.fsum(e.get("truncation_probability", 0.0) * e["count"] for e in self.entries)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed ``dp_accounting`` event of the ledger (:func:`calibration.entries_event`; fixed-size sigma
        already halved, see the package doc). Truncation is not part of the event; :meth:`epsilon` accounts it
        through ``delta``."""
        return entries_event(self.entries)

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """Epsilon of everything recorded, at ``delta`` (truncation included, see the module doc)."""
        delta = _check_delta(delta)
        _check_accountant(accountant)
        if not self.entries:
            return 0.0
        schemes = {e["sampling"] for e in self.entries}
        if len(schemes) > 1:
            raise ValueError("ledger mixes poisson and fixed-size events (different adjacency); cannot account it")
        if any(e["noise_multiplier"] == 0 for e in self.entries):
            return math.inf
        key = tuple(tuple(sorted(e.items())) for e in self.entries)
        return _ledger_epsilon(key, delta, accountant)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": 1, "events": [dict(e) for e in self.entries]}
        if self.overflowed_steps:
            data["overflowed_steps"] = list(self.overflowed_steps)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyLedger:
        if data.get("version") != 1:
            raise ValueError(f"unsupported ledger version {data.get('version')!r}")
        ledger = cls()
        for e in data["events"]:
            e = dict(e)
            saved_split = e.pop("gradient_noise_multiplier", None)
            ledger.record(e.pop("noise_multiplier"), steps=e.pop("count"), **e)
            derived = ledger.entries[-1].get("gradient_noise_multiplier") if ledger.entries else None
            if saved_split is not None and not math.isclose(saved_split, derived, rel_tol=1e-12):
                raise ValueError(f"ledger entry {e}: gradient_noise_multiplier {saved_split!r} is not the split of "
                                 f"its noise multipliers ({derived!r})")
        for step in data.get("overflowed_steps", []):
            ledger.record_overflow(step)
        return ledger

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PrivacyLedger) and self.entries == other.entries
                and self.overflowed_steps == other.overflowed_steps)

    def __repr__(self) -> str:
        return f"PrivacyLedger({len(self.entries)} entries, {self.steps} steps)"
