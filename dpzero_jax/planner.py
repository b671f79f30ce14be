"""Memory planner: per-device bytes of a DP-ZeRO training step for a GPT-style decoder, before anything is built.

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
* **activations** (an *estimate*, see :func:`activation_bytes_per_token`): what the backward pass keeps per token
  of the per-device batch, without recomputation.
* **DP extra**: per trainable weight the buffer of its per-example norm under the mixed ghost-norm rule (paper 000,
  Appendix A): ``min(2 T^2, rows * cols)`` fp32 numbers per example -- the two ``T x T`` Grams ``A A^T`` and
  ``G G^T`` of the ghost norm, or the instantiated ``rows x cols`` per-example gradient -- with ``T`` the positions
  of all uses of the weight (a tied embedding / LM head has ``2 T``); biases and LayerNorm parameters are
  instantiated (``B * size``). The engine computes the norms one weight at a time and frees the buffers, so the
  step's extra is the largest buffer (``dp_extra``); ``dp_extra_all_layers`` is the sum, the bound for a schedule
  that kept every layer's buffer alive.

Everything is in bytes, per device, on the per-device batch ``batch / devices``. The model is a GPT-2-style
decoder (:class:`DecoderConfig`): learned positions, pre-LN blocks with two LayerNorms, fused QKV, GELU MLP of width
``d_ff`` (``4 d_model``), all linear layers with biases, tied or untied LM head without bias -- exactly
:class:`dpzero_jax.models.GPT2`. Larger published models are approximated by it (GPT-J's rotary positions, bias-free
attention and single LayerNorm differ by < 0.2% of its parameters).

``dpzero plan --model gpt2-xl --devices 8 --batch 64 --seq 1024 --precision bf16 --zero 3`` prints the breakdown;
``dpzero plan --sizes`` the parameter counts of paper 000's Table 2 models against the paper's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

PRECISIONS = ("bf16", "fp16", "fp32")
ZERO_STAGES = (0, 1, 2, 3)
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A GPT-2-style decoder: ``n_layer`` blocks of width ``d_model``, ``n_head`` heads, vocabulary ``vocab``,
    context ``n_ctx`` (learned positions), MLP width ``d_ff`` (default ``4 d_model``), tied or untied LM head."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    n_ctx: int
    d_ff: int | None = None
    tied: bool = True

    def __post_init__(self):
        for field in ("n_layer", "d_model", "n_head", "vocab", "n_ctx"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.d_ff is not None and (isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise ValueError(f"model {self.name!r}: d_ff must be a positive int, got {self.d_ff!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"model {self.name!r}: d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not isinstance(self.tied, bool):
            raise ValueError(f"model {self.name!r}: tied must be true or false, got {self.tied!r}")

    @property
    def mlp_width(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def n_params(self) -> int:
        """Trainable parameters, counted from the architecture (see :func:`weights`)."""
        return sum(w.size for w in weights(self))


# Presets. GPT-2: Radford et al. 2019 (HF GPT2Config). GPT-J-6B: EleutherAI (28 layers, 4096, 16 heads, vocab 50400,
# context 2048, untied head). GPT-3 175B: Brown et al. 2020, Table 2.1 (96 layers, 12288, 96 heads, context 2048,
# GPT-2's vocabulary). GPT 1T: the 1T configuration of Narayanan et al. 2021 (Megatron-LM), Table 1 (128 layers,
# 25600, 160 heads, vocab 51200, context 2048) -- paper 000 does not give its architecture.
PRESETS: dict[str, DecoderConfig] = {c.name: c for c in (
    DecoderConfig("gpt2", 12, 768, 12, 50257, 1024),
    DecoderConfig("gpt2-medium", 24, 1024, 16, 50257, 1024),
    DecoderConfig("gpt2-large", 36, 1280, 20, 50257, 1024),
    DecoderConfig("gpt2-xl", 48, 1600, 25, 50257, 1024),
    DecoderConfig("gpt-j-6b", 28, 4096, 16, 50400, 2048, tied=False),
    DecoderConfig("gpt3-175b", 96, 12288, 96, 50257, 2048),
    DecoderConfig("gpt-1t", 128, 25600, 160, 51200, 2048),
)}

# Paper 000, Table 2 ("# param"): the figures our counts are compared with by ``dpzero plan --sizes``.
PAPER_TABLE2 = (("gpt2-large", "GPT2-large", 774e6), ("gpt2-xl", "GPT2-XL", 1.56e9), ("gpt-j-6b", "GPT-J", 6e9),
                ("gpt3-175b", "GPT3", 175e9), ("gpt-1t", "GPT", 1e12))

_CONFIG_KEYS = {"name": "name", "n_layer": "n_layer", "d_model": "d_model", "n_embd": "d_model", "n_head": "n_head",
                "vocab": "vocab", "vocab_size": "vocab", "n_ctx": "n_ctx", "n_positions": "n_ctx", "d_ff": "d_ff",
                "n_inner": "d_ff", "tied": "tied", "tie_word_embeddings": "tied"}


def config_from_dict(values: dict, name: str = "custom") -> DecoderConfig:
    """A :class:`DecoderConfig` from a mapping; GPT2Config's names (``n_embd``, ``vocab_size``, ``n_positions``,
    ``n_inner``, ``tie_word_embeddings``) are accepted as aliases. Unknown keys are an error, except in a Hugging
    Face ``config.json`` (it has ``model_type``): there, GPT-2's other keys (dropouts, token ids, activation, ...)
    do not change the memory plan and are ignored."""
    if not isinstance(values, dict):
        raise ValueError(f"model config {name!r} must be a JSON object, got {type(values).__name__}")
    if "model_type" in values:   # a save_pretrained config.json
        if values["model_type"] != "gpt2":
            raise ValueError(f"model config {name!r}: model_type {values['model_type']!r}; the planner models "
                             "GPT-2-style decoders (model_type 'gpt2')")
        values = {k: v for k, v in values.items() if k in _CONFIG_KEYS and v is not None}
    unknown = sorted(set(values) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"model config {name!r}: unknown keys {unknown}; expected some of {sorted(_CONFIG_KEYS)}")
    fields: dict = {"name": name}
    for key, value in values.items():
        field = _CONFIG_KEYS[key]
        if field in fields and field != "name" and fields[field] != value:
            raise ValueError(f"model config {name!r}: {field} given twice (as {key!r} and an alias)")
        fields[field] = value
    missing = [f for f in ("n_layer", "d_model", "n_head", "vocab", "n_ctx") if f not in fields]
    if missing:
        raise ValueError(f"model config {name!r}: missing keys {missing}")
    return DecoderConfig(**fields)


def resolve_model(model: str | DecoderConfig | dict) -> DecoderConfig:
    """A preset name, the path of a JSON file holding a config mapping, a mapping, or a :class:`DecoderConfig`."""
    if isinstance(model, DecoderConfig):
        return model
    if isinstance(model, dict):
        return config_from_dict(model)
    if not isinstance(model, str):
        raise ValueError(f"model must be a preset name, a JSON file or a config, got {model!r}")
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"model config file {model!r} does not exist")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"model config file {model!r} is not valid JSON: {error}") from None
        return config_from_dict(values, name=values.get("name", path.stem) if isinstance(values, dict) else model)
    raise ValueError(f"unknown model {model!r}: expected one of {sorted(PRESETS)} or a JSON config file")


@dataclasses.dataclass(frozen=True)
class Weight:
    """One trainable array of the decoder.

    ``rows x cols``: a weight viewed as the matrix whose per-example gradient is ``sum_t left_t (x) right_t``
    (``rows`` = input features, ``cols`` = output features; an embedding table is ``vocab x d``); ``cols = 0``
    marks a vector (bias, LayerNorm scale) whose per-example gradient is instantiated. ``uses``: layer calls that
    read it (2 for a tied embedding table: lookup and LM head); ``layer``: the layer call it belongs to.
    """

    path: str
    rows: int
    cols: int
    uses: int = 1

    @property
    def size(self) -> int:
        return self.rows * max(self.cols, 1)

    @property
    def is_matrix(self) -> bool:
        return self.cols > 0

    @property
    def layer(self) -> str:
        return self.path.rsplit("/", 1)[0]


def weights(config: DecoderConfig) -> list[Weight]:
    """The trainable arrays of :class:`dpzero_jax.models.GPT2` with this config, in forward order (paths as the
    engine names them)."""
    d, f = config.d_model, config.mlp_width
    out = [Weight("wte/embedding", config.vocab, d, uses=2 if config.tied else 1),
           Weight("wpe/embedding", config.n_ctx, d)]
    for i in range(config.n_layer):
        h = f"h/{i}"
        out += [Weight(f"{h}/ln_1/scale", d, 0), Weight(f"{h}/ln_1/bias", d, 0),
                Weight(f"{h}/attn/c_attn/kernel", d, 3 * d), Weight(f"{h}/attn/c_attn/bias", 3 * d, 0),
                Weight(f"{h}/attn/c_proj/kernel", d, d), Weight(f"{h}/attn/c_proj/bias", d, 0),
                Weight(f"{h}/ln_2/scale", d, 0), Weight(f"{h}/ln_2/bias", d, 0),
                Weight(f"{h}/mlp/c_fc/kernel", d, f), Weight(f"{h}/mlp/c_fc/bias", f, 0),
                Weight(f"{h}/mlp/c_proj/kernel", f, d), Weight(f"{h}/mlp/c_proj/bias", d, 0)]
    out += [Weight("ln_f/scale", d, 0), Weight("ln_f/bias", d, 0)]
    if not config.tied:
        out.append(Weight("lm_head/kernel", d, config.vocab))
    return out


@dataclasses.dataclass(frozen=True)
class NormBuffer:
    """The per-example norm buffer of one weight on the per-device batch ``B``: ``ghost`` (two ``[B, T, T]`` fp32
    Grams, ``T`` = positions of all uses) or instantiated (``[B, rows, cols]`` or ``[B, size]`` fp32)."""

    path: str
    ghost: bool
    bytes: int


def norm_buffers(config: DecoderConfig, batch_per_device: int, seq: int) -> list[NormBuffer]:
    """Per trainable array, the mixed-rule choice and its buffer (fp32) on ``batch_per_device`` examples of ``seq``
    tokens: ghost iff ``2 T^2 < rows * cols`` (paper 000, Appendix A), ``T = uses * seq``."""
    out = []
    for w in weights(config):
        if not w.is_matrix:
            out.append(NormBuffer(w.path, False, 4 * batch_per_device * w.size))
            continue
        positions = w.uses * seq
        ghost = 2 * positions**2 < w.size
        elements = 2 * positions**2 if ghost else w.size
        out.append(NormBuffer(w.path, ghost, 4 * batch_per_device * elements))
    return out


def activation_bytes_per_token(config: DecoderConfig, seq: int, precision: str) -> tuple[int, int]:
    """``(per block, LM head)`` bytes the backward keeps per token -- an estimate, without recomputation.

    Per block, at the compute precision (2 bytes, 4 in fp32): the inputs of ``ln_1``, ``c_attn``, ``c_proj``,
    ``ln_2``, ``c_fc`` (``d`` each), ``q, k, v`` (``3 d``), the GELU input and output (``2 d_ff``) -- ``8 d + 2 d_ff``
    numbers, i.e. ``16 d`` for ``d_ff = 4 d`` -- plus the attention probabilities, ``n_head * T`` fp32 numbers (this
    project's GPT2 takes its softmax in fp32). This is the count of Korthikanti et al. 2022 (``34 d + 5 h T`` bytes
    per token in fp16) without their dropout masks. Head: the inputs of ``ln_f`` and of the LM head (``2 d`` at the
    compute precision) and the fp32 log-probabilities of the loss (``vocab`` fp32 numbers).
    """
    act = 4 if precision == "fp32" else 2
    d = config.d_model
    block = act * (8 * d + 2 * config.mlp_width) + 4 * config.n_head * seq
    head = act * 2 * d + 4 * config.vocab
    return block, head


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

    @property
    def batch_per_device(self) -> int:
        return self.batch // self.devices

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

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
        return [
            ("parameters", self.parameters, f"{'2 (16-bit)' if half else '4 (fp32)'} x Psi"
             + (" / N" if self.zero == 3 else "")),
            ("gradients", self.gradients, f"{'2' if half else '4'} x Psi" + (" / N" if self.zero >= 2 else "")),
            ("optimizer state", self.optimizer_state,
             f"{'12 (master, m, v)' if half else '8 (m, v)'} x Psi" + (" / N" if self.zero >= 1 else "")),
            ("gathered weights", self.gathered_weights, "largest layer, full, compute precision (stage 3)"),
            ("activations (estimate)", self.activations, "B/N x T x (L x block + head) bytes per token"),
            ("DP extra (norm buffers)", self.dp_extra,
             f"largest: {largest.path} ({'ghost 2BT^2' if largest.ghost else 'instantiated B p d'}, fp32); "
             f"{n_ghost}/{n_matrix} weights ghost"),
            ("  (all layers at once)", self.dp_extra_all_layers, "sum over layers, not in the total"),
            ("total", self.total, f"ZeRO-{self.zero}: {stage}; non-DP {_gib(self.total_non_dp)}"),
        ]

    def format_table(self) -> str:
        """A plain-text table of the breakdown (GiB per device)."""
        m = self.model
        head = (f"{m.name}: {self.n_params:,} parameters ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, "
                f"vocab {m.vocab}, {'tied' if m.tied else 'untied'} head)\n"
                f"{self.devices} device(s), batch {self.batch} ({self.batch_per_device} per device), seq {self.seq}, "
                f"{self.precision}, ZeRO stage {self.zero}; bytes per device\n")
        rows = self.rows()
        width = max(len(r[0]) for r in rows)
        lines = [f"{'item':<{width}}  {'GiB':>10}  formula", "-" * (width + 40)]
        for item, value, formula in rows:
            if item == "total":
                lines.append("-" * (width + 40))
            lines.append(f"{item:<{width}}  {value / GiB:>10.3f}  {formula}")
        return head + "\n".join(lines)

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "norm_buffers"}
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
    """``(parameters, gradients, optimizer state)`` bytes per device for Adam (see the module docstring)."""
    shard = -(-n_params // devices)   # ceil: the flat ZeRO buffer padded to a multiple of N
    half = precision != "fp32"
    param_bytes, grad_bytes, optim_bytes = (2, 2, 12) if half else (4, 4, 8)
    return (param_bytes * (shard if zero >= 3 else n_params), grad_bytes * (shard if zero >= 2 else n_params),
            optim_bytes * (shard if zero >= 1 else n_params))


def plan_memory(model: str | DecoderConfig | dict, devices: int, batch: int, seq: int, precision: str = "bf16",
                zero: int = 3) -> MemoryPlan:
    """Per-device memory of a DP-ZeRO Adam step.

    model: a preset (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``gpt-j-6b``, ``gpt3-175b``,
    ``gpt-1t``), a JSON file of a :class:`DecoderConfig`, a mapping or a config. devices: ``N``. batch: the global
    (physical) batch, a multiple of ``N``. seq: tokens per example, at most the model's context. precision: ``bf16``
    / ``fp16`` (mixed: 16-bit parameters, gradients and activations, fp32 master copy and moments) or ``fp32``.
    zero: ZeRO stage 0-3.
    """
    config = resolve_model(model)
    _check_positive_int("devices", devices)
    _check_positive_int("batch", batch)
    _check_positive_int("seq", seq)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if batch % devices:
        raise ValueError(f"batch={batch} is not divisible by devices={devices}")
    if seq > config.n_ctx:
        raise ValueError(f"seq={seq} exceeds the context n_ctx={config.n_ctx} of model {config.name!r}")
    n_params = config.n_params
    parameters, gradients, optimizer_state = model_state_bytes(n_params, devices, precision, zero)
    compute_bytes = 4 if precision == "fp32" else 2
    layer_sizes: dict[str, int] = {}
    for w in weights(config):
        layer_sizes[w.layer] = layer_sizes.get(w.layer, 0) + w.size
    gathered = compute_bytes * max(layer_sizes.values()) if zero == 3 and devices > 1 else 0
    per_device = batch // devices
    block, head = activation_bytes_per_token(config, seq, precision)
    activations = per_device * seq * (config.n_layer * block + head)
    buffers = tuple(norm_buffers(config, per_device, seq))
    return MemoryPlan(config, devices, batch, seq, precision, zero, n_params, parameters, gradients, optimizer_state,
                      gathered, activations, max(b.bytes for b in buffers), sum(b.bytes for b in buffers), buffers)


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
    parser.add_argument("--model", help=f"{', '.join(PRESETS)} or a JSON config file "
                                        "(n_layer, d_model, n_head, vocab, n_ctx[, d_ff, tied])")
    parser.add_argument("--devices", type=int, default=1, help="number of devices N (default 1)")
    parser.add_argument("--batch", type=int, help="global physical batch, a multiple of N")
    parser.add_argument("--seq", type=int, help="tokens per example (default: the model's context)")
    parser.add_argument("--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)} (default bf16)")
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage 0-3 (default 3)")
    parser.add_argument("--sizes", action="store_true", help="print paper 000 Table 2's model sizes and exit")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


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
                       args.precision, args.zero)
    if args.json:
        return json.dumps(plan.to_dict(), indent=2)
    return plan.format_table()


def main(argv: Sequence[str] | None = None) -> int:
    """``dpzero plan`` as a function: prints the plan (or the error) and returns the exit status."""
    parser = argparse.ArgumentParser(prog="dpzero plan", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        print(run(args))
    except ValueError as error:
        print(f"dpzero plan: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
