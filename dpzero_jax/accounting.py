"""Privacy accounting for DP training, built on Google's ``dp_accounting``.

What is accounted
-----------------
One *step* is one **logical** batch: the noise is added once per logical batch (however many micro-batches or
devices it was split across), so gradient accumulation does not change the accounting.  Each step is a sampled
Gaussian mechanism with ``noise_multiplier`` = (noise standard deviation) / (clipping norm C).

Sampling scheme and adjacency
-----------------------------
* ``sampling="poisson"`` (the default, and the only scheme of :func:`epsilon`, :func:`calibrate_noise` and
  :func:`max_steps`): every example joins a batch independently with probability ``sampling_rate`` (q).  The
  guarantee is for **add-or-remove-one** adjacency, and it only holds if the data really were Poisson sampled.
  It does not hold for shuffled fixed-size batches.
* ``sampling="fixed-size"`` (``PrivacyLedger.record`` only): batches of exactly ``batch_size`` drawn uniformly
  without replacement from ``dataset_size`` examples.  ``dp_accounting`` supports this only with the RDP accountant
  and **replace-one** adjacency (the dataset size is public).  Under replace-one the sum of clipped
  contributions has sensitivity 2C, so the accountant is given ``noise_multiplier / 2``.  The PLD accountant does not
  support this event, so asking for ``accountant="pld"`` raises a ``ValueError`` (nothing is switched silently).
  Poisson and fixed-size events use different adjacency relations and cannot be mixed in one ledger.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

__all__ = ["epsilon", "calibrate_noise", "max_steps", "PrivacyLedger"]

ACCOUNTANTS = ("pld", "rdp")
SAMPLINGS = ("poisson", "fixed-size")


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def _check_noise(noise_multiplier: float) -> float:
    if not isinstance(noise_multiplier, numbers.Real) or not noise_multiplier >= 0 or math.isinf(noise_multiplier):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def _check_rate(sampling_rate: float) -> float:
    if not isinstance(sampling_rate, numbers.Real) or not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    return float(sampling_rate)


def _check_steps(steps: int, name: str = "steps") -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {steps!r}")
    return int(steps)


def _check_delta(delta: float) -> float:
    if not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def _check_target(target_epsilon: float) -> float:
    if not isinstance(target_epsilon, numbers.Real) or not 0 < target_epsilon < math.inf:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    return float(target_epsilon)


def _poisson_event(noise_multiplier: float, sampling_rate: float, steps: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )


def _event_epsilon(event: dp_accounting.DpEvent, delta: float, accountant: str, replace_one: bool = False) -> float:
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE if replace_one else None
    if accountant == "pld":
        if replace_one:
            raise ValueError(
                'fixed-size (without-replacement) sampling is not supported by the PLD accountant; use accountant="rdp"'
            )
        acc: dp_accounting.PrivacyAccountant = pld.PLDAccountant()
    else:
        acc = rdp.RdpAccountant(neighboring_relation=relation) if replace_one else rdp.RdpAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float, accountant: str = "pld") -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps at ``delta`` (add-or-remove-one adjacency)."""
    sigma, q, steps, delta = _check_noise(noise_multiplier), _check_rate(sampling_rate), _check_steps(steps), \
        _check_delta(delta)
    _check_accountant(accountant)
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    return _event_epsilon(_poisson_event(sigma, q, steps), delta, accountant)


def calibrate_noise(target_epsilon: float, sampling_rate: float, steps: int, delta: float, accountant: str = "pld",
                    rtol: float = 5e-3) -> float:
    """Smallest noise multiplier (to relative tolerance ``rtol``) whose epsilon is <= ``target_epsilon``.

    The returned value always satisfies the budget (it is the upper end of the final bisection bracket).
    """
    target = _check_target(target_epsilon)
    q, steps, delta = _check_rate(sampling_rate), _check_steps(steps), _check_delta(delta)
    _check_accountant(accountant)
    if steps == 0:
        return 0.0

    def eps(s: float) -> float:
        return epsilon(s, q, steps, delta, accountant)

    # RDP is cheap and (up to discretisation) never below PLD, so its answer is a good upper starting point for PLD.
    hi = calibrate_noise(target, q, steps, delta, "rdp", rtol=0.05) if accountant == "pld" else 1.0
    while eps(hi) > target:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"target_epsilon={target} is unreachable with noise_multiplier <= 1e6")
    lo = hi / 2.0
    while lo > 1e-3 and eps(lo) <= target:  # move lo down until it violates the budget
        hi, lo = lo, lo / 2.0
    while hi - lo > rtol * hi:  # invariant: eps(hi) <= target (eps(lo) > target unless lo hit the floor)
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def max_steps(noise_multiplier: float, sampling_rate: float, target_epsilon: float, delta: float,
              accountant: str = "pld", limit: int = 10**8) -> int:
    """Largest number of steps whose epsilon is <= ``target_epsilon`` (capped at ``limit``)."""
    sigma, q, target, delta = _check_noise(noise_multiplier), _check_rate(sampling_rate), \
        _check_target(target_epsilon), _check_delta(delta)
    _check_accountant(accountant)
    limit = _check_steps(limit, "limit")

    def ok(k: int) -> bool:
        return epsilon(sigma, q, k, delta, accountant) <= target

    if limit == 0 or not ok(1):
        return 0
    lo, hi = 1, 2  # invariant: ok(lo) and (hi > limit or not ok(hi))
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


class PrivacyLedger:
    """Record of every composed DP event; consecutive identical events are merged into one entry with a count."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def record(self, noise_multiplier: float, sampling_rate: float | None = None, steps: int = 1,
               sampling: str = "poisson", dataset_size: int | None = None, batch_size: int | None = None) -> None:
        """Record ``steps`` logical steps. ``fixed-size`` needs ``dataset_size`` and ``batch_size``."""
        sigma, steps = _check_noise(noise_multiplier), _check_steps(steps)
        if sampling == "poisson":
            if sampling_rate is None:
                raise ValueError("sampling_rate is required for sampling='poisson'")
            entry = {"sampling": sampling, "noise_multiplier": sigma, "sampling_rate": _check_rate(sampling_rate)}
        elif sampling == "fixed-size":
            if dataset_size is None or batch_size is None:
                raise ValueError("dataset_size and batch_size are required for sampling='fixed-size'")
            n, m = _check_steps(dataset_size, "dataset_size"), _check_steps(batch_size, "batch_size")
            if not 0 < m <= n:
                raise ValueError(f"batch_size must be in [1, dataset_size={n}], got {m}")
            if sampling_rate is not None and not math.isclose(_check_rate(sampling_rate), m / n, rel_tol=1e-9):
                raise ValueError(f"sampling_rate={sampling_rate} does not equal batch_size / dataset_size = {m / n}")
            entry = {"sampling": sampling, "noise_multiplier": sigma, "dataset_size": n, "batch_size": m}
        else:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
        if steps == 0:
            return
        last = self.entries[-1] if self.entries else None
        if last is not None and {k: v for k, v in last.items() if k != "count"} == entry:
            last["count"] += steps
        else:
            self.entries.append({**entry, "count": steps})

    @property
    def steps(self) -> int:
        return sum(e["count"] for e in self.entries)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed ``dp_accounting`` event of the ledger (fixed-size sigma already halved, see module doc)."""
        events = []
        for e in self.entries:
            if e["sampling"] == "poisson":
                events.append(_poisson_event(e["noise_multiplier"], e["sampling_rate"], e["count"]))
            else:
                inner = dp_accounting.GaussianDpEvent(e["noise_multiplier"] / 2.0)
                sampled = dp_accounting.SampledWithoutReplacementDpEvent(e["dataset_size"], e["batch_size"], inner)
                events.append(dp_accounting.SelfComposedDpEvent(sampled, e["count"]))
        return dp_accounting.ComposedDpEvent(events)

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """Epsilon of everything recorded, at ``delta``."""
        delta = _check_delta(delta)
        _check_accountant(accountant)
        if not self.entries:
            return 0.0
        schemes = {e["sampling"] for e in self.entries}
        if len(schemes) > 1:
            raise ValueError("ledger mixes poisson and fixed-size events (different adjacency); cannot account it")
        if any(e["noise_multiplier"] == 0 for e in self.entries):
            return math.inf
        return _event_epsilon(self.dp_event(), delta, accountant, replace_one=schemes == {"fixed-size"})

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "events": [dict(e) for e in self.entries]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyLedger:
        if data.get("version") != 1:
            raise ValueError(f"unsupported ledger version {data.get('version')!r}")
        ledger = cls()
        for e in data["events"]:
            e = dict(e)
            ledger.record(e.pop("noise_multiplier"), steps=e.pop("count"), **e)
        return ledger

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"PrivacyLedger({len(self.entries)} entries, {self.steps} steps)"
