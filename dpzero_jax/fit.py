"""An open DP trainer: the user's model, per-example loss, data and optax optimiser; the library's clipping, noise,
sampling, accounting and checkpoints.

``PrivateTrainer(model, loss_fn, optimizer, data, batch_size=..., steps=..., epsilon=...).fit()``

* model: a ``flax.nnx`` module (``loss_fn(model, batch)``; its ``wrt`` variables, ``nnx.Param`` by default, are
  trained, the rest of its state is passed through unchanged), or a params pytree of float arrays
  (``loss_fn(params, batch)``: a flax.linen ``apply``, plain ``jax.numpy``). Any JAX model: the engine plans it
  (:func:`dpzero_jax.private_value_and_grad`; the traced-program front-end when it is not built of ``dz.layers``
  layers).
* loss_fn: per-example losses ``[B]`` (not their mean): checked on the first batch.
* optimizer: any ``optax.GradientTransformation`` (schedules included); it receives the private gradient.
* data: see :mod:`dpzero_jax.fit_data`. An indexable dataset is Poisson sampled by the trainer
  (:class:`~dpzero_jax.sampling.PoissonSampler`, capacity and truncation charge from
  :func:`dpzero_jax.accounting.run.poisson_sampler`, every step charged by
  :func:`dpzero_jax.accounting.run.record_step`):
  the epsilon is a formal guarantee. An iterable of batches was sampled by the user, which the trainer cannot check,
  so the sampling must be declared -- ``sampling="poisson"`` (each of ``dataset_size`` examples joined each batch
  independently with probability ``batch_size / dataset_size``: the epsilon is accounted as Poisson, a guarantee
  *only if the declaration is true*, said in a warning) or ``sampling="other"`` (shuffled or fixed batches: NO formal
  guarantee; the number is computed *as if* Poisson, reported as ``epsilon_as_if_poisson``, with a warning). User
  batches are padded, never truncated.

One logical step (one batch, one noise draw, one ledger event): the batch's ``slots`` are cut into
``accumulation_steps`` chunks whose clipped sums (:func:`dpzero_jax.clipped_grad`) are added up, then
:func:`dpzero_jax.noise.privatize` noises the sum once and divides by the expected batch size (with one chunk the
step is :func:`dpzero_jax.private_value_and_grad` itself); ``micro_batch_size`` chunks inside the engine
(:class:`dpzero_jax.DPConfig` ``microbatch_size``). The keys of step ``t`` are ``split(fold_in(fold_in(key(seed),
1), t))`` = ``(sample_key, noise_key)``, so a run resumed from a checkpoint (:mod:`dpzero_jax.checkpoints`: params,
optimiser state, key, step and the privacy ledger) continues exactly as the uninterrupted run; with an iterable the
resumed run skips the batches already trained on (the iterable must yield the same batches when iterated again).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpzero_jax import accounting, noise, rundir, validation
from dpzero_jax import checkpoints as ckpt
from dpzero_jax import metric_writers as writers_lib
from dpzero_jax.accounting import run as run_privacy
from dpzero_jax.config import DPConfig
from dpzero_jax.engine import private_value_and_grad
from dpzero_jax.fit_data import (
    FitResult,
    as_host_batch,
    as_target,
    check_trainer_loss,
    declared_sampling,
    metric_sums,
    pad_batch,
    run_evaluation,
    warn_about_sampling,
)
from dpzero_jax.optax_dp import clipped_grad, merged_loss
from dpzero_jax.running_accountant import RunningAccountant, row_interval
from dpzero_jax.sampling import PoissonSampler
from dpzero_jax.train_metrics import jsonable, read_metrics

__all__ = ["FitResult", "PrivateTrainer"]


@dataclasses.dataclass(frozen=True)
class _PrivacyOptions:
    """The fields :mod:`dpzero_jax.accounting.run` reads of a run's config (it is written for ``TrainConfig``)."""

    epsilon: float | None
    delta: float
    noise_multiplier: float | None
    accountant: str
    batch_size: int
    sampling: str = "poisson"
    no_dp: bool = False


def _name(value) -> str:
    return getattr(value, "__qualname__", type(value).__name__)


def _positive_real(name: str, value, why: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"PrivateTrainer: {name} must be a finite number > 0{why}, got {value!r}")
    return float(value)


def _positive_int(name: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"PrivateTrainer: {name} must be an int >= 1, got {value!r}")
    return int(value)


class PrivateTrainer:
    """DP training of a user's model (module docstring). ``fit()`` trains; ``evaluate(fn, data)`` evaluates.

    Privacy: ``epsilon`` (sigma calibrated for the planned ``steps`` at ``delta``) or ``noise_multiplier`` (epsilon
    reported), ``delta`` (below ``1 / N`` unless ``allow_large_delta``), ``accountant`` (``"pld"`` / ``"rdp"``).
    Clipping: ``max_grad_norm``, ``clip_fn``, ``groups``, ``mode``, ``front_end``, ``noise_rng`` (as
    :class:`dpzero_jax.DPConfig`). ``batch_size``: the expected logical batch (Poisson rate ``batch_size / N``; the
    divisor of the noised sum). Length: ``steps`` or ``epochs`` (``steps = ceil(epochs * N / batch_size)``). Outputs
    (``out``: optional): ``metrics.jsonl`` (a row every ``log_every`` steps and at the end), ``summary.json``,
    ``checkpoints/`` every ``checkpoint_every`` steps; ``metric_writers``: ``"tensorboard"`` / ``"wandb"``
    (:mod:`dpzero_jax.metric_writers`) or objects with ``write(row)``, ``sync()``, ``close()``. ``callbacks``:
    ``fn(trainer, row)`` after every step (``row``: ``step``, ``loss`` -- the mean loss of the batch's examples
    --, ``batch_size``, and on logged rows the epsilon); entries a callback adds to a logged row are written with it,
    and ``trainer.params`` / :meth:`evaluate` see the parameters after the step. ``check_loss``: before training,
    :func:`dpzero_jax.check_per_example_loss` on the first examples refuses a loss that couples the examples (a batch
    norm in training mode): one more compile of the loss at that size.
    """

    def __init__(self, model, loss_fn: Callable, optimizer: optax.GradientTransformation, data, *,
                 batch_size: int, steps: int | None = None, epochs: float | None = None,
                 epsilon: float | None = None, delta: float = 1e-5, noise_multiplier: float | None = None,
                 accountant: str = "pld", allow_large_delta: bool = False, max_grad_norm: float = 1.0,
                 clip_fn: str = "abadi", groups: Any = "all-layer", mode: str = "auto", front_end: str = "auto",
                 micro_batch_size: int | None = None, accumulation_steps: int = 1, noise_rng: str = "auto",
                 sampling: str | None = None, dataset_size: int | None = None, seed: int = 0, wrt: Any = None,
                 check_loss: bool = True,
                 out=None, checkpoint_every: int | None = None, keep_checkpoints: int | None = None,
                 log_every: int = 10, callbacks: Sequence[Callable] = (), metric_writers: Sequence = (),
                 wandb_project: str | None = None):
        if not callable(loss_fn):
            raise TypeError(f"PrivateTrainer: loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(f"PrivateTrainer: optimizer must be an optax.GradientTransformation, got "
                            f"{type(optimizer).__name__}")
        self.tx = optimizer
        validation.check_bool("PrivateTrainer", "check_loss", check_loss)
        self._check_coupling = check_loss
        self._setup_model(model, loss_fn, wrt)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.accumulation_steps = _positive_int("accumulation_steps", accumulation_steps)
        self.log_every = _positive_int("log_every", log_every)
        self.checkpoint_every = _positive_int("checkpoint_every", checkpoint_every, allow_none=True)
        self.keep_checkpoints = _positive_int("keep_checkpoints", keep_checkpoints, allow_none=True)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"PrivateTrainer: seed must be an int, got {seed!r}")
        self.seed = int(seed)
        self.out = None if out is None else rundir.as_path(out)
        if self.checkpoint_every is not None and self.out is None:
            raise ValueError("PrivateTrainer: checkpoint_every needs an output directory (out=...)")
        self.callbacks = tuple(callbacks)
        for cb in self.callbacks:
            if not callable(cb):
                raise TypeError(f"PrivateTrainer: callbacks must be callables fn(trainer, row), got {cb!r}")
        self._writer_specs = tuple(metric_writers)
        names = [w for w in self._writer_specs if isinstance(w, str)]
        if names:
            if self.out is None:
                raise ValueError(f"PrivateTrainer: metric writers {names} write into the output directory: give out=")
            writers_lib.check(names, self.out, wandb_project)
        self.wandb_project = wandb_project

        # ---- data and sampling
        self.kind, self.data, self.dataset_size, self.sampling = declared_sampling(data, sampling, dataset_size)
        n = self.dataset_size
        if self.batch_size > n:
            raise ValueError(f"PrivateTrainer: batch_size={self.batch_size} exceeds the {n} examples")
        self.sampling_rate = self.batch_size / n
        if (steps is None) == (epochs is None):
            raise ValueError(f"PrivateTrainer: give exactly one of steps and epochs (the planned length the noise is "
                             f"calibrated and accounted for), got steps={steps!r}, epochs={epochs!r}")
        if epochs is not None:
            steps = max(1, math.ceil(_positive_real("epochs", epochs) / self.sampling_rate))
        self.steps = _positive_int("steps", steps)

        # ---- privacy: dpzero_jax.accounting.run (sigma, planned epsilon, the sampler's cap)
        validation.check_privacy_options({"epsilon": epsilon, "noise_multiplier": noise_multiplier},
                                         "PrivateTrainer")
        if epsilon is None and noise_multiplier is None:
            raise ValueError("PrivateTrainer: give epsilon (sigma is calibrated) or noise_multiplier (epsilon is "
                             "reported)")
        if noise_multiplier is not None:
            _positive_real("noise_multiplier", noise_multiplier, " (0 adds no noise: epsilon would be infinite)")
        if epsilon is not None:
            _positive_real("epsilon", epsilon)
        if _positive_real("delta", delta) >= 1:
            raise ValueError(f"PrivateTrainer: delta must be in (0, 1), got {delta!r}")
        validation.check_delta(delta, n, allow_large_delta)
        accounting._check_accountant(accountant)
        self.delta, self.accountant = float(delta), accountant
        self._privacy = _PrivacyOptions(epsilon, self.delta, noise_multiplier, accountant, self.batch_size)
        q = self.sampling_rate
        self.noise_multiplier = run_privacy.noise_multiplier(self._privacy, q, self.steps, n)
        self.planned_epsilon = run_privacy.planned_epsilon(self._privacy, self.noise_multiplier, q, self.steps, n)
        if self.kind == "indexable":
            self.sampler = run_privacy.poisson_sampler(self._privacy, n, q, self.steps, self.planned_epsilon,
                                                       self.noise_multiplier, 1)
            slots = self.sampler.capacity
        else:
            self.sampler = None   # declared Poisson batches vary in size: room for all but a 1e-9 tail
            slots = PoissonSampler(n, q).capacity if self.sampling == "declared-poisson" else self.batch_size
        self.slots = -(-slots // self.accumulation_steps) * self.accumulation_steps
        self._row_accountant = RunningAccountant(accountant, row_interval(self.planned_epsilon), block=self.log_every)
        self.epsilon_name = "epsilon_as_if_poisson" if self.sampling == "as-if-poisson" else "epsilon"
        warn_about_sampling(self.sampling, n, self.sampling_rate)

        # ---- the private gradient (the engine's; no clipping or noise here)
        self.dp_config = DPConfig(noise_multiplier=self.noise_multiplier, max_grad_norm=max_grad_norm,
                                  clip_fn=clip_fn, groups=groups, mode=mode, front_end=front_end,
                                  expected_batch_size=float(self.batch_size), microbatch_size=micro_batch_size,
                                  noise_rng=noise_rng)
        self._config = jsonable({
            "batch_size": self.batch_size, "dataset_size": n, "sampling": self.sampling, "epsilon": epsilon,
            "delta": self.delta, "noise_multiplier": noise_multiplier, "accountant": accountant,
            "max_grad_norm": max_grad_norm, "clip_fn": clip_fn, "groups": groups, "mode": mode,
            "front_end": front_end, "micro_batch_size": micro_batch_size,
            "accumulation_steps": self.accumulation_steps, "noise_rng": noise_rng, "seed": self.seed,
            "steps": self.steps}, other=_name)   # a callable (groups=fn) by name: stable across processes
        self.train_key = jax.random.fold_in(jax.random.key(self.seed), 1)
        self._build_step()
        self._evaluators: dict = {}
        self._loss_checked = False
        self.params, self.opt_state = self.init_params, None
        if self.kind == "indexable":   # a wrong loss fails here, not after the sampler's first draw
            self._check_loss(self.data.take(np.arange(min(2, n))))

    # ---------------------------------------------------------------- set-up
    def _setup_model(self, model, loss_fn, wrt) -> None:
        """``self.init_params`` (the trained pytree), ``self._rest`` (an NNX model's other state, passed to the
        jitted step as an argument, never folded in as constants) and ``self._loss(params, batch, rest) -> [B]``."""
        from flax import nnx

        if isinstance(model, nnx.Module):
            graphdef, params, rest = nnx.split(model, nnx.Param if wrt is None else wrt, ...)
            self._graphdef = graphdef
            loss = merged_loss(loss_fn, graphdef)
        else:
            if wrt is not None:
                raise ValueError("PrivateTrainer: wrt selects the trained variables of a flax.nnx model; model is a "
                                 f"params pytree ({type(model).__name__}), all of which is trained")
            self._graphdef, params, rest = None, model, {}

            def loss(params, batch, rest):
                del rest
                return loss_fn(params, batch)
        leaves = jax.tree.leaves(params)
        if not leaves:
            raise ValueError(f"PrivateTrainer: the model has no trainable parameters (got {type(model).__name__})")
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise ValueError(f"PrivateTrainer: trained parameter {jax.tree_util.keystr(path)} has dtype "
                                 f"{jnp.result_type(leaf)}; only floating-point arrays can be trained")
        self.init_params, self._rest, self._loss = params, rest, loss

    def _check_loss(self, batch: dict) -> None:
        """``loss_fn`` on ``batch``: ``[B]`` floating per-example losses that do not couple the examples
        (:func:`~dpzero_jax.fit_data.check_trainer_loss`)."""
        check_trainer_loss(self._loss, self.init_params, self._rest, batch, self._check_coupling)
        self._loss_checked = True

    def _build_step(self) -> None:
        """``self._step`` (one chunk: the whole logical step) or ``self._accumulate`` + ``self._finish``."""
        cfg, tx, loss = self.dp_config, self.tx, self._loss

        def masked_sum(losses, mask):
            return jnp.sum(jnp.where(mask, losses.astype(jnp.float32), 0.0))

        def update(params, opt_state, grads):
            grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def step(params, opt_state, batch, noise_key, mask, rest):
            losses, grads, _ = private_value_and_grad(functools.partial(loss, rest=rest), cfg)(
                params, batch, noise_key, mask)
            params, opt_state = update(params, opt_state, grads)
            return params, opt_state, masked_sum(losses, mask)

        def accumulate(params, batch, mask, rest, grad_sum, loss_sum):
            out = clipped_grad(functools.partial(loss, rest=rest), cfg)(params, batch, mask)
            return (jax.tree.map(jnp.add, grad_sum, out.grad_sum), loss_sum + masked_sum(out.losses, mask),
                    out.l2_sensitivity)

        def finish(params, opt_state, grad_sum, noise_key, sensitivity):
            grads = noise.privatize(grad_sum, noise_key, cfg.noise_multiplier, sensitivity, cfg.expected_batch_size,
                                    noise.resolve_rng(cfg.noise_rng, cfg.target))
            return update(params, opt_state, grads)

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._accumulate = jax.jit(accumulate, donate_argnums=(4,))
        self._finish = jax.jit(finish, donate_argnums=(0, 1))

    # ---------------------------------------------------------------- one step
    def step_keys(self, step: int):
        """``(sample_key, noise_key)`` of step ``step``: a pure function of ``(seed, step)``."""
        sample_key, noise_key = jax.random.split(jax.random.fold_in(self.train_key, step))
        return sample_key, noise_key

    def sample(self, step: int):
        """The trainer's Poisson batch of step ``step`` (indexable data): a :class:`~dpzero_jax.sampling.Batch` of
        ``sampler.capacity`` slots (``indices``, ``mask``, ``realised_size``, ``overflowed``)."""
        if self.sampler is None:
            raise ValueError("PrivateTrainer.sample: the batches come from your iterable, not the trainer's sampler")
        return self.sampler.sample(self.step_keys(step)[0])

    def _apply(self, params, opt_state, batch: dict, mask: np.ndarray, noise_key):
        """One logical step on a padded host batch ``[slots, ...]``: ``(params, opt_state, loss sum)``."""
        k = self.accumulation_steps
        if k == 1:
            return self._step(params, opt_state, batch, noise_key, mask, self._rest)
        size = len(mask) // k
        grad_sum = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params)
        loss_sum = jnp.zeros((), jnp.float32)
        sensitivity = None
        for c in range(k):
            part = slice(c * size, (c + 1) * size)
            grad_sum, loss_sum, sensitivity = self._accumulate(params, {n: v[part] for n, v in batch.items()},
                                                               mask[part], self._rest, grad_sum, loss_sum)
        params, opt_state = self._finish(params, opt_state, grad_sum, noise_key, sensitivity)
        return params, opt_state, loss_sum

    def _batches(self, start: int):
        """``(host batch, realised size, Batch or None)`` for steps ``start, start + 1, ...``."""
        if self.kind == "indexable":
            step = start
            while True:
                drawn = self.sample(step)
                yield self.data.take(drawn.indices), drawn.realised_size, drawn
                step += 1
        iterator = iter(self.data)
        for skipped in range(start):   # resume: the batches already trained on
            if next(iterator, None) is None:
                raise ValueError(f"PrivateTrainer: resuming at step {start}, but the data iterable ended after "
                                 f"{skipped} batches; it must yield the same batches each time it is iterated")
        for i, batch in enumerate(iterator, start):
            batch = as_host_batch(batch, f"data batch {i}")
            yield batch, len(next(iter(batch.values()))), None

    def _record(self, ledger: accounting.PrivacyLedger, step: int, drawn) -> None:
        if drawn is not None:   # the trainer's sampler: truncation probability and overflows as train.py records them
            run_privacy.record_step(ledger, self._privacy, step, drawn, sigma=self.noise_multiplier,
                                    sampling_rate=self.sampling_rate, sampler=self.sampler,
                                    dataset_size=self.dataset_size, count_noise_multiplier=None)
        else:   # the user's batches: padded, never truncated
            ledger.record(self.noise_multiplier, self.sampling_rate)

    # ---------------------------------------------------------------- evaluation and the model
    def as_model(self, params=None):
        """The model with ``params`` (default: the current ones): an NNX model, or the params pytree itself."""
        params = self.params if params is None else params
        if self._graphdef is None:
            return params
        from flax import nnx

        return nnx.merge(self._graphdef, params, self._rest)

    def evaluate(self, fn: Callable, data, *, batch_size: int = 256, params=None):
        """:func:`dpzero_jax.fit_data.evaluate` of the current model (or ``params``): ``fn(model_or_params, batch)
        -> [B]`` or ``{name: [B]}``; means over ``data``. The compiled function is kept per ``fn``."""
        _positive_int("batch_size", batch_size)
        if fn not in self._evaluators:
            self._evaluators[fn] = jax.jit(metric_sums(fn))
        return run_evaluation(self._evaluators[fn], as_target(self.as_model(params)), data, batch_size)

    # ---------------------------------------------------------------- checkpoints
    def _check_same_run(self, saved: dict) -> None:
        """Refuse a checkpoint written with other options; ``steps`` may change when sigma was given (it does not
        depend on the planned length then: the run is extended or shortened, the ledger says what ran)."""
        allowed = {"steps"} if self._privacy.noise_multiplier is not None else set()
        changed = sorted(k for k in saved.keys() | self._config.keys()
                         if k not in allowed and saved.get(k) != self._config.get(k))
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} -> {self._config.get(k)!r}" for k in changed)
            raise ValueError(f"cannot resume from {self.out / 'checkpoints'}: it was written with different options "
                             f"({details}); use the original options or another out")

    def _open_writers(self, first_step: int) -> list:
        names = [w for w in self._writer_specs if isinstance(w, str)]
        opened = [] if not names else writers_lib.open_writers(
            names, self.out, config=self._config, wandb_project=self.wandb_project, first_step=first_step)
        return opened + [w for w in self._writer_specs if not isinstance(w, str)]

    # ---------------------------------------------------------------- the loop
    def fit(self, resume: bool | str = False, stop_at: int | None = None) -> FitResult:
        """Train up to the planned ``steps`` (or only up to ``stop_at``). ``resume``: False (a new run; refused when
        ``out`` holds another run's outputs), True (from the newest intact checkpoint in ``out``) or ``"or-start"``.
        ``out`` is locked while training (:class:`dpzero_jax.rundir.RunLock`)."""
        resume = rundir.resume_mode(resume)
        if resume and self.out is None:
            raise ValueError("PrivateTrainer.fit: resume needs the output directory of the run (out=...)")
        if stop_at is not None:
            _positive_int("stop_at", stop_at)
        if self.out is None:
            return self._fit(False, stop_at)
        if resume is True and not (self.out / "checkpoints").is_dir():
            raise FileNotFoundError(f"resume: {self.out} holds no checkpoints/ to resume from")
        rundir.check_directory(self.out, "out")
        with rundir.RunLock(self.out):
            return self._fit(resume, stop_at)

    @staticmethod
    def _ended(done: int, end: int) -> int:
        warnings.warn(f"PrivateTrainer: the data ended after {done} of {end} steps; the ledger holds the {done} "
                      f"steps that ran", UserWarning, stacklevel=4)
        return done

    def _fit(self, resume, stop_at: int | None) -> FitResult:
        params = jax.tree.map(jnp.array, self.init_params)   # fresh copies: the step donates its inputs
        opt_state = self.tx.init(params)
        ledger, start, earlier = accounting.PrivacyLedger(), 0, []
        key_data = jax.random.key_data(self.train_key)
        if resume:
            found = ckpt.restore(self.out / "checkpoints", params, opt_state, key_data,
                                 check_config=self._check_same_run)
            if found is not None:
                start, params, opt_state = found.step, found.params, found.opt_state
                ledger = accounting.PrivacyLedger.from_dict(found.ledger)
                earlier = read_metrics(self.out / "metrics.jsonl", upto=start)
            elif resume is True:
                raise FileNotFoundError(f"resume: no checkpoint in {self.out / 'checkpoints'} to resume from")
        if self.out is not None and not start:
            rundir.check_fresh(self.out, resume)
        end = self.steps if stop_at is None else min(self.steps, stop_at)
        history = list(earlier)
        metrics = writers = manager = None
        try:
            if self.out is not None:
                self.out.mkdir(parents=True, exist_ok=True)
                metrics = rundir.MetricsFile(self.out / "metrics.jsonl", earlier)
                if self.checkpoint_every is not None:
                    manager = ckpt.open_manager(self.out / "checkpoints", keep=self.keep_checkpoints)
            writers = self._open_writers(start + 1)
            batches = self._batches(start)
            upcoming = next(batches, None) if start < end else None   # one batch ahead: the data may end early
            end = end if upcoming is not None else self._ended(start, end)
            for step in range(start, end):
                batch, realised, drawn = upcoming
                if not self._loss_checked:
                    self._check_loss(batch)
                slots = max(self.slots, -(-realised // self.slots) * self.slots)   # a larger batch: more slots
                padded, mask = pad_batch(batch, slots, None if drawn is None else drawn.mask)
                params, opt_state, loss_sum = self._apply(params, opt_state, padded, mask, self.step_keys(step)[1])
                self._record(ledger, step, drawn)
                self.params, self.opt_state = params, opt_state
                done = step + 1
                if done < end and (upcoming := next(batches, None)) is None:
                    end = self._ended(done, end)   # this step is the last: logged and checkpointed as such
                row = {"step": done, "loss": float(loss_sum) / max(realised, 1), "batch_size": int(realised)}
                logged = done % self.log_every == 0 or done == end
                if logged:   # the last planned row: the epsilon of record (from scratch)
                    row[self.epsilon_name] = (ledger.epsilon(self.delta, self.accountant) if done == self.steps
                                              else self._row_accountant.epsilon(ledger, self.delta))
                for callback in self.callbacks:
                    callback(self, row)
                if logged:
                    history.append(row)
                    for sink in ([metrics] if metrics is not None else []) + writers:
                        sink.write(row)
                if manager is not None and (done % self.checkpoint_every == 0 or done == end):
                    ckpt.save(manager, done, params, opt_state, key_data, ledger.to_dict(), self._config)
                    for sink in ([metrics] if metrics is not None else []) + writers:
                        sink.sync()
                if done == end:
                    break
        finally:
            for closable in ([metrics] if metrics is not None else []) + (writers or []):
                closable.close()
            if manager is not None:
                manager.close()
        epsilon = ledger.epsilon(self.delta, self.accountant)
        result = FitResult(params=params, opt_state=opt_state,
                           model=None if self._graphdef is None else self.as_model(params), ledger=ledger,
                           epsilon=epsilon, delta=self.delta, noise_multiplier=self.noise_multiplier,
                           sampling_rate=self.sampling_rate, steps=ledger.steps, sampling=self.sampling,
                           formal_guarantee=self.sampling != "as-if-poisson", history=history)
        if self.out is not None:
            summary = {"epsilon": epsilon, "epsilon_name": self.epsilon_name, "delta": self.delta,
                       "noise_multiplier": self.noise_multiplier, "sampling_rate": self.sampling_rate,
                       "steps": ledger.steps, "sampling": self.sampling, "formal_guarantee": result.formal_guarantee,
                       "batch_slots": self.slots, "ledger": ledger.to_dict(), "config": self._config}
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return result
