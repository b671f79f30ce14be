"""Setting up a training run from its :class:`~dpzero_jax.train_config.TrainConfig`: data, model, PEFT, RMM
layers, devices, the mesh and multi-process start, the sampling and privacy plan (:func:`plan_run`), adaptive
clipping's rule and split of sigma (:func:`plan_adaptive_clipping`; used by :class:`dpzero_jax.train.Trainer`)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import warnings

import jax
import numpy as np
from flax import nnx

from dpzero_jax import (
    accounting,
    adaptive_clipping,
    clipping,
    hf,
    models,
    peft,
    rmm,
    rmm_diagnostics,
    sharding,
    text,
)
from dpzero_jax.accounting import run as run_privacy
from dpzero_jax.config import DPConfig
from dpzero_jax.data import load_dataset
from dpzero_jax.engine import make_plan
from dpzero_jax.running_accountant import RunningAccountant, row_interval
from dpzero_jax.sampling import FixedSizeSampler, ShuffledEpochs
from dpzero_jax.train_config import PRECISIONS, RMM_KEY_TAG, TrainConfig, _hf_path, _mesh_shape


def _load_data(cfg: TrainConfig):
    """``(train, test, label_names)``: the image ``dataset``, or for a Hugging Face text model the tokenised
    ``data`` (:func:`dpzero_jax.text.load_text_dataset`)."""
    path = _hf_path(cfg)
    if path is None:
        return (*load_dataset(cfg.dataset, seed=0), None)
    hf_config = hf.read_config(path)
    model_type = hf_config.get("model_type")
    if model_type not in models.pretrained.SUPPORTED:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; supported architectures: "
                         f"{models.pretrained.ARCHITECTURES}")
    wanted = models.pretrained.CAUSAL_LM if cfg.task == "causal-lm" else ("bert", "roberta", "vit")
    if model_type not in wanted:
        raise ValueError(f"task {cfg.task!r} needs a {' / '.join(wanted)} checkpoint, but {path} holds "
                         f"model_type {model_type!r}")
    if model_type == "vit":
        if cfg.data is not None or cfg.eval_data is not None:
            raise ValueError("a ViT checkpoint trains on the image dataset (--dataset), not on a text data file")
        return (*load_dataset(cfg.dataset, seed=0), None)
    if model_type == "gpt2":
        positions = hf_config.get("n_positions", 1024)
    elif cfg.task == "causal-lm":
        positions = hf_config.get("max_position_embeddings", 2048)
    else:
        positions = models.bert_hf.max_length(hf_config, model_type)
    max_length = cfg.max_length if cfg.max_length is not None else min(128, positions)
    if max_length > positions:
        raise ValueError(f"max_length={max_length} exceeds the {positions} positions of the checkpoint in {path}")
    tokenizer = text.load_tokenizer(cfg.tokenizer or path)
    pad_id = hf_config.get("pad_token_id")
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return text.load_text_dataset(tokenizer, task=cfg.task, max_length=max_length, pad_id=int(pad_id),
                                  vocab_size=int(hf_config.get("vocab_size", 0)) or 1 << 31, data=cfg.data,
                                  eval_data=cfg.eval_data, text_field=cfg.text_field, label_field=cfg.label_field)


def _make_model(cfg: TrainConfig, train_data, rngs: nnx.Rngs, label_names=None, seed: int = 0) -> nnx.Module:
    path = _hf_path(cfg)
    if path is not None:
        kwargs = {"seed": seed}
        if cfg.task == "classification":
            kwargs["num_labels"] = len(label_names) if label_names is not None else int(train_data["label"].max()) + 1
            kwargs["id2label"] = label_names
        if "input_ids" in train_data and cfg.precision != "fp32":
            kwargs["dtype"] = PRECISIONS[cfg.precision]
        if cfg.scan_layers:
            kwargs["scan_layers"] = True
        if cfg.remat != "none":
            kwargs["remat"] = cfg.remat
        model = models.from_pretrained(path, **kwargs)
        if isinstance(model, models.ViT):
            c, shape = model.config, train_data["image"].shape[1:]
            if shape != (c.image_size, c.image_size, c.num_channels):
                raise ValueError(f"the ViT checkpoint in {path} takes {c.image_size}x{c.image_size}x{c.num_channels}"
                                 f" images, the {cfg.dataset} dataset has {'x'.join(map(str, shape))}")
        return model
    image_shape = train_data["image"].shape[1:]
    num_classes = int(train_data["label"].max()) + 1
    dtype = None if cfg.precision == "fp32" else PRECISIONS[cfg.precision]   # nnx layers compute in `dtype`
    if cfg.model == "mlp":
        return models.MLP(models.MLPConfig(in_features=int(np.prod(image_shape)), hidden=cfg.hidden,
                                           num_classes=num_classes, dtype=dtype), rngs=rngs)
    size, _, channels = image_shape
    if cfg.model == "cnn":
        return models.CNN(models.CNNConfig(image_size=size, num_channels=channels, num_classes=num_classes,
                                           dtype=dtype), rngs=rngs)
    return models.ViT(models.ViTConfig(image_size=size, patch_size=2, num_channels=channels, hidden_size=64,
                                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                       num_classes=num_classes), rngs=rngs)


def _apply_peft(cfg: TrainConfig, model: nnx.Module, key: jax.Array):
    """``(model, trainable filter)`` for ``cfg.peft`` (LoRA adapters drawn from ``key``)."""
    if cfg.peft == "none":
        return peft.apply(model, "full")
    also_train = cfg.peft_also_train
    if also_train is None:  # a classification head is new: train it; a causal LM's head is the pretrained one
        also_train = ("head",) if cfg.peft in ("lora", "bitfit") and cfg.task == "classification" else ()
    options = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": cfg.lora_targets, "key": key} \
        if cfg.peft == "lora" else {}
    return peft.apply(model, cfg.peft, also_train=also_train, **options)


def _apply_rmm(cfg: TrainConfig, model: nnx.Module, trainable: peft.Trainable) -> nnx.Module:
    """``model`` with its dense layers converted to RMM layers (:func:`dpzero_jax.rmm.convert_to_rmm`) for
    ``cfg.rmm`` / ``cfg.rmm_rate``: those whose kernel trains (a frozen layer keeps nothing for a weight gradient,
    so a sketch would only add memory), except the classification head ``head``, which stays exact (its ``[B, d]``
    input has no token axis to compress under DP, and it is small). Layout: per-example tokens (``private=True``,
    the DP variant) unless ``no_dp`` (the batch's rows, as in paper 002)."""
    if cfg.rmm == "none":
        return model
    trained = set(trainable.names)

    def where(path: str, layer) -> bool:
        return path != "head" and not path.startswith("head/") and f"{path}/kernel" in trained

    if not any(where(peft.path_name(path), m) for path, m in nnx.iter_modules(model)
               if isinstance(m, rmm.CONVERTIBLE)):   # what convert_to_rmm converts
        raise ValueError(f"TrainConfig.rmm={cfg.rmm!r}: no dense layer (dpzero_jax.layers.Linear / DenseGeneral, "
                         f"nnx.Linear / LinearGeneral) besides the head has a trainable kernel (peft={cfg.peft!r}), "
                         f"so there is nothing to convert")
    if cfg.model == "mlp" and not cfg.no_dp:
        warnings.warn("rmm under DP compresses each example's tokens, and the MLP's dense layers see one per "
                      "example: B_proj = 1 keeps the whole input (no memory saved), the orthogonal and Rademacher "
                      "sketches are then exact and the Gaussian one rescales each layer's gradient by a random "
                      "factor; RMM pays off on token models (model='vit')", UserWarning, stacklevel=3)
    return rmm.convert_to_rmm(model, sketch=cfg.rmm, rate=cfg.rmm_rate, private=not cfg.no_dp, where=where)


@dataclasses.dataclass(frozen=True)
class Objective:
    """A run's model and loss (:func:`build_objective`).

    ``model``: the model after PEFT (what the run exports: RMM layers are a device of training);
    ``trainable``: the NNX filter of the trained parameters; ``inputs``: the batch key(s) the model reads
    (``"image"``, ``"input_ids"`` or ``("input_ids", "attention_mask")``); ``init_params``: the trained parameters'
    initial values; ``loss_fn(params, batch, frozen=None) -> [B]``; ``loss_for_key(noise_key) -> loss_fn`` with the
    step's RMM sketches (None without RMM layers); ``apply_fn(params, x, frozen=None) -> logits``; ``step_model``:
    the model the step computes (RMM layers converted); ``rmm_diagnostics``: the jitted diagnostics
    (:func:`_diagnostics_fn`) when asked for, else None."""

    model: nnx.Module
    trainable: object
    inputs: str | tuple
    init_params: object
    loss_fn: object
    loss_for_key: object
    apply_fn: object
    step_model: nnx.Module
    rmm_diagnostics: object


def build_objective(cfg: TrainConfig, train_data: dict, label_names, root: jax.Array) -> Objective:
    """The :class:`Objective` of a run: the model (initialised from ``fold_in(root, 0)``; PEFT adapters from
    ``fold_in(root, 3)``), its RMM conversion, and the task's objective over the training data's inputs."""
    model = _make_model(cfg, train_data, nnx.Rngs(params=jax.random.fold_in(root, 0)), label_names, seed=cfg.seed)
    model, trainable = _apply_peft(cfg, model, jax.random.fold_in(root, 3))
    step_model = _apply_rmm(cfg, model, trainable)
    if cfg.task == "causal-lm":
        inputs = "input_ids"
        objective, objective_args = models.lm_objective, ()
    else:
        inputs = ("input_ids", "attention_mask") if "input_ids" in train_data else "image"
        objective, objective_args = models.classification_objective, (inputs,)
    init_params, loss_fn = objective(step_model, *objective_args, trainable=trainable)
    loss_for_key = diagnostics = None
    if cfg.rmm != "none":  # the loss of a step draws its sketches from that step's key
        _, keyed = rmm.keyed_objective(objective, step_model, *objective_args, trainable=trainable)

        def loss_for_key(noise_key):
            return keyed(rmm_step_key(noise_key))

        if cfg.rmm_diagnostics_every:
            diagnostics = _diagnostics_fn(loss_fn)
    _, apply_fn = models.logits_fn(step_model, trainable=trainable)
    return Objective(model, trainable, inputs, init_params, loss_fn, loss_for_key, apply_fn, step_model, diagnostics)


def rmm_step_key(noise_key: jax.Array) -> jax.Array:
    """The key of the RMM sketches of the step whose noise key is ``noise_key``: ``fold_in(noise_key,
    RMM_KEY_TAG)`` (layer ``j`` then uses ``fold_in(., j)``, :func:`dpzero_jax.rmm.fresh_keys`).

    Fresh sketches every step, a pure function of ``(seed, step)`` (resume is exact). The noise of gradient leaf
    ``j`` is drawn from ``fold_in(noise_key, j)`` with ``j`` far below the tag, so the sketches are independent of
    the noise -- which the privacy analysis needs: it conditions on the data-independent sketch."""
    return jax.random.fold_in(noise_key, RMM_KEY_TAG)


def _diagnostics_fn(loss_fn):
    """Jitted ``fn(params, batch, mask) -> {"rmm/<layer>/<d2_sgd | d2_rmm | alpha>": scalar}``: paper 002's
    diagnostics (:func:`dpzero_jax.rmm_diagnostics.diagnostics_fn`; eqs. 9, 11, 13) of every RMM layer, from its
    exact input and the output gradient of the mean loss over the batch's real examples, in float32. One extra
    forward and backward pass; the exact RMM variances (``T^3`` for the orthogonal sketches) are left out."""
    diagnostics = rmm_diagnostics.diagnostics_fn(loss_fn, exact_variance=False)

    def fn(params, batch, mask):
        return {f"rmm/{path}/{field}": getattr(layer, field) for path, layer in diagnostics(params, batch, mask).items()
                for field in ("d2_sgd", "d2_rmm", "alpha")}

    return jax.jit(fn)


def request_cpu_devices(cfg: TrainConfig) -> None:
    """Ask for the virtual CPU devices this process needs (its share of the mesh); only effective before JAX's
    first operation, and irrelevant on GPU / TPU."""
    shape = _mesh_shape(cfg)
    if shape is None:
        return
    request_cpu_device_count(shape.size // (cfg.num_processes or 1))


# XLA:CPU aborts the process when its virtual devices do not all reach a collective within 40 s (its default); on a
# loaded host a simulated mesh can miss that without any deadlock (the test suite's workers did, tests/conftest.py)
CPU_COLLECTIVE_TIMEOUTS = {"--xla_cpu_collective_call_terminate_timeout_seconds": 600,
                           "--xla_cpu_collective_call_warn_stuck_timeout_seconds": 120}


def request_cpu_device_count(count: int) -> None:
    """At least ``count`` virtual CPU devices in this process; only effective before JAX's first operation (after
    it, the devices that exist are used), irrelevant on GPU / TPU. With more than one, XLA:CPU's collective
    timeouts are raised to ``CPU_COLLECTIVE_TIMEOUTS`` (600 s to abort, 120 s to warn) unless ``XLA_FLAGS`` sets
    them: XLA reads that variable when its CPU backend starts, which is after this call when it has any effect."""
    try:
        if jax.config.jax_num_cpu_devices < count:
            jax.config.update("jax_num_cpu_devices", count)
            if count > 1:
                relax_cpu_collective_timeouts()
    except (RuntimeError, TypeError, ValueError):
        pass  # JAX already started


def relax_cpu_collective_timeouts(environ=None) -> None:
    """Append :data:`CPU_COLLECTIVE_TIMEOUTS` to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``), each flag
    unless it is there already."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    extra = [f"{flag}={value}" for flag, value in CPU_COLLECTIVE_TIMEOUTS.items() if flag not in flags]
    if extra:
        environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def init_distributed(cfg: TrainConfig) -> None:
    """``jax.distributed.initialize`` for a multi-process run (no-op for a single process or if already done).

    Must run before JAX's first operation in every process. With ``coordinator`` / ``num_processes`` /
    ``process_id`` those are passed; with ``distributed=True`` alone JAX detects the cluster (SLURM, Open MPI, TPU
    pod). On CPU the cross-process collectives use gloo.
    """
    if not (cfg.distributed or cfg.coordinator is not None) or jax.distributed.is_initialized():
        return
    if cfg.num_processes == 1:
        return
    request_cpu_devices(cfg)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (RuntimeError, ValueError):
        pass
    if cfg.coordinator is not None:
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id)
    else:
        jax.distributed.initialize()


def _make_mesh(cfg: TrainConfig):
    """The ``("data", "fsdp")`` mesh of ``cfg`` over the default devices (None: one device, no mesh): from
    :func:`jax.make_mesh`, or hybrid ICI x DCN with ``dcn_mesh`` (:func:`sharding.make_mesh`)."""
    shape = _mesh_shape(cfg)
    if shape is None:
        return None
    request_cpu_devices(cfg)
    available = jax.devices()
    if shape.size > len(available):
        raise ValueError(f"devices={shape.size} but only {len(available)} {available[0].platform} device(s) exist; "
                         f"on a CPU, request virtual devices before JAX starts (the dpzero CLI does; in Python call "
                         f"jax.config.update('jax_num_cpu_devices', {shape.size}) right after importing jax)")
    dcn = None if cfg.dcn_mesh is None else sharding.parse_mesh(cfg.dcn_mesh, "dcn_mesh")
    return sharding.make_mesh(shape, dcn=dcn)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run's length, sampler and privacy plan (:func:`plan_run`).

    ``steps``: the run's planned steps; ``sampler``: Poisson (capacity from the truncation budget), fixed-size or
    shuffled epochs; ``slots``: a batch's static size (the sampler's capacity or the batch size, rounded up to a
    multiple of the device count); ``noise_multiplier``: sigma (given or calibrated); ``planned_epsilon``: the
    epsilon the run ends at (None without a formal guarantee); ``row_accountant``: the per-row epsilon's incremental
    accountant (None without a formal guarantee); ``accounting_s``: seconds spent in privacy accounting here."""

    steps: int
    sampler: object
    slots: int
    noise_multiplier: float | None
    planned_epsilon: float | None
    row_accountant: RunningAccountant | None
    accounting_s: float


def plan_run(cfg: TrainConfig, n: int, n_devices: int) -> RunPlan:
    """The :class:`RunPlan` of a run on ``n`` training examples over ``n_devices`` devices (the privacy arithmetic
    itself is :mod:`dpzero_jax.accounting.run`). The shuffled sampler warns that it has no formal guarantee."""
    sampling_rate = cfg.batch_size / n
    sampler = None
    if cfg.sampling == "shuffled":
        sampler = ShuffledEpochs(n, cfg.batch_size)  # warns: no formal guarantee
        default_steps = math.ceil(cfg.epochs * sampler.steps_per_epoch)
    else:
        default_steps = math.ceil(cfg.epochs / sampling_rate)
    steps = cfg.steps if cfg.steps is not None else max(1, default_steps)
    poisson = cfg.sampling == "poisson"
    formal = run_privacy.formal_guarantee(cfg)
    accounting_start = time.perf_counter()   # the run's privacy arithmetic: dpzero_jax.accounting.run
    noise_multiplier = run_privacy.noise_multiplier(cfg, sampling_rate, steps, n)
    # the epsilon the run will end at, known before training (None without a formal guarantee)
    planned_epsilon = None if not formal else run_privacy.planned_epsilon(cfg, noise_multiplier, sampling_rate,
                                                                           steps, n)
    if poisson:
        sampler = run_privacy.poisson_sampler(cfg, n, sampling_rate, steps, planned_epsilon, noise_multiplier,
                                              n_devices)
    elif cfg.sampling == "fixed-size":
        sampler = FixedSizeSampler(n, cfg.batch_size)
    slots = sampler.capacity if poisson else cfg.batch_size
    slots = -(-slots // n_devices) * n_devices  # every device gets the same number of slots
    if formal and poisson:
        # the epsilon of record of the run as planned (dp_accounting from scratch at full resolution): composed
        # now, so that its time and memory are spent before the first step rather than after the last; the
        # ledger's own from-scratch call at the end finds it (accounting._EPSILONS). A calibrated sigma: free,
        # calibration composed it.
        accounting.epsilon_of_record(noise_multiplier, sampling_rate, steps, cfg.delta, cfg.accountant)
        release_free_memory()   # the composition's arrays are freed: hand their pages back (glibc keeps them)
    # per-row epsilon: composed incrementally at a resolution that keeps a row in milliseconds (running_accountant)
    row_accountant = None if not formal else RunningAccountant(cfg.accountant, row_interval(planned_epsilon),
                                                               block=cfg.log_every)
    return RunPlan(steps, sampler, slots, noise_multiplier, planned_epsilon, row_accountant,
                   time.perf_counter() - accounting_start)


def release_free_memory() -> None:
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


@dataclasses.dataclass(frozen=True)
class AdaptivePlan:
    """Adaptive clipping of a run (:func:`plan_adaptive_clipping`): the ``rule``, the clipping ``groups`` (``M``
    names), the ``initial_thresholds [M]`` and the split of sigma between the gradient and the count."""

    rule: adaptive_clipping.AdaptiveClipping
    groups: list
    initial_thresholds: object
    gradient_noise_multiplier: float
    count_noise_multiplier: float


def plan_adaptive_clipping(cfg: TrainConfig, loss_fn, init_params, train_data: dict,
                           noise_multiplier: float) -> AdaptivePlan | None:
    """``clip_quantile``: the rule, the group names (the plan of ``loss_fn`` on one training example), the initial
    thresholds ``[M]`` and the split of the run's ``noise_multiplier`` (:mod:`dpzero_jax.adaptive_clipping`); None
    with fixed thresholds."""
    if cfg.clip_quantile is None:
        return None
    example = {k: v[:1] for k, v in train_data.items()}
    groups = make_plan(loss_fn, DPConfig(groups=cfg.groups), init_params, example,
                       require_supported=False).group_names
    rule = adaptive_clipping.AdaptiveClipping(
        cfg.clip_quantile, count_noise_std=cfg.clip_count_noise or cfg.batch_size *
        adaptive_clipping.DEFAULT_COUNT_NOISE_FRACTION, expected_batch_size=cfg.batch_size,
        learning_rate=cfg.clip_lr)
    count_noise_multiplier = rule.count_noise_multiplier(len(groups))
    gradient_noise_multiplier = rule.gradient_noise_multiplier(noise_multiplier, len(groups))
    return AdaptivePlan(rule, groups, clipping.thresholds(cfg.max_grad_norm, len(groups), None),
                        gradient_noise_multiplier, count_noise_multiplier)
