"""The training run's configuration: :class:`TrainConfig` (every option of ``dpzero train``, validated once here)
and the choices its options take."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax.numpy as jnp

from dpzero_jax import (
    accounting,
    metric_writers,
    optim,
    rmm,
    rundir,
    sharding,
    text,
    validation,
)
from dpzero_jax.config import MODES, DPConfig
from dpzero_jax.data import DATASETS
from dpzero_jax.models.gpt2 import REMAT

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
# a Poisson batch cap above this many times the expected batch is refused (accounting.run.poisson_sampler)
MAX_CAP_FACTOR = 4


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
    epochs: float = 60.0
    batch_size: int = 512
    micro_batch_size: int | None = None
    epsilon: float = 3.0   # EPSILON_DEFAULT
    delta: float = 1e-5
    noise_multiplier: float | None = None
    accountant: str = "pld"
    max_grad_norm: float = 0.3
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


def _hf_path(cfg: TrainConfig) -> str | None:
    """The checkpoint directory of ``model='hf:PATH'`` (None for a bundled model)."""
    return cfg.model[3:].strip() if cfg.model.startswith("hf:") else None


def _mesh_shape(cfg: TrainConfig) -> sharding.MeshShape | None:
    """The ``(data, fsdp)`` mesh shape of ``mesh`` / ``devices`` (None: one device, no mesh)."""
    if cfg.mesh is None and cfg.devices is None:
        return None
    return sharding.parse_mesh(cfg.mesh) if cfg.mesh is not None else sharding.MeshShape(data=1, fsdp=cfg.devices)
