"""The training run's configuration: :class:`TrainConfig` (every option of ``dpzero train``) composed of option
groups defined next to what they configure -- :class:`~dpzero_jax.config.PrivacyOptions` and
:class:`~dpzero_jax.config.ClippingOptions` (next to ``DPConfig``), :class:`~dpzero_jax.mesh_options.MeshOptions` and
:class:`~dpzero_jax.mesh_options.DistributedOptions`, :class:`~dpzero_jax.peft.PeftOptions`,
:class:`~dpzero_jax.sketch.RMMOptions` -- and here (:class:`ModelOptions`, :class:`TextOptions`,
:class:`TrainingOptions`, :class:`OutputOptions`); and the choices its options take."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from dpzero_jax import metric_writers, optim, rundir, text, validation
from dpzero_jax.clipping import CLIP_FUNCTIONS
from dpzero_jax.config import EPSILON_DEFAULT, SAMPLINGS, ClippingOptions, PrivacyOptions  # noqa: F401 (re-exported)
from dpzero_jax.data import DATASETS
from dpzero_jax.models.gpt2 import REMAT
from dpzero_jax.options import (
    INVALID,
    Check,
    OptionGroup,
    boolean,
    choice,
    integer,
    number,
    option,
    option_of,
)
from dpzero_jax.options import text as nonempty
from dpzero_jax.peft import PEFT_METHODS, PeftOptions  # noqa: F401 (re-exported)
from dpzero_jax.sharding import STRATEGIES, DistributedOptions, MeshOptions, MeshShape  # noqa: F401 (re-exported)
from dpzero_jax.sketch import RMM_CHOICES, RMMOptions

MODELS = ("mlp", "vit", "cnn")   # or "hf:PATH", a Hugging Face checkpoint directory (GPT-2, BERT, RoBERTa, ViT)
TASKS = text.TASKS
RMM_SKETCHES = RMM_CHOICES   # "dft": the discrete Hartley transform (real, orthogonal, by an FFT)
RMM_KEY_TAG = 0x7FFFFFFF   # the sketch key of a step is fold_in(noise_key, RMM_KEY_TAG) (rmm_step_key)
PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# options that may differ between a run and its resumption (they do not change what is computed)
RESUMABLE_CHANGES = ("out", "progress", "plot", "log_every", "checkpoint_every", "keep_checkpoints", "eval_every",
                     "devices", "mesh", "dcn_mesh", "zero", "strategy", "distributed", "coordinator", "num_processes",
                     "process_id", "rmm_diagnostics_every", "export", "tensorboard", "wandb_project")
CLIP_FNS = CLIP_FUNCTIONS
# a Poisson batch cap above this many times the expected batch is refused (accounting.run.poisson_sampler)
MAX_CAP_FACTOR = 4


def _accept_model(value, name):
    ok = isinstance(value, str) and (value in MODELS or (value.startswith("hf:") and value[3:].strip()))
    return value if ok else INVALID


def _accept_hidden(value, name):
    value = tuple(value) if isinstance(value, list) else value
    ok = isinstance(value, tuple) and all(integer(1).accept(h, name) is not INVALID for h in value)
    return value if ok else INVALID


def _parse_widths(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in text.split(","))


def _accept_location(value, name):
    """A local path or a ``gs://`` (``s3://``, ...) URL (:func:`dpzero_jax.rundir.check_url`)."""
    if not isinstance(value, str) or not value.strip():
        return INVALID
    rundir.check_url(value, name)
    return value


LOCATION = Check("a non-empty directory path", _accept_location, at_flag=False)


@dataclasses.dataclass(frozen=True)
class ModelOptions(OptionGroup):
    """The model and what it is trained for."""

    GROUP = "model"

    model: str = option("mlp", Check(f"one of {MODELS} or 'hf:PATH'", _accept_model,
                                             flag_expected="mlp, vit, cnn or hf:PATH"),
                        "mlp, vit, cnn, or hf:PATH (a Hugging Face save_pretrained directory: GPT-2, Llama, Mistral, "
                        "Qwen2, Gemma 1 / 2, BERT, RoBERTa, ViT)")
    task: str = option("classification", choice(TASKS),
                       "classification (default) or causal-lm (hf:PATH GPT-2 checkpoints)")
    dataset: str = option("digits", choice(DATASETS))
    hidden: tuple[int, ...] = option((128,), Check("a tuple of positive ints", _accept_hidden, _parse_widths,
                                                   flag_expected="comma-separated positive ints"),
                                     "MLP hidden widths, e.g. 128 or 256,128")
    precision: str = option("fp32", choice(tuple(PRECISIONS)),
                            "compute precision; fp32 master weights, norms and noise; no loss scaling")
    scan_layers: bool = option(False, boolean(), "GPT-2 (--task causal-lm): stack the blocks and scan over them "
                               "(compile time independent of depth)")
    remat: str = option("none", choice(REMAT),
                        "scanned decoders (--task causal-lm): what each block's backward recomputes: none (keep every "
                        "activation; default), block (only the block's input kept: least memory), dots (the "
                        "projections' outputs kept, the rest recomputed)")

    def _check_group(self, owner: str) -> None:
        hf = self.model.startswith("hf:")
        if self.task == "causal-lm" and not hf:
            raise ValueError(f"{owner}.task='causal-lm' needs model='hf:PATH' (a GPT-2 or Llama-family checkpoint "
                             "directory)")
        if self.scan_layers and self.task != "causal-lm":
            raise ValueError(f"{owner}.scan_layers applies to decoders (task='causal-lm', model='hf:PATH'), not "
                             f"task={self.task!r}")
        if self.remat != "none" and (self.task != "causal-lm" or not hf):
            raise ValueError(f"{owner}.remat={self.remat!r} applies to decoders (task='causal-lm', model='hf:PATH'), "
                             f"not model={self.model!r} task={self.task!r}")


@dataclasses.dataclass(frozen=True)
class TextOptions(OptionGroup):
    """Text data for ``model='hf:PATH'`` models."""

    GROUP = "text"
    HELP = "the data of hf:PATH text models"

    data: str | None = option(None, nonempty("a path").or_none(),
                              "text data for hf:PATH models: a .txt (causal-lm: one corpus cut into max-length "
                              "windows) or .jsonl file (one example per line); default: the embedded Python "
                              "help-topics corpus")
    eval_data: str | None = option(None, nonempty("a path").or_none(),
                                   "held-out .txt/.jsonl file (default: 10%% of --data, fixed)")
    max_length: int | None = option(None, integer(2).or_none(),
                                    "tokens per example (default: the model's positions, at most 128)")
    text_field: str = option("text", nonempty(), "JSONL field holding the text (default text)")
    label_field: str = option("label", nonempty(), "JSONL field holding the class (default label)")
    tokenizer: str | None = option(None, nonempty("a path").or_none(),
                                   "tokenizer directory (default: the checkpoint's)")


@dataclasses.dataclass(frozen=True)
class TrainingOptions(OptionGroup):
    """Length, batch, optimiser and seed."""

    GROUP = "training"

    steps: int | None = option(None, integer(1).or_none(), "number of steps (default: from --epochs)",
                               exclusive="length")
    epochs: float = option(60.0, number(), "steps = ceil(epochs / q)", exclusive="length")
    batch_size: int = option(512, integer(1), "expected (Poisson) batch size")
    lr: float = option(1e-2, number(), "the (peak) learning rate")
    lr_schedule: str = option("constant", choice(optim.SCHEDULES),
                              "after the warmup: constant, or cosine / linear decay to 0 at the last step")
    warmup_steps: int = option(0, integer(0), "linear warmup: lr * (t + 1) / N for the first N steps (default 0)")
    optimizer: str = option("adam", choice(optim.OPTIMIZERS))
    weight_decay: float = option(1e-4, number(low_open=False))
    seed: int = option(0, integer(0))

    def _check_group(self, owner: str) -> None:
        if self.steps is not None and self.warmup_steps and self.warmup_steps >= self.steps:
            raise ValueError(f"{owner}.warmup_steps must be below steps={self.steps}, got {self.warmup_steps!r}")


@dataclasses.dataclass(frozen=True)
class OutputOptions(OptionGroup):
    """Where the run writes, how often, and what it shows."""

    GROUP = "output"

    out: str = option("runs/dpzero", LOCATION, "output directory or gs:// (s3://, ...) URL (metrics.jsonl, "
                      "training.png, checkpoints/)")
    log_every: int = option(10, integer(1))
    eval_every: int = option(50, integer(0), "test-set evaluation every N steps (0: only at the end)")
    checkpoint_every: int = option(50, integer(0), "0: never")
    keep_checkpoints: int = option(3, integer(1))
    export: str | None = option(None, LOCATION.or_none("a directory path or None"),
                                "write the trained model here (a directory or gs:// URL) in Hugging Face "
                                "save_pretrained format")
    tensorboard: bool = option(False, boolean(), "also write the metric rows as TensorBoard event files under "
                               "OUT/tensorboard (pip install 'dpzero_jax[tensorboard]')")
    wandb_project: str | None = option(None, nonempty().or_none("a non-empty string or None"),
                                       "also log the metric rows to this Weights & Biases project (wandb installed, "
                                       "logged in)", flag="--wandb", metavar="PROJECT")
    progress: bool = option(True, boolean(), flag="--no-progress")
    plot: bool = option(True, boolean(), "write training.png (process 0; skipped without matplotlib)", cli=False)

    @property
    def metric_writers(self) -> tuple[str, ...]:
        """The writers besides ``metrics.jsonl`` (:mod:`dpzero_jax.metric_writers`)."""
        return ("tensorboard",) * bool(self.tensorboard) + ("wandb",) * (self.wandb_project is not None)

    def _check_group(self, owner: str) -> None:
        metric_writers.check(OutputOptions.metric_writers.fget(self), self.out, self.wandb_project)


class _GroupView:
    """``cfg.<group>_options``: the group's options of ``cfg`` as a group object."""

    def __init__(self, group: type[OptionGroup]):
        self.group = group

    def __get__(self, obj, owner=None):
        return self if obj is None else self.group.of(obj)


# TrainConfig's groups, in the order of `dpzero train --help`
GROUPS = (ModelOptions, TextOptions, TrainingOptions, PrivacyOptions, ClippingOptions, MeshOptions,
          DistributedOptions, PeftOptions, RMMOptions, OutputOptions)


@dataclasses.dataclass(frozen=True)
class TrainConfig(*reversed(GROUPS)):   # reversed: dataclass fields come from the last base first
    """Everything that determines a training run (frozen; ``replace`` gives a modified copy).

    Composed of the option groups :data:`GROUPS` by inheritance: every option is a flat field (``cfg.lr``,
    ``TrainConfig(lr=...)``, ``to_dict`` / ``from_dict`` flat), checked once by the group that defines it, then
    the rules between groups (:meth:`_check_across`). Each group is also available as an object
    (``cfg.privacy_options``, ``cfg.rmm_options``, ...); ``cfg.dp_config(sigma, ...)`` is the runtime
    :class:`~dpzero_jax.config.DPConfig`. The ``dpzero train`` flags are generated from the fields
    (:func:`dpzero_jax.options.add_flags`); :data:`PYTHON_ONLY` have none.

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

    GROUP = "TrainConfig"
    model_options = _GroupView(ModelOptions)
    text_options = _GroupView(TextOptions)
    training_options = _GroupView(TrainingOptions)
    privacy_options = _GroupView(PrivacyOptions)
    clipping_options = _GroupView(ClippingOptions)
    mesh_options = _GroupView(MeshOptions)
    distributed_options = _GroupView(DistributedOptions)
    peft_options = _GroupView(PeftOptions)
    rmm_options = _GroupView(RMMOptions)
    output_options = _GroupView(OutputOptions)

    def __post_init__(self):
        for group in GROUPS:   # each option checked once, by the group that defines it
            group.validate(self, "TrainConfig")
        self._check_across()

    def _check_across(self) -> None:
        """The rules between options of different groups."""
        hf = self.model.startswith("hf:")
        for name in ("data", "eval_data", "tokenizer"):
            if getattr(self, name) is not None and not hf:
                raise ValueError(f"TrainConfig.{name} applies to model='hf:PATH' text models and must be a path, "
                                 f"got {getattr(self, name)!r} with model={self.model!r}")
        if self.max_length is not None and not hf:
            raise ValueError(f"TrainConfig.max_length applies to model='hf:PATH' text models, not "
                             f"model={self.model!r}")
        if self.export is not None:
            rundir.check_export_target(self.export, _hf_path(self))
        if self.clip_quantile is not None and self.no_dp:
            raise ValueError("TrainConfig.clip_quantile (adaptive clipping) needs DP: no_dp=True clips nothing")
        if self.coordinator is not None and self.mesh is None and self.devices is None:
            raise ValueError("TrainConfig: multi-process training needs a mesh (mesh= or devices=)")
        if self.rmm != "none" and self.strategy == "explicit":
            raise ValueError(f"TrainConfig.rmm={self.rmm!r} is not supported with strategy='explicit' (its "
                             "shard_map gradient takes no per-step sketch key); use strategy='gspmd'")
        if self.rmm != "none" and self.export is not None:
            raise ValueError(f"TrainConfig.export is not supported with rmm={self.rmm!r}: RMM layers are a "
                             "training-time replacement of the dense layers with no Hugging Face counterpart; train "
                             "without rmm to export")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every option, as :meth:`from_dict` takes it back: ``epsilon`` is left out when it is not in effect (with
        ``noise_multiplier`` or ``no_dp`` it keeps its default and is only reported, and ``from_dict`` refuses it
        next to either)."""
        values = dataclasses.asdict(self)
        if self.noise_multiplier is not None or self.no_dp:
            del values["epsilon"]
        return values

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
        validation.check_privacy_options(clean, bool_fields=BOOL_OPTIONS)
        return cls(**clean)


# options with no `dpzero train` flag (Python / --config only)
PYTHON_ONLY = tuple(f.name for f in dataclasses.fields(TrainConfig) if not option_of(f).cli)
# the boolean options (a string such as "false" is refused, naming the --config file: validation.check_bool)
BOOL_OPTIONS = tuple(f.name for f in dataclasses.fields(TrainConfig) if isinstance(f.default, bool))


def _hf_path(cfg: TrainConfig) -> str | None:
    """The checkpoint directory of ``model='hf:PATH'`` (None for a bundled model)."""
    return cfg.model[3:].strip() if cfg.model.startswith("hf:") else None


def _mesh_shape(cfg: TrainConfig) -> MeshShape | None:
    """The ``(data, fsdp)`` mesh shape of ``mesh`` / ``devices`` (None: one device, no mesh)."""
    return MeshOptions.mesh_shape(cfg)
