"""The DP training loop: ``Trainer(TrainConfig(...)).run()`` or ``train(config)``; ``dpzero train`` on the CLI.

One step
    ``key_t = fold_in(train_key, t)`` -> ``(sample_key, noise_key)``. The batch is Poisson sampled on the host
    (:class:`~dpzero_jax.sampling.PoissonSampler`: static ``capacity`` slots + a mask), then ONE jitted function
    computes the private gradient (:func:`dpzero_jax.private_value_and_grad`, noise once per logical batch,
    ``micro_batch_size`` = gradient accumulation inside it) and applies the optax update. With ``no_dp`` the same
    sampler and step count are used with the plain mean loss over the realised batch (no clipping, no noise).
    With RMM layers (``rmm``) the step's sketches are drawn from ``fold_in(noise_key, RMM_KEY_TAG)``.

Determinism and resuming
    Every random choice of step ``t`` is a pure function of ``(seed, t)``, so resuming from a checkpoint at step
    ``t`` reproduces the uninterrupted run exactly. Checkpoints (:mod:`dpzero_jax.checkpoints`) hold params and
    optimizer state as named trees, the key data, the step and the privacy ledger, with a digest of every array. On
    ``resume`` the newest intact checkpoint is used; damaged ones are skipped with a warning naming them.

A run whose final evaluation is not finite (diverged) raises :class:`NonFiniteEvaluationError` once its outputs are
written (``dpzero train`` exits with status 2).

Outputs under ``out``: ``metrics.jsonl`` (one JSON object per logged step), ``training.png`` (loss and epsilon vs
step; needs matplotlib, the ``plot`` extra, else skipped with a notice), ``summary.json``, ``checkpoints/``.
``out`` and ``export`` may be local paths or ``gs://`` (``s3://``, ...) URLs: every file goes through
``etils.epath`` (:mod:`dpzero_jax.rundir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpzero_jax import (
    accounting,
    metric_writers,
    models,
    optim,
    rundir,
    sharding,
    validation,
)
from dpzero_jax.accounting import run as run_privacy
from dpzero_jax.engine import make_plan, private_value_and_grad  # noqa: F401  (re-exported; the step: train_step)
from dpzero_jax.sampling import gather
from dpzero_jax.train_checkpoint import initial_clip_state, open_manager
from dpzero_jax.train_checkpoint import restore as restore_checkpoint
from dpzero_jax.train_checkpoint import save as save_checkpoint
from dpzero_jax.train_config import (  # noqa: F401  (re-exported: the run's options and their choices)
    CLIP_FNS,
    EPSILON_DEFAULT,
    MAX_CAP_FACTOR,
    MODELS,
    PEFT_METHODS,
    PRECISIONS,
    RESUMABLE_CHANGES,
    RMM_KEY_TAG,
    RMM_SKETCHES,
    SAMPLINGS,
    STRATEGIES,
    TASKS,
    TrainConfig,
    _hf_path,
)
from dpzero_jax.train_metrics import (  # noqa: F401  (EVAL_CHUNK re-exported)
    EVAL_CHUNK,
    Evaluator,
    clip_row,
    metric_name,
    summary,
)
from dpzero_jax.train_metrics import jsonable as _jsonable
from dpzero_jax.train_metrics import plot as _plot
from dpzero_jax.train_metrics import progress_bar_class as _progress_bar_class
from dpzero_jax.train_metrics import read_metrics as _read_metrics
from dpzero_jax.train_metrics import text_evaluator as _text_evaluator  # noqa: F401
from dpzero_jax.train_result import NonFiniteEvaluationError, TrainResult
from dpzero_jax.train_setup import (  # noqa: F401  (rmm_step_key, init_distributed, request_cpu_devices: public)
    _apply_peft,
    _apply_rmm,
    _diagnostics_fn,
    _load_data,
    _make_mesh,
    _make_model,
    build_objective,
    init_distributed,
    plan_adaptive_clipping,
    plan_run,
    request_cpu_devices,
    rmm_step_key,
)
from dpzero_jax.train_setup import release_free_memory as _release_free_memory  # noqa: F401
from dpzero_jax.train_step import bind_frozen, build_step, frozen_arguments
from dpzero_jax.train_step import cast_inputs as _cast_inputs  # noqa: F401
from dpzero_jax.train_step import matrices_in as _matrices_in  # noqa: F401
from dpzero_jax.train_step import to_global as _to_global

__all__ = ["TrainConfig", "TrainResult", "Trainer", "train"]


class Trainer:
    """Builds data, model, optimizer, sampler and the compiled step from a :class:`TrainConfig`.

    ``run(resume=False, stop_at=None)`` trains (from the latest good checkpoint if ``resume``) up to
    ``config.steps`` (or only up to ``stop_at``, for interrupted runs) and returns a :class:`TrainResult`.
    The pieces live in modules of their own: the set-up and the sampling / privacy plan in
    :mod:`dpzero_jax.train_setup`, the compiled step in :mod:`dpzero_jax.train_step`, checkpoints in
    :mod:`dpzero_jax.train_checkpoint`, evaluation, metric rows and the plot in :mod:`dpzero_jax.train_metrics`.
    """

    def __init__(self, config: TrainConfig, *, canaries=None):
        """``canaries``: the seam of a privacy audit (:mod:`dpzero_jax.audit`; None for training), an object with
        ``extend(train, test) -> (train, test)`` (input canaries added to the training data before anything is sized
        from it), ``insert(clipped_sum, noise_key, plan) -> clipped_sum`` (gradient canaries added to the clipped sum
        before the noise: :func:`dpzero_jax.private_value_and_grad`'s ``clipped_sum_hook``) and ``observer() ->
        optax.GradientTransformation`` (chained before the optimiser: it sees the noised gradient and keeps the
        canaries' scores in its state). Only with DP, the ``gspmd`` strategy and no RMM layers."""
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.canaries = canaries
        if canaries is not None and (cfg.no_dp or cfg.strategy == "explicit" or cfg.rmm != "none"
                                     or cfg.clip_quantile is not None):
            raise ValueError("canaries (a privacy audit) need a private run with the gspmd strategy, no RMM layers and "
                             f"fixed thresholds; got no_dp={cfg.no_dp}, strategy={cfg.strategy!r}, rmm={cfg.rmm!r}, "
                             f"clip_quantile={cfg.clip_quantile!r}")
        self.out = rundir.as_path(cfg.out)   # an epath.Path: local or gs:// ...
        request_cpu_devices(cfg)   # before JAX's first operation, if this is it
        init_distributed(cfg)
        self.is_primary = jax.process_index() == 0   # writes metrics, summary and plot
        self.mesh = _make_mesh(cfg)
        self.rules = None if self.mesh is None else sharding.ShardingRules(self.mesh, cfg.zero)
        self.train_data, self.test_data, self.label_names = _load_data(cfg)
        if canaries is not None:
            self.train_data, self.test_data = canaries.extend(self.train_data, self.test_data)
        n = next(iter(self.train_data.values())).shape[0]
        if cfg.batch_size > n:
            raise ValueError(f"batch_size={cfg.batch_size} exceeds the training set size {n}")
        self.dataset_size = n
        if not cfg.no_dp:
            validation.check_delta(cfg.delta, n, cfg.allow_large_delta)
        self.sampling_rate = cfg.batch_size / n
        root = jax.random.key(cfg.seed)
        self.init_key = jax.random.fold_in(root, 1)
        self.shuffle_key = jax.random.fold_in(root, 2)
        plan = plan_run(cfg, n, 1 if self.mesh is None else self.mesh.size)   # steps, sigma, sampler, slots
        self.steps, self.sampler, self.slots = plan.steps, plan.sampler, plan.slots
        self.noise_multiplier, self.planned_epsilon = plan.noise_multiplier, plan.planned_epsilon
        self._row_accountant = plan.row_accountant
        # seconds in privacy accounting: calibration and planning here; in run() the running rows (row_count of
        # them) and the epsilon of record (the last planned row and the summary, from scratch at full resolution)
        self.accounting_s = {"plan": plan.accounting_s, "rows": 0.0, "row_count": 0, "final": 0.0}

        objective = build_objective(cfg, self.train_data, self.label_names, root)   # model, PEFT, RMM, loss
        self.model, self.trainable, self.inputs = objective.model, objective.trainable, objective.inputs
        self.init_params, self._rmm_diagnostics = objective.init_params, objective.rmm_diagnostics
        # adaptive clipping (clip_quantile): the rule, its groups, initial thresholds [M] and the split of sigma
        adaptive = plan_adaptive_clipping(cfg, objective.loss_fn, self.init_params, self.train_data,
                                          self.noise_multiplier)
        self.adaptive, self.clip_groups, self.initial_thresholds = None, None, None
        self.gradient_noise_multiplier = self.count_noise_multiplier = None
        if adaptive is not None:
            self.adaptive, self.clip_groups, self.initial_thresholds = (adaptive.rule, adaptive.groups,
                                                                        adaptive.initial_thresholds)
            self.gradient_noise_multiplier = adaptive.gradient_noise_multiplier
            self.count_noise_multiplier = adaptive.count_noise_multiplier
        self._frozen_by_argument, self._frozen, self._frozen_shardings = frozen_arguments(
            cfg, objective.step_model, self.trainable, self.rules)
        self.learning_rate = optim.learning_rate_schedule(cfg.lr, cfg.lr_schedule, cfg.warmup_steps, self.steps)
        self.tx = optim.make_optimizer(cfg.optimizer, self.learning_rate, cfg.weight_decay)
        if canaries is not None:   # the audit's scores see the noised gradient, as the optimiser does
            self.tx = optax.chain(canaries.observer(), self.tx)
        compiled = build_step(
            cfg, self.tx, loss_fn=objective.loss_fn, apply_fn=objective.apply_fn, loss_for_key=objective.loss_for_key,
            inputs=self.inputs, init_params=self.init_params, train_data=self.train_data, rules=self.rules,
            frozen_by_argument=self._frozen_by_argument, frozen_shardings=self._frozen_shardings,
            # adaptive clipping: the gradient's share of sigma (the count takes the rest; same epsilon)
            noise_multiplier=self.noise_multiplier if self.adaptive is None else self.gradient_noise_multiplier,
            adaptive=self.adaptive, canaries=canaries)
        self._step = compiled.step
        self._param_shardings, self._opt_shardings = compiled.param_shardings, compiled.opt_shardings
        self._evaluator = Evaluator(bind_frozen(objective.apply_fn, self._frozen_by_argument), task=cfg.task,
                                    compute_dtype=PRECISIONS[cfg.precision], text="input_ids" in self.train_data,
                                    rules=self.rules, frozen=self._frozen)

    @property
    def formal_guarantee(self) -> bool:
        """True when the run's epsilon is a formal (epsilon, delta) guarantee (DP on, Poisson or fixed-size)."""
        return run_privacy.formal_guarantee(self.config)

    # ---------------------------------------------------------------- inputs of the compiled functions
    def _place(self, params, opt_state):
        """Fresh device copies (the step donates its inputs), laid out as the ZeRO stage says if there is a mesh."""
        if self.rules is None:
            return jax.tree.map(jnp.array, params), jax.tree.map(jnp.array, opt_state)
        return (jax.tree.map(_to_global, params, self._param_shardings),
                jax.tree.map(_to_global, opt_state, self._opt_shardings))

    def _evaluate_split(self, params, data, inputs=None):
        """``(loss, accuracy)`` of a data split; causal LM: ``(loss per token, perplexity)`` (:class:`Evaluator`)."""
        return self._evaluator(params, data, inputs)

    def _device_batch(self, batch, mask, noise_key):
        """Step inputs as global arrays: each process builds only its own devices' slices of the batch."""
        if self.rules is None:
            return batch, mask, noise_key
        batch_shardings = self.rules.batch(batch)
        return (jax.tree.map(_to_global, batch, batch_shardings), _to_global(mask, self.rules.batch(0)),
                jax.random.wrap_key_data(_to_global(jax.random.key_data(noise_key), self.rules.replicated)))

    def lower_step(self):
        """The jitted training step lowered on abstract arguments of the real shapes and shardings (inspect its
        HLO, collectives or ``.compile().memory_analysis()``; nothing runs)."""
        params, opt_state = self.init_params, jax.eval_shape(self.tx.init, self.init_params)
        if self.rules is not None:
            params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params,
                                  self._param_shardings)
            opt_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), opt_state,
                                     self._opt_shardings)
        batch = {k: jax.ShapeDtypeStruct((self.slots,) + v.shape[1:], v.dtype) for k, v in self.train_data.items()}
        mask = jax.ShapeDtypeStruct((self.slots,), jnp.bool_)
        frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                              self._frozen)
        clip_state = () if self.adaptive is None else jax.ShapeDtypeStruct(self.initial_thresholds.shape, jnp.float32)
        return self._step.lower(params, opt_state, batch, self.step_keys(0)[1], mask, frozen, clip_state)

    # ---------------------------------------------------------------- sampling and privacy of a step
    def step_keys(self, step: int):
        """``(sample_key, noise_key)`` of step ``step``: a pure function of (seed, step)."""
        sample_key, noise_key = jax.random.split(jax.random.fold_in(self.init_key, step))
        return sample_key, noise_key

    def sample(self, step: int):
        """The batch of step ``step`` (a :class:`~dpzero_jax.sampling.Batch` padded to ``self.slots``)."""
        sample_key, _ = self.step_keys(step)
        if self.config.sampling == "shuffled":  # one permutation per epoch from a fixed base key
            batch = self.sampler.sample(self.shuffle_key, step)
        else:
            batch = self.sampler.sample(sample_key)
        pad = self.slots - batch.indices.shape[0]
        if pad:
            batch = dataclasses.replace(batch, indices=np.concatenate([batch.indices, np.zeros(pad, np.int32)]),
                                        mask=np.concatenate([batch.mask, np.zeros(pad, bool)]))
        return batch

    def _record(self, ledger: accounting.PrivacyLedger, step: int, batch) -> None:
        """Charge step ``step`` to the ledger (:func:`run_privacy.record_step`)."""
        run_privacy.record_step(ledger, self.config, step, batch, sigma=self.noise_multiplier,
                                sampling_rate=self.sampling_rate, sampler=self.sampler,
                                dataset_size=self.dataset_size, count_noise_multiplier=self.count_noise_multiplier)

    def _epsilon(self, ledger: accounting.PrivacyLedger) -> float | None:
        """The run's epsilon of record: ``dp_accounting`` from scratch over the ledger (the summary, the last row)."""
        return ledger.epsilon(self.config.delta, self.config.accountant) if self.formal_guarantee else None

    def _row_epsilon(self, ledger: accounting.PrivacyLedger) -> float | None:
        """Epsilon of a logged row: the running accountant, composing only the steps since the previous row."""
        if not self.formal_guarantee:
            return None
        return self._row_accountant.epsilon(ledger, self.config.delta)

    # ---------------------------------------------------------------- the loop
    def run(self, resume: bool | str = False, stop_at: int | None = None, callbacks=()) -> TrainResult:
        """``resume``: False (a new run; refused if ``out`` holds another run's outputs), True (continue from the
        newest good checkpoint; an error if there is none) or ``"or-start"`` (resume if there is a checkpoint,
        else start anew in a directory without earlier outputs). ``out`` (and ``export``) are checked writable
        and ``out`` is locked for the duration (:mod:`dpzero_jax.rundir`). A final evaluation that is not finite
        raises :class:`NonFiniteEvaluationError` (carrying the result) after the outputs are written.
        ``callbacks``: callables ``fn(row)`` run on the first process with every metrics row (a dict, as written to
        ``metrics.jsonl``), after the TensorBoard / W&B writers (``TrainConfig.tensorboard`` / ``wandb_project``)."""
        resume = rundir.resume_mode(resume)
        if resume is True and not (self.out / "checkpoints").is_dir():   # a typo in --out: create nothing
            raise FileNotFoundError(f"resume: {self.out} holds no checkpoints/ to resume from (use "
                                    f"--resume-or-start / resume='or-start' to start a new run there instead)")
        lock = None
        if self.is_primary:
            rundir.check_output_paths(self.out, self.config.export)
            lock = rundir.RunLock(self.out).acquire()
        try:
            return self._run(resume, stop_at, tuple(callbacks))
        finally:
            if lock is not None:
                lock.release()

    def _start(self, resume):
        """``(start, params, opt_state, ledger, clip_state, resumed)``: the newest good checkpoint's state when
        resuming (:mod:`dpzero_jax.train_checkpoint`), else the initial one; params and optimizer state placed."""
        params = self.init_params
        opt_state = self.tx.init(params)
        ledger = accounting.PrivacyLedger()
        start = 0
        restored = None
        if resume:
            shardings = None if self.rules is None else (self._param_shardings, self._opt_shardings)
            restored = restore_checkpoint(self.out, params, opt_state, init_key=self.init_key, config=self.config,
                                          shardings=shardings, set_aside=self.is_primary)
        train_state = None
        if restored is not None:
            start, params, opt_state, ledger, train_state = restored
        elif resume is True:
            raise FileNotFoundError(f"resume: no checkpoint in {self.out / 'checkpoints'} to resume from (use "
                                    f"--resume-or-start / resume='or-start' to start a new run there instead)")
        else:
            rundir.check_fresh(self.out, resume)
        params, opt_state = self._place(params, opt_state)
        clip_state = initial_clip_state(train_state, self.initial_thresholds, self.clip_groups,
                                        None if self.rules is None else self.rules.replicated)
        return start, params, opt_state, ledger, clip_state, restored is not None

    def _run(self, resume, stop_at: int | None, callbacks: tuple = ()) -> TrainResult:
        tqdm = _progress_bar_class(self.config.progress)
        cfg = self.config
        start_time = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        start, params, opt_state, ledger, clip_state, resumed = self._start(resume)
        end = self.steps if stop_at is None else min(self.steps, stop_at)

        metrics_path = self.out / "metrics.jsonl"
        earlier = _read_metrics(metrics_path, upto=start) if resumed and self.is_primary else []
        test_inputs = None if "input_ids" in self.test_data else self._evaluator.inputs(self.test_data)
        manager = open_manager(self.out, cfg.keep_checkpoints) if cfg.checkpoint_every else None
        bar = tqdm(total=self.steps, initial=start, disable=not cfg.progress, desc="dp" if not cfg.no_dp else "non-dp",
                   dynamic_ncols=True)
        test_acc = None
        lm = cfg.task == "causal-lm"
        short = "ppl" if lm else "acc"
        try:
            # rows are streamed to this file, not kept in memory (remote: staged, uploaded at each checkpoint)
            metrics = rundir.MetricsFile(metrics_path if self.is_primary else None, earlier)
            del earlier
            writers = metric_writers.open_writers(cfg.metric_writers, self.out, config=cfg.to_dict(),
                                                  wandb_project=cfg.wandb_project, first_step=start + 1) \
                if self.is_primary else []
            with metrics, contextlib.ExitStack() as closing:
                for writer in writers:
                    closing.callback(writer.close)
                for step in range(start, end):
                    _, noise_key = self.step_keys(step)
                    batch_info = self.sample(step)
                    if batch_info.overflowed:  # charged to delta through the ledger's truncation probability
                        warnings.warn(f"step {step}: Poisson batch of {batch_info.num_selected} truncated to "
                                      f"capacity {self.sampler.capacity} (probability "
                                      f"{self.sampler.overflow_probability:.2g}); recorded in the privacy ledger",
                                      RuntimeWarning, stacklevel=2)
                    batch, mask, noise_key = self._device_batch(gather(self.train_data, batch_info.indices),
                                                                batch_info.mask, noise_key)
                    diagnostics = None
                    if self._rmm_diagnostics is not None and (step + 1) % cfg.rmm_diagnostics_every == 0:
                        # at the parameters the step starts from (the step donates them), on its batch
                        values = self._rmm_diagnostics(params, batch, mask)
                        diagnostics = {k: float(v) if np.isfinite(v) else None for k, v in values.items()}
                    params, opt_state, loss, acc, clip_state, clip_fraction = self._step(
                        params, opt_state, batch, noise_key, mask, self._frozen, clip_state)
                    if not cfg.no_dp:
                        self._record(ledger, step, batch_info)
                    done = step + 1
                    bar.update(1)
                    evaluate = (cfg.eval_every and done % cfg.eval_every == 0) or done == self.steps
                    if done % cfg.log_every == 0 or done == end or evaluate or diagnostics is not None:
                        row = self._row(ledger, step, loss, acc, batch_info, diagnostics, clip_state, clip_fraction)
                        if evaluate:
                            test_loss, test_acc = self._evaluate_split(params, self.test_data, test_inputs)
                            row.update(test_loss=float(test_loss), **{metric_name(lm, True): float(test_acc)})
                        metrics.write(row)
                        for sink in (*(w.write for w in writers), *(callbacks if self.is_primary else ())):
                            sink(row)
                        eps = row["epsilon"]
                        bar.set_postfix(loss=f"{row['loss']:.3f}", **{short: f"{float(acc):.3f}"},
                                        **({} if test_acc is None else {f"test_{short}": f"{float(test_acc):.3f}"}),
                                        eps="n/a" if eps is None else f"{eps:.2f}")
                    if manager is not None and (done % cfg.checkpoint_every == 0 or done == end):
                        save_checkpoint(manager, done, params, opt_state, init_key=self.init_key, ledger=ledger,
                                        config=cfg, clip_state=None if self.adaptive is None else clip_state)
                        metrics.sync()
                        for writer in writers:
                            writer.sync()
        finally:
            bar.close()
            if manager is not None:
                manager.close()
        return self._finish(params, opt_state, ledger, clip_state, end, test_inputs, start_time)

    def _row(self, ledger, step: int, loss, acc, batch_info, diagnostics, clip_state, clip_fraction) -> dict:
        """The metrics row after step ``step``: loss and accuracy (perplexity) of the batch, epsilon (of record at
        the last planned step, else the running accountant's), realised batch size, learning rate, RMM diagnostics
        and adaptive clipping's thresholds and unclipped fractions."""
        done = step + 1
        tick = time.perf_counter()
        if done == self.steps:   # the last planned row: the epsilon of record (from scratch at full resolution)
            eps = self._epsilon(ledger)
            self.accounting_s["final"] += time.perf_counter() - tick
        else:
            eps = self._row_epsilon(ledger)
            self.accounting_s["rows"] += time.perf_counter() - tick
            self.accounting_s["row_count"] += 1
        row = {"step": done, "loss": float(loss), metric_name(self.config.task == "causal-lm", False): float(acc),
               "epsilon": eps, "batch_size": int(batch_info.realised_size), "lr": float(self.learning_rate(step))}
        row.update(diagnostics or {})
        if self.adaptive is not None:
            row.update(clip_row(self.clip_groups, clip_state.addressable_data(0), clip_fraction.addressable_data(0)))
        return row

    def _finish(self, params, opt_state, ledger, clip_state, end: int, test_inputs, start_time: float) -> TrainResult:
        """The final evaluation, the :class:`TrainResult`, ``summary.json``, the plot and the export (process 0);
        :class:`NonFiniteEvaluationError` when the final test loss is not finite (outputs written, no export)."""
        cfg = self.config
        lm = cfg.task == "causal-lm"
        test_loss, test_acc = self._evaluate_split(params, self.test_data, test_inputs)
        train_acc = None if lm else self._evaluate_split(params, self.train_data)[1]
        history = _read_metrics(self.out / "metrics.jsonl", upto=end) if self.is_primary else []
        tick = time.perf_counter()
        epsilon = self._epsilon(ledger)   # memoised when the last row already composed this ledger
        self.accounting_s["final"] += time.perf_counter() - tick
        cap = charge = None
        if self.formal_guarantee and cfg.sampling == "poisson":
            cap = int(self.sampler.capacity)
            charge = ledger.truncation_mass * (1.0 + math.exp(min(epsilon, 700.0))) / cfg.delta
        model = nnx.clone(self.model)
        nnx.update(model, params)
        result = TrainResult(test_accuracy=None if lm else float(test_acc),
                             train_accuracy=None if lm else float(train_acc),
                             test_loss=float(test_loss), epsilon=epsilon, delta=cfg.delta,
                             steps=end, noise_multiplier=self.noise_multiplier,
                             sampling_rate=self.sampling_rate, runtime_s=time.perf_counter() - start_time,
                             out=str(self.out), sampling=cfg.sampling, task=cfg.task,
                             test_perplexity=float(test_acc) if lm else None, batch_cap=cap,
                             truncation_charge=charge, accounting_s=dict(self.accounting_s), params=params,
                             opt_state=opt_state,
                             large_delta=cfg.delta > 1.0 / self.dataset_size,
                             clip_thresholds=None if self.adaptive is None else
                             [float(t) for t in np.asarray(clip_state.addressable_data(0))],
                             gradient_noise_multiplier=self.gradient_noise_multiplier,
                             count_noise_multiplier=self.count_noise_multiplier,
                             history=history, model=model)
        finite = math.isfinite(float(test_loss))   # the same on every process (a global evaluation)
        export_model = model
        if cfg.export is not None and jax.process_count() > 1:  # every process joins the all-gather; process 0 writes
            export_model = nnx.clone(self.model)
            nnx.update(export_model, jax.tree.map(lambda x: _to_global(x, self.rules.replicated), params))
        if not self.is_primary:
            if not finite:
                raise NonFiniteEvaluationError(result, float(test_loss))
            return result
        (self.out / "summary.json").write_text(json.dumps({**summary(result, ledger, finite),
                                                           "config": _jsonable(cfg.to_dict())}, indent=2))
        if cfg.plot and history:
            _plot(history, self.out / "training.png")
        if not finite:   # outputs kept for inspection; diverged weights are not exported
            raise NonFiniteEvaluationError(result, float(test_loss))

        if cfg.export is not None:
            exported = models.pretrained.save(export_model, cfg.export)
            rundir.copy_hf_extras(_hf_path(cfg), exported)
        return result


def train(config: TrainConfig | None = None, resume: bool = False, **overrides) -> TrainResult:
    """``train(TrainConfig(...))`` or ``train(steps=100, epsilon=1)``: build a :class:`Trainer` and run it."""
    config = (config or TrainConfig()).replace(**overrides) if overrides else (config or TrainConfig())
    return Trainer(config).run(resume=resume)
