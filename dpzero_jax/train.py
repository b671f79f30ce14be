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
import functools
import json
import math
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpzero_jax import (
    accounting,
    adaptive_clipping,
    clipping,
    metric_writers,
    models,
    optim,
    rmm,
    rundir,
    sharding,
    spmd,
    validation,
)
from dpzero_jax import checkpoints as ckpt
from dpzero_jax.accounting import run as run_privacy
from dpzero_jax.config import DPConfig
from dpzero_jax.engine import make_plan, private_value_and_grad
from dpzero_jax.running_accountant import RunningAccountant, row_interval
from dpzero_jax.sampling import FixedSizeSampler, ShuffledEpochs, gather
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
from dpzero_jax.train_result import NonFiniteEvaluationError, TrainResult
from dpzero_jax.train_setup import (  # noqa: F401  (rmm_step_key, init_distributed, request_cpu_devices: public)
    _apply_peft,
    _apply_rmm,
    _diagnostics_fn,
    _load_data,
    _make_mesh,
    _make_model,
    init_distributed,
    request_cpu_devices,
    rmm_step_key,
)

__all__ = ["TrainConfig", "TrainResult", "Trainer", "train"]


class Trainer:
    """Builds data, model, optimizer, sampler and the compiled step from a :class:`TrainConfig`.

    ``run(resume=False, stop_at=None)`` trains (from the latest good checkpoint if ``resume``) up to
    ``config.steps`` (or only up to ``stop_at``, for interrupted runs) and returns a :class:`TrainResult`.
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
        n_devices = 1 if self.mesh is None else self.mesh.size
        if cfg.sampling == "shuffled":
            self.sampler = ShuffledEpochs(n, cfg.batch_size)  # warns: no formal guarantee
            default_steps = math.ceil(cfg.epochs * self.sampler.steps_per_epoch)
        else:
            default_steps = math.ceil(cfg.epochs / self.sampling_rate)
        self.steps = cfg.steps if cfg.steps is not None else max(1, default_steps)
        poisson = cfg.sampling == "poisson"
        accounting_start = time.perf_counter()   # the run's privacy arithmetic: dpzero_jax.accounting.run
        self.noise_multiplier = run_privacy.noise_multiplier(cfg, self.sampling_rate, self.steps, n)
        # the epsilon the run will end at, known before training (None without a formal guarantee)
        self.planned_epsilon = None if not self.formal_guarantee else run_privacy.planned_epsilon(
            cfg, self.noise_multiplier, self.sampling_rate, self.steps, n)
        if poisson:
            self.sampler = run_privacy.poisson_sampler(cfg, n, self.sampling_rate, self.steps, self.planned_epsilon,
                                                       self.noise_multiplier, n_devices)
        elif cfg.sampling == "fixed-size":
            self.sampler = FixedSizeSampler(n, cfg.batch_size)
        slots = self.sampler.capacity if poisson else cfg.batch_size
        self.slots = -(-slots // n_devices) * n_devices  # every device gets the same number of slots
        if self.formal_guarantee and poisson:
            # the epsilon of record of the run as planned (dp_accounting from scratch at full resolution): composed
            # now, so that its time and memory are spent before the first step rather than after the last; the
            # ledger's own from-scratch call at the end finds it (accounting._EPSILONS). A calibrated sigma: free,
            # calibration composed it.
            accounting.epsilon_of_record(self.noise_multiplier, self.sampling_rate, self.steps, cfg.delta,
                                         cfg.accountant)
            _release_free_memory()   # the composition's arrays are freed: hand their pages back (glibc keeps them)
        # per-row epsilon: composed incrementally at a resolution that keeps a row in milliseconds (running_accountant)
        self._row_accountant = None if not self.formal_guarantee else RunningAccountant(
            cfg.accountant, row_interval(self.planned_epsilon), block=cfg.log_every)
        # seconds in privacy accounting: calibration and planning here; in run() the running rows (row_count of
        # them) and the epsilon of record (the last planned row and the summary, from scratch at full resolution)
        self.accounting_s = {"plan": time.perf_counter() - accounting_start, "rows": 0.0, "row_count": 0,
                             "final": 0.0}

        model = _make_model(cfg, self.train_data, nnx.Rngs(params=jax.random.fold_in(root, 0)), self.label_names,
                            seed=cfg.seed)
        model, trainable = _apply_peft(cfg, model, jax.random.fold_in(root, 3))
        self.model, self.trainable = model, trainable
        model = _apply_rmm(cfg, model, trainable)
        if cfg.task == "causal-lm":
            self.inputs = "input_ids"
            objective, objective_args = models.lm_objective, ()
        else:
            self.inputs = ("input_ids", "attention_mask") if "input_ids" in self.train_data else "image"
            objective, objective_args = models.classification_objective, (self.inputs,)
        self.init_params, loss_fn = objective(model, *objective_args, trainable=trainable)
        self._setup_adaptive_clipping(loss_fn)
        loss_for_key = None
        self._rmm_diagnostics = None
        if cfg.rmm != "none":  # the loss of a step draws its sketches from that step's key
            _, keyed = rmm.keyed_objective(objective, model, *objective_args, trainable=trainable)

            def loss_for_key(noise_key):
                return keyed(rmm_step_key(noise_key))

            if cfg.rmm_diagnostics_every:
                self._rmm_diagnostics = _diagnostics_fn(loss_fn)
        _, apply_fn = models.logits_fn(model, trainable=trainable)
        # The frozen variables (a PEFT base model) enter the jitted functions as (sharded) arguments, not as
        # constants folded into the program; a Llama in half precision holds its frozen matrices in it. RMM's keyed
        # loss (whose frozen state holds the step's sketch keys) and the explicit strategy's shard_map keep them
        # captured.
        self._frozen_by_argument = cfg.rmm == "none" and not (self.rules is not None and cfg.strategy == "explicit")
        frozen = models.frozen_state(model, trainable) if self._frozen_by_argument else {}
        if cfg.precision != "fp32" and isinstance(model, models.Llama):
            frozen = _matrices_in(frozen, PRECISIONS[cfg.precision])
        self._frozen_shardings = None if self.rules is None else self.rules.params(frozen)
        self._frozen = (jax.tree.map(jnp.asarray, frozen) if self.rules is None
                        else jax.tree.map(_to_global, frozen, self._frozen_shardings))
        self.learning_rate = optim.learning_rate_schedule(cfg.lr, cfg.lr_schedule, cfg.warmup_steps, self.steps)
        self.tx = optim.make_optimizer(cfg.optimizer, self.learning_rate, cfg.weight_decay)
        if canaries is not None:   # the audit's scores see the noised gradient, as the optimiser does
            self.tx = optax.chain(canaries.observer(), self.tx)
        self._build_step(loss_fn, apply_fn, loss_for_key)
        if "input_ids" in self.train_data:
            self._evaluate_text = _text_evaluator(self._bind_frozen(apply_fn), cfg.task)

    def _setup_adaptive_clipping(self, loss_fn) -> None:
        """``clip_quantile``: the rule, the group names, the initial thresholds ``[M]`` and the split of sigma
        (:mod:`dpzero_jax.adaptive_clipping`); all None with fixed thresholds."""
        cfg = self.config
        self.adaptive = self.clip_groups = self.initial_thresholds = None
        self.gradient_noise_multiplier = self.count_noise_multiplier = None
        if cfg.clip_quantile is None:
            return
        example = {k: v[:1] for k, v in self.train_data.items()}
        groups = make_plan(loss_fn, DPConfig(groups=cfg.groups), self.init_params, example,
                           require_supported=False).group_names
        self.clip_groups = groups
        self.adaptive = adaptive_clipping.AdaptiveClipping(
            cfg.clip_quantile, count_noise_std=cfg.clip_count_noise or cfg.batch_size *
            adaptive_clipping.DEFAULT_COUNT_NOISE_FRACTION, expected_batch_size=cfg.batch_size,
            learning_rate=cfg.clip_lr)
        self.count_noise_multiplier = self.adaptive.count_noise_multiplier(len(groups))
        self.gradient_noise_multiplier = self.adaptive.gradient_noise_multiplier(self.noise_multiplier, len(groups))
        self.initial_thresholds = clipping.thresholds(cfg.max_grad_norm, len(groups), None)

    def _clip_row(self, thresholds, fraction) -> dict:
        """Metrics of adaptive clipping: the thresholds after the step's update (the next step clips with them) and
        the released unclipped fraction."""
        thresholds, fraction = np.asarray(thresholds), np.asarray(fraction)
        if len(self.clip_groups) == 1:
            return {"clip_threshold": float(thresholds[0]), "unclipped_fraction": float(fraction[0])}
        row = {f"clip_threshold/{g}": float(t) for g, t in zip(self.clip_groups, thresholds)}
        row.update({f"unclipped_fraction/{g}": float(f) for g, f in zip(self.clip_groups, fraction)})
        return row

    def _initial_clip_state(self, restored: dict | None):
        """The step's clip state: ``()`` with fixed thresholds, else the thresholds ``[M]`` (restored or initial),
        replicated under a mesh."""
        if self.adaptive is None:
            return ()
        if restored is not None:
            if "clip_thresholds" not in restored:
                raise ValueError("the checkpoint holds no adaptive clipping thresholds (train_state); it was not "
                                 "written by a run with clip_quantile")
            values = np.asarray(restored["clip_thresholds"], np.float32)
            if values.shape != self.initial_thresholds.shape:
                raise ValueError(f"the checkpoint's clip thresholds have shape {values.shape}, this run's groups "
                                 f"{self.clip_groups} need {self.initial_thresholds.shape}")
        else:
            values = self.initial_thresholds
        return jnp.asarray(values) if self.rules is None else _to_global(values, self.rules.replicated)

    @property
    def formal_guarantee(self) -> bool:
        """True when the run's epsilon is a formal (epsilon, delta) guarantee (DP on, Poisson or fixed-size)."""
        return run_privacy.formal_guarantee(self.config)

    # ---------------------------------------------------------------- compiled functions
    def _bind_frozen(self, fn):
        """``fn(params, x, frozen=...)`` -> ``bound(params, x, frozen)``: the frozen variables passed in when they
        are an argument of the jitted functions (:attr:`_frozen_by_argument`), else ignored (``fn`` captured them)."""
        if not self._frozen_by_argument:
            return lambda params, x, frozen: fn(params, x)
        return lambda params, x, frozen: fn(params, x, frozen=frozen)

    def _build_step(self, loss_fn, apply_fn, loss_for_key=None):
        """``loss_for_key(noise_key)``: the step's loss when it depends on the step (RMM sketches); else ``loss_fn``."""
        cfg, tx = self.config, self.tx
        if loss_for_key is None:
            def loss_for_key(noise_key):
                return loss_fn
        bind = self._bind_frozen
        adaptive = self.adaptive
        if cfg.no_dp:
            def gradient(params, batch, key, mask, frozen):
                def mean_loss(p):
                    losses = bind(loss_for_key(key))(p, batch, frozen)
                    w = mask.astype(losses.dtype)
                    return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1.0), losses
                (_, losses), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
                return losses, grads
        else:
            # adaptive clipping: the gradient's share of sigma (the count takes the rest; same epsilon)
            sigma_grad = self.noise_multiplier if adaptive is None else self.gradient_noise_multiplier
            dp_cfg = DPConfig(noise_multiplier=sigma_grad, max_grad_norm=cfg.max_grad_norm,
                              clip_fn=cfg.clip_fn, groups=cfg.groups, mode=cfg.mode,
                              expected_batch_size=cfg.batch_size, microbatch_size=cfg.micro_batch_size,
                              norm_kernel=cfg.norm_kernel, noise_rng="partitionable")

            hook = None if self.canaries is None else self.canaries.insert

            def gradient(params, batch, key, mask, frozen, *clip):   # clip: (thresholds [M],) with adaptive clipping
                loss = functools.partial(bind(loss_for_key(key)), frozen=frozen)
                losses, grads, stats = private_value_and_grad(loss, dp_cfg, clipped_sum_hook=hook)(
                    params, batch, key, mask, thresholds=clip[0] if clip else None)
                return (losses, grads, stats.norms) if clip else (losses, grads)

        if self.rules is not None and cfg.strategy == "explicit":
            explicit = self._explicit_gradient(loss_fn, None if cfg.no_dp else dp_cfg)

            def gradient(params, batch, key, mask, frozen, *clip):   # the shard_map captures the frozen variables
                return explicit(params, batch, key, mask, *clip)

        compute_dtype = PRECISIONS[cfg.precision]
        lm, inputs = cfg.task == "causal-lm", self.inputs

        def model_inputs(batch):
            return batch[inputs] if isinstance(inputs, str) else {k: batch[k] for k in inputs}

        grad_shardings = None if self.rules is None else self.rules.grads(self.init_params)
        step_apply = bind(apply_fn)  # the training batch's accuracy after the update
        if self.rules is not None and cfg.strategy == "explicit":  # gathers layer by layer, as the gradient does
            step_apply = bind(sharding.explicit_apply(apply_fn, self.rules, self.init_params))

        # GSPMD: the scanned models' activations split over the batch, each weight gathered where used (spmd.py)
        hint = (functools.partial(spmd.batch_sharded, self.rules.mesh, sharding.BATCH_AXES)
                if self.rules is not None and cfg.strategy == "gspmd" else contextlib.nullcontext)

        def step(params, opt_state, batch, noise_key, mask, frozen, clip_state):
            """``frozen``: the model's frozen variables (or ``{}``); ``clip_state``: ``()``, or adaptive clipping's
            thresholds ``[M]`` (returned updated, with the released unclipped fractions ``[M]``)."""
            batch = _cast_inputs(batch, compute_dtype)
            with hint():
                if adaptive is None:
                    losses, grads = gradient(params, batch, noise_key, mask, frozen)
                    fraction = ()
                else:
                    losses, grads, norms = gradient(params, batch, noise_key, mask, frozen, clip_state)
            if adaptive is not None:   # the update in units of the thresholds it was clipped with, then the rule
                grads = adaptive_clipping.normalize_update(grads, clip_state, adaptive)
                clip_state, fraction = adaptive_clipping.adapt(clip_state, norms, mask, noise_key, adaptive)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)  # fp32 master gradient
            if grad_shardings is not None:  # the ZeRO stage's gradient layout (reduce-scatter to the owners)
                grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            w = mask.astype(jnp.float32)
            count = jnp.maximum(jnp.sum(w), 1.0)
            loss = jnp.sum(jnp.where(mask, losses.astype(jnp.float32), 0.0)) / count
            if lm:  # causal LM: the batch's perplexity exp(loss) in place of an accuracy
                return params, opt_state, loss, jnp.exp(loss), clip_state, fraction
            correct = jnp.argmax(step_apply(params, model_inputs(batch), frozen), -1) == batch["label"]  # updated
            return params, opt_state, loss, jnp.sum(correct * w) / count, clip_state, fraction

        def evaluate(params, images, labels, frozen):
            logits = bind(apply_fn)(params, images.astype(compute_dtype), frozen).astype(jnp.float32)
            loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
            return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

        if self.rules is None:
            self._step = jax.jit(step, donate_argnums=(0, 1))
        else:  # GSPMD: one jit with the ZeRO stage's shardings; XLA inserts all-gathers and reduce-scatters
            rules = self.rules
            opt_shape = jax.eval_shape(tx.init, self.init_params)
            batch_shape = {k: v[:1] for k, v in self.train_data.items()}
            self._param_shardings = rules.params(self.init_params)
            self._opt_shardings = rules.opt_state(opt_shape)
            self._step = jax.jit(step, donate_argnums=(0, 1),
                                 in_shardings=(self._param_shardings, self._opt_shardings, rules.batch(batch_shape),
                                               rules.replicated, rules.batch(0), self._frozen_shardings,
                                               rules.replicated),
                                 out_shardings=(self._param_shardings, self._opt_shardings, rules.replicated,
                                                rules.replicated, rules.replicated, rules.replicated))
        self._evaluate = jax.jit(evaluate)

    def _explicit_gradient(self, loss_fn, dp_cfg: DPConfig | None):
        """``gradient(params, batch, key, mask)`` of the ``explicit`` strategy (:mod:`dpzero_jax.sharding`)."""
        if dp_cfg is None:
            return sharding.explicit_mean_gradient(loss_fn, self.rules, self.init_params)
        return sharding.explicit_private_gradient(loss_fn, dp_cfg, self.rules, self.init_params,
                                                  adaptive=self.adaptive is not None)

    def _place(self, params, opt_state):
        """Fresh device copies (the step donates its inputs), laid out as the ZeRO stage says if there is a mesh."""
        if self.rules is None:
            return jax.tree.map(jnp.array, params), jax.tree.map(jnp.array, opt_state)
        return (jax.tree.map(_to_global, params, self._param_shardings),
                jax.tree.map(_to_global, opt_state, self._opt_shardings))

    def _eval_inputs(self, data):
        """``(images, labels)`` for evaluation; replicated global arrays under a mesh (valid across processes)."""
        if self.rules is None:
            return data["image"], data["label"]
        return _to_global(data["image"], self.rules.replicated), _to_global(data["label"], self.rules.replicated)

    def _device_batch(self, batch, mask, noise_key):
        """Step inputs as global arrays: each process builds only its own devices' slices of the batch."""
        if self.rules is None:
            return batch, mask, noise_key
        batch_shardings = self.rules.batch(batch)
        return (jax.tree.map(_to_global, batch, batch_shardings), _to_global(mask, self.rules.batch(0)),
                jax.random.wrap_key_data(_to_global(jax.random.key_data(noise_key), self.rules.replicated)))

    def _evaluate_split(self, params, data, inputs=None):
        """``(loss, accuracy)`` of a data split; causal LM: ``(loss per token, perplexity)``. ``inputs``: the
        split's :meth:`_eval_inputs` if already placed (image data)."""
        if "input_ids" not in data:
            return self._evaluate(params, *(inputs if inputs is not None else self._eval_inputs(data)), self._frozen)
        place = None if self.rules is None else functools.partial(_to_global, sharding=self.rules.replicated)
        return self._evaluate_text(params, data, place, self._frozen)

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

    # ---------------------------------------------------------------- checkpoints (dpzero_jax.checkpoints)
    def _manager(self):
        return ckpt.open_manager(self.out / "checkpoints", keep=self.config.keep_checkpoints)

    def _save(self, manager, step, params, opt_state, ledger, clip_state=()):
        train_state = None
        if self.adaptive is not None:   # replicated: any process's first copy is the whole vector
            host = np.asarray(clip_state.addressable_data(0), np.float32)
            train_state = {"clip_thresholds": [float(t) for t in host]}
        ckpt.save(manager, step, params, opt_state, jax.random.key_data(self.init_key), ledger.to_dict(),
                  _jsonable(self.config.to_dict()), train_state=train_state)

    def _check_same_run(self, saved: dict) -> None:
        """Refuse to resume a checkpoint written by a different run (a mixed run would match neither config).

        Only presentation options, ``devices`` and -- when sigma does not depend on the planned length (explicit
        ``noise_multiplier`` or ``no_dp``) -- ``steps`` / ``epochs`` may change.
        """
        cfg = self.config
        current = _jsonable(cfg.to_dict())
        allowed = set(RESUMABLE_CHANGES)
        if cfg.noise_multiplier is not None or cfg.no_dp:
            allowed |= {"steps", "epochs"}
        # an option missing from an older checkpoint's config did not exist then: that run had its default
        defaults = _jsonable({f.name: f.default for f in dataclasses.fields(TrainConfig)
                              if f.default is not dataclasses.MISSING})
        changed = sorted(k for k in current.keys() | saved.keys()
                         if k not in allowed and current.get(k) != saved.get(k, defaults.get(k)))
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
            raise ValueError(f"cannot resume from {self.out / 'checkpoints'}: it was written with different "
                             f"options ({details}); use the original options or another --out")

    def _restore(self, params, opt_state):
        """Newest intact checkpoint -> (step, params, opt_state, ledger, train_state); None if there is none
        (:func:`dpzero_jax.checkpoints.restore`: damaged ones skipped with a warning, another run's refused)."""
        shardings = None if self.rules is None else (self._param_shardings, self._opt_shardings)
        found = ckpt.restore(self.out / "checkpoints", params, opt_state, jax.random.key_data(self.init_key),
                                    shardings, check_config=self._check_same_run, set_aside=self.is_primary)
        if found is None:
            return None
        return (found.step, found.params, found.opt_state, accounting.PrivacyLedger.from_dict(found.ledger),
                found.train_state)

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

    def _run(self, resume, stop_at: int | None, callbacks: tuple = ()) -> TrainResult:
        tqdm = _progress_bar_class(self.config.progress)
        cfg = self.config
        start_time = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        params = self.init_params
        opt_state = self.tx.init(params)
        ledger = accounting.PrivacyLedger()
        start = 0
        restored = self._restore(params, opt_state) if resume else None
        train_state = None
        if restored is not None:
            start, params, opt_state, ledger, train_state = restored
        elif resume is True:
            raise FileNotFoundError(f"resume: no checkpoint in {self.out / 'checkpoints'} to resume from (use "
                                    f"--resume-or-start / resume='or-start' to start a new run there instead)")
        else:
            rundir.check_fresh(self.out, resume)
        params, opt_state = self._place(params, opt_state)
        clip_state = self._initial_clip_state(train_state)
        end = self.steps if stop_at is None else min(self.steps, stop_at)

        metrics_path = self.out / "metrics.jsonl"
        earlier = _read_metrics(metrics_path, upto=start) if restored is not None and self.is_primary else []
        test_inputs = None if "input_ids" in self.test_data else self._eval_inputs(self.test_data)
        manager = self._manager() if cfg.checkpoint_every else None
        bar = tqdm(total=self.steps, initial=start, disable=not cfg.progress, desc="dp" if not cfg.no_dp else "non-dp",
                   dynamic_ncols=True)
        test_acc = None
        lm = cfg.task == "causal-lm"
        short = "ppl" if lm else "acc"

        def metric_name(test: bool) -> str:
            return ("test_" if test else "") + ("perplexity" if lm else "accuracy")

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
                        # the last planned row: the epsilon of record (from scratch at full resolution)
                        tick = time.perf_counter()
                        if done == self.steps:
                            eps = self._epsilon(ledger)
                            self.accounting_s["final"] += time.perf_counter() - tick
                        else:
                            eps = self._row_epsilon(ledger)
                            self.accounting_s["rows"] += time.perf_counter() - tick
                            self.accounting_s["row_count"] += 1
                        row = {"step": done, "loss": float(loss), metric_name(False): float(acc),
                               "epsilon": eps, "batch_size": int(batch_info.realised_size),
                               "lr": float(self.learning_rate(step))}
                        row.update(diagnostics or {})
                        if self.adaptive is not None:
                            row.update(self._clip_row(clip_state.addressable_data(0),
                                                      clip_fraction.addressable_data(0)))
                        if evaluate:
                            test_loss, test_acc = self._evaluate_split(params, self.test_data, test_inputs)
                            row.update(test_loss=float(test_loss), **{metric_name(True): float(test_acc)})
                        metrics.write(row)
                        for sink in (*(w.write for w in writers), *(callbacks if self.is_primary else ())):
                            sink(row)
                        eps = row["epsilon"]
                        bar.set_postfix(loss=f"{row['loss']:.3f}", **{short: f"{float(acc):.3f}"},
                                        **({} if test_acc is None else {f"test_{short}": f"{float(test_acc):.3f}"}),
                                        eps="n/a" if eps is None else f"{eps:.2f}")
                    if manager is not None and (done % cfg.checkpoint_every == 0 or done == end):
                        self._save(manager, done, params, opt_state, ledger, clip_state)
                        metrics.sync()
                        for writer in writers:
                            writer.sync()
        finally:
            bar.close()
            if manager is not None:
                manager.close()

        test_loss, test_acc = self._evaluate_split(params, self.test_data, test_inputs)
        train_acc = None if lm else self._evaluate_split(params, self.train_data)[1]
        history = _read_metrics(metrics_path, upto=end) if self.is_primary else []
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
        summary = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
                   if f.name not in ("params", "opt_state", "history", "model")}
        summary["ledger"] = ledger.to_dict()
        finite = math.isfinite(float(test_loss))   # the same on every process (a global evaluation)
        summary["evaluation_finite"] = finite
        export_model = model
        if cfg.export is not None and jax.process_count() > 1:  # every process joins the all-gather; process 0 writes
            export_model = nnx.clone(self.model)
            nnx.update(export_model, jax.tree.map(lambda x: _to_global(x, self.rules.replicated), params))
        if not self.is_primary:
            if not finite:
                raise NonFiniteEvaluationError(result, float(test_loss))
            return result
        (self.out / "summary.json").write_text(json.dumps({**summary, "config": _jsonable(cfg.to_dict())}, indent=2))
        if cfg.plot and history:
            _plot(history, self.out / "training.png")
        if not finite:   # outputs kept for inspection; diverged weights are not exported
            raise NonFiniteEvaluationError(result, float(test_loss))

        if cfg.export is not None:
            exported = models.pretrained.save(export_model, cfg.export)
            rundir.copy_hf_extras(_hf_path(cfg), exported)
        return result


def _progress_bar_class(wanted: bool):
    """``tqdm.auto.tqdm``; without tqdm (the ``train`` extra), a bar that shows nothing, with a one-line notice on
    stderr when a bar was asked for."""
    try:
        from tqdm.auto import tqdm
        return tqdm
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "tqdm":   # installed but broken: show the real error
            raise
    if wanted:
        print("dpzero: no progress bar: tqdm is not installed (pip install 'dpzero_jax[train]')", file=sys.stderr)

    class NoBar:
        def __init__(self, *args, **kwargs):
            pass

        def update(self, n=1):
            pass

        def set_postfix(self, *args, **kwargs):
            pass

        def close(self):
            pass

    return NoBar


def _release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``; nothing elsewhere). After a large transient
    allocation (a full-resolution PLD composition, ~100 MB at 20,000 steps), glibc otherwise keeps most of the
    freed pages resident for the rest of the run."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc (musl)
        pass


def _cast_inputs(batch: dict, dtype) -> dict:
    """Floating-point inputs (images) in the compute dtype; integer arrays (token ids, masks, labels) unchanged."""
    return {k: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in batch.items()}


EVAL_CHUNK = 64  # examples per compiled evaluation call of text models (the last chunk is padded)


def _matrices_in(frozen, dtype):
    """``frozen`` with its floating matrices (2-D and up: kernels, embedding tables) stored in ``dtype``.

    For the Llama family under ``--precision bf16|fp16``: built with that compute ``dtype``, its ``nnx.Linear`` /
    ``nnx.Embed`` layers cast every weight to it at use, so a frozen base model stored so gives the same logits with
    half the bytes (the trained parameters keep their fp32 masters). Vectors (norm scales, biases) stay as they are.
    GPT-2 and BERT sum their embeddings in fp32 before the cast, so theirs stay fp32 (not the same result)."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 else x
    return jax.tree.map(cast, frozen)


def _text_evaluator(apply_fn, task: str):
    """``evaluate(params, data) -> (loss, metric)`` over a tokenised split in chunks of ``EVAL_CHUNK`` examples.

    Classification: mean cross-entropy and accuracy over examples. Causal LM: the mean next-token cross-entropy over
    all target tokens of the split (``loss_mask``) and its exponential, the perplexity."""

    def chunk_sums(params, chunk, weight, frozen):
        if task == "causal-lm":
            ids = chunk["input_ids"]
            logits = apply_fn(params, ids, frozen)[:, :-1].astype(jnp.float32)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
            tokens = chunk["loss_mask"][:, 1:].astype(jnp.float32) * weight[:, None]
            return jnp.sum(nll * tokens), jnp.sum(tokens)
        logits = apply_fn(params, {k: chunk[k] for k in ("input_ids", "attention_mask")}, frozen).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, chunk["label"])
        correct = (jnp.argmax(logits, -1) == chunk["label"]).astype(jnp.float32)
        return jnp.sum(loss * weight), jnp.sum(correct * weight)

    chunk_sums = jax.jit(chunk_sums)

    def evaluate(params, data, place=None, frozen=None):
        """``place``: host array -> global array (under a mesh, so that every process passes the same chunk);
        ``frozen``: the model's frozen variables when ``apply_fn`` takes them as an argument."""
        n = len(next(iter(data.values())))
        size = min(EVAL_CHUNK, n)
        first = second = 0.0
        for start in range(0, n, size):
            chunk = {k: v[start:start + size] for k, v in data.items()}
            real = len(chunk["input_ids"])
            pad = size - real
            if pad:
                chunk = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in chunk.items()}
            weight = (np.arange(size) < real).astype(np.float32)
            if place is not None:
                chunk, weight = {k: place(v) for k, v in chunk.items()}, place(weight)
            a, b = chunk_sums(params, chunk, weight, frozen)
            first, second = first + float(a), second + float(b)
        if task == "causal-lm":
            loss = first / max(second, 1.0)
            return loss, math.exp(min(loss, 700.0))
        return first / n, second / n

    return evaluate


def train(config: TrainConfig | None = None, resume: bool = False, **overrides) -> TrainResult:
    """``train(TrainConfig(...))`` or ``train(steps=100, epsilon=1)``: build a :class:`Trainer` and run it."""
    config = (config or TrainConfig()).replace(**overrides) if overrides else (config or TrainConfig())
    return Trainer(config).run(resume=resume)


def _to_global(value, sharding):
    """A global ``jax.Array`` with ``sharding`` from a value every process holds in full (host or device): each
    process transfers only the slices of its own devices (works across processes, unlike ``device_put``)."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return jnp.copy(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)   # already global: reshard collectively
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _read_metrics(path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def _plot(history: list[dict], path) -> None:
    """Loss and epsilon against the step, as a PNG: matplotlib's object API, so neither the global backend nor
    pyplot's figure registry is touched (safe in notebooks and other users' processes). matplotlib is optional (the
    ``plot`` extra): without it the plot is skipped with a one-line notice on stderr."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "matplotlib":   # installed but broken: show the real error
            raise
        print(f"dpzero: {path} not written: matplotlib is not installed (pip install 'dpzero_jax[plot]')",
              file=sys.stderr)
        return

    steps = [r["step"] for r in history]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_loss, ax_eps = fig.subplots(1, 2)
    ax_loss.plot(steps, [r["loss"] for r in history])
    ax_loss.set(xlabel="step", ylabel="train loss (batch)", title="loss")
    eps = [r["epsilon"] for r in history]
    if all(e is not None for e in eps):
        ax_eps.plot(steps, eps)
        ax_eps.set(xlabel="step", ylabel="epsilon", title="privacy spent")
    else:
        ax_eps.text(0.5, 0.5, "no DP", ha="center", va="center")
        ax_eps.set_axis_off()
    fig.tight_layout()
    with rundir.as_path(path).open("wb") as file:   # local or remote (epath)
        fig.savefig(file, format="png", dpi=100)
