"""Tests of dpzero_jax.accounting against dp_accounting directly and the analytic Gaussian mechanism."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy.optimize import brentq
from scipy.stats import norm

from dpzero_jax import accounting as acc
from dpzero_jax.accounting import calibration

DELTA = 1e-5


def analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with sensitivity 1 (Balle & Wang 2018, Theorem 8)."""

    def delta_of(eps: float) -> float:
        return norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)

    if delta_of(0.0) <= delta:
        return 0.0
    return brentq(lambda e: delta_of(e) - delta, 0.0, 500.0, xtol=1e-12)


def direct(sigma, q, steps, delta, accountant):
    a = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    a.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return a.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.01, 1000), (0.8, 0.05, 200), (2.0, 1.0, 10)])
def test_epsilon_matches_dp_accounting(accountant, sigma, q, steps):
    got = acc.epsilon(sigma, q, steps, DELTA, accountant=accountant)
    assert got == pytest.approx(direct(sigma, q, steps, DELTA, accountant), rel=1e-9)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0, 5.0])
def test_unsubsampled_gaussian_matches_analytic(sigma):
    exact = analytic_gaussian_epsilon(sigma, DELTA)
    assert acc.epsilon(sigma, 1.0, 1, DELTA) == pytest.approx(exact, rel=1e-2)
    assert acc.epsilon(sigma, 1.0, 1, DELTA, accountant="rdp") >= exact * (1 - 1e-9)


@pytest.mark.parametrize("k", [4, 25])
def test_composition_of_gaussians_is_one_gaussian(k):
    sigma = 3.0
    exact = analytic_gaussian_epsilon(sigma / math.sqrt(k), DELTA)
    assert acc.epsilon(sigma, 1.0, k, DELTA) == pytest.approx(exact, rel=1e-2)
    assert acc.epsilon(sigma, 1.0, k, DELTA, accountant="rdp") >= exact * (1 - 1e-9)


def test_edge_cases():
    assert acc.epsilon(1.0, 0.01, 0, DELTA) == 0.0
    assert acc.epsilon(0.0, 0.01, 0, DELTA) == 0.0
    assert acc.epsilon(0.0, 0.01, 5, DELTA) == math.inf
    assert acc.epsilon(0.0, 0.01, 5, DELTA, accountant="rdp") == math.inf
    assert acc.epsilon(1.0, 0.01, np.int64(10), DELTA) > 0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target", [1.0, 2.5])
def test_calibrate_noise_round_trip(accountant, target):
    q, steps = 0.02, 200
    sigma = acc.calibrate_noise(target, q, steps, DELTA, accountant=accountant)
    eps = acc.epsilon(sigma, q, steps, DELTA, accountant=accountant)
    assert target * 0.98 <= eps <= target
    assert acc.epsilon(sigma * 0.99, q, steps, DELTA, accountant=accountant) > target * 0.98


@pytest.mark.parametrize("target,q,steps", [(3.0, 256 / 1437, 300), (8.0, 256 / 1437, 1000), (50.0, 256 / 1437, 3000)])
def test_calibration_against_dp_accounting(target, q, steps, monkeypatch):
    """The calibrated sigma meets the target and sigma * (1 - rtol) does not, by dp_accounting from scratch at its
    default resolution; the epsilon of a ledger at that sigma is that same composition, remembered from
    calibration (nothing composed again) and equal to a fresh one."""
    delta, rtol = DELTA * (1 - acc.TRUNCATION_SHARE), 5e-3

    def scratch(sigma):
        a = pld.PLDAccountant()
        a.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return a.get_epsilon(delta)

    calibration._calibrate.cache_clear()
    calibration._EPSILONS.clear()
    sigma = acc.calibrate_noise(target, q, steps, delta)
    expected = scratch(sigma)
    assert expected <= target < scratch(sigma * (1 - rtol))
    composed = []
    for name in ("_compose_from_scratch", "_composed"):
        original = getattr(calibration, name)
        monkeypatch.setattr(calibration, name, lambda *a, _f=original: composed.append(a) or _f(*a))
    ledger = acc.PrivacyLedger()
    ledger.record(sigma, q, steps=steps)
    assert ledger.epsilon(delta) == expected and composed == []


def test_calibration_start_is_an_upper_rdp_bound():
    """Calibration starts its PLD search from an RDP bound over integer orders only: never below the bound over
    dp_accounting's default orders (fewer orders, a looser bound), so the start stays on the safe side."""
    q, steps, delta = 256 / 1437, 3000, DELTA
    start = calibration._rdp_start(50.0, q, steps, delta)
    full = rdp.RdpAccountant()
    full.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(start)), steps)
    few = rdp.RdpAccountant(list(acc.START_RDP_ORDERS))
    few.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(start)), steps)
    assert few.get_epsilon(delta) <= 50.0
    assert full.get_epsilon(delta) <= few.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_max_steps_consistent(accountant):
    sigma, q, target = 1.0, 0.02, 2.0
    n = acc.max_steps(sigma, q, target, DELTA, accountant=accountant)
    assert n > 0
    assert acc.epsilon(sigma, q, n, DELTA, accountant=accountant) <= target
    assert acc.epsilon(sigma, q, n + 1, DELTA, accountant=accountant) > target


def test_max_steps_edge_cases():
    assert acc.max_steps(0.0, 0.01, 1.0, DELTA) == 0
    assert acc.max_steps(0.3, 1.0, 0.1, DELTA) == 0
    assert acc.max_steps(1e4, 0.001, 10.0, DELTA, accountant="rdp", limit=1000) == 1000


def test_ledger_merges_and_round_trips():
    ledger = acc.PrivacyLedger()
    for _ in range(100):
        ledger.record(1.1, 0.01)
    ledger.record(1.1, 0.01, steps=50)
    ledger.record(1.1, 0.01, steps=0)
    ledger.record(0.9, 0.02, steps=30)
    ledger.record(1.1, 0.01, steps=20)
    assert [e["count"] for e in ledger.entries] == [150, 30, 20]
    assert ledger.steps == 200

    restored = acc.PrivacyLedger.from_json(ledger.to_json())
    assert restored == ledger
    assert acc.PrivacyLedger.from_dict(ledger.to_dict()) == ledger

    for accountant in ["pld", "rdp"]:
        a = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
        for s, q, k in [(1.1, 0.01, 150), (0.9, 0.02, 30), (1.1, 0.01, 20)]:
            a.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), k)
        expected = a.get_epsilon(DELTA)
        assert restored.epsilon(DELTA, accountant=accountant) == pytest.approx(expected, rel=1e-6)
    # a single-scheme ledger agrees with the function
    single = acc.PrivacyLedger()
    single.record(1.1, 0.01, steps=300)
    assert single.epsilon(DELTA) == pytest.approx(acc.epsilon(1.1, 0.01, 300, DELTA), rel=1e-9)
    assert acc.PrivacyLedger().epsilon(DELTA) == 0.0


def test_ledger_fixed_size():
    ledger = acc.PrivacyLedger()
    ledger.record(2.0, steps=100, sampling="fixed-size", dataset_size=1000, batch_size=10)
    ledger.record(2.0, 0.01, steps=100, sampling="fixed-size", dataset_size=1000, batch_size=10)
    assert len(ledger.entries) == 1 and ledger.entries[0]["count"] == 200
    a = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    inner = dp_accounting.GaussianDpEvent(1.0)  # replace-one sensitivity is 2C: sigma / 2
    a.compose(dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, inner), 200)
    assert ledger.epsilon(DELTA, accountant="rdp") == pytest.approx(a.get_epsilon(DELTA), rel=1e-9)
    assert acc.PrivacyLedger.from_json(ledger.to_json()) == ledger
    with pytest.raises(ValueError, match="rdp"):
        ledger.epsilon(DELTA)  # PLD does not support sampling without replacement
    ledger.record(2.0, 0.01)
    with pytest.raises(ValueError, match="mixes"):
        ledger.epsilon(DELTA, accountant="rdp")
    with pytest.raises(ValueError, match="sampling_rate"):
        ledger.record(2.0, 0.5, sampling="fixed-size", dataset_size=1000, batch_size=10)
    with pytest.raises(ValueError, match="dataset_size"):
        ledger.record(2.0, sampling="fixed-size", batch_size=10)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: acc.epsilon(1.0, 0.0, 10, DELTA), "sampling_rate"),
        (lambda: acc.epsilon(1.0, 1.5, 10, DELTA), "sampling_rate"),
        (lambda: acc.epsilon(-1.0, 0.1, 10, DELTA), "noise_multiplier"),
        (lambda: acc.epsilon(float("nan"), 0.1, 10, DELTA), "noise_multiplier"),
        (lambda: acc.epsilon(1.0, 0.1, -1, DELTA), "steps"),
        (lambda: acc.epsilon(1.0, 0.1, 2.5, DELTA), "steps"),
        (lambda: acc.epsilon(1.0, 0.1, True, DELTA), "steps"),
        (lambda: acc.epsilon(1.0, 0.1, 10, 0.0), "delta"),
        (lambda: acc.epsilon(1.0, 0.1, 10, 1.0), "delta"),
        (lambda: acc.epsilon(1.0, 0.1, 10, DELTA, accountant="gdp"), "accountant"),
        (lambda: acc.calibrate_noise(0.0, 0.1, 10, DELTA), "target_epsilon"),
        (lambda: acc.calibrate_noise(-1.0, 0.1, 10, DELTA), "target_epsilon"),
        (lambda: acc.max_steps(1.0, 0.1, 0.0, DELTA), "target_epsilon"),
        (lambda: acc.max_steps(1.0, 0.1, 1.0, 2.0), "delta"),
        (lambda: acc.PrivacyLedger().record(1.0, 0.1, sampling="shuffle"), "sampling"),
        (lambda: acc.PrivacyLedger().record(1.0, None), "sampling_rate"),
        (lambda: acc.PrivacyLedger().epsilon(DELTA, accountant="x"), "accountant"),
    ],
)
def test_bad_inputs_raise(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def _replace_one_rdp(sigma, n, m, steps, delta):
    a = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    a.compose(dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(sigma / 2)), steps)
    return a.get_epsilon(delta)


def test_fixed_size_epsilon_and_calibration():
    n, m, steps = 1000, 50, 300
    got = acc.epsilon(3.0, m / n, steps, DELTA, "rdp", sampling="fixed-size", dataset_size=n)
    assert got == pytest.approx(_replace_one_rdp(3.0, n, m, steps, DELTA), rel=1e-9)
    sigma = acc.calibrate_noise(2.0, m / n, steps, DELTA, "rdp", sampling="fixed-size", dataset_size=n)
    assert _replace_one_rdp(sigma, n, m, steps, DELTA) <= 2.0
    assert _replace_one_rdp(sigma * 0.99, n, m, steps, DELTA) > 2.0
    with pytest.raises(ValueError, match="PLD"):
        acc.calibrate_noise(2.0, m / n, steps, DELTA, sampling="fixed-size", dataset_size=n)
    with pytest.raises(ValueError, match="whole batch size"):
        acc.epsilon(3.0, 0.0123456, steps, DELTA, "rdp", sampling="fixed-size", dataset_size=n)


def test_truncation_is_charged_to_delta():
    sigma, q, steps, eta = 1.0, 0.01, 500, 1e-10
    ledger = acc.PrivacyLedger()
    ledger.record(sigma, q, steps=steps, truncation_probability=eta)
    ledger.record_overflow(17)
    eps = ledger.epsilon(DELTA)
    # the certificate: the untruncated mechanism is (eps, delta0)-DP with delta0 = delta - (1 + e^eps) * T * eta
    delta0 = DELTA - (1 + math.exp(eps)) * steps * eta
    assert direct(sigma, q, steps, delta0, "pld") <= eps
    assert eps >= direct(sigma, q, steps, DELTA, "pld")
    assert eps == pytest.approx(direct(sigma, q, steps, DELTA, "pld"), rel=1e-2)  # the slack costs little here
    restored = acc.PrivacyLedger.from_json(ledger.to_json())
    assert restored == ledger and restored.overflowed_steps == [17]
    tiny = acc.PrivacyLedger()  # a truncation mass far below delta (the trainer's case): certified in one call
    tiny.record(sigma, q, steps=steps, truncation_probability=1e-15)
    eps_tiny = tiny.epsilon(DELTA)
    assert direct(sigma, q, steps, DELTA - (1 + math.exp(eps_tiny)) * steps * 1e-15, "pld") <= eps_tiny
    assert eps_tiny == pytest.approx(direct(sigma, q, steps, DELTA, "pld"), rel=1e-3)
    hopeless = acc.PrivacyLedger()
    hopeless.record(sigma, q, steps=steps, truncation_probability=1e-7)  # T * eta = 5e-5 > delta
    assert hopeless.epsilon(DELTA) == math.inf
