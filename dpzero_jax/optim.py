"""The trainer's optimisers and learning-rate schedules (optax), built from a few named options.

A schedule maps the optimizer's step count ``t`` (0 for the first update) to a learning rate:

* ``"constant"``: ``lr`` (after the warmup, if any);
* ``"cosine"``: ``lr * (1 + cos(pi * s)) / 2`` with ``s = (t - warmup) / (total - warmup)``, from ``lr`` to 0 at
  ``t = total``;
* ``"linear"``: ``lr * (1 - s)``, from ``lr`` to 0 at ``t = total``.

With ``warmup_steps = w > 0`` every schedule starts with a linear warmup ``lr * (t + 1) / w`` for ``t < w`` (the
first update already moves the parameters: under DP every step spends privacy budget). The step count lives in the
optimizer state, so a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import optax

OPTIMIZERS = ("adam", "sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(lr: float, schedule: str = "constant", warmup_steps: int = 0,
                           total_steps: int | None = None) -> optax.Schedule:
    """The learning rate as a function of the update count (see the module docstring for the formulas).

    ``total_steps`` (the run's number of updates) is needed by ``"cosine"`` and ``"linear"``; ``warmup_steps``
    must be below it.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"learning-rate schedule {schedule!r}: expected one of {SCHEDULES}")
    if not isinstance(warmup_steps, numbers.Integral) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if schedule != "constant" or warmup_steps:
        if total_steps is None or total_steps < 1:
            raise ValueError(f"the {schedule!r} schedule with warmup_steps={warmup_steps} needs the run's number of "
                             f"steps (total_steps >= 1), got {total_steps!r}")
        if warmup_steps >= total_steps:
            raise ValueError(f"warmup_steps={warmup_steps} must be below the run's {total_steps} steps")
    if schedule == "constant":
        after = optax.constant_schedule(lr)
    elif schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps=total_steps - warmup_steps, alpha=0.0)
    else:
        after = optax.linear_schedule(lr, 0.0, transition_steps=total_steps - warmup_steps)
    if not warmup_steps:
        return after

    def warmed_up(count):
        return jnp.where(count < warmup_steps, lr * (count + 1) / warmup_steps, after(count - warmup_steps))

    return warmed_up


def make_optimizer(name: str, learning_rate: optax.ScalarOrSchedule, weight_decay: float = 0.0
                   ) -> optax.GradientTransformation:
    """``"adam"``, ``"adamw"`` (decoupled ``weight_decay``) or ``"sgd"`` (momentum 0.9) with a fixed learning rate
    or a schedule."""
    if name == "adam":
        return optax.adam(learning_rate)
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=weight_decay)
    if name == "sgd":
        return optax.sgd(learning_rate, momentum=0.9)
    raise ValueError(f"optimizer {name!r}: expected one of {OPTIMIZERS}")
