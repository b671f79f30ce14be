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

Truncated Poisson batches (static shapes)
-----------------------------------------
A jitted step has a fixed number of slots, so the trainer's Poisson sampler truncates a batch that exceeds its
capacity (probability ``eta`` per step, typically ~1e-12).  The truncated mechanism differs from the exact Poisson
mechanism by at most ``eta`` in total variation on every dataset, so ``T`` such steps that are ``(eps, delta0)``-DP
when untruncated are ``(eps, delta0 + (1 + e^eps) * sum_t eta_t)``-DP.  A ledger entry may carry
``truncation_probability`` (``eta``, computed for the larger of two neighbouring datasets); then
:meth:`PrivacyLedger.epsilon` reports the smallest ``eps`` it can certify with ``delta0 = delta - (1 + e^eps) *
sum eta`` (:func:`certified_epsilon`: one call when the charge is at most ``TRUNCATION_SHARE`` = 1e-3 of delta,
else a fixed point solved from below and verified).  Nothing is approximated silently: a truncation that actually
happened is also listed in ``PrivacyLedger.overflowed_steps``.

The batch cap (how many slots a step has) is therefore part of the privacy budget.  The trainer sizes it before
training from the epsilon the run will end at (:func:`plan_overflow_target`): the per-step ``eta`` is chosen so that
``T * eta * (1 + e^(eps_final + CAP_MARGIN)) <= TRUNCATION_SHARE * delta``; every row of the run is then certified
at ``delta * (1 - TRUNCATION_SHARE)``, and ``dpzero privacy --dataset-size N`` reproduces the same cap and charge.

Running epsilon
---------------
:meth:`PrivacyLedger.epsilon` composes the whole ledger from scratch (``dp_accounting``'s own accountants; the
last few compositions are memoised); it is the accountant of record.  The trainer's per-row epsilon comes from
:class:`dpzero_jax.running_accountant.RunningAccountant`, which composes only the steps added since its last row.

Modules
-------
:mod:`~dpzero_jax.accounting.calibration` (epsilon, sigma calibration, step budgets, composition from scratch),
:mod:`~dpzero_jax.accounting.truncation` (the batch cap's charge to delta, planned epsilon and epsilon of record),
:mod:`~dpzero_jax.accounting.ledger` (``PrivacyLedger``) and :mod:`~dpzero_jax.accounting.run` (a training run's
privacy arithmetic from its ``TrainConfig``: imported on its own, ``from dpzero_jax.accounting import run``).
"""

from dpzero_jax.accounting.calibration import (  # noqa: F401
    _EPSILONS,
    ACCOUNTANTS,
    PLD_MAX_EPSILON,
    PLD_MAX_STEPS,
    SAMPLINGS,
    START_RDP_ORDERS,
    _check_accountant,
    _check_delta,
    _check_noise,
    _check_pld_work,
    _check_rate,
    _check_steps,
    calibrate_noise,
    coarse_interval,
    entries_event,
    epsilon,
    max_steps,
    quiet_rdp_warnings,
)
from dpzero_jax.accounting.ledger import PrivacyLedger  # noqa: F401
from dpzero_jax.accounting.truncation import (  # noqa: F401
    CAP_MARGIN,
    TRUNCATION_SHARE,
    certified_epsilon,
    epsilon_of_record,
    plan_overflow_target,
    planned_epsilon,
)

__all__ = ["epsilon", "calibrate_noise", "max_steps", "PrivacyLedger"]
