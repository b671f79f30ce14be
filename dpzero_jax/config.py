"""The frozen, validated configuration of the private gradient."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

from dpzero_jax.clipping import CLIP_FUNCTIONS, validate_groups
from dpzero_jax.noise import NOISE_RNGS
from dpzero_jax.pergrad import NORM_METHODS
from dpzero_jax_kernels.ghost_norm import NORM_KERNELS

MODES = ("auto", "bk", "ghost", "fused", "vmap")
FRONT_ENDS = ("auto", "layers", "program")
TARGETS = ("cpu", "gpu", "tpu")


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
        (ghost iff it takes fewer operations than instantiating and reusing the per-example gradient),
        ``"ghost"``, ``"instantiate"`` or ``"auto"`` (default): ``"fastest"`` when the step is compiled for a TPU
        (``target``), ``"mixed"`` elsewhere (see :func:`dpzero_jax.engine.resolve_target`).
    norm_kernel: how weight norms (and clipped sums) are computed: ``"xla"`` (einsums that build the ``[B, T, T]``
        Grams or the ``[B, rows, cols]`` per-example gradients), ``"pallas"`` (the tiled kernels of
        ``dpzero_jax_kernels.ghost_norm``: neither buffer; the mixed rule then decides on operations) or ``"auto"``
        (default: currently ``"xla"`` on every backend -- the kernels are only interpreted on CPU and not yet timed on
        GPU/TPU).
    expected_batch_size: the divisor of the noised sum; ``None`` uses the (static) batch size B.
    microbatch_size: examples per chunk in ``vmap`` and ``bk`` modes (``None``: the whole batch at once).
    gamma: the stability constant of automatic clipping.
    noise_rng: ``"blocked"`` (default: XLA's fused bit generator, block by block in place; fastest on one device)
        or ``"partitionable"`` (``jax.random``'s partitionable Threefry: every coordinate's noise depends only on the
        key and its global index, so a sharded gradient is noised shard by shard, on its owner, and the noise is the
        same on any number of devices). See :mod:`dpzero_jax.noise`.
    group_thresholds: explicit ``(R_1..R_M)`` instead of ``R / sqrt(M)``.
    front_end: where the plan comes from. ``"layers"``: the calls of ``dpzero_jax`` layers (every mode, ZeRO-3
        layer-by-layer gathering, RMM); ``"program"``: the traced program of any JAX model (flax.nnx, flax.linen,
        plain ``jax.numpy``; scans stay scans), book-keeping only (``mode`` ``"bk"`` or ``"auto"``; ``"vmap"`` runs
        as ever); ``"auto"`` (default): ``"layers"`` when every trainable leaf is used inside ``dpzero_jax`` layers,
        else ``"program"``. See :mod:`dpzero_jax.program`.
    target: the backend the step is compiled for, ``"cpu"``, ``"gpu"`` or ``"tpu"``; ``None`` (default):
        ``jax.default_backend()`` when the step is traced. It decides what the ``"auto"`` settings resolve to; set
        it when compiling ahead of time for another backend (a TPU program compiled on a CPU host).
    """

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    clip_fn: str = "abadi"
    groups: Any = "all-layer"
    mode: str = "auto"
    norm_method: str = "auto"
    norm_kernel: str = "auto"
    expected_batch_size: float | None = None
    microbatch_size: int | None = None
    gamma: float = 0.01
    noise_rng: str = "blocked"
    group_thresholds: Sequence[float] | None = None
    front_end: str = "auto"
    target: str | None = None

    def __post_init__(self):
        def positive_number(name, value, allow_zero=False):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"DPConfig.{name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and not allow_zero):
                raise ValueError(f"DPConfig.{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")

        positive_number("noise_multiplier", self.noise_multiplier, allow_zero=True)
        positive_number("max_grad_norm", self.max_grad_norm)
        positive_number("gamma", self.gamma)
        if self.clip_fn not in CLIP_FUNCTIONS:
            raise ValueError(f"DPConfig.clip_fn={self.clip_fn!r}: expected one of {CLIP_FUNCTIONS}")
        if self.mode not in MODES:
            raise ValueError(f"DPConfig.mode={self.mode!r}: expected one of {MODES}")
        if self.front_end not in FRONT_ENDS:
            raise ValueError(f"DPConfig.front_end={self.front_end!r}: expected one of {FRONT_ENDS}")
        if self.norm_method not in ("auto", *NORM_METHODS):
            raise ValueError(f"DPConfig.norm_method={self.norm_method!r}: expected one of {('auto', *NORM_METHODS)}")
        if self.target is not None and self.target not in TARGETS:
            raise ValueError(f"DPConfig.target={self.target!r}: expected None (jax.default_backend()) or one of "
                             f"{TARGETS}")
        if self.noise_rng not in NOISE_RNGS:
            raise ValueError(f"DPConfig.noise_rng={self.noise_rng!r}: expected one of {NOISE_RNGS}")
        if self.norm_kernel not in NORM_KERNELS:
            raise ValueError(f"DPConfig.norm_kernel={self.norm_kernel!r}: expected one of {NORM_KERNELS} "
                             "('pallas' runs the tiled Pallas kernels of dpzero_jax_kernels.ghost_norm)")
        validate_groups(self.groups)
        if self.expected_batch_size is not None:
            positive_number("expected_batch_size", self.expected_batch_size)
        if self.microbatch_size is not None and (isinstance(self.microbatch_size, bool) or
                                                 not isinstance(self.microbatch_size, numbers.Integral) or
                                                 self.microbatch_size < 1):
            raise ValueError(f"DPConfig.microbatch_size must be a positive int or None, got {self.microbatch_size!r}")
        if self.group_thresholds is not None:
            values = self.group_thresholds
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
                    isinstance(r, numbers.Real) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                    for r in values):
                raise ValueError(f"DPConfig.group_thresholds must be a sequence of positive numbers, got {values!r}")
            object.__setattr__(self, "group_thresholds", tuple(float(r) for r in values))
        if isinstance(self.groups, list):
            raise ValueError("DPConfig.groups: use a tuple ('uniform', k), not a list")

    def replace(self, **changes) -> DPConfig:
        return dataclasses.replace(self, **changes)
