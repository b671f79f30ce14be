"""Memory planner: per-device bytes of a DP-ZeRO training step for a decoder LM, before anything is built.

``plan_memory(model, devices, batch, seq, precision, zero)`` returns a :class:`MemoryPlan` with, per device:

* **model states** (paper 000 §2.2.2, the ZeRO paper's mixed-precision Adam with ``Psi`` parameters):
  16-bit parameters ``2 Psi``, 16-bit gradients ``2 Psi``, optimizer state ``12 Psi`` (fp32 master copy, first and
  second moments). Stage 1 partitions the optimizer state over the ``N`` devices (``4 Psi + 12 Psi / N``), stage 2
  also the gradients (``2 Psi + 14 Psi / N``), stage 3 also the parameters (``16 Psi / N``); stage 0 is plain data
  parallelism (``16 Psi``). In ``fp32`` the parameters are the master copy: ``4 Psi`` parameters, ``4 Psi``
  gradients, ``8 Psi`` moments. A partitioned buffer is the flat ZeRO buffer padded to a multiple of ``N``:
  ``ceil(Psi / N)`` elements per device.
* **gathered weights** (stage 3 only): the all-gathered weights of the largest single layer, at the compute
  precision, live while that layer runs (one layer at a time, no prefetch; DESIGN §4's explicit strategy). The
  ``explicit`` strategy of :mod:`dpzero_jax.sharding` gathers linear layers so; it gathers embedding tables and
  norm parameters in fp32 (its master weights), up to twice this row when the embedding is the largest layer.
* **activations** (``remat='none'``; :func:`activation_bytes_per_token`): the residuals the backward keeps per
  token of the per-device batch, without recomputation, as the TPU compiler keeps them for the project's models.
* **temporaries** (``remat='block'``; :mod:`dpzero_jax.step_memory`): the named buffers of the compiled ZeRO-3
  step with the models' block remat at the largest of its moments -- the LM head (gathered table or activations,
  logits, the head's gradient), one block's backward at its attention or its weight gradients (probabilities,
  activations, the largest matrix gathered and its gradients) with the scan's saved block inputs, stacked fp32
  gradients and the head's held gradient, or a ``d``-sharded table's whole gradients after the blocks -- with the
  DP step's extra buffers (its float32 sums -- the privatized sum is never rounded to half precision -- and what
  its second pass keeps). Within 10% of the TPU compiler's peak on 200 of the 214 compiled steps compared; on shapes
  compiled after their predictions 108 of 162, 25 of 28 in rounds 18-20, 6 of 14 in two LoRA rounds
  (``docs/planner.md``).
* **DP extra**: per trainable weight the buffer of its per-example norm under the mixed ghost-norm rule (paper 000,
  Appendix A): ``min(2 T^2, rows * cols)`` fp32 numbers per example -- the two ``T x T`` Grams ``A A^T`` and
  ``G G^T`` of the ghost norm, or the instantiated ``rows x cols`` per-example gradient -- with ``T`` the positions
  of all uses of the weight (a tied embedding / LM head has ``2 T``); biases and norm scales are instantiated
  (``B * size``). The engine computes the norms one weight at a time and frees the buffers, so the step's extra is
  the largest buffer, plus (``remat='none'``) the DP step's float32 clipped sums of
  :func:`~dpzero_jax.step_memory.dp_float32_sums` (``dp_extra``); ``dp_extra_all_layers`` is the buffers' sum, the
  bound for a schedule that kept every layer's buffer alive.

With ``peft="lora"`` (``--peft lora``) the trained parameters are the LoRA adapters (``Psi_a``; their model
states, norms and DP float32 sums), and the frozen base is held at the compute precision, partitioned like the
parameters (``frozen base weights``).

Everything is in bytes, per device, on the per-device batch ``batch / devices``; the model states are partitioned
over ``shards`` of the devices (``F``, a mesh's ``fsdp`` axis; default all ``N``). The model
(:class:`~dpzero_jax.decoder_shapes.DecoderConfig`, :mod:`dpzero_jax.decoder_shapes`) is exactly the project's
:class:`~dpzero_jax.models.GPT2` (family ``gpt2``) or :class:`~dpzero_jax.models.Llama` (family ``llama``: Llama
2/3, Mistral, Qwen2, Gemma 1/2; presets ``llama-2-7b`` ... ``gemma-2-9b``, or a checkpoint's ``config.json``).
GPT-J and GPT-3 are approximated by the GPT-2 family (GPT-J's rotary positions, bias-free attention and single
LayerNorm differ by < 0.2% of its parameters).

``dpzero plan --model gpt2-xl --devices 8 --batch 64 --seq 1024 --precision bf16 --zero 3`` prints the breakdown;
``--compile TARGET`` also compiles the non-private and the DP step for a TPU topology or this host's devices and
prints the compiler's bytes per device beside it (:mod:`dpzero_jax.aot`: the compiler's figures, not an estimate);
``dpzero plan --sizes`` the parameter counts of paper 000's Table 2 models against the paper's figures and of the
Llama-family presets against the published checkpoints' counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from dpzero_jax import aot
from dpzero_jax.decoder_shapes import (  # noqa: F401  (DecoderConfig, PRESETS, ...: the planner's public names)
    PRESETS,
    DecoderConfig,
    Weight,
    activation_bytes_per_token,
    config_from_dict,
    lora_weights,
    resolve_model,
    weights,
)
from dpzero_jax.step_memory import (
    Term,
    block_parameters,
    block_remat_terms,
    dp_float32_sums,
    largest_phase,
    non_private,
    peak_bytes,
)

PRECISIONS = ("bf16", "fp16", "fp32")
ZERO_STAGES = (0, 1, 2, 3)
PLANNED_REMAT = ("none", "block")
PLANNED_PEFT = (None, "lora")
GiB = 2**30

# The Llama-family presets' parameter counts as published with the checkpoints (``num_parameters()`` of the
# transformers model, model cards): compared with our architecture counts by ``dpzero plan --sizes``.
PUBLISHED_LLAMA = {"llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
                   "llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096, "qwen2-7b": 7_615_616_512,
                   "gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma-2-9b": 9_241_705_984}

# Paper 000, Table 2 ("# param"): the figures our counts are compared with by ``dpzero plan --sizes``.
PAPER_TABLE2 = (("gpt2-large", "GPT2-large", 774e6), ("gpt2-xl", "GPT2-XL", 1.56e9), ("gpt-j-6b", "GPT-J", 6e9),
                ("gpt3-175b", "GPT3", 175e9), ("gpt-1t", "GPT", 1e12))


@dataclasses.dataclass(frozen=True)
class NormBuffer:
    """The per-example norm buffer of one weight on the per-device batch ``B``: ``ghost`` (two ``[B, T, T]`` fp32
    Grams, ``T`` = positions of all uses) or instantiated (``[B, rows, cols]`` or ``[B, size]`` fp32)."""

    path: str
    ghost: bool
    bytes: int


def norm_buffers(config: DecoderConfig, batch_per_device: int, seq: int, lora_rank: int = 0) -> list[NormBuffer]:
    """Per trainable array (the LoRA adapters with ``lora_rank``), the mixed-rule choice and its buffer (fp32) on
    ``batch_per_device`` examples of ``seq`` tokens: ghost iff ``2 T^2 < rows * cols`` (paper 000, Appendix A),
    ``T = uses * seq``."""
    out = []
    for w in lora_weights(config, lora_rank) if lora_rank else weights(config):
        if not w.is_matrix:
            out.append(NormBuffer(w.path, False, 4 * batch_per_device * w.size))
            continue
        positions = w.uses * seq
        ghost = 2 * positions**2 < w.size
        elements = 2 * positions**2 if ghost else w.size
        out.append(NormBuffer(w.path, ghost, 4 * batch_per_device * elements))
    return out


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one DP-ZeRO training step (see the module docstring for every formula)."""

    model: DecoderConfig
    devices: int
    batch: int
    seq: int
    precision: str
    zero: int
    n_params: int
    parameters: int
    gradients: int
    optimizer_state: int
    gathered_weights: int
    activations: int
    dp_extra: int
    dp_extra_all_layers: int
    norm_buffers: tuple[NormBuffer, ...]
    remat: str = "none"
    shards: int = 0                         # F: devices sharing the ZeRO partition (0: all ``devices``)
    temporaries: tuple[Term, ...] = ()      # remat='block': the compiled step's named buffers (step_memory)
    lora_rank: int = 0                      # > 0: LoRA adapters trained (n_trainable), the base frozen
    n_trainable: int = 0                    # parameters trained (n_params without LoRA)
    frozen: int = 0                         # the frozen base's bytes (LoRA), compute precision
    dp_sums: int = 0                        # remat='none': the DP step's float32 clipped sums, part of dp_extra

    @property
    def batch_per_device(self) -> int:
        return self.batch // self.devices

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.frozen

    @property
    def total_non_dp(self) -> int:
        return self.model_states + self.gathered_weights + self.activations

    @property
    def total(self) -> int:
        return self.total_non_dp + self.dp_extra

    def rows(self) -> list[tuple[str, int, str]]:
        """``(item, bytes, formula)`` rows of :meth:`format_table`."""
        stage = {0: "replicated", 1: "optimizer state partitioned", 2: "optimizer state + gradients partitioned",
                 3: "all partitioned"}[self.zero]
        half = self.precision != "fp32"
        largest = max(self.norm_buffers, key=lambda b: b.bytes)
        n_ghost = sum(b.ghost for b in self.norm_buffers)
        n_matrix = sum(w.is_matrix for w in weights(self.model))
        partition = " / N" if self.shards in (0, self.devices) else " / F"
        if self.temporaries:
            return self._block_rows(stage, half, partition)
        return [
            *self._state_rows(half, partition),
            ("gathered weights", self.gathered_weights, "largest layer, full, compute precision (stage 3)"),
            ("activations", self.activations, "B/N x T x (L x block + head) bytes per token (residuals)"),
            ("DP extra", self.dp_extra, "the largest norm buffer + the fp32 clipped sums"),
            ("  largest norm buffer", self.dp_extra - self.dp_sums,
             f"{largest.path} ({'ghost 2BT^2' if largest.ghost else 'instantiated B p d'}, fp32); "
             f"{n_ghost}/{n_matrix} weights ghost"),
            ("  fp32 clipped sums", self.dp_sums, "stacked blocks' + a block's unsharded + the LM head's"),
            ("  (norm buffers of all layers)", self.dp_extra_all_layers, "sum over layers, not in the total"),
            ("total", self.total, f"ZeRO-{self.zero}: {stage}; non-DP {_gib(self.total_non_dp)}"),
        ]

    def _state_rows(self, half: bool, partition: str) -> list[tuple[str, int, str]]:
        psi = "Psi_a" if self.lora_rank else "Psi"
        frozen = [("frozen base weights", self.frozen, f"{'2' if half else '4'} x Psi (LoRA: not trained)"
                   + (partition if self.zero == 3 else ""))] if self.lora_rank else []
        return frozen + [
            ("parameters", self.parameters, f"{'2 (16-bit)' if half else '4 (fp32)'} x {psi}"
             + (partition if self.zero == 3 else "")),
            ("gradients", self.gradients, f"{'2' if half else '4'} x {psi}" + (partition if self.zero >= 2 else "")),
            ("optimizer state", self.optimizer_state,
             f"{'12 (master, m, v)' if half else '8 (m, v)'} x {psi}" + (partition if self.zero >= 1 else "")),
        ]

    def _block_rows(self, stage: str, half: bool, partition: str) -> list[tuple[str, int, str]]:
        """remat='block': the model states, then the compiled step's buffers by phase (step_memory)."""
        non_dp = non_private(self.temporaries)
        rows = self._state_rows(half, partition)
        for term in (t for t in self.temporaries if t.bytes):       # the buffers this step has
            rows.append((f"  {term.name}", term.bytes, f"{term.formula}  [{term.phase}]"))
        rows += [
            ("temporaries", self.activations, f"the largest moment: {largest_phase(non_dp)}"),
            ("DP extra", self.dp_extra, f"DP step's largest moment: {largest_phase(self.temporaries)}; less the "
                                        "non-DP temporaries"),
            ("total", self.total, f"ZeRO-{self.zero}: {stage}; non-DP {_gib(self.total_non_dp)}"),
        ]
        return rows

    def format_table(self) -> str:
        """A plain-text table of the breakdown (GiB per device)."""
        m = self.model
        kv = f" ({m.kv_heads} key/value)" if m.kv_heads != m.n_head else ""
        lora = (f"LoRA rank {self.lora_rank} on the blocks' dense layers: {self.n_trainable:,} trained (Psi_a), "
                f"the base frozen\n") if self.lora_rank else ""
        head = (f"{m.name}: {self.n_params:,} parameters ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads"
                f"{kv}, {m.family} family, vocab {m.vocab}, {'tied' if m.tied else 'untied'} head)\n{lora}"
                f"{self.devices} device(s), batch {self.batch} ({self.batch_per_device} per device), seq {self.seq}, "
                f"{self.precision}, ZeRO stage {self.zero}; bytes per device\n")
        rows = self.rows()
        width = max(len(r[0]) for r in rows)
        lines = [f"{'item':<{width}}  {'GiB':>10}  formula", "-" * (width + 40)]
        for item, value, formula in rows:
            if item == "total":
                lines.append("-" * (width + 40))
            lines.append(f"{item:<{width}}  {value / GiB:>10.3f}  {formula}")
        return head + "\n".join(lines) + "\n" + ESTIMATE_NOTE[self.remat]

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("norm_buffers", "temporaries")}
        out["temporaries"] = [dataclasses.asdict(t) for t in self.temporaries]
        out.update(model_states=self.model_states, total=self.total, total_non_dp=self.total_non_dp,
                   batch_per_device=self.batch_per_device)
        return out


def _gib(value: int) -> str:
    return f"{value / GiB:.3f} GiB"


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def model_state_bytes(n_params: int, devices: int, precision: str, zero: int) -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` bytes per device for Adam (see the module docstring);
    ``devices``: those sharing the ZeRO partition."""
    shard = -(-n_params // devices)   # ceil: the flat ZeRO buffer padded to a multiple of N
    half = precision != "fp32"
    param_bytes, grad_bytes, optim_bytes = (2, 2, 12) if half else (4, 4, 8)
    return (param_bytes * (shard if zero >= 3 else n_params), grad_bytes * (shard if zero >= 2 else n_params),
            optim_bytes * (shard if zero >= 1 else n_params))


def plan_memory(model: str | DecoderConfig | dict, devices: int, batch: int, seq: int, precision: str = "bf16",
                zero: int = 3, remat: str = "none", shards: int | None = None, peft: str | None = None,
                lora_rank: int = 8) -> MemoryPlan:
    """Per-device memory of a DP-ZeRO Adam step.

    model: a preset (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``gpt-j-6b``, ``gpt3-175b``,
    ``gpt-1t``), a JSON file of a :class:`DecoderConfig`, a mapping or a config. devices: ``N``. batch: the global
    (physical) batch, a multiple of ``N``. seq: tokens per example, at most the model's context. precision: ``bf16``
    / ``fp16`` (mixed: 16-bit parameters, gradients and activations, fp32 master copy and moments) or ``fp32``.
    zero: ZeRO stage 0-3. remat: ``none`` (the backward keeps every block's activations) or ``block`` (the
    models' ``remat='block'``: each block's input is kept, ``d`` numbers per token per layer at the compute
    precision, and one block's activations are rebuilt at a time; the temporaries are the compiled step's named
    buffers of :mod:`dpzero_jax.step_memory`, checked against TPU compiles). shards: ``F``, the devices sharing the
    ZeRO partition (a mesh's ``fsdp`` axis; the others hold replicas and split the batch), a divisor of
    ``devices``; default ``devices``. peft: ``"lora"`` trains rank-``lora_rank`` adapters on the blocks' dense
    layers (:func:`~dpzero_jax.decoder_shapes.lora_weights`, as ``dpzero train --peft lora``) and freezes the base:
    the model states are the adapters' (``Psi_a``) plus the frozen base at the compute precision, partitioned like
    the parameters (the trainer passes it to the step as sharded arguments); the norms and the DP step's gradient
    shard are the adapters'.
    """
    config = resolve_model(model)
    _check_positive_int("devices", devices)
    _check_positive_int("batch", batch)
    _check_positive_int("seq", seq)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if remat not in PLANNED_REMAT:
        raise ValueError(f"remat must be one of {PLANNED_REMAT} (the planner does not model the 'dots' policy), "
                         f"got {remat!r}")
    shards = devices if shards is None else _check_positive_int("shards", shards)
    if devices % shards:
        raise ValueError(f"shards={shards} does not divide devices={devices}")
    if batch % devices:
        raise ValueError(f"batch={batch} is not divisible by devices={devices}")
    if seq > config.n_ctx:
        raise ValueError(f"seq={seq} exceeds the context n_ctx={config.n_ctx} of model {config.name!r}")
    if peft not in PLANNED_PEFT:
        raise ValueError(f"peft must be one of {PLANNED_PEFT}, got {peft!r}")
    rank = _check_positive_int("lora_rank", lora_rank) if peft == "lora" else 0
    n_params = config.n_params
    trained = sum(w.size for w in lora_weights(config, rank)) if rank else n_params
    parameters, gradients, optimizer_state = model_state_bytes(trained, shards, precision, zero)
    compute_bytes = 4 if precision == "fp32" else 2
    frozen = compute_bytes * (-(-n_params // shards) if zero == 3 else n_params) if rank else 0
    layer_sizes: dict[str, int] = {}
    for w in weights(config):
        layer_sizes[w.layer] = layer_sizes.get(w.layer, 0) + w.size
    gathered = compute_bytes * max(layer_sizes.values()) if zero == 3 and shards > 1 else 0
    per_device = batch // devices
    block, head = activation_bytes_per_token(config, seq, precision)
    buffers = tuple(norm_buffers(config, per_device, seq, rank))
    dp_extra, terms, dp_sums = max(b.bytes for b in buffers), (), 0
    if remat == "block":   # the compiled step's buffers (step_memory): gathered weights are one of them
        terms = block_remat_terms(config, per_device, seq, shards, compute_bytes, zero,
                                  replicas=devices // shards, lora_rank=rank)
        activations = peak_bytes(non_private(terms))
        dp_extra, gathered = peak_bytes(terms) - activations, 0
    else:
        activations = per_device * seq * (config.n_layer * block + head)
        # the DP step's float32 clipped sums besides the norm buffer (step_memory.dp_float32_sums: the stacked sums
        # throughout, then a block's unsharded sum and the head's held sum, or the untied head's formed sum); the
        # sums are partitioned from ZeRO stage 2 (the gradients' stage), whole on every device below it
        p_g, split = block_parameters(config, rank), shards if zero >= 2 else 1
        dp_sums = peak_bytes(tuple(dp_float32_sums(config, split, compute_bytes, p_g, "p_g", not rank)))
        dp_extra += dp_sums
    return MemoryPlan(config, devices, batch, seq, precision, zero, n_params, parameters, gradients, optimizer_state,
                      gathered, activations, dp_extra, sum(b.bytes for b in buffers), buffers, remat,
                      shards, terms, rank, trained, frozen, dp_sums)


# How far the formulas are from the TPU compiler's peak (docs/planner.md), printed under every table
ESTIMATE_NOTE = {
    "none": "An estimate: within 10% of the TPU compiler's peak on the 10 compiled steps compared (docs/planner.md); "
            "--compile TARGET prints the compiler's own bytes.",
    "block": "An estimate: within 10% of the TPU compiler's peak on 108 of 162 steps compiled after their prediction "
             "(-43% to +55%; docs/planner.md); --compile TARGET prints the compiler's own bytes.",
}


def format_sizes() -> str:
    """Paper 000 Table 2's models: our architecture counts against the paper's figures."""
    lines = [f"{'model':<12} {'layers':>6} {'d_model':>7} {'heads':>5} {'vocab':>6} {'ctx':>5} {'head':>6} "
             f"{'params (ours)':>17} {'paper 000':>9} {'ours/paper':>10}"]
    for key, label, paper in PAPER_TABLE2:
        c = PRESETS[key]
        lines.append(f"{label:<12} {c.n_layer:>6} {c.d_model:>7} {c.n_head:>5} {c.vocab:>6} {c.n_ctx:>5} "
                     f"{'tied' if c.tied else 'untied':>6} {c.n_params:>17,} {_short(paper):>9} "
                     f"{c.n_params / paper:>10.3f}")
    lines.append("ViT-Gigantic (1.84B in Table 2) is not a decoder and is not counted here.")
    lines += ["", f"{'model':<12} {'layers':>6} {'d_model':>7} {'heads':>5} {'kv':>3} {'vocab':>6} {'head':>6} "
                  f"{'params (ours)':>17} {'published':>15} {'ours/published':>14}"]
    for key, published in PUBLISHED_LLAMA.items():
        c = PRESETS[key]
        lines.append(f"{key:<12} {c.n_layer:>6} {c.d_model:>7} {c.n_head:>5} {c.kv_heads:>3} {c.vocab:>6} "
                     f"{'tied' if c.tied else 'untied':>6} {c.n_params:>17,} {published:>15,} "
                     f"{c.n_params / published:>14.3f}")
    return "\n".join(lines)


def _short(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` command to an ``argparse`` subparsers object; returns its parser."""
    parser = subparsers.add_parser("plan", help="per-device memory of a DP-ZeRO step (estimate), model sizes",
                                   description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"{', '.join(PRESETS)}, a JSON config file (n_layer, d_model, n_head, "
                                        "vocab, n_ctx[, d_ff, tied, family, n_kv_head, head_dim, qkv_bias, "
                                        "sandwich_norms]) or a checkpoint directory / config.json (GPT-2, Llama, "
                                        "Mistral, Qwen2, Gemma)")
    parser.add_argument("--devices", type=int, default=1, help="number of devices N (default 1)")
    parser.add_argument("--batch", type=int, help="global physical batch, a multiple of N")
    parser.add_argument("--seq", type=int, help="tokens per example (default: the model's context)")
    parser.add_argument("--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)} (default bf16)")
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage 0-3 (default 3)")
    parser.add_argument("--shards", type=int, default=None, help="F: devices sharing the ZeRO partition (a mesh's "
                                                                  "fsdp axis), a divisor of N (default N)")
    parser.add_argument("--remat", default="none", help=f"one of {', '.join(PLANNED_REMAT)}: the model's remat "
                                                        "policy (default none)")
    parser.add_argument("--peft", default=None, choices=("lora",), help="lora: plan LoRA fine-tuning (adapters on "
                        "the blocks' dense layers trained, the base frozen)")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (default 8; with --peft lora)")
    parser.add_argument("--sizes", action="store_true", help="print paper 000 Table 2's model sizes and exit")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--compile", metavar="TARGET", default=None,
                        help="also compile the non-private and the DP step for TARGET and print the compiler's "
                             "bytes per device beside the plan: a TPU topology (v5e:16x16, v5p:4x4x8; libtpu, the "
                             "tpu-aot extra, compiles for it on any host) or 'local' (this host's devices)")
    parser.add_argument("--strategy", default=None, choices=aot.STRATEGIES,
                        help="with --compile: the trainer's sharding strategy (default gspmd)")


def run(args: argparse.Namespace) -> str:
    """The text ``dpzero plan`` prints for parsed ``args``; raises ``ValueError`` naming a bad value."""
    if args.sizes:
        return format_sizes()
    if args.model is None:
        raise ValueError("--model is required (or --sizes)")
    if args.batch is None:
        raise ValueError("--batch is required")
    config = resolve_model(args.model)
    plan = plan_memory(config, args.devices, args.batch, config.n_ctx if args.seq is None else args.seq,
                       args.precision, args.zero, args.remat, args.shards, args.peft, args.lora_rank)
    target, strategy = getattr(args, "compile", None), getattr(args, "strategy", None)   # absent: built by hand
    if strategy is not None and target is None:
        raise ValueError("--strategy chooses how --compile builds the step; give --compile TARGET with it")
    compiled = [] if target is None else compile_plan(args.model, plan, target, strategy or "gspmd")
    if args.json:
        return json.dumps({**plan.to_dict(), **({"compiled": [c.to_dict() for c in compiled]} if compiled else {})},
                          indent=2)
    return plan.format_table() + ("\n\n" + format_compiled(plan, compiled) if compiled else "")


def compile_plan(model, plan: MemoryPlan, target: str, strategy: str = "gspmd", log=sys.stderr) -> list:
    """The plan's non-private and DP steps compiled for ``target`` (:func:`dpzero_jax.aot.compiled_memory`, the
    model as ``model`` names it, the plan's devices, batch, sequence, precision, ZeRO stage, remat, shards and
    LoRA rank): two :class:`~dpzero_jax.aot.CompiledMemory`. Progress goes to ``log`` (a large model's compile takes
    minutes)."""
    results = []
    for private in (False, True):
        name = "DP" if private else "non-private"
        print(f"compiling the {name} step for {target} ...", file=log, flush=True)
        result = aot.compiled_memory(model, target, devices=plan.devices, batch=plan.batch, seq=plan.seq,
                                     precision=plan.precision, zero=plan.zero, remat=plan.remat,
                                     lora_rank=plan.lora_rank, shards=plan.shards or plan.devices, private=private,
                                     strategy=strategy)
        print(f"  done in {result.seconds:.0f} s", file=log, flush=True)
        results.append(result)
    return results


def format_compiled(plan: MemoryPlan, compiled: list) -> str:
    """The compiled steps' bytes per device (GiB) against the plan's totals and the device's memory."""
    first = compiled[0]
    hbm = first.hbm_bytes
    memory = f"; {hbm / GiB:.2f} GiB a device" if hbm else "; the device's memory unknown here"
    lines = [f"compiled for {first.target} ({first.devices} devices, mesh {first.mesh}{memory}); bytes per device "
             "from memory_analysis()",
             f"{'step':<12} {'arguments':>10} {'temporaries':>12} {'total':>10} {'peak':>10} {'plan':>10} "
             f"{'plan/total':>11} {'plan/peak':>10}  fits",
             "-" * 98]
    for c in compiled:
        name = "DP (auto)" if c.private else "non-DP"
        planned = plan.total if c.private else plan.total_non_dp
        if c.refused is not None:
            stated = (f": needs {c.needed_bytes / GiB:.3f} of {c.available_bytes / GiB:.3f} GiB"
                      if c.needed_bytes and c.available_bytes else f": {c.refused[:200]}")
            lines.append(f"{name:<12} refused by the compiler (does not fit){stated}")
            continue
        fits = {True: "yes", False: "NO", None: "-"}[c.fits]
        peak = "-" if c.peak_bytes is None else f"{c.peak_bytes / GiB:.3f}"
        of_peak = "-" if c.peak_bytes is None else f"{planned / c.peak_bytes:.2f}"
        lines.append(f"{name:<12} {c.argument_bytes / GiB:>10.3f} {c.temp_bytes / GiB:>12.3f} "
                     f"{c.total_bytes / GiB:>10.3f} {peak:>10} {planned / GiB:>10.3f} "
                     f"{planned / c.total_bytes:>11.2f} {of_peak:>10}  {fits}")
    lines.append("total: arguments + temporaries + outputs not aliased to donated arguments; peak: the compiler's "
                 "high-water mark of live bytes, what the chip must hold (a TPU's temporaries also count on-chip "
                 "scratch); the plan's totals are estimates of the peak (docs/planner.md). fits: for a TPU "
                 "topology the compiler's verdict (it refuses a step whose buffers exceed the chip's usable HBM, "
                 "v5e 15.75 of 16 GiB); for a local device, total <= its memory")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``dpzero plan`` as a function: prints the plan (or the error) and returns the exit status."""
    parser = argparse.ArgumentParser(prog="dpzero plan", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        print(run(args))
    except (ValueError, RuntimeError) as error:
        print(f"dpzero plan: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
