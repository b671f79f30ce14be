"""The one-run privacy audit (dpzero_jax.audit): the bound against direct binomial sums, soundness of the real
mechanism, and power against mechanisms broken here (and only here) by monkeypatching.

Runs: MLP (hidden 16) on the digits, 30 steps, expected batch 128 (q ~ 0.089), m = 256 gradient canaries, confidence
0.95, delta 1e-5 -- the numbers docs/audit.md states."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from dpzero_jax import audit as audit_lib
from dpzero_jax import clipping, engine, noise, train_step
from dpzero_jax import train as train_mod
from dpzero_jax.audit import AuditConfig, audit, epsilon_lower_bound, guess_and_bound, p_value
from dpzero_jax.train import TrainConfig

M = 256
RUN = dict(hidden=(16,), steps=30, batch_size=128, delta=1e-5, checkpoint_every=0, eval_every=0, log_every=50,
           progress=False, plot=False, lr=0.01)


# ---------------------------------------------------------------- the bound, computed independently
def _tail(r, v, p):
    """P[Binomial(r, p) >= v] summed term by term with exact binomial coefficients."""
    return sum(math.comb(r, j) * p**j * (1 - p)**(r - j) for j in range(v, r + 1))


def _reference_p_value(m, r, v, eps, delta):
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, j) * p**j * (1 - p)**(r - j) for j in range(r + 1)]
    charge = max((sum(pmf[v - i:v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, _tail(r, v, p) + 2 * m * delta * charge)


@pytest.mark.parametrize("m,r,v,eps,delta", [(100, 20, 18, 1.0, 0.0), (1000, 50, 45, 2.0, 1e-5),
                                              (1000, 100, 70, 0.5, 1e-4), (10, 10, 10, 3.0, 1e-3),
                                              (500, 40, 0, 1.0, 1e-5), (256, 26, 26, 0.3, 1e-5)])
def test_p_value_matches_direct_binomial_sums(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(_reference_p_value(m, r, v, eps, delta), rel=1e-9,
                                                         abs=1e-15)


@pytest.mark.parametrize("r,v", [(20, 18), (50, 50), (100, 80), (26, 22)])
def test_lower_bound_without_delta_solves_the_binomial_tail(r, v):
    """delta = 0: the bound is the epsilon at which P[Binomial(r, e^eps / (1 + e^eps)) >= v] = 0.05 (brentq)."""
    def excess(eps):
        return scipy.stats.binom.sf(v - 1, r, 1 / (1 + math.exp(-eps))) - 0.05

    expected = scipy.optimize.brentq(excess, 0.0, 50.0, xtol=1e-10)
    assert epsilon_lower_bound(1000, r, v, 0.0, 0.95) == pytest.approx(expected, rel=1e-5)


def test_lower_bound_is_zero_at_chance_and_grows_with_correct_guesses():
    assert epsilon_lower_bound(1000, 100, 50, 1e-5, 0.95) == 0.0
    bounds = [epsilon_lower_bound(1000, 100, v, 1e-5, 0.95) for v in (70, 80, 90, 100)]
    assert bounds == sorted(bounds) and bounds[0] > 0
    # delta's charge only lowers the bound
    assert epsilon_lower_bound(1000, 100, 90, 1e-4, 0.95) < epsilon_lower_bound(1000, 100, 90, 0.0, 0.95)


def test_guess_and_bound_counts_and_bonferroni():
    included = np.array([True] * 10 + [False] * 10)
    scores = np.concatenate([np.arange(10, 20), np.arange(10)]).astype(float)   # perfectly separated
    out = guess_and_bound(scores, included, 0.0, 0.95, guesses=(4, 20))
    assert [row["correct"] for row in out["by_guesses"]] == [4, 20]
    assert out["guesses"] == 20 and out["correct"] == 20 and out["included"] == 10
    # each r is bounded at 1 - 0.05 / 2
    assert out["epsilon_lower_bound"] == pytest.approx(epsilon_lower_bound(20, 20, 20, 0.0, 0.975))
    flipped = guess_and_bound(-scores, included, 0.0, 0.95, guesses=(4, 20))
    assert flipped["correct"] == 0 and flipped["epsilon_lower_bound"] == 0.0


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="v <= r <= m"):
        p_value(10, 5, 6, 1.0, 0.0)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(10, 5, 5, 0.0, 1.0)
    with pytest.raises(ValueError, match="guesses"):
        guess_and_bound(np.zeros(4), np.ones(4, bool), 0.0, 0.95, guesses=(5,))
    with pytest.raises(ValueError, match="canaries=0 and input_canaries=0"):
        AuditConfig(canaries=0)
    with pytest.raises(ValueError, match="Poisson"):
        audit(TrainConfig(sampling="fixed-size", accountant="rdp"), AuditConfig())


def test_canary_is_clipped_by_the_engines_function():
    """A gradient canary's clipped norm per group is R_g (abadi, 10x the threshold before clipping)."""
    canaries = audit_lib.GradientCanaries(4, 0.5, 8, np.ones(4, bool), canary_norm=10.0)
    shapes = [(3, 5), (5,), (7,)]
    leaves = canaries._clipped(jax.random.key(0), shapes, (0, 0, 1), (0.6, 0.8))
    norms = [math.sqrt(float(jnp.sum(leaves[0] ** 2) + jnp.sum(leaves[1] ** 2))), float(jnp.linalg.norm(leaves[2]))]
    assert norms == pytest.approx([0.6, 0.8], rel=1e-5)


# ---------------------------------------------------------------- runs
def _audit(tmp_path, audit_config=None, **overrides):
    cfg = TrainConfig(out=str(tmp_path / "run"), **{**RUN, **overrides})
    return audit(cfg, audit_config or AuditConfig(canaries=M))


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(epsilon=1.0), dict(epsilon=8.0), dict(epsilon=3.0, groups="layer-wise"),
                                       dict(epsilon=3.0, devices=8)],
                         ids=["eps1", "eps8", "grouped", "sharded8"])
def test_sound_for_the_real_mechanism(tmp_path, overrides):
    report = _audit(tmp_path, **overrides)
    res = report.results["gradient"]
    assert 0.0 <= res["epsilon_lower_bound"] <= report.epsilon, res


# ---------------------------------------------------------------- broken mechanisms (built only here)
def _noise_scaled(monkeypatch, factor):
    real = noise.privatize

    def privatize(clipped_sum, key, noise_multiplier, *args, **kwargs):
        return real(clipped_sum, key, noise_multiplier * factor, *args, **kwargs)
    monkeypatch.setattr(noise, "privatize", privatize)


def _clipping_skipped(monkeypatch):
    def coefficients(norms, thresholds, keep, clip_fn, gamma=0.01):
        return jnp.broadcast_to(jnp.asarray(keep, jnp.float32)[:, None], norms.shape)
    monkeypatch.setattr(clipping, "coefficients", coefficients)


def _realised_divisor(monkeypatch):
    """The clipped sum divided by the realised batch (examples that contributed), the noise by the expected one;
    90% of the training images are NaN (dropped by the engine), so the realised batch is ~1/10 of the expected."""
    real_privatize, real_load = noise.privatize, train_mod._load_data

    def broken(loss_fn, cfg, *, has_aux=False, clipped_sum_hook=None):
        def grad(params, batch, key, mask=None, thresholds=None):   # fixed thresholds: an audit refuses adaptive
            plan, result, stats = engine._clip(loss_fn, cfg, params, batch, mask)
            total = clipped_sum_hook(result.clipped_sum, key, plan)
            realised = jnp.maximum(stats.num_included.astype(jnp.float32), 1.0)
            noised = real_privatize(jax.tree.map(jnp.zeros_like, total), key, cfg.noise_multiplier,
                                    clipping.l2_sensitivity(plan.thresholds), cfg.expected_batch_size, cfg.noise_rng)
            return result.losses, jax.tree.map(lambda s, z: s / realised + z, total, noised), stats
        return grad

    def load(cfg):
        train, test, names = real_load(cfg)
        images = train["image"].copy()
        images[np.random.default_rng(0).random(images.shape[0]) < 0.9] = np.nan
        return {**train, "image": images}, test, names

    monkeypatch.setattr(train_step, "private_value_and_grad", broken)   # the trainer's step calls it there
    monkeypatch.setattr(train_mod, "_load_data", load)


BROKEN = {"noise_off": lambda mp: _noise_scaled(mp, 0.0), "noise_tenth": lambda mp: _noise_scaled(mp, 0.1),
          "clipping_skipped": _clipping_skipped, "realised_batch": _realised_divisor}


@pytest.mark.parametrize("variant", ["noise_off"])
def test_white_box_catches_a_broken_mechanism(tmp_path, monkeypatch, variant):
    BROKEN[variant](monkeypatch)
    report = _audit(tmp_path, epsilon=1.0)
    res = report.results["gradient"]
    assert res["epsilon_lower_bound"] > report.epsilon, res
    assert report.violated


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["noise_tenth", "clipping_skipped", "realised_batch"])
def test_white_box_catches_a_broken_mechanism_slow(tmp_path, monkeypatch, variant):
    test_white_box_catches_a_broken_mechanism(tmp_path, monkeypatch, variant)


def test_sound_at_epsilon_3_with_both_kinds_of_canaries_from_the_cli(tmp_path, capsys):
    """``dpzero audit --json``: the real mechanism at epsilon 3, gradient and input canaries; the printed JSON is
    audit.json; both lower bounds within [0, epsilon]."""
    from dpzero_jax.cli import main

    out = tmp_path / "cli"
    code = main(["audit", "--epsilon", "3", "--steps", "30", "--batch-size", "128", "--hidden", "16", "--lr", "0.01",
                 "--canaries", str(M), "--input-canaries", "100", "--checkpoint-every", "0", "--eval-every", "0",
                 "--no-progress", "--out", str(out), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "audit.json").read_text())
    assert printed["epsilon"] == pytest.approx(3.0, rel=1e-3) and printed["confidence"] == 0.95
    assert printed["steps"] == 30 and set(printed["results"]) == {"gradient", "input"}
    for kind, res in printed["results"].items():
        assert res["canaries"] == (M if kind == "gradient" else 100)
        assert 0.0 <= res["epsilon_lower_bound"] <= printed["epsilon"], (kind, res)
        assert res["correct"] <= res["guesses"] == max(res["by_guesses"], key=lambda r: r["epsilon_lower_bound"])[
            "guesses"]
    assert main(["audit", "--canaries", "0", "--out", str(tmp_path / "none")]) == 2
    assert "nothing to audit" in capsys.readouterr().err


def test_report_table_names_the_columns():
    report = audit_lib.AuditReport(epsilon=1.0, delta=1e-5, confidence=0.95, steps=3, noise_multiplier=1.0,
                                   sampling_rate=0.1, results={"gradient": guess_and_bound(
                                       np.arange(8.0), np.arange(8) >= 4, 1e-5, 0.95)})
    assert "eps lower bound" in report.table() and "accountant eps" in report.table()
    assert report.violated == (report.results["gradient"]["epsilon_lower_bound"] > 1.0)
