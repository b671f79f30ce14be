"""Truncated Poisson batches: the share of delta charged for a batch cap, and the epsilon a run plans and records
(see "Truncated Poisson batches" in :mod:`dpzero_jax.accounting`)."""

from __future__ import annotations

import math

from dp_accounting import pld

from dpzero_jax.accounting import calibration
from dpzero_jax.accounting.calibration import (
    _check_accountant,
    _check_delta,
    _check_noise,
    _check_rate,
    _check_steps,
    _poisson_event,
    _poisson_key,
    coarse_interval,
    epsilon,
)

TRUNCATION_SHARE = 1e-3  # share of delta that the truncation of Poisson batches may take (module doc)
CAP_MARGIN = 1.0  # nats of headroom above the planned epsilon when sizing the batch cap (plan_overflow_target)


def certified_epsilon(eps_at, mass: float, delta: float) -> float:
    """Smallest epsilon certified at ``delta`` when truncation has total-variation mass ``mass`` (module doc).

    ``eps_at(d)``: epsilon of the untruncated composed mechanism at delta ``d``. Claiming ``eps`` leaves
    ``delta - mass * (1 + e^eps)`` for the mechanism, so ``eps`` is certified iff ``eps >= eps_at(that)``.

    * ``mass == 0``: ``eps_at(delta)``.
    * One call (the trainer's case, where the batch cap is sized for it): ``e = eps_at(delta * (1 - share))`` with
      ``share = TRUNCATION_SHARE`` is certified when ``mass * (1 + e^e) <= share * delta``.
    * Otherwise the fixed point is iterated from below and each candidate verified; ``inf`` when nothing can be
      certified (a truncation mass comparable to delta).
    """
    if mass == 0:
        return eps_at(delta)

    def mechanism_delta(eps: float) -> float:  # delta left for the untruncated mechanism if we claim eps
        return delta - mass * (1.0 + math.exp(min(eps, 700.0)))

    e = eps_at(delta * (1.0 - TRUNCATION_SHARE))
    if mass * (1.0 + math.exp(min(e, 700.0))) <= TRUNCATION_SHARE * delta:
        return e
    eps = eps_at(delta)
    for _ in range(20):
        d = mechanism_delta(eps)
        if d <= 0:
            return math.inf
        nxt = eps_at(d)
        if nxt <= eps:
            return eps
        eps = nxt * (1 + 1e-9) + 1e-12
    return math.inf  # not certified (only with a truncation mass comparable to delta)


def plan_overflow_target(steps: int, delta: float, final_epsilon: float) -> float:
    """Per-step truncation probability bound for a run of ``steps`` that will end at ``final_epsilon``.

    Chosen so that the charge ``steps * eta * (1 + e^(final_epsilon + CAP_MARGIN))`` is ``TRUNCATION_SHARE * delta``:
    then :func:`certified_epsilon` certifies every row of the run in one call (the margin covers rows computed at a
    coarser PLD resolution).  0.0 when no positive bound is representable (the cap must then hold ``N + 1``, which
    never truncates).
    """
    steps, delta = _check_steps(steps), _check_delta(delta)
    if not final_epsilon >= 0:
        raise ValueError(f"final_epsilon must be a number >= 0, got {final_epsilon!r}")
    exponent = final_epsilon + CAP_MARGIN
    if steps == 0:
        return 1e-9
    if exponent > 700.0:
        return 0.0
    return min(1e-9, TRUNCATION_SHARE * delta / (max(steps, 1) * (1.0 + math.exp(exponent))))


def planned_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
                    accountant: str = "pld") -> float:
    """A quick upper bound on the epsilon of ``steps`` Poisson steps, for sizing the batch cap before training.

    RDP (cheap; never below PLD up to discretisation), then for ``accountant="pld"`` the PLD at
    :func:`coarse_interval` of that value (pessimistic, within ~0.2% of full resolution), the smaller of the two.
    Skipped when RDP already exceeds 700 (no truncation is affordable then anyway). Not the run's epsilon of
    record, which is composed from scratch at full resolution at the end."""
    sigma, q, steps, delta = _check_noise(noise_multiplier), _check_rate(sampling_rate), _check_steps(steps), \
        _check_delta(delta)
    _check_accountant(accountant)
    upper = epsilon(sigma, q, steps, delta, "rdp")
    if accountant == "rdp" or not upper <= 700.0:
        return upper
    coarse = pld.PLDAccountant(value_discretization_interval=coarse_interval(upper))
    coarse.compose(_poisson_event(sigma, q, steps))
    return min(upper, float(coarse.get_epsilon(delta)))


def epsilon_of_record(noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
                      accountant: str = "pld") -> float:
    """What :meth:`PrivacyLedger.epsilon` will report for ``steps`` Poisson steps at (sigma, q) whose truncation
    charge stays within ``TRUNCATION_SHARE`` of delta (the trainer's batch cap sees to it): ``dp_accounting``'s
    from-scratch composition at ``delta * (1 - TRUNCATION_SHARE)``, at its default resolution. Computed now and
    remembered (``_EPSILONS``; the composition itself is not kept), so that the ledger's own call finds it: the
    trainer asks before training, spending the time and memory of the composition before the first step instead of
    after the last (free for a calibrated sigma, which calibration already composed)."""
    sigma, q, steps, delta = _check_noise(noise_multiplier), _check_rate(sampling_rate), _check_steps(steps), \
        _check_delta(delta)
    _check_accountant(accountant)
    if steps == 0 or sigma == 0:
        return 0.0 if steps == 0 else math.inf
    key = _poisson_key(sigma, q, steps)
    # through the module: the memo and the composition are calibration's (tests watch them there)
    return calibration._from_scratch_epsilon(key, delta * (1.0 - TRUNCATION_SHARE), accountant,
                                             lambda: calibration._compose_from_scratch(key, accountant))
