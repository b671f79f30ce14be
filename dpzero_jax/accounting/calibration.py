"""Epsilon and noise calibration of Poisson (and fixed-size) subsampled Gaussian steps, on ``dp_accounting``; the
composition of ledger entries from scratch and its memo. See :mod:`dpzero_jax.accounting` for what is accounted."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers

import dp_accounting
from dp_accounting import pld, rdp

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


# The PLD accountant discretises the privacy-loss distribution: its time and memory grow with the privacy loss and
# the number of composed steps (at q=0.01, sigma=0.1, 1000 steps -- epsilon ~1200 -- one call takes ~30 s; at 1e11
# steps it asks for hundreds of GiB). Beyond these limits it is refused with the reason; RDP (an upper bound, a
# closed form per order) answers any of them in milliseconds.
PLD_MAX_STEPS = 10**7
PLD_MAX_EPSILON = 500.0


@contextlib.contextmanager
def quiet_rdp_warnings():
    """Silence dp_accounting's RDP warnings (through absl) about orders it skips: irrelevant for a bound."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def _check_pld_work(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> None:
    """Refuse a Poisson PLD computation that would take minutes or exhaust memory (see ``PLD_MAX_*``)."""
    if steps > PLD_MAX_STEPS:
        raise ValueError(f"steps={steps} is beyond the PLD accountant's limit of {PLD_MAX_STEPS:.0e} composed steps "
                         f"(its memory grows with the steps); use accountant='rdp' (--accountant rdp)")
    if noise_multiplier > 0 and steps > 0:
        with quiet_rdp_warnings():
            bound = _event_epsilon(_poisson_event(noise_multiplier, sampling_rate, steps), delta, "rdp")
        if bound > PLD_MAX_EPSILON:
            raise ValueError(f"noise_multiplier={noise_multiplier:g} at q={sampling_rate:g} over {steps} steps gives "
                             f"epsilon ~{bound:.3g} (RDP bound): beyond the PLD accountant's limit of epsilon "
                             f"{PLD_MAX_EPSILON:g} (no meaningful guarantee, and PLD would take minutes); use more "
                             f"noise, or accountant='rdp' (--accountant rdp) for the figure")


def _check_pld_target(target_epsilon: float) -> None:
    if target_epsilon > PLD_MAX_EPSILON:
        raise ValueError(f"target epsilon {target_epsilon:g} is beyond the PLD accountant's limit of "
                         f"{PLD_MAX_EPSILON:g} (e^{PLD_MAX_EPSILON:g}: no meaningful guarantee, and PLD would take "
                         f"minutes); use accountant='rdp' (--accountant rdp), or no_dp for a non-private run")


def _poisson_event(noise_multiplier: float, sampling_rate: float, steps: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )


def _event_epsilon(event: dp_accounting.DpEvent, delta: float, accountant: str) -> float:
    """Epsilon of one Poisson ``event`` composed from scratch (no memo: calibration's trial sigmas, bounds)."""
    acc: dp_accounting.PrivacyAccountant = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def _fixed_size_batch(sampling_rate: float, dataset_size: int | None) -> tuple[int, int]:
    if dataset_size is None:
        raise ValueError("dataset_size is required for sampling='fixed-size'")
    n = _check_steps(dataset_size, "dataset_size")
    m = round(sampling_rate * n)
    if n == 0 or not math.isclose(m / n, sampling_rate, rel_tol=1e-9):
        raise ValueError(f"sampling_rate={sampling_rate} times dataset_size={n} is not a whole batch size")
    return n, m


def epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float, accountant: str = "pld", *,
            sampling: str = "poisson", dataset_size: int | None = None) -> float:
    """Epsilon of ``steps`` subsampled Gaussian steps at ``delta``.

    ``sampling="poisson"`` (default): add-or-remove-one adjacency.  ``sampling="fixed-size"``: batches of exactly
    ``sampling_rate * dataset_size`` examples without replacement, replace-one adjacency, RDP only (module doc).
    """
    sigma, q, steps, delta = _check_noise(noise_multiplier), _check_rate(sampling_rate), _check_steps(steps), \
        _check_delta(delta)
    _check_accountant(accountant)
    if sampling == "fixed-size":
        n, m = _fixed_size_batch(q, dataset_size)
        if steps == 0:
            return 0.0
        if sigma == 0:
            return math.inf
        if accountant == "pld":
            raise ValueError('fixed-size (without-replacement) sampling is not supported by the PLD accountant; '
                             'use accountant="rdp"')
        key = ((("batch_size", m), ("count", steps), ("dataset_size", n), ("noise_multiplier", sigma),
                ("sampling", "fixed-size")),)
        return _from_scratch_epsilon(key, delta, accountant)
    if sampling != "poisson":
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if accountant == "pld":
        _check_pld_work(sigma, q, steps, delta)
    return _from_scratch_epsilon(_poisson_key(sigma, q, steps), delta, accountant)


def _poisson_key(sigma: float, q: float, steps: int) -> tuple:
    """The mechanism key (:func:`_mechanism_key`) of a ledger of ``steps`` Poisson steps at (sigma, q)."""
    return ((("count", steps), ("noise_multiplier", sigma), ("sampling", "poisson"), ("sampling_rate", q)),)


def calibrate_noise(target_epsilon: float, sampling_rate: float, steps: int, delta: float, accountant: str = "pld",
                    rtol: float = 5e-3, *, sampling: str = "poisson", dataset_size: int | None = None) -> float:
    """Smallest noise multiplier (to relative tolerance ``rtol``) whose epsilon is <= ``target_epsilon``.

    The returned value always satisfies the budget (it is the upper end of the final bisection bracket).
    ``sampling`` / ``dataset_size`` as in :func:`epsilon`.
    """
    target = _check_target(target_epsilon)
    q, steps, delta = _check_rate(sampling_rate), _check_steps(steps), _check_delta(delta)
    _check_accountant(accountant)
    if accountant == "pld" and sampling == "poisson":
        _check_pld_target(target)
        if steps > PLD_MAX_STEPS:
            _check_pld_work(1.0, q, steps, delta)
    return _calibrate(target, q, steps, delta, accountant, float(rtol), sampling, dataset_size)


@functools.lru_cache(maxsize=64)
def _calibrate(target: float, q: float, steps: int, delta: float, accountant: str, rtol: float, sampling: str,
               dataset_size: int | None) -> float:
    """:func:`calibrate_noise` on checked arguments (memoised: a pure function, and each PLD call is slow)."""
    if sampling == "fixed-size":
        _fixed_size_batch(q, dataset_size)
        if accountant == "pld":
            raise ValueError('fixed-size (without-replacement) sampling is not supported by the PLD accountant; '
                             'use accountant="rdp"')
    elif sampling != "poisson":
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if steps == 0:
        return 0.0

    def eps(s: float) -> float:
        if sampling == "poisson":   # checked above; trial sigmas below the answer may exceed the PLD limits briefly
            if s <= 0:
                return math.inf
            # from scratch, exactly as the ledger of a run at sigma s is composed, and remembered: the trainer's
            # epsilon of record for the calibrated sigma is then this very value (_from_scratch_epsilon)
            key = _poisson_key(s, q, steps)
            return _from_scratch_epsilon(key, delta, accountant, lambda: _compose_from_scratch(key, accountant))
        return epsilon(s, q, steps, delta, accountant, sampling=sampling, dataset_size=dataset_size)

    # RDP is cheap and (up to discretisation) never below PLD, so its answer is a good upper starting point for PLD;
    # integer orders only (START_RDP_ORDERS): a few milliseconds per trial sigma instead of ~0.2 s (fractional
    # orders are series), and the start need not be tight (the coarse search below moves from it).
    start = _rdp_start(target, q, steps, delta) if accountant == "pld" else 1.0
    interval = coarse_interval(target)
    if accountant == "pld" and sampling == "poisson" and interval > 1e-4:
        # Locate sigma with a coarse PLD (milliseconds per call), then settle it at full resolution: usually two
        # calls, eps(hi) <= target and eps(hi * (1 - rtol)) > target, which is the bracket the contract asks for.
        def coarse(s: float) -> float:
            acc = pld.PLDAccountant(value_discretization_interval=interval)
            acc.compose(_poisson_event(s, q, steps))
            return float(acc.get_epsilon(delta))

        start = _bracket_search(coarse, target, start, 0.8, rtol)
        if eps(start) <= target and eps(start * (1.0 - rtol)) > target:
            return start
    return _bracket_search(eps, target, start, 0.8 if accountant == "pld" else 0.5, rtol)


START_RDP_ORDERS = tuple(range(2, 65)) + (128, 256)   # the RDP orders of calibration's starting point (_rdp_start)


def _rdp_start(target: float, q: float, steps: int, delta: float) -> float:
    """Noise multiplier (to 5%) whose RDP bound over ``START_RDP_ORDERS`` meets ``target``: where calibration's PLD
    search starts. A bound over fewer orders is still an upper bound on epsilon, only possibly looser, so the start
    is still (up to PLD discretisation) on the safe side of the answer."""
    def bound(s: float) -> float:
        acc = rdp.RdpAccountant(list(START_RDP_ORDERS))
        acc.compose(_poisson_event(s, q, steps))
        return float(acc.get_epsilon(delta))

    with quiet_rdp_warnings():
        return _bracket_search(bound, target, 1.0, 0.5, 0.05)


def coarse_interval(eps: float) -> float:
    """A PLD discretisation for quick answers near ``eps``: ``1.5e-4 * eps``, never finer than 1e-4.

    A composed PLD spans a privacy-loss range of a few times its epsilon, so this keeps it to roughly 20,000 points
    (milliseconds to compose and query). Coarser discretisation is still pessimistic (an upper bound), a little
    looser: 0.01-0.2% in epsilon on the runs measured up to epsilon 50; about 5% at epsilon 300 over 30,000 steps,
    where per-step rounding accumulates. Used to locate sigma in calibration (then settled at full
    resolution) and for the trainer's per-row epsilon (:mod:`dpzero_jax.running_accountant`).
    """
    if eps is None or not math.isfinite(eps):
        return 1e-4
    return float(f"{max(1e-4, 1.5e-4 * eps):.2g}")


def _bracket_search(eps, target: float, hi: float, lo_factor: float, rtol: float) -> float:
    """Smallest sigma (to ``rtol``) with ``eps(sigma) <= target``, searching from ``hi``: bracket, then shrink."""
    eps_hi = eps(hi)
    while eps_hi > target:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"target_epsilon={target} is unreachable with noise_multiplier <= 1e6")
        eps_hi = eps(hi)
    lo = hi * lo_factor
    eps_lo = eps(lo)
    while lo > 1e-3 and eps_lo <= target:  # move lo down until it violates the budget
        hi, eps_hi, lo = lo, eps_lo, lo / 2.0
        eps_lo = eps(lo)
    if eps_lo <= target:
        return hi
    return _shrink_bracket(eps, target, lo, eps_lo, hi, eps_hi, rtol)


def _shrink_bracket(eps, target: float, lo: float, eps_lo: float, hi: float, eps_hi: float, rtol: float) -> float:
    """Shrink ``[lo, hi]`` (``eps(lo) > target >= eps(hi)``) until ``hi - lo <= rtol * hi``; return ``hi``.

    Illinois-modified regula falsi on ``log eps`` against ``log sigma`` (nearly linear there), with each trial kept
    a quarter-tolerance inside the bracket so that both ends move: a handful of accountant calls instead of the
    ~8 of bisection.  Infinite epsilons (sigma too small) fall back to bisection.
    """
    x_lo, x_hi = math.log(lo), math.log(hi)
    log_t = math.log(target)
    f_lo = math.log(eps_lo) - log_t if math.isfinite(eps_lo) else math.inf
    f_hi = math.log(eps_hi) - log_t if eps_hi > 0 else -math.inf
    side = 0
    while hi - lo > rtol * hi:
        margin = 0.25 * -math.log1p(-rtol)  # a quarter of the tolerance, in log sigma
        if math.isfinite(f_lo) and math.isfinite(f_hi) and f_lo != f_hi:
            x = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo)
        else:
            x = 0.5 * (x_lo + x_hi)
        x = min(max(x, x_lo + margin), x_hi - margin)
        if x <= x_lo or x >= x_hi:
            x = 0.5 * (x_lo + x_hi)
        value = eps(math.exp(x))
        f = math.log(value) - log_t if 0 < value < math.inf else (math.inf if value > 0 else -math.inf)
        if f <= 0:  # x satisfies the budget: new upper end
            x_hi, f_hi, hi = x, f, math.exp(x)
            if side == -1:
                f_lo *= 0.5
            side = -1
        else:
            x_lo, f_lo, lo = x, f, math.exp(x)
            if side == 1:
                f_hi *= 0.5
            side = 1
    return hi


def max_steps(noise_multiplier: float, sampling_rate: float, target_epsilon: float, delta: float,
              accountant: str = "pld", limit: int = 10**8) -> int:
    """Largest number of steps whose epsilon is <= ``target_epsilon`` (capped at ``limit``).

    With PLD, step counts beyond ``PLD_MAX_STEPS`` or whose RDP bound exceeds ``PLD_MAX_EPSILON`` are judged by the
    RDP bound (an upper bound on epsilon: the answer can only be smaller, never a weaker guarantee). Arguments may be
    given by keyword: ``max_steps(noise_multiplier=, sampling_rate=, target_epsilon=, delta=)``."""
    sigma, q, target, delta = _check_noise(noise_multiplier), _check_rate(sampling_rate), \
        _check_target(target_epsilon), _check_delta(delta)
    _check_accountant(accountant)
    limit = _check_steps(limit, "limit")
    if accountant == "pld":
        _check_pld_target(target)

    def ok(k: int) -> bool:
        if sigma == 0:
            return False
        if accountant == "pld":   # beyond the PLD limits the RDP bound decides (conservative: never more steps)
            bound = _event_epsilon(_poisson_event(sigma, q, k), delta, "rdp")
            if k > PLD_MAX_STEPS or bound > PLD_MAX_EPSILON:
                return bound <= target
        return _event_epsilon(_poisson_event(sigma, q, k), delta, accountant) <= target

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


def entries_event(entries) -> dp_accounting.DpEvent:
    """The composed ``dp_accounting`` event of ledger entries (dicts as :meth:`PrivacyLedger.record` makes them;
    fixed-size sigma halved: replace-one adjacency).

    With adaptive clipping an entry's inner event is the composition of the gradient's and the count's Gaussians
    (``dp_accounting``'s RDP accountant composes it; its PLD accountant takes only a Gaussian there, so the ledger's
    epsilon composes the equivalent Gaussian at ``noise_multiplier``: :mod:`dpzero_jax.adaptive_clipping`).
    """
    events = []
    for e in entries:
        if "count_noise_multiplier" in e:
            parts = (e["gradient_noise_multiplier"], e["count_noise_multiplier"])
        else:
            parts = (e["noise_multiplier"],)
        if e["sampling"] == "poisson":
            inner = [dp_accounting.GaussianDpEvent(z) for z in parts]
            sampled = dp_accounting.PoissonSampledDpEvent(
                e["sampling_rate"], inner[0] if len(inner) == 1 else dp_accounting.ComposedDpEvent(inner))
        else:
            inner = [dp_accounting.GaussianDpEvent(z / 2.0) for z in parts]
            sampled = dp_accounting.SampledWithoutReplacementDpEvent(
                e["dataset_size"], e["batch_size"],
                inner[0] if len(inner) == 1 else dp_accounting.ComposedDpEvent(inner))
        events.append(dp_accounting.SelfComposedDpEvent(sampled, e["count"]))
    return dp_accounting.ComposedDpEvent(events)


_NOT_MECHANISM = ("truncation_probability", "count_noise_multiplier", "gradient_noise_multiplier")


def _mechanism_key(entries: tuple) -> tuple:
    """The composed mechanism of a ledger given as a tuple of entries: counts kept, truncation dropped (charged to
    delta), and adaptive clipping's split of sigma dropped (both parts together are exactly the Gaussian at the
    entry's ``noise_multiplier``: :mod:`dpzero_jax.adaptive_clipping`)."""
    return tuple(tuple(sorted((k, v) for k, v in e if k not in _NOT_MECHANISM)) for e in entries)


def _compose_from_scratch(key: tuple, accountant: str) -> dp_accounting.PrivacyAccountant:
    """``dp_accounting`` accountant (default resolution) that has composed the ledger ``key`` from scratch."""
    entries = [dict(e) for e in key]
    replace_one = entries[0]["sampling"] == "fixed-size"
    if accountant == "pld":
        if replace_one:
            raise ValueError(
                'fixed-size (without-replacement) sampling is not supported by the PLD accountant; use accountant="rdp"'
            )
        acc: dp_accounting.PrivacyAccountant = pld.PLDAccountant()
    else:
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE) if replace_one \
            else rdp.RdpAccountant()
    acc.compose(entries_event(entries))
    return acc


# memoised, a few only (a PLD of a long run holds millions of points): certified_epsilon's fixed-point iteration asks
# one composition at several deltas
_composed = functools.lru_cache(maxsize=3)(_compose_from_scratch)

# (mechanism key, delta, accountant) -> epsilon from scratch at the accountant's default resolution. Floats only (the
# compositions are not kept): calibration fills it for the sigmas it tries, so the epsilon of record of a calibrated
# run -- the same composition at the same delta -- costs nothing at the end of training.
_EPSILONS: dict[tuple, float] = {}
_EPSILONS_MAX = 256


def _from_scratch_epsilon(key: tuple, delta: float, accountant: str, compose=None) -> float:
    """``dp_accounting``'s epsilon at ``delta`` of the ledger ``key`` composed from scratch (memoised in
    ``_EPSILONS``). ``compose()``: the accountant to use on a miss (default: :func:`_composed`, kept for the next
    delta); a caller that does not need the composition again passes :func:`_compose_from_scratch`."""
    memo = (key, float(delta), accountant)
    if memo not in _EPSILONS:
        acc = compose() if compose is not None else _composed(key, accountant)
        if len(_EPSILONS) >= _EPSILONS_MAX:
            del _EPSILONS[next(iter(_EPSILONS))]
        _EPSILONS[memo] = float(acc.get_epsilon(delta))
    return _EPSILONS[memo]
