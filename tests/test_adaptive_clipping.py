"""Adaptive clipping (Andrew et al. 2021; dpzero_jax.adaptive_clipping): the threshold tracks the target quantile,
the ledger's epsilon is dp-accounting's composition of the gradient and count mechanisms, resume is exact, and the
thresholds work in every engine mode and sharded over 8 virtual devices."""

from __future__ import annotations

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import pld, rdp
from flax import nnx

from dpzero_jax import accounting, adaptive_clipping, checkpoints
from dpzero_jax import layers as dz_nn
from dpzero_jax.config import DPConfig
from dpzero_jax.engine import private_value_and_grad
from dpzero_jax.train import TrainConfig, Trainer

RUN = dict(steps=6, batch_size=64, log_every=2, progress=False, plot=False, checkpoint_every=3, optimizer="sgd",
           lr=0.1, noise_multiplier=1.0, clip_quantile=0.5, clip_lr=0.3, max_grad_norm=100.0)


# ------------------------------------------------------------------------------------------------ the rule itself
@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.9])
def test_threshold_converges_to_the_target_quantile(quantile):
    """Batches drawn from a fixed population of norms: the threshold, started 100x too large, settles at numpy's
    empirical quantile of that population (the fixed point of the update)."""
    population = np.random.default_rng(0).lognormal(mean=0.0, sigma=0.7, size=20_000).astype(np.float32)
    rule = adaptive_clipping.AdaptiveClipping(quantile, count_noise_std=512 / 20, expected_batch_size=512,
                                              learning_rate=0.2)
    target = float(np.quantile(population, quantile))
    norms_of = jnp.asarray(population)

    def step(threshold, key):
        batch_key, noise_key = jax.random.split(key)
        norms = norms_of[jax.random.randint(batch_key, (512,), 0, population.size)]
        threshold, _ = adaptive_clipping.adapt(threshold, norms, jnp.ones(512, bool), noise_key, rule)
        return threshold, threshold[0]

    _, path = jax.lax.scan(step, jnp.asarray([100.0 * target], jnp.float32), jax.random.split(jax.random.key(1), 600))
    settled = np.asarray(path[-200:])
    assert abs(np.mean(settled) / target - 1) < 0.03, (np.mean(settled), target)
    # the fraction of the population under the settled threshold is the quantile
    assert abs(np.mean(population <= np.mean(settled)) - quantile) < 0.02


def test_counts_noise_and_update_by_hand():
    norms = jnp.asarray([[0.5, 3.0], [2.0, 1.0], [jnp.inf, 0.1], [0.1, 0.1]])   # [B=4, M=2]
    mask = jnp.asarray([True, True, True, False])                                 # the last is padding
    thresholds = jnp.asarray([1.0, 2.0])
    # group 0: 1{<=1} = 1, 0, 0 (non-finite counts as clipped) -> centred 1/2 - 1/2 - 1/2; group 1: 0, 1, 1
    np.testing.assert_allclose(adaptive_clipping.unclipped_counts(norms, thresholds, mask), [-0.5, 0.5])
    rule = adaptive_clipping.AdaptiveClipping(0.5, count_noise_std=2.0, expected_batch_size=4.0, learning_rate=0.3)
    key = jax.random.key(7)
    noise = 2.0 * jax.random.normal(jax.random.fold_in(key, adaptive_clipping.COUNT_KEY), (2,))
    new, fraction = adaptive_clipping.adapt(thresholds, norms, mask, key, rule)
    expected_fraction = (np.asarray([-0.5, 0.5]) + np.asarray(noise)) / 4.0 + 0.5
    np.testing.assert_allclose(fraction, expected_fraction, rtol=1e-6)
    np.testing.assert_allclose(new, np.asarray([1.0, 2.0]) * np.exp(-0.3 * (expected_fraction - 0.5)), rtol=1e-6)


def test_noise_split_and_errors():
    z_b = adaptive_clipping.count_noise_multiplier(10.0, 4)       # 2 * 10 / sqrt(4)
    assert z_b == 10.0
    z_g = adaptive_clipping.gradient_noise_multiplier(1.0, z_b)
    assert z_g == pytest.approx((1.0 - 1.0 / 100.0) ** -0.5)      # the paper's (sigma^-2 - (2 sigma_b)^-2)^-1/2
    assert adaptive_clipping.joint_noise_multiplier(z_g, z_b) == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(ValueError, match="must exceed the total noise multiplier"):
        adaptive_clipping.gradient_noise_multiplier(2.0, 1.5)
    with pytest.raises(ValueError, match=r"target_quantile.*\(0, 1\).*1.5"):
        adaptive_clipping.AdaptiveClipping(1.5, count_noise_std=1.0, expected_batch_size=10)
    with pytest.raises(ValueError, match="clip_quantile"):
        TrainConfig(clip_quantile=0.0)
    with pytest.raises(ValueError, match="needs DP"):
        TrainConfig(clip_quantile=0.5, no_dp=True)
    with pytest.raises(ValueError, match="must exceed"):   # sigma_b = 0.1: z_b = 0.2 < sigma = 1
        Trainer(TrainConfig(**{**RUN, "clip_count_noise": 0.1, "out": "/nonexistent/never-written"}))


# ------------------------------------------------------------------------------------------------ accounting
def test_same_batch_composition_is_one_gaussian_at_sigma():
    """dp-accounting composes, inside ONE Poisson sampling, the gradient Gaussian at z_g and the count Gaussian at
    z_b (its RDP accountant reduces the composition itself); that equals one Gaussian at sigma."""
    sigma, q, steps, delta = 0.9, 0.05, 300, 1e-5
    z_b = 2 * 6.0 / math.sqrt(3)                        # sigma_b = 6, M = 3 groups
    z_g = (sigma ** -2 - z_b ** -2) ** -0.5             # the paper's split, written here independently

    def rdp_eps(event):
        acc = rdp.RdpAccountant()
        acc.compose(event)
        return acc.get_epsilon(delta)

    joint = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(z_g), dp_accounting.GaussianDpEvent(z_b)]))
    one = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    assert rdp_eps(dp_accounting.SelfComposedDpEvent(joint, steps)) == pytest.approx(
        rdp_eps(dp_accounting.SelfComposedDpEvent(one, steps)), rel=1e-9)
    # forgetting the count (the gradient's z_g alone) would report less: the comparison can fail
    alone = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z_g))
    assert rdp_eps(dp_accounting.SelfComposedDpEvent(alone, steps)) < 0.995 * rdp_eps(
        dp_accounting.SelfComposedDpEvent(one, steps))

    ledger = accounting.PrivacyLedger()
    ledger.record(sigma, q, steps=steps, count_noise_multiplier=z_b)
    (entry,) = ledger.entries
    assert entry["gradient_noise_multiplier"] == pytest.approx(z_g, rel=1e-12)
    assert ledger.epsilon(delta, "rdp") == pytest.approx(rdp_eps(dp_accounting.SelfComposedDpEvent(joint, steps)),
                                                         rel=1e-9)
    acc = rdp.RdpAccountant()
    acc.compose(ledger.dp_event())                      # the ledger's own event: the composition inside the sampling
    assert acc.get_epsilon(delta) == pytest.approx(ledger.epsilon(delta, "rdp"), rel=1e-9)
    assert accounting.PrivacyLedger.from_dict(ledger.to_dict()) == ledger


def test_fixed_size_ledger_halves_both_parts():
    """Fixed-size batches (replace-one adjacency): the gradient's and the counts' sensitivities both double, so the
    ledger's event is the two halved Gaussians composed inside one sampling without replacement."""
    sigma, z_b, n, m, steps, delta = 1.2, 5.0, 1000, 50, 40, 1e-5
    ledger = accounting.PrivacyLedger()
    ledger.record(sigma, sampling="fixed-size", dataset_size=n, batch_size=m, steps=steps, count_noise_multiplier=z_b)
    z_g = (sigma ** -2 - z_b ** -2) ** -0.5
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        n, m, dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z_g / 2),
                                             dp_accounting.GaussianDpEvent(z_b / 2)])), steps)
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(event)
    assert ledger.epsilon(delta, "rdp") == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    with pytest.raises(ValueError, match="must exceed"):
        ledger.record(sigma, 0.1, count_noise_multiplier=1.0)


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("adaptive")
    trainer = Trainer(TrainConfig(out=str(out), **RUN))
    return trainer, trainer.run(), out


def test_run_epsilon_equals_dp_accounting_composition(adaptive_run):
    """The run's epsilon (PLD, the default accountant) against dp-accounting's PLD of the two mechanisms on the same
    Poisson batch: after scaling each by its noise, one Gaussian of std 1 whose sensitivity is the norm of the two
    sensitivities, sqrt(z_g^-2 + z_b^-2), composed here from the run's sampling rate and step count."""
    trainer, result, _ = adaptive_run
    q, steps, delta = trainer.sampling_rate, RUN["steps"], trainer.config.delta
    z_b = 2 * (RUN["batch_size"] / 20) / math.sqrt(1)        # default sigma_b = expected batch / 20, one group
    z_g = (RUN["noise_multiplier"] ** -2 - z_b ** -2) ** -0.5
    assert result.count_noise_multiplier == pytest.approx(z_b) and result.gradient_noise_multiplier == \
        pytest.approx(z_g, rel=1e-12)
    joint = pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=1.0, sensitivity=math.sqrt(z_g ** -2 + z_b ** -2), sampling_prob=q).self_compose(steps)
    # the trainer's Poisson batches are capped: the truncation charge is taken from delta (accounting.py)
    expected = joint.get_epsilon_for_delta(delta * (1 - accounting.TRUNCATION_SHARE))
    assert result.epsilon == pytest.approx(expected, rel=1e-6)
    # and the RDP view of the recorded ledger composes the two Gaussians inside one sampling event
    ledger = accounting.PrivacyLedger.from_dict(checkpoints_ledger(adaptive_run))
    acc = rdp.RdpAccountant()
    acc.compose(ledger.dp_event())
    two = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(z_g), dp_accounting.GaussianDpEvent(z_b)])), steps)
    ref = rdp.RdpAccountant()
    ref.compose(two)
    assert acc.get_epsilon(delta) == pytest.approx(ref.get_epsilon(delta), rel=1e-9)


def checkpoints_ledger(adaptive_run) -> dict:
    import json

    _, _, out = adaptive_run
    return json.loads((out / "summary.json").read_text())["ledger"]


# ------------------------------------------------------------------------------------------------ resume
def test_resume_is_exact_and_restores_the_thresholds(adaptive_run, tmp_path):
    _, full, _ = adaptive_run
    first = [row["clip_threshold"] for row in full.history]
    assert first[0] < 100.0 and len(set(first)) == len(first)     # the threshold moved every logged row
    cfg = TrainConfig(out=str(tmp_path), **RUN)
    Trainer(cfg).run(stop_at=3)
    restored = checkpoints.restore(tmp_path / "checkpoints", full.params, full.opt_state,
                                   jax.random.key_data(Trainer(cfg).init_key))
    assert restored.step == 3 and len(restored.train_state["clip_thresholds"]) == 1
    assert restored.train_state["clip_thresholds"][0] != 100.0
    resumed = Trainer(cfg).run(resume=True)
    for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert resumed.clip_thresholds == full.clip_thresholds
    by_step = {row["step"]: row["clip_threshold"] for row in resumed.history}   # + the row of the stop at 3
    assert [by_step[row["step"]] for row in full.history] == first
    assert resumed.epsilon == full.epsilon


# ------------------------------------------------------------------------------------------------ engine modes
class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = dz_nn.Linear(6, 16, rngs=rngs)
        self.fc2 = dz_nn.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def _problem():
    model = _MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1)[:, 0]

    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(12, 6)), jnp.float32), "y": jnp.asarray(rng.integers(0, 3, 12))}
    return loss_fn, params, batch


@pytest.mark.parametrize("mode, front_end", [("bk", "layers"), ("ghost", "layers"), ("fused", "layers"),
                                             ("vmap", "layers"), ("bk", "program"), ("ghost", "program")])
def test_traced_thresholds_in_every_engine_mode(mode, front_end):
    """Thresholds given at call time (traced under jit) give exactly the gradient of the same thresholds fixed in
    the config, in each mode, with per-layer groups (M = 2); the norms the count uses are the vmap reference's."""
    loss_fn, params, batch = _problem()
    mask = jnp.arange(12) < 10
    thresholds = np.asarray([0.3, 0.05], np.float32)
    key = jax.random.key(3)
    cfg = DPConfig(noise_multiplier=0.7, groups="layer-wise", mode=mode, noise_rng="partitionable",
                   front_end=front_end)
    traced = jax.jit(lambda p, t: private_value_and_grad(loss_fn, cfg)(p, batch, key, mask, thresholds=t))
    _, grads, stats = traced(params, jnp.asarray(thresholds))
    fixed = private_value_and_grad(loss_fn, cfg.replace(group_thresholds=tuple(thresholds.tolist())))
    _, expected, fixed_stats = fixed(params, batch, key, mask)
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stats.clip_factors, fixed_stats.clip_factors, rtol=1e-6)
    reference = private_value_and_grad(loss_fn, cfg.replace(mode="vmap", front_end="layers"))(
        params, batch, key, mask)[2]
    np.testing.assert_allclose(stats.norms, reference.norms, rtol=1e-5)
    assert stats.norms.shape == (12, 2)
    with pytest.raises(ValueError, match=r"thresholds must have shape \[M\] = \(2,\)"):
        private_value_and_grad(loss_fn, cfg)(params, batch, key, mask, thresholds=jnp.ones(3))


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_trainer_modes_follow_the_same_thresholds(adaptive_run, tmp_path, mode):
    """The trainer in ghost and vmap mode takes the threshold path of the bk (auto) run: same norms, same counts."""
    _, bk, _ = adaptive_run
    other = Trainer(TrainConfig(out=str(tmp_path), **{**RUN, "mode": mode, "checkpoint_every": 0})).run()
    np.testing.assert_allclose([r["clip_threshold"] for r in other.history],
                               [r["clip_threshold"] for r in bk.history], rtol=1e-5)


@pytest.mark.parametrize("mesh, strategy", [("fsdp=8", "gspmd"), ("data=2,fsdp=4", "explicit")])
def test_sharded_over_8_devices_equals_one_device(adaptive_run, tmp_path, mesh, strategy):
    _, one, _ = adaptive_run
    assert jax.device_count() == 8
    eight = Trainer(TrainConfig(out=str(tmp_path), mesh=mesh, strategy=strategy,
                                **{**RUN, "checkpoint_every": 0})).run()
    np.testing.assert_allclose(eight.clip_thresholds, one.clip_thresholds, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(eight.params), jax.tree.leaves(one.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert eight.epsilon == pytest.approx(one.epsilon, rel=1e-3)


def test_layer_wise_groups_adapt_separately(tmp_path):
    result = Trainer(TrainConfig(out=str(tmp_path), groups="layer-wise",
                                 **{**RUN, "checkpoint_every": 0, "steps": 2, "log_every": 1})).run()
    assert len(result.clip_thresholds) == 2
    row = result.history[-1]
    names = sorted(k for k in row if k.startswith("clip_threshold/"))
    assert len(names) == 2 and len({row[k] for k in names}) == 2
    # M = 2: the count vector's sensitivity is sqrt(2)/2, so z_b = 2 sigma_b / sqrt(2)
    assert result.count_noise_multiplier == pytest.approx(2 * (64 / 20) / math.sqrt(2))


def test_cli_flags(tmp_path, capsys):
    from dpzero_jax.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--clip-quantile", "1.5"])
    assert exit_info.value.code == 2 and "--clip-quantile" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--batch-size", "64", "--noise-multiplier", "1.0", "--clip-quantile", "0.5",
                 "--clip-lr", "0.3", "--clip-count-noise", "8", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    # M = 1: z_b = 2 * 8; z_g = (1 - 16^-2)^-1/2
    assert "count sigma 16" in out and f"gradient sigma {(1 - 16 ** -2) ** -0.5:.4f}" in out


def test_optax_clipped_grad_takes_thresholds():
    """Your own loop: dz.clipped_grad with thresholds at call time gives their sensitivity and the clipped sum of the
    same thresholds fixed in the config."""
    from dpzero_jax.optax_dp import clipped_grad

    loss_fn, params, batch = _problem()
    cfg = DPConfig(groups="layer-wise", mode="bk")
    t = jnp.asarray([0.2, 0.07])
    out = jax.jit(lambda p, t: clipped_grad(loss_fn, cfg)(p, batch, thresholds=t))(params, t)
    fixed = clipped_grad(loss_fn, cfg.replace(group_thresholds=(0.2, 0.07)))(params, batch)
    assert float(out.l2_sensitivity) == pytest.approx(math.hypot(0.2, 0.07), rel=1e-6)
    for x, y in zip(jax.tree.leaves(out.grad_sum), jax.tree.leaves(fixed.grad_sum), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_normalize_update_divides_by_the_threshold_norm():
    grads = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    thresholds = jnp.asarray([3.0, 4.0])   # ||C|| = 5
    rule = adaptive_clipping.AdaptiveClipping(0.5, count_noise_std=1.0, expected_batch_size=8)
    out = adaptive_clipping.normalize_update(grads, thresholds, rule)
    np.testing.assert_allclose(out["w"], np.arange(6.0).reshape(2, 3) / 5.0, rtol=1e-6)
    assert out["b"].dtype == jnp.bfloat16 and np.allclose(np.asarray(out["b"], np.float32), 0.2, rtol=1e-2)
    off = dataclasses.replace(rule, normalize_update=False)
    assert adaptive_clipping.normalize_update(grads, thresholds, off) is grads
    with pytest.raises(ValueError, match="normalize_update"):
        dataclasses.replace(rule, normalize_update=1)


def test_a_huge_initial_threshold_gives_the_optimizer_unit_noise(tmp_path):
    """Started at R = 1e4 (every example far inside), the first step's update is noise whose scale does not depend on
    R: SGD's first step moves the parameters by ``lr * z_g * ||N(0, I_P)|| / B``, i.e. ``lr z_g sqrt(P) / B`` to
    within the chi distribution's ``1 / sqrt(2P)`` spread (the clipped sum's share is ~||g|| / R = 1e-4 of it).
    Without the division by ``||C||`` it would be 1e4 times larger."""
    config = TrainConfig(out=str(tmp_path), **{**RUN, "steps": 1, "checkpoint_every": 0, "max_grad_norm": 1e4,
                                                 "log_every": 1})
    trainer = Trainer(config)
    before = jax.tree.map(np.asarray, trainer.init_params)
    result = trainer.run()
    deltas = jax.tree.leaves(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, result.params, before))
    moved = math.sqrt(sum(float(np.sum(d ** 2)) for d in deltas))
    count = sum(d.size for d in deltas)
    expected = RUN["lr"] * result.gradient_noise_multiplier * math.sqrt(count) / RUN["batch_size"]
    assert moved == pytest.approx(expected, rel=0.05)
