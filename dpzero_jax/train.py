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
import numbers
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpzero_jax import (
    accounting,
    adaptive_clipping,
    clipping,
    hf,
    metric_writers,
    models,
    optim,
    peft,
    rmm,
    rmm_diagnostics,
    rundir,
    sharding,
    spmd,
    text,
    validation,
)
from dpzero_jax import checkpoints as ckpt
from dpzero_jax import nn as dz_nn
from dpzero_jax.config import MODES, DPConfig
from dpzero_jax.data import DATASETS, load_dataset
from dpzero_jax.engine import make_plan, private_value_and_grad
from dpzero_jax.models.gpt2 import REMAT
from dpzero_jax.running_accountant import RunningAccountant, row_interval
from dpzero_jax.sampling import FixedSizeSampler, PoissonSampler, ShuffledEpochs, gather

MODELS = ("mlp", "vit", "cnn")   # or "hf:PATH", a Hugging Face checkpoint directory (GPT-2, BERT, RoBERTa, ViT)
TASKS = text.TASKS
SAMPLINGS = ("poisson", "fixed-size", "shuffled")
PEFT_METHODS = ("none", "lora", "bitfit", "linear-probe")
RMM_SKETCHES = ("none",) + rmm.SKETCHES   # "dft": the discrete Hartley transform (real, orthogonal, by an FFT)
RMM_KEY_TAG = 0x7FFFFFFF   # the sketch key of a step is fold_in(noise_key, RMM_KEY_TAG) (rmm_step_key)
STRATEGIES = ("gspmd", "explicit")
PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# options that may differ between a run and its resumption (they do not change what is computed)
RESUMABLE_CHANGES = ("out", "progress", "plot", "log_every", "checkpoint_every", "keep_checkpoints", "eval_every",
                     "devices", "mesh", "dcn_mesh", "zero", "strategy", "distributed", "coordinator", "num_processes",
                     "process_id", "rmm_diagnostics_every", "export", "tensorboard", "wandb_project")
EPSILON_DEFAULT = 3.0
CLIP_FNS = ("abadi", "automatic", "global")
MAX_CAP_FACTOR = 4   # a Poisson batch cap above this many times the expected batch is refused (Trainer._batch_cap)

__all__ = ["TrainConfig", "TrainResult", "Trainer", "train"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (frozen; ``replace`` gives a modified copy).

    Length: ``steps`` if set, else ``ceil(epochs / q)`` with ``q = batch_size / N_train``.
    Privacy: ``noise_multiplier`` if set (then ``epsilon`` is only reported, not targeted), else sigma is calibrated
    so that the planned steps reach ``epsilon`` at ``delta``. ``no_dp`` trains without clipping or noise. The
    privacy options are checked by :mod:`dpzero_jax.validation`: booleans must be real booleans, ``noise_multiplier``
    excludes a non-default ``epsilon`` (and ``from_dict`` refuses both keys), ``noise_multiplier=0`` is refused (use
    ``no_dp``), and ``delta > 1/n`` needs ``allow_large_delta`` (recorded in the result's summary).
    ``groups``: "all-layer", "layer-wise", "param-wise" or ("uniform", k).
    ``clip_quantile``: adaptive clipping (:mod:`dpzero_jax.adaptive_clipping`): each group's threshold, starting at
    ``max_grad_norm / sqrt(M)``, follows the ``clip_quantile``-quantile of its per-example norms by the geometric
    update with rate ``clip_lr`` from a count of unclipped examples noised with std ``clip_count_noise`` (None:
    ``batch_size / 20``). The count is paid from sigma: the gradient's noise multiplier becomes
    ``(sigma^-2 - (2 clip_count_noise / sqrt(M))^-2)^-1/2``, epsilon is that of sigma. The thresholds are part of
    the checkpointed state. None (default): fixed thresholds.
    ``sampling``: "poisson" (default; add/remove adjacency, PLD or RDP), "fixed-size" (exactly ``batch_size``
    examples without replacement; replace-one adjacency, ``accountant="rdp"`` required) or "shuffled" (epochs of a
    permutation: NO formal guarantee, epsilon is not reported; sigma is calibrated as if Poisson).
    ``eval_every``: test-set evaluation every that many steps (0: only at the end).
    ``devices`` / ``mesh``: train over a ``("data", "fsdp")`` device mesh (:mod:`dpzero_jax.sharding`): ``mesh``
    as ``"data=2,fsdp=4"``; ``devices=N`` alone means ``data=1,fsdp=N``. On a CPU-only machine these are virtual
    CPU devices, which must be requested before JAX starts (the CLI does this). None: one device, no mesh.
    The devices are placed by :func:`jax.make_mesh` (topology-aware). ``dcn_mesh``: a multi-slice run's hybrid
    ICI x DCN mesh, as ``"data=2"``: how many slices (TPU slices; elsewhere runs of consecutive devices, e.g. one
    per host: :func:`sharding.slices_of`) each axis of ``mesh`` spans over the slower DCN; every ``mesh`` size must
    be a multiple of its ``dcn_mesh`` size (:func:`sharding.make_mesh`).
    ``zero``: ZeRO stage 1, 2 or 3 (what is sharded over ``fsdp``); ``strategy``: ``"gspmd"`` (one ``jax.jit``
    with shardings; XLA inserts the collectives) or ``"explicit"`` (the gradient in ``jax.shard_map`` with
    all-gathers of the weights and reduce-scatters of their gradients written out; :func:`sharding.explicit_gradient`).
    ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` compute (inputs cast; layers compute in their input's
    dtype with the fp32 master weights cast at use); norms, clip factors, the clipped sum, the noise and the
    optimizer stay fp32, and there is no loss scaling.
    ``distributed`` / ``coordinator`` / ``num_processes`` / ``process_id``: multi-host training
    (:func:`init_distributed`); ``distributed=True`` alone lets ``jax.distributed.initialize`` detect SLURM,
    Open MPI or a TPU pod; a ``coordinator`` ``"HOST:PORT"`` with ``num_processes`` and ``process_id`` sets them
    explicitly. Every process runs the same program; the mesh spans all processes' devices; each process feeds only
    its own devices' slices of the batch; checkpoints are written collectively (orbax) and files by process 0.
    ``peft``: "none" (every parameter trains), "lora", "bitfit" or "linear-probe" (:mod:`dpzero_jax.peft`);
    ``lora_rank`` / ``lora_alpha`` / ``lora_targets`` (path patterns; None: every dense layer except the head);
    ``peft_also_train``: patterns of parameters trained in full besides the method's (None: ``("head",)`` for LoRA
    and BiTFiT, whose task head is new; ``()`` trains nothing more). Frozen parameters get no norm computation, no
    gradient and no optimizer state; under a mesh they are replicated constants of the compiled step.
    ``rmm``: "none", or a sketch ("gaussian", "rademacher", "dct", "dft" -- the discrete Hartley transform, the real
    orthogonal transform computed by an FFT) with which every dense layer with a trainable kernel, except the
    classification head, becomes a randomized-matmul layer (:mod:`dpzero_jax.rmm`, paper 002) keeping ``rmm_rate``
    of its input for the backward pass (per example: its tokens, under DP; with ``no_dp`` the rows of all the
    batch's slots, padding included, so there ``B_proj`` and the sketch depend on the slot count, which ``devices``
    can round up). Fresh sketches every step (:func:`rmm_step_key`). Not with ``strategy="explicit"``.
    ``rmm_diagnostics_every``: every that many steps, paper 002's D2_SGD, D2_RMM and alpha of each RMM layer on the
    step's batch go into ``metrics.jsonl`` (0: never).
    ``model="hf:PATH"``: a Hugging Face checkpoint directory (:mod:`dpzero_jax.models.pretrained`): GPT-2 or a
    Llama-family model (Llama, Mistral, Qwen2, Gemma 1 / 2) for ``task="causal-lm"``; BERT / RoBERTa (text) or ViT (the
    image ``dataset``) for ``task="classification"``.
    Text: ``data`` (a ``.txt`` or ``.jsonl`` file; None: the embedded corpus, :mod:`dpzero_jax.text`),
    ``eval_data`` (None: a fixed 10% of ``data`` held out), ``max_length`` tokens per example (None: the model's
    positions, at most 128), ``text_field`` / ``label_field`` of the JSONL records, ``tokenizer`` (a directory;
    None: the checkpoint's). Causal LM reports loss and perplexity instead of accuracy. ``export``: a directory
    where the trained model is written in ``save_pretrained`` format at the end (LoRA folded in).
    ``out`` / ``export``: local paths or ``gs://`` / ``s3://`` / ``az://`` / ``hf://`` URLs (:mod:`dpzero_jax.rundir`).
    ``scan_layers`` (``task="causal-lm"``): the GPT-2 blocks stacked and scanned (``GPT2Config.scan_layers``): one
    block in the compiled step at any depth, the private gradient from the traced-program front-end. Llama-family
    models are scanned whatever this says (``LlamaConfig.scan_layers`` defaults to True). ``remat`` (scanned
    decoders): ``"none"``, ``"block"`` (each block's forward recomputed in the backward: least activation memory) or
    ``"dots"`` (the projections' outputs kept, the rest recomputed); ``auto`` is then ``ghost``, whose norms come out
    of the rematerialised backward.
    """

    model: str = "mlp"
    dataset: str = "digits"
    hidden: tuple[int, ...] = (128,)
    steps: int | None = None
    epochs: float = 30.0
    batch_size: int = 256
    micro_batch_size: int | None = None
    epsilon: float = 3.0   # EPSILON_DEFAULT
    delta: float = 1e-5
    noise_multiplier: float | None = None
    accountant: str = "pld"
    max_grad_norm: float = 1.0
    clip_fn: str = "abadi"
    groups: Any = "all-layer"
    clip_quantile: float | None = None
    clip_lr: float = 0.2
    clip_count_noise: float | None = None
    mode: str = "auto"
    norm_kernel: str = "auto"
    lr: float = 1e-2
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    optimizer: str = "adam"
    weight_decay: float = 1e-4
    seed: int = 0
    out: str = "runs/dpzero"
    log_every: int = 10
    tensorboard: bool = False
    wandb_project: str | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    sampling: str = "poisson"
    eval_every: int = 50
    devices: int | None = None
    mesh: str | None = None
    dcn_mesh: str | None = None
    zero: int = 3
    strategy: str = "gspmd"
    precision: str = "fp32"
    distributed: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    peft: str = "none"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None
    peft_also_train: tuple[str, ...] | None = None
    rmm: str = "none"
    rmm_rate: float = 1.0
    rmm_diagnostics_every: int = 0
    task: str = "classification"
    data: str | None = None
    eval_data: str | None = None
    max_length: int | None = None
    text_field: str = "text"
    label_field: str = "label"
    tokenizer: str | None = None
    export: str | None = None
    no_dp: bool = False
    progress: bool = True
    plot: bool = True
    allow_large_delta: bool = False
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self):
        def fail(name, expected, value):
            raise ValueError(f"TrainConfig.{name} must be {expected}, got {validation.short_repr(value)}")

        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

        for name in validation.BOOL_FIELDS:   # never a string: "false" is not False
            validation.check_bool("TrainConfig", name, getattr(self, name))
        if not isinstance(self.model, str) or (self.model not in MODELS and not (
                self.model.startswith("hf:") and self.model[3:].strip())):
            fail("model", f"one of {MODELS} or 'hf:PATH'", self.model)
        if not isinstance(self.out, str) or not self.out.strip():
            fail("out", "a non-empty directory path", self.out)
        rundir.check_url(self.out, "TrainConfig.out")
        if self.task not in TASKS:
            fail("task", f"one of {TASKS}", self.task)
        if self.task == "causal-lm" and not self.model.startswith("hf:"):
            raise ValueError("TrainConfig.task='causal-lm' needs model='hf:PATH' (a GPT-2 or Llama-family "
                             "checkpoint directory)")
        for name in ("data", "eval_data", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not self.model.startswith("hf:") or not isinstance(value, str) or not value):
                raise ValueError(f"TrainConfig.{name} applies to model='hf:PATH' text models and must be a path, "
                                 f"got {value!r}" + ("" if self.model.startswith("hf:") else
                                                     f" with model={self.model!r}"))
        if not isinstance(self.scan_layers, bool):
            fail("scan_layers", "a bool", self.scan_layers)
        if self.scan_layers and self.task != "causal-lm":
            raise ValueError("TrainConfig.scan_layers applies to decoders (task='causal-lm', model='hf:PATH'), not "
                             f"task={self.task!r}")
        if self.remat not in REMAT:
            raise ValueError(f"TrainConfig.remat must be one of {REMAT}, got {self.remat!r}")
        if self.remat != "none" and (self.task != "causal-lm" or not self.model.startswith("hf:")):
            raise ValueError(f"TrainConfig.remat={self.remat!r} applies to decoders (task='causal-lm', "
                             f"model='hf:PATH'), not model={self.model!r} task={self.task!r}")
        if self.max_length is not None and (not is_int(self.max_length) or self.max_length < 2):
            fail("max_length", "an integer >= 2 or None", self.max_length)
        if self.max_length is not None and not self.model.startswith("hf:"):
            raise ValueError(f"TrainConfig.max_length applies to model='hf:PATH' text models, not "
                             f"model={self.model!r}")
        for name in ("text_field", "label_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                fail(name, "a non-empty string", getattr(self, name))
        if self.export is not None and (not isinstance(self.export, str) or not self.export.strip()):
            fail("export", "a directory path or None", self.export)
        if self.export is not None:
            rundir.check_url(self.export, "TrainConfig.export")
            rundir.check_export_target(self.export, _hf_path(self))
        if self.dataset not in DATASETS:
            fail("dataset", f"one of {DATASETS}", self.dataset)
        if self.optimizer not in optim.OPTIMIZERS:
            fail("optimizer", f"one of {optim.OPTIMIZERS}", self.optimizer)
        if not isinstance(self.tensorboard, bool):
            fail("tensorboard", "a bool", self.tensorboard)
        if self.wandb_project is not None and (not isinstance(self.wandb_project, str) or not self.wandb_project):
            fail("wandb_project", "a non-empty string or None", self.wandb_project)
        metric_writers.check(self.metric_writers, self.out, self.wandb_project)
        if self.lr_schedule not in optim.SCHEDULES:
            fail("lr_schedule", f"one of {optim.SCHEDULES}", self.lr_schedule)
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            fail("warmup_steps", "an integer >= 0", self.warmup_steps)
        if self.steps is not None and is_int(self.steps) and is_int(self.warmup_steps) and \
                self.warmup_steps and self.warmup_steps >= self.steps:
            fail("warmup_steps", f"below steps={self.steps}", self.warmup_steps)
        if self.clip_fn not in CLIP_FNS:
            fail("clip_fn", f"one of {CLIP_FNS}", self.clip_fn)
        if self.mode not in MODES:
            fail("mode", f"one of {MODES}", self.mode)
        if self.accountant not in accounting.ACCOUNTANTS:
            fail("accountant", f"one of {accounting.ACCOUNTANTS}", self.accountant)
        if self.sampling not in SAMPLINGS:
            fail("sampling", f"one of {SAMPLINGS}", self.sampling)
        if self.sampling == "fixed-size" and self.accountant != "rdp" and not self.no_dp:
            raise ValueError("TrainConfig.accountant must be 'rdp' with sampling='fixed-size': the PLD accountant "
                             "does not support sampling without replacement")
        hidden = tuple(self.hidden) if isinstance(self.hidden, (list, tuple)) else self.hidden
        if not isinstance(hidden, tuple) or not all(is_int(h) and h > 0 for h in hidden):
            fail("hidden", "a tuple of positive ints", self.hidden)
        object.__setattr__(self, "hidden", hidden)
        if isinstance(self.groups, list):
            object.__setattr__(self, "groups", tuple(self.groups))
        for name in ("batch_size", "log_every", "keep_checkpoints"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "an integer >= 1", getattr(self, name))
        for name in ("checkpoint_every", "seed", "eval_every"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "an integer >= 0", getattr(self, name))
        if self.steps is not None and (not is_int(self.steps) or self.steps < 1):
            fail("steps", "an integer >= 1 or None", self.steps)
        if self.devices is not None and (not is_int(self.devices) or self.devices < 1):
            fail("devices", "an integer >= 1 or None", self.devices)
        if self.mesh is not None:
            shape = sharding.parse_mesh(self.mesh)
            if self.devices is not None and self.devices != shape.size:
                raise ValueError(f"TrainConfig.devices={self.devices} does not match mesh {self.mesh!r} "
                                 f"({shape.size} devices)")
        if self.dcn_mesh is not None:
            if not isinstance(self.dcn_mesh, str):
                fail("dcn_mesh", "a string like 'data=2' or None", self.dcn_mesh)
            if self.mesh is None and self.devices is None:
                raise ValueError(f"TrainConfig.dcn_mesh={self.dcn_mesh!r} needs a mesh (mesh= or devices=) to split "
                                 "into slices")
            try:
                sharding.ici_shape(_mesh_shape(self), sharding.parse_mesh(self.dcn_mesh, "dcn_mesh"))
            except ValueError as error:
                raise ValueError(f"TrainConfig.{error}") from None
        if self.zero not in sharding.ZERO_STAGES:
            fail("zero", f"one of {sharding.ZERO_STAGES}", self.zero)
        if self.strategy not in STRATEGIES:
            fail("strategy", f"one of {STRATEGIES}", self.strategy)
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            fail("precision", f"one of {tuple(PRECISIONS)}", self.precision)
        explicit = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in explicit):
            if any(v is None for v in explicit):
                raise ValueError("TrainConfig: coordinator, num_processes and process_id go together (set all three, "
                                 "or none and distributed=True to detect them)")
            host, sep, port = str(self.coordinator).rpartition(":")
            if not sep or not host or not port.isdigit():
                fail("coordinator", "'HOST:PORT'", self.coordinator)
            if not is_int(self.num_processes) or self.num_processes < 1:
                fail("num_processes", "an integer >= 1", self.num_processes)
            if not is_int(self.process_id) or not 0 <= self.process_id < self.num_processes:
                fail("process_id", f"an integer in [0, {self.num_processes})", self.process_id)
            if self.mesh is None and self.devices is None:
                raise ValueError("TrainConfig: multi-process training needs a mesh (mesh= or devices=)")
        if not isinstance(self.distributed, bool):
            fail("distributed", "a bool", self.distributed)
        if self.peft not in PEFT_METHODS:
            fail("peft", f"one of {PEFT_METHODS}", self.peft)
        if not is_int(self.lora_rank) or self.lora_rank < 1:
            fail("lora_rank", "an integer >= 1", self.lora_rank)
        if not is_num(self.lora_alpha) or self.lora_alpha <= 0:
            fail("lora_alpha", "a finite number > 0", self.lora_alpha)
        for name in ("lora_targets", "peft_also_train"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if value is not None:
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                    fail(name, "a tuple of path patterns or None", getattr(self, name))
                object.__setattr__(self, name, tuple(value))
        if self.lora_targets is not None and self.peft != "lora":
            raise ValueError(f"TrainConfig.lora_targets applies to peft='lora' only, not peft={self.peft!r}")
        if self.rmm not in RMM_SKETCHES:
            fail("rmm", f"one of {RMM_SKETCHES}", self.rmm)
        if not is_num(self.rmm_rate) or not 0 < self.rmm_rate <= 1:
            fail("rmm_rate", "a compression rate in (0, 1]", self.rmm_rate)
        if not is_int(self.rmm_diagnostics_every) or self.rmm_diagnostics_every < 0:
            fail("rmm_diagnostics_every", "an integer >= 0", self.rmm_diagnostics_every)
        if self.rmm == "none" and (self.rmm_rate != 1.0 or self.rmm_diagnostics_every):
            name = "rmm_rate" if self.rmm_rate != 1.0 else "rmm_diagnostics_every"
            raise ValueError(f"TrainConfig.{name} applies to RMM layers only; set rmm to one of {RMM_SKETCHES[1:]}")
        if self.rmm != "none" and self.strategy == "explicit":
            raise ValueError(f"TrainConfig.rmm={self.rmm!r} is not supported with strategy='explicit' (its "
                             "shard_map gradient takes no per-step sketch key); use strategy='gspmd'")
        if self.rmm != "none" and self.export is not None:
            raise ValueError(f"TrainConfig.export is not supported with rmm={self.rmm!r}: RMM layers are a "
                             "training-time replacement of the dense layers with no Hugging Face counterpart; train "
                             "without rmm to export")
        if self.micro_batch_size is not None and (not is_int(self.micro_batch_size) or self.micro_batch_size < 1):
            fail("micro_batch_size", "an integer >= 1 or None", self.micro_batch_size)
        for name in ("epochs", "epsilon", "max_grad_norm", "lr"):
            if not is_num(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "a finite number > 0", getattr(self, name))
        if not is_num(self.weight_decay) or self.weight_decay < 0:
            fail("weight_decay", "a finite number >= 0", self.weight_decay)
        if not is_num(self.delta) or not 0 < self.delta < 1:
            fail("delta", "in (0, 1)", self.delta)
        if self.noise_multiplier is not None and (not is_num(self.noise_multiplier) or self.noise_multiplier < 0):
            fail("noise_multiplier", "a finite number > 0 or None", self.noise_multiplier)
        validation.check_noise(self.noise_multiplier)
        if self.noise_multiplier is not None and self.epsilon != EPSILON_DEFAULT:
            validation.check_privacy_options({"noise_multiplier": self.noise_multiplier, "epsilon": self.epsilon})
        if self.no_dp and self.noise_multiplier is not None:
            validation.check_privacy_options({"no_dp": True, "noise_multiplier": self.noise_multiplier})
        if self.clip_quantile is not None:
            if not is_num(self.clip_quantile) or not 0 < self.clip_quantile < 1:
                fail("clip_quantile", "a number in (0, 1) or None (fixed thresholds)", self.clip_quantile)
            if self.no_dp:
                raise ValueError("TrainConfig.clip_quantile (adaptive clipping) needs DP: no_dp=True clips nothing")
        if not is_num(self.clip_lr) or self.clip_lr <= 0:
            fail("clip_lr", "a finite number > 0", self.clip_lr)
        if self.clip_count_noise is not None and (not is_num(self.clip_count_noise) or self.clip_count_noise <= 0):
            fail("clip_count_noise", "a finite number > 0 or None (expected batch size / 20)", self.clip_count_noise)
        # the DP-specific fields are checked by DPConfig itself (groups, mode, ...)
        DPConfig(max_grad_norm=self.max_grad_norm, clip_fn=self.clip_fn, groups=self.groups, mode=self.mode,
                 microbatch_size=self.micro_batch_size, norm_kernel=self.norm_kernel)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def metric_writers(self) -> tuple[str, ...]:
        """The writers besides ``metrics.jsonl`` (:mod:`dpzero_jax.metric_writers`)."""
        return ("tensorboard",) * bool(self.tensorboard) + ("wandb",) * (self.wandb_project is not None)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a mapping; keys may use dashes (``max-grad-norm``); unknown keys are an error, and so are the
        exclusive pairs of :func:`dpzero_jax.validation.check_privacy_options` (``noise_multiplier`` with ``epsilon``,
        either with ``no_dp``) and non-boolean values of boolean options."""
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown training option {key!r}")
            clean[name] = value
        validation.check_privacy_options(clean)
        return cls(**clean)


@dataclasses.dataclass
class TrainResult:
    test_accuracy: float | None     # None for causal LM
    train_accuracy: float | None
    test_loss: float
    epsilon: float | None          # None without a formal guarantee (no_dp, shuffled epochs)
    delta: float
    steps: int
    noise_multiplier: float | None
    sampling_rate: float
    runtime_s: float
    out: str
    sampling: str = "poisson"
    task: str = "classification"
    test_perplexity: float | None = None   # causal LM: exp(test loss per token)
    batch_cap: int | None = None           # Poisson: static slots per step (batches beyond are truncated)
    truncation_charge: float | None = None  # Poisson: share of delta charged for truncation, mass * (1 + e^eps) / delta
    accounting_s: dict | None = None        # seconds in privacy accounting: plan (calibration), rows, final
    large_delta: bool = False   # delta > 1/n, allowed by allow_large_delta
    clip_thresholds: list | None = None   # adaptive clipping: the final group thresholds
    gradient_noise_multiplier: float | None = None   # adaptive clipping: the gradient's share of sigma
    count_noise_multiplier: float | None = None      # adaptive clipping: the count's, 2 sigma_b / sqrt(M)
    params: Any = dataclasses.field(repr=False, default=None)
    opt_state: Any = dataclasses.field(repr=False, default=None)
    history: list = dataclasses.field(repr=False, default_factory=list)
    model: Any = dataclasses.field(repr=False, default=None)   # the trained NNX model (final params)

    def save_pretrained(self, path) -> Path:
        """Write the trained model as a Hugging Face checkpoint (``config.json`` + ``model.safetensors``; LoRA
        adapters folded in) that ``transformers``' ``from_pretrained`` loads. GPT2, BertEncoder and ViT only."""
        if not hasattr(self.model, "save_pretrained"):
            raise ValueError(f"save_pretrained: the {type(self.model).__name__} model has no Hugging Face format "
                             f"(GPT-2, BERT / RoBERTa and ViT have)")
        from dpzero_jax.models import pretrained

        return pretrained.save(self.model, path)

    def summary(self) -> str:
        if self.noise_multiplier is None:
            privacy = "no privacy guarantee (--no-dp)"
        elif self.epsilon is None:
            privacy = f"sigma {self.noise_multiplier:.4f} but NO formal guarantee ({self.sampling} sampling)"
        else:
            privacy = f"epsilon {self.epsilon:.3f} at delta {self.delta:g} (sigma {self.noise_multiplier:.4f})"
            if self.batch_cap is not None and self.truncation_charge is not None:
                reserved = accounting.TRUNCATION_SHARE
                within = f", within the {reserved:g} reserved" if self.truncation_charge <= reserved else ""
                privacy += (f"  batch cap {self.batch_cap} (truncation charge {self.truncation_charge:.2g} of "
                            f"delta{within})")
        if self.large_delta and self.noise_multiplier is not None:
            privacy += " [delta > 1/n: allowed by --allow-large-delta]"
        if self.clip_thresholds is not None:
            privacy += (f"  adaptive clipping: gradient sigma {self.gradient_noise_multiplier:.4f}, count sigma "
                        f"{self.count_noise_multiplier:.4g}, final thresholds "
                        f"{', '.join(f'{t:.4g}' for t in self.clip_thresholds)}")
        if self.task == "causal-lm":
            quality = f"test loss {self.test_loss:.4f}  test perplexity {self.test_perplexity:.2f}"
        else:
            quality = f"test accuracy {100 * self.test_accuracy:.2f}%  train accuracy {100 * self.train_accuracy:.2f}%"
        return f"{quality}  {privacy}  steps {self.steps}  q {self.sampling_rate:.4f}  time {self.runtime_s:.1f}s"


class NonFiniteEvaluationError(RuntimeError):
    """The run's final evaluation is not finite (NaN or infinite test loss): training diverged. Raised by
    :meth:`Trainer.run` after the run's outputs (metrics, summary with ``evaluation_finite: false``, plot,
    checkpoints) are written, for inspection; no export is written. ``result`` is the run's :class:`TrainResult`.
    ``dpzero train`` prints the message and exits with status 2."""

    def __init__(self, result: TrainResult, test_loss: float):
        super().__init__(f"the final evaluation is not finite (test loss {test_loss}): training diverged after "
                         f"{result.steps} steps; outputs kept in {result.out} for inspection, nothing exported -- "
                         f"try a lower --lr (or --precision fp32)")
        self.result = result


def _hf_path(cfg: TrainConfig) -> str | None:
    return cfg.model[3:].strip() if cfg.model.startswith("hf:") else None


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
    if cfg.model == "mlp":
        return models.MLP(models.MLPConfig(in_features=int(np.prod(image_shape)), hidden=cfg.hidden,
                                           num_classes=num_classes), rngs=rngs)
    size, _, channels = image_shape
    if cfg.model == "cnn":
        dtype = None if cfg.precision == "fp32" else PRECISIONS[cfg.precision]   # nnx layers compute in `dtype`
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
               if isinstance(m, (dz_nn.Linear, dz_nn.DenseGeneral))):   # what convert_to_rmm converts
        raise ValueError(f"TrainConfig.rmm={cfg.rmm!r}: no dpzero_jax.nn dense layer besides the head has a trainable "
                         f"kernel (peft={cfg.peft!r}; Flax's nnx.Linear, as in Llama, is not converted), so there is "
                         f"nothing to convert")
    if cfg.model == "mlp" and not cfg.no_dp:
        warnings.warn("rmm under DP compresses each example's tokens, and the MLP's dense layers see one per "
                      "example: B_proj = 1 keeps the whole input (no memory saved), the orthogonal and Rademacher "
                      "sketches are then exact and the Gaussian one rescales each layer's gradient by a random "
                      "factor; RMM pays off on token models (model='vit')", UserWarning, stacklevel=3)
    return rmm.convert_to_rmm(model, sketch=cfg.rmm, rate=cfg.rmm_rate, private=not cfg.no_dp, where=where)


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


def _mesh_shape(cfg: TrainConfig) -> sharding.MeshShape | None:
    if cfg.mesh is None and cfg.devices is None:
        return None
    return sharding.parse_mesh(cfg.mesh) if cfg.mesh is not None else sharding.MeshShape(data=1, fsdp=cfg.devices)


def request_cpu_devices(cfg: TrainConfig) -> None:
    """Ask for the virtual CPU devices this process needs (its share of the mesh); only effective before JAX's
    first operation, and irrelevant on GPU / TPU."""
    shape = _mesh_shape(cfg)
    if shape is None:
        return
    local = shape.size // (cfg.num_processes or 1)
    try:
        if jax.config.jax_num_cpu_devices < local:
            jax.config.update("jax_num_cpu_devices", local)
    except (RuntimeError, TypeError, ValueError):
        pass  # JAX already started: the devices that exist are used


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
        accounting_start = time.perf_counter()
        if cfg.no_dp:
            self.noise_multiplier = None
        elif cfg.noise_multiplier is not None:
            self.noise_multiplier = float(cfg.noise_multiplier)
        else:
            fixed = cfg.sampling == "fixed-size"
            # Poisson: the batch cap below is sized so that truncation takes TRUNCATION_SHARE of delta at most
            calibration_delta = cfg.delta * (1.0 - accounting.TRUNCATION_SHARE) if poisson else cfg.delta
            with accounting.quiet_rdp_warnings():   # the RDP bracket of calibrate_noise warns about low orders
                self.noise_multiplier = accounting.calibrate_noise(
                    cfg.epsilon, self.sampling_rate, self.steps, calibration_delta, accountant=cfg.accountant,
                    sampling="fixed-size" if fixed else "poisson", dataset_size=n if fixed else None)
        if self.formal_guarantee and cfg.sampling == "poisson" and cfg.accountant == "pld":
            accounting._check_pld_work(self.noise_multiplier, self.sampling_rate, self.steps, cfg.delta)
        # the epsilon the run will end at, known before training (None without a formal guarantee)
        self.planned_epsilon = None if not self.formal_guarantee else self._plan_epsilon()
        if poisson:
            self.sampler = self._batch_cap(n, n_devices)
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
        self.gradient_noise_multiplier = adaptive_clipping.gradient_noise_multiplier(self.noise_multiplier,
                                                                                     self.count_noise_multiplier)
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
        return not self.config.no_dp and self.config.sampling != "shuffled"

    def _plan_epsilon(self) -> float:
        """Epsilon of the whole planned run (truncation budget included), computed before training.

        Calibrated sigma: the target (sigma was calibrated at ``delta * (1 - TRUNCATION_SHARE)`` for Poisson).
        Given sigma: a quick upper bound on the accountant's epsilon of the planned steps
        (:func:`accounting.planned_epsilon`), refused when it is infinite (sigma = 0)."""
        cfg = self.config
        if cfg.noise_multiplier is None:
            return float(cfg.epsilon)
        sigma = self.noise_multiplier
        if sigma == 0:
            raise ValueError("TrainConfig.noise_multiplier=0 adds no noise: epsilon would be infinite; use no_dp=True "
                             "(--no-dp) for a non-private run")
        if cfg.sampling == "fixed-size":
            return accounting.epsilon(sigma, self.sampling_rate, self.steps, cfg.delta, cfg.accountant,
                                      sampling="fixed-size", dataset_size=self.dataset_size)
        with accounting.quiet_rdp_warnings():
            return accounting.planned_epsilon(sigma, self.sampling_rate, self.steps,
                                              cfg.delta * (1.0 - accounting.TRUNCATION_SHARE), cfg.accountant)

    def _batch_cap(self, n: int, n_devices: int) -> PoissonSampler:
        """The Poisson sampler with the batch cap the run can afford (:func:`accounting.plan_overflow_target`).

        DP: the per-step truncation probability is bounded so that its charge is at most ``TRUNCATION_SHARE`` of
        delta at the planned epsilon (plus ``CAP_MARGIN``); a cap above ``MAX_CAP_FACTOR`` times the expected batch
        is refused before training, naming the cap and its cost.  Without DP: the default 1e-9 target."""
        cfg = self.config
        if self.planned_epsilon is None:
            return PoissonSampler(n, self.sampling_rate, capacity_multiple=n_devices)
        sampler = PoissonSampler.for_privacy_budget(n, self.sampling_rate, self.steps, cfg.delta,
                                                    self.planned_epsilon, capacity_multiple=n_devices)
        limit = max(MAX_CAP_FACTOR * cfg.batch_size, cfg.batch_size + 64)
        if sampler.capacity > limit:
            raise ValueError(
                f"the run would end at epsilon {self.planned_epsilon:.4g} (sigma {self.noise_multiplier:.4g}, "
                f"{self.steps} steps, q {self.sampling_rate:.4g}); keeping the charge for truncated Poisson batches "
                f"below {accounting.TRUNCATION_SHARE:g} of delta there needs a batch cap of {sampler.capacity} slots "
                f"per step ({sampler.capacity / cfg.batch_size:.1f}x the expected batch {cfg.batch_size}, in compute "
                f"and memory), more than the {limit} allowed; use a larger noise multiplier, fewer steps or --epsilon")
        return sampler

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
            if adaptive is not None:
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
        """Charge step ``step`` to the ledger (nothing for no_dp and for shuffled epochs, which have no event)."""
        cfg = self.config
        if not self.formal_guarantee:
            return
        if cfg.sampling == "poisson":
            ledger.record(self.noise_multiplier, self.sampling_rate,
                          truncation_probability=self.sampler.truncation_probability,
                          count_noise_multiplier=self.count_noise_multiplier)
            if batch.overflowed:
                ledger.record_overflow(step)
        else:
            ledger.record(self.noise_multiplier, sampling="fixed-size", dataset_size=self.dataset_size,
                          batch_size=cfg.batch_size, count_noise_multiplier=self.count_noise_multiplier)

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
