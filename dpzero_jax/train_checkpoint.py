"""A training run's checkpoints (used by :class:`dpzero_jax.train.Trainer`; the storage, digests and damage
handling are :mod:`dpzero_jax.checkpoints`): what a run saves (params, optimizer state, key data, ledger, config,
adaptive clipping's thresholds), the check that a checkpoint was written by this run's options before it is resumed
(:func:`check_same_run`), and the thresholds a resumed run starts from (:func:`initial_clip_state`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import accounting
from dpzero_jax import checkpoints as ckpt
from dpzero_jax.train_config import RESUMABLE_CHANGES, TrainConfig
from dpzero_jax.train_metrics import jsonable
from dpzero_jax.train_step import to_global


def open_manager(out, keep: int | None):
    """The orbax manager of the run directory ``out``'s ``checkpoints/`` (``keep`` newest kept)."""
    return ckpt.open_manager(out / "checkpoints", keep=keep)


def save(manager, step: int, params, opt_state, *, init_key: jax.Array, ledger: accounting.PrivacyLedger,
         config: TrainConfig, clip_state=None) -> None:
    """Write checkpoint ``step`` (collective with several processes). ``clip_state``: None with fixed thresholds,
    else adaptive clipping's replicated thresholds ``[M]``, kept as floats in the checkpoint's ``train_state``."""
    train_state = None
    if clip_state is not None:   # replicated: any process's first copy is the whole vector
        host = np.asarray(clip_state.addressable_data(0), np.float32)
        train_state = {"clip_thresholds": [float(t) for t in host]}
    ckpt.save(manager, step, params, opt_state, jax.random.key_data(init_key), ledger.to_dict(),
              jsonable(config.to_dict()), train_state=train_state)


def check_same_run(config: TrainConfig, saved: dict, out) -> None:
    """Refuse to resume a checkpoint written by a different run (a mixed run would match neither config).

    ``saved``: the checkpoint's config (a dict); ``out``: the run directory (named in the error). Only presentation
    options, ``devices`` and -- when sigma does not depend on the planned length (explicit ``noise_multiplier`` or
    ``no_dp``) -- ``steps`` / ``epochs`` may change.
    """
    current = jsonable(config.to_dict())
    allowed = set(RESUMABLE_CHANGES)
    if config.noise_multiplier is not None or config.no_dp:
        allowed |= {"steps", "epochs"}
    # an option missing from an older checkpoint's config did not exist then: that run had its default (and an option
    # to_dict leaves out, epsilon next to noise_multiplier / no_dp, has its default)
    defaults = jsonable({f.name: f.default for f in dataclasses.fields(TrainConfig)
                         if f.default is not dataclasses.MISSING})
    changed = sorted(k for k in current.keys() | saved.keys()
                     if k not in allowed and current.get(k, defaults.get(k)) != saved.get(k, defaults.get(k)))
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume from {out / 'checkpoints'}: it was written with different "
                         f"options ({details}); use the original options or another --out")


def restore(out, params, opt_state, *, init_key: jax.Array, config: TrainConfig, shardings=None,
            set_aside: bool = True):
    """Newest intact checkpoint of run directory ``out`` -> ``(step, params, opt_state, ledger, train_state)``;
    None if there is none (:func:`dpzero_jax.checkpoints.restore`: damaged ones skipped with a warning, another
    run's refused by :func:`check_same_run`). ``shardings``: ``(param_shardings, opt_shardings)`` under a mesh."""
    found = ckpt.restore(out / "checkpoints", params, opt_state, jax.random.key_data(init_key), shardings,
                         check_config=functools.partial(check_same_run, config, out=out), set_aside=set_aside)
    if found is None:
        return None
    return (found.step, found.params, found.opt_state, accounting.PrivacyLedger.from_dict(found.ledger),
            found.train_state)


def initial_clip_state(train_state: dict | None, initial_thresholds, clip_groups, replicated=None):
    """The step's clip state: ``()`` with fixed thresholds (``initial_thresholds`` None), else the thresholds
    ``[M]``: a restored checkpoint's ``train_state`` (checked: written with adaptive clipping, ``M`` groups) or the
    initial ones; a global array with the ``replicated`` sharding under a mesh."""
    if initial_thresholds is None:
        return ()
    if train_state is not None:
        if "clip_thresholds" not in train_state:
            raise ValueError("the checkpoint holds no adaptive clipping thresholds (train_state); it was not "
                             "written by a run with clip_quantile")
        values = np.asarray(train_state["clip_thresholds"], np.float32)
        if values.shape != initial_thresholds.shape:
            raise ValueError(f"the checkpoint's clip thresholds have shape {values.shape}, this run's groups "
                             f"{clip_groups} need {initial_thresholds.shape}")
    else:
        values = initial_thresholds
    return jnp.asarray(values) if replicated is None else to_global(values, replicated)
