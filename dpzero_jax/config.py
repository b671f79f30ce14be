"""The frozen, validated configuration of the private gradient (:class:`DPConfig`), and the training run's
privacy and clipping options (:class:`PrivacyOptions`, :class:`ClippingOptions`: groups of
:class:`~dpzero_jax.train_config.TrainConfig`). The checks of the options both take (``max_grad_norm``, ``clip_fn``,
``groups``, ``mode``, ``norm_kernel``, the micro-batch size, the noise multiplier) are defined once here and used by
both (:mod:`dpzero_jax.options`)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from dpzero_jax import validation
from dpzero_jax.clipping import CLIP_FUNCTIONS, GROUP_PRESETS, validate_groups
from dpzero_jax.noise import NOISE_RNG_OPTIONS
from dpzero_jax.options import (
    INVALID,
    Check,
    OptionGroup,
    boolean,
    check_fields,
    choice,
    group_default,
    integer,
    number,
    option,
)
from dpzero_jax.pergrad import NORM_METHODS
from dpzero_jax_kernels.ghost_norm import NORM_KERNELS

MODES = ("auto", "bk", "ghost", "fused", "vmap")
FRONT_ENDS = ("auto", "layers", "program")
TARGETS = ("cpu", "gpu", "tpu")
SCAN_GROUPS = ("whole", "per-iteration")
SAMPLINGS = ("poisson", "fixed-size", "shuffled")
EPSILON_DEFAULT = 3.0


def _accountants() -> tuple[str, ...]:   # dp-accounting is imported only when an accountant is checked
    return importlib.import_module("dpzero_jax.accounting").ACCOUNTANTS


def _accept_groups(value, name):
    if isinstance(value, list):
        raise ValueError(f"{name}: use a tuple ('uniform', k), not a list")
    try:
        validate_groups(value)
    except ValueError:
        return INVALID
    return value


def _parse_groups(text: str):
    """A flag's ``all-layer`` / ``layer-wise`` / ``param-wise`` / ``uniform:K``."""
    if text in GROUP_PRESETS:
        return text
    kind, sep, k = text.partition(":")
    if kind != "uniform" or not sep:
        raise ValueError(text)
    return ("uniform", int(k))


# the checks DPConfig and the training options share
NOISE_MULTIPLIER = number(0.0, low_open=False)
MAX_GRAD_NORM = number()
CLIP_FN = choice(CLIP_FUNCTIONS)
GROUPS = Check(f"one of {GROUP_PRESETS}, ('uniform', k) with an integer k >= 1, a mapping {{path: group}} or a "
               "callable", _accept_groups, _parse_groups,
               flag_expected="all-layer, layer-wise, param-wise or uniform:K (K an integer >= 1)")
MODE = choice(MODES)
NORM_KERNEL = choice(NORM_KERNELS)
MICROBATCH_SIZE = integer(1).or_none()
INSTANTIATED_DTYPES = ("float32", "bfloat16")


def check_instantiated_dtype(owner: str, instantiated_dtype: str, mode: str) -> None:
    """Refuse a non-default ``instantiated_dtype`` with ``mode="vmap"``, which keeps no book-kept per-example
    gradient (the one rule :class:`DPConfig` and :class:`ClippingOptions` share, with the owner's name in the
    message). ``"ghost"`` accepts it: on the traced-program front-end ghost book-keeps the leaves it cannot tap
    (tied weights, a weight shared across scan iterations, a position table), and ``"auto"`` resolves to it."""
    if instantiated_dtype != "float32" and mode == "vmap":
        raise ValueError(f"{owner}.instantiated_dtype={instantiated_dtype!r} is the dtype of the per-example "
                         f"gradients book-keeping keeps for the clipped sum (modes 'bk', 'auto', 'ghost' where it "
                         f"book-keeps, and the book-kept groups of 'fused'); mode={mode!r} keeps none")


def _accept_thresholds(values, name):
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or \
            any(MAX_GRAD_NORM.accept(r, name) is INVALID for r in values):
        return INVALID
    return tuple(float(r) for r in values)


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """How the private gradient is computed.

    noise_multiplier: sigma; the noise std on the clipped sum is ``sigma * ||(R_1..R_M)||``. 0 gives the exact
        clipped (non-private) gradient, for tests and baselines.
    max_grad_norm: R; group thresholds default to ``R / sqrt(M)``.
    clip_fn: ``"abadi"`` (``min(1, R/||g||)``), ``"automatic"`` (``R/(||g|| + gamma)``) or ``"global"``
        (``1{||g|| < R}``).
    groups: ``"all-layer"``, ``"layer-wise"``, ``"param-wise"``, ``("uniform", k)``, ``{path: group}`` or a callable.
    mode: ``"auto"`` (default), ``"bk"``, ``"ghost"``, ``"fused"`` or ``"vmap"``.
    norm_method: for weights, ``"mixed"`` (ghost iff ``2T^2 < p*d``: the space rule of paper 000), ``"fastest"``
        (ghost iff it takes fewer operations than instantiating and reusing the per-example gradient, or if that
        gradient would hold more than twice the per-example operands the ghost norm keeps:
        ``norm_rules.INSTANTIATION_MEMORY_BOUND``),
        ``"ghost"``, ``"instantiate"`` or ``"auto"`` (default): ``"fastest"`` when the step is compiled for a TPU
        (``target``) and for book-keeping on a CPU, ``"mixed"`` otherwise (see
        :func:`dpzero_jax.engine.resolve_target`).
    norm_kernel: how weight norms (and clipped sums) are computed: ``"xla"`` (einsums that build the ``[B, T, T]``
        Grams or the ``[B, rows, cols]`` per-example gradients), ``"pallas"`` (the tiled kernels of
        ``dpzero_jax_kernels.ghost_norm``: neither buffer; the mixed rule then decides on operations) or ``"auto"``
        (default: currently ``"xla"`` on every backend -- the kernels are only interpreted on CPU, were timed on a GPU
        op by op but not inside a step, and not on a TPU).
    expected_batch_size: the divisor of the noised sum; ``None`` uses the (static) batch size B.
    microbatch_size: examples per chunk in ``vmap`` and ``bk`` modes (``None``: the whole batch at once).
    gamma: the stability constant of automatic clipping.
    noise_rng: how the noise is computed -- not what it is: leaf ``j`` gets ``jax.random.normal(fold_in(key, j),
        leaf.shape)`` (partitionable Threefry: every coordinate's noise depends only on the key and its index in the
        leaf, so it is the same on any backend, sharding or number of devices) either way. ``"blocked"``: one loop
        over blocks, in place, with Threefry written as fused elementwise operations (fastest on a CPU);
        ``"partitionable"``: ``jax.random.normal`` per leaf, one fused computation per leaf (what a GPU or TPU
        needs; a sharded gradient is noised shard by shard, on its owner); ``"auto"`` (default): ``"blocked"``
        when ``target`` is the CPU, else ``"partitionable"``. See :mod:`dpzero_jax.noise`.
    group_thresholds: explicit ``(R_1..R_M)`` instead of ``R / sqrt(M)``.
    front_end: where the plan comes from. ``"layers"``: the calls of ``dpzero_jax`` layers (every mode, ZeRO-3
        layer-by-layer gathering, RMM); ``"program"``: the traced program of any JAX model (flax.nnx, flax.linen,
        plain ``jax.numpy``; scans stay scans), book-keeping only (``mode`` ``"bk"`` or ``"auto"``; ``"vmap"`` runs
        as ever); ``"auto"`` (default): ``"layers"`` when every trainable leaf is used inside ``dpzero_jax`` layers,
        else ``"program"``. See :mod:`dpzero_jax.program`.
    scan_groups: the clipping groups of parameters stacked over the iterations of a ``lax.scan`` (a scanned stack of
        layers: ``nn.scan``, ``nnx.scan``, ``stacked_blocks``; program front-end). ``"whole"`` (default): a stacked
        leaf ``[L, ...]`` is one parameter, its group holds every iteration's gradient. ``"per-iteration"``: each
        iteration's slice is a parameter of its own, so ``groups`` applies layer by layer within the stack
        (``"layer-wise"``: one group per layer of the stack; ``M`` grows by the stack's depth; thresholds ``R /
        sqrt(M)``). Computed by ``mode="fused"``, in one backward pass inside the scan (each iteration's
        coefficient is known as soon as its output gradient is); the other modes refuse it.
    instantiated_dtype: the dtype in which book-keeping (``mode="bk"``; ``"auto"``; on the traced-program
        front-end also ``"ghost"``, for the leaves it book-keeps: tied weights, a weight shared across scan
        iterations, a position table; the layer front-end's ghost keeps none) keeps a per-example gradient it
        instantiates (where the norm rule picks instantiation over a ghost norm) and reuses for the clipped sum:
        ``"float32"`` (default) or ``"bfloat16"``, which halves that buffer -- at long sequences the largest the
        private step adds (the tied LM head's ``[B, d, V]``). The rounded gradients are
        then what is clipped and summed: their norms are taken after rounding, so each example's clipped
        contribution is bounded by its threshold exactly and the sensitivity is unchanged; the summed gradient is
        each example's gradient in bfloat16 (a contraction accumulated in float32 and rounded once; an embedding's
        rows added in bfloat16) instead of the exact one. Compiled for a TPU (GPT-2 small, T 1024, 8 per chip) it
        brings ``auto``'s temporaries from 1.25x to 1.00x the non-private step's (``docs/benchmarks/compiled.md``).
    target: the backend the step is compiled for, ``"cpu"``, ``"gpu"`` or ``"tpu"``; ``None`` (default):
        ``jax.default_backend()`` when the step is traced. It decides what the ``"auto"`` settings resolve to; set
        it when compiling ahead of time for another backend (a TPU program compiled on a CPU host).
    """

    noise_multiplier: float = option(1.0, NOISE_MULTIPLIER)
    max_grad_norm: float = option(1.0, MAX_GRAD_NORM)
    clip_fn: str = option("abadi", CLIP_FN)
    groups: Any = option("all-layer", GROUPS)
    mode: str = option("auto", MODE)
    norm_method: str = option("auto", choice(("auto", *NORM_METHODS)))
    norm_kernel: str = option("auto", NORM_KERNEL)
    expected_batch_size: float | None = option(None, number().or_none())
    microbatch_size: int | None = option(None, MICROBATCH_SIZE)
    gamma: float = option(0.01, number())
    noise_rng: str = option("auto", choice(NOISE_RNG_OPTIONS))
    group_thresholds: Sequence[float] | None = option(None, Check("a sequence of positive numbers",
                                                                   _accept_thresholds).or_none())
    front_end: str = option("auto", choice(FRONT_ENDS))
    scan_groups: str = option("whole", choice(SCAN_GROUPS))
    instantiated_dtype: str = option("float32", choice(INSTANTIATED_DTYPES))
    target: str | None = option(None, choice(TARGETS).or_none("None (jax.default_backend()) or one of {choices}"))

    def __post_init__(self):
        check_fields(DPConfig, self, "DPConfig")
        check_instantiated_dtype("DPConfig", self.instantiated_dtype, self.mode)

    def replace(self, **changes) -> DPConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class PrivacyOptions(OptionGroup):
    """A training run's privacy budget and how it is accounted (a group of ``TrainConfig``).

    ``noise_multiplier`` if set (then ``epsilon`` is only reported, not targeted), else sigma is calibrated so that
    the planned steps reach ``epsilon`` at ``delta``; ``no_dp`` trains without clipping or noise. The two and
    ``no_dp`` are exclusive, and zero noise is refused (:mod:`dpzero_jax.validation`). ``sampling``: ``"poisson"``
    (add/remove adjacency, PLD or RDP), ``"fixed-size"`` (replace-one adjacency, ``accountant="rdp"`` required) or
    ``"shuffled"`` (no formal guarantee). ``delta > 1/n`` needs ``allow_large_delta``.
    """

    GROUP = "privacy"

    epsilon: float = option(EPSILON_DEFAULT, number(), "target epsilon (sigma calibrated)", exclusive="privacy")
    noise_multiplier: float | None = option(None, NOISE_MULTIPLIER.or_none(),
                                            "sigma, the noise multiplier (epsilon is then reported, not targeted)",
                                            exclusive="privacy")
    no_dp: bool = option(False, boolean(),
                         "non-private baseline (same sampling and steps)", exclusive="privacy")
    delta: float = option(1e-5, number(high=1.0, high_open=True))
    accountant: str = option("pld", choice(_accountants))
    sampling: str = option("poisson", choice(SAMPLINGS),
                           "poisson (default), fixed-size (needs --accountant rdp) or shuffled (no formal guarantee)")
    allow_large_delta: bool = option(False, boolean(),
                                     "accept delta above 1/n (n training examples); recorded in the summary")

    def _check_group(self, owner: str) -> None:
        validation.check_noise(self.noise_multiplier)
        if self.noise_multiplier is not None and self.epsilon != group_default(PrivacyOptions, "epsilon"):
            validation.check_privacy_options({"noise_multiplier": self.noise_multiplier, "epsilon": self.epsilon},
                                             owner)
        if self.no_dp and self.noise_multiplier is not None:
            validation.check_privacy_options({"no_dp": True, "noise_multiplier": self.noise_multiplier}, owner)
        if self.sampling == "fixed-size" and self.accountant != "rdp" and not self.no_dp:
            raise ValueError(f"{owner}.accountant must be 'rdp' with sampling='fixed-size': the PLD accountant does "
                             "not support sampling without replacement")


@dataclasses.dataclass(frozen=True)
class ClippingOptions(OptionGroup):
    """How a training run clips (a group of ``TrainConfig``): the fields of :class:`DPConfig` it sets, with the same
    checks, and adaptive clipping (:mod:`dpzero_jax.adaptive_clipping`): with ``clip_quantile`` each group's
    threshold, starting at ``max_grad_norm / sqrt(M)``, follows that quantile of its per-example norms by the
    geometric update with rate ``clip_lr`` from a count of unclipped examples noised with std ``clip_count_noise``
    (None: ``batch_size / 20``), paid from sigma. :meth:`dp_config` is the runtime :class:`DPConfig`."""

    GROUP = "clipping"

    # 0.3: the trainer's default, part of the digits recipe (experiments/digits_recipe.py); DPConfig's is 1.0
    max_grad_norm: float = option(0.3, MAX_GRAD_NORM,
                                  "clipping threshold R (the initial one with --clip-quantile)")
    clip_fn: str = option("abadi", CLIP_FN)
    groups: Any = option("all-layer", GROUPS.after(lambda v: tuple(v) if isinstance(v, list) else v),
                         "all-layer, layer-wise, param-wise or uniform:K")
    clip_quantile: float | None = option(
        None, number(high=1.0, high_open=True).or_none("a number in (0, 1) or None (fixed thresholds)"),
        "adaptive clipping (Andrew et al. 2021): every step each group's threshold moves toward this quantile of its "
        "per-example gradient norms, from a noised count of unclipped examples; --max-grad-norm is then the initial "
        "threshold (default: fixed thresholds). The count's noise is paid from the same privacy budget (same "
        "epsilon; the gradient's noise multiplier grows slightly: docs/privacy.md)")
    clip_lr: float = option(0.2, number(),
                            "adaptive clipping's learning rate eta: C <- C * exp(-eta (unclipped fraction - quantile))")
    clip_count_noise: float | None = option(
        None, number().or_none("a finite number > 0 or None (expected batch size / 20)"),
        "adaptive clipping: std sigma_b of the noise on each group's count of unclipped examples (default: expected "
        "batch size / 20, as in the paper); must exceed sigma * sqrt(groups) / 2")
    mode: str = option("auto", MODE)
    norm_kernel: str = option("auto", NORM_KERNEL,
                              "per-example norms with XLA einsums or the tiled Pallas kernels (auto: xla for now)")
    micro_batch_size: int | None = option(None, MICROBATCH_SIZE,
                                          "physical chunk size (gradient accumulation; noise once per logical batch)")
    scan_groups: str = option("whole", choice(SCAN_GROUPS),
                              "groups of scanned, stacked layers: whole (a stacked weight is one parameter) or "
                              "per-iteration (each layer of the stack its own; computed by mode fused in one "
                              "backward pass: --groups layer-wise or param-wise)")
    instantiated_dtype: str = option("float32", choice(INSTANTIATED_DTYPES),
                                     "dtype of the per-example gradients book-keeping instantiates and reuses for the "
                                     "clipped sum: bfloat16 halves that buffer (normed after rounding: what is "
                                     "summed is what is clipped); not with --mode vmap")

    def _check_group(self, owner: str) -> None:
        check_instantiated_dtype(owner, self.instantiated_dtype, self.mode)

    def dp_config(self, noise_multiplier: float, **more) -> DPConfig:
        """The runtime :class:`DPConfig` of these options with ``noise_multiplier`` (``more``: its other fields,
        e.g. ``expected_batch_size``, ``noise_rng``)."""
        return DPConfig(noise_multiplier=noise_multiplier, max_grad_norm=self.max_grad_norm, clip_fn=self.clip_fn,
                        groups=self.groups, mode=self.mode, norm_kernel=self.norm_kernel,
                        microbatch_size=self.micro_batch_size, scan_groups=self.scan_groups,
                        instantiated_dtype=self.instantiated_dtype, **more)
