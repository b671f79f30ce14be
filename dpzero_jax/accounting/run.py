"""A training run's privacy arithmetic, in one place: the noise multiplier (given, or calibrated to the target
epsilon), the epsilon the planned run ends at, the Poisson batch cap (whose truncation is charged to delta), what
each step adds to the ledger, and the epsilon of record. :class:`dpzero_jax.train.Trainer` calls these; the
mechanisms they account for are :mod:`dpzero_jax.clipping`, :mod:`dpzero_jax.noise` and
:mod:`dpzero_jax.adaptive_clipping`, and the composition is :mod:`dpzero_jax.accounting`'s.

Poisson sampling with a static batch cap: a batch larger than the cap is truncated, which breaks the Poisson
mechanism with some small per-step probability. Sigma is therefore calibrated at ``delta * (1 - TRUNCATION_SHARE)``
and the cap is sized so that the truncation charge stays within ``TRUNCATION_SHARE`` of delta at the planned epsilon
(:func:`accounting.plan_overflow_target`); the ledger records each step's truncation probability and every step
that did overflow.
"""

from __future__ import annotations

from dpzero_jax import accounting
from dpzero_jax.sampling import PoissonSampler
from dpzero_jax.train_config import MAX_CAP_FACTOR, TrainConfig


def formal_guarantee(cfg: TrainConfig) -> bool:
    """True when the run's epsilon is a formal (epsilon, delta) guarantee (DP on, Poisson or fixed-size)."""
    return not cfg.no_dp and cfg.sampling != "shuffled"


def noise_multiplier(cfg: TrainConfig, sampling_rate: float, steps: int, dataset_size: int) -> float | None:
    """The run's sigma: None without DP; the configured one; or calibrated so that ``steps`` steps at
    ``sampling_rate`` end at ``cfg.epsilon`` (Poisson: at ``delta * (1 - TRUNCATION_SHARE)``, the rest of delta
    being the truncation budget). Refuses a PLD composition too large for this machine before it starts."""
    if cfg.no_dp:
        return None
    poisson = cfg.sampling == "poisson"
    if cfg.noise_multiplier is not None:
        sigma = float(cfg.noise_multiplier)
    else:
        fixed = cfg.sampling == "fixed-size"
        calibration_delta = cfg.delta * (1.0 - accounting.TRUNCATION_SHARE) if poisson else cfg.delta
        with accounting.quiet_rdp_warnings():   # the RDP bracket of calibrate_noise warns about low orders
            sigma = accounting.calibrate_noise(
                cfg.epsilon, sampling_rate, steps, calibration_delta, accountant=cfg.accountant,
                sampling="fixed-size" if fixed else "poisson", dataset_size=dataset_size if fixed else None)
    if formal_guarantee(cfg) and poisson and cfg.accountant == "pld":
        accounting._check_pld_work(sigma, sampling_rate, steps, cfg.delta)
    return sigma


def planned_epsilon(cfg: TrainConfig, sigma: float, sampling_rate: float, steps: int, dataset_size: int) -> float:
    """Epsilon of the whole planned run (truncation budget included), computed before training.

    Calibrated sigma: the target (sigma was calibrated at ``delta * (1 - TRUNCATION_SHARE)`` for Poisson). Given
    sigma: a quick upper bound on the accountant's epsilon of the planned steps (:func:`accounting.planned_epsilon`),
    refused when it is infinite (sigma = 0)."""
    if cfg.noise_multiplier is None:
        return float(cfg.epsilon)
    if sigma == 0:
        raise ValueError("TrainConfig.noise_multiplier=0 adds no noise: epsilon would be infinite; use no_dp=True "
                         "(--no-dp) for a non-private run")
    if cfg.sampling == "fixed-size":
        return accounting.epsilon(sigma, sampling_rate, steps, cfg.delta, cfg.accountant, sampling="fixed-size",
                                  dataset_size=dataset_size)
    with accounting.quiet_rdp_warnings():
        return accounting.planned_epsilon(sigma, sampling_rate, steps, cfg.delta * (1.0 - accounting.TRUNCATION_SHARE),
                                          cfg.accountant)


def poisson_sampler(cfg: TrainConfig, dataset_size: int, sampling_rate: float, steps: int,
                    planned: float | None, sigma: float | None, n_devices: int) -> PoissonSampler:
    """The Poisson sampler with the batch cap the run can afford (:func:`accounting.plan_overflow_target`).

    DP: the per-step truncation probability is bounded so that its charge is at most ``TRUNCATION_SHARE`` of delta
    at the planned epsilon (plus ``CAP_MARGIN``); a cap above ``MAX_CAP_FACTOR`` times the expected batch is refused
    before training, naming the cap and its cost. Without DP: the default 1e-9 target."""
    if planned is None:
        return PoissonSampler(dataset_size, sampling_rate, capacity_multiple=n_devices)
    sampler = PoissonSampler.for_privacy_budget(dataset_size, sampling_rate, steps, cfg.delta, planned,
                                                capacity_multiple=n_devices)
    limit = max(MAX_CAP_FACTOR * cfg.batch_size, cfg.batch_size + 64)
    if sampler.capacity > limit:
        raise ValueError(
            f"the run would end at epsilon {planned:.4g} (sigma {sigma:.4g}, {steps} steps, q {sampling_rate:.4g}); "
            f"keeping the charge for truncated Poisson batches below {accounting.TRUNCATION_SHARE:g} of delta there "
            f"needs a batch cap of {sampler.capacity} slots per step ({sampler.capacity / cfg.batch_size:.1f}x the "
            f"expected batch {cfg.batch_size}, in compute and memory), more than the {limit} allowed; use a larger "
            f"noise multiplier, fewer steps or --epsilon")
    return sampler


def record_step(ledger: accounting.PrivacyLedger, cfg: TrainConfig, step: int, batch, *, sigma: float,
                sampling_rate: float, sampler, dataset_size: int, count_noise_multiplier: float | None) -> None:
    """Charge step ``step`` (its sampled ``batch``) to the ledger: nothing for no_dp and for shuffled epochs, which
    have no event; Poisson: the sampler's truncation probability, and the step itself if its batch overflowed the
    cap; adaptive clipping: the count's share of sigma."""
    if not formal_guarantee(cfg):
        return
    if cfg.sampling == "poisson":
        ledger.record(sigma, sampling_rate, truncation_probability=sampler.truncation_probability,
                      count_noise_multiplier=count_noise_multiplier)
        if batch.overflowed:
            ledger.record_overflow(step)
    else:
        ledger.record(sigma, sampling="fixed-size", dataset_size=dataset_size, batch_size=cfg.batch_size,
                      count_noise_multiplier=count_noise_multiplier)
