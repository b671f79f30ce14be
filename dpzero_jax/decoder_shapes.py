"""The decoders the memory planner models, as shapes only: configs, presets, trainable arrays, activation counts.

Two families, each exactly the project's model of that name (paths as the engine names the leaves):

* ``gpt2`` -- :class:`dpzero_jax.models.GPT2`: learned positions, pre-LN blocks with two LayerNorms (scale and
  bias), fused QKV, GELU MLP of width ``d_ff`` (``4 d_model``), every linear layer with a bias, tied or untied head.
* ``llama`` -- :class:`dpzero_jax.models.Llama` (Llama 2/3, Mistral, Qwen2, Gemma 1/2): rotary positions (no
  table), RMSNorm (a scale only; Gemma 2 adds two "sandwich" norms per block), separate ``q/k/v/o`` projections with
  ``n_kv_head`` key/value heads of width ``head_dim`` (grouped- and multi-query attention), biases on ``q/k/v``
  only where the checkpoint has them (Qwen2), a gated MLP (``gate``, ``up``, ``down``, no biases).

A config comes from a preset, a mapping or a ``save_pretrained`` ``config.json`` (GPT-2 keys, or a Llama-family
``model_type`` read by the same :func:`dpzero_jax.models.llama_hf.config_from_hf` that loads checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FAMILIES = ("gpt2", "llama")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder: ``n_layer`` blocks of width ``d_model``, ``n_head`` heads, vocabulary ``vocab``, context ``n_ctx``
    (GPT-2: its learned positions; Llama: ``max_position_embeddings``), MLP width ``d_ff`` (default ``4 d_model``),
    tied or untied LM head. Llama family only: ``n_kv_head`` (default ``n_head``), ``head_dim`` (default
    ``d_model / n_head``), ``qkv_bias``, ``sandwich_norms`` (Gemma 2)."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    n_ctx: int
    d_ff: int | None = None
    tied: bool = True
    family: str = "gpt2"
    n_kv_head: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    sandwich_norms: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        for field in ("n_layer", "d_model", "n_head", "vocab", "n_ctx"):
            _positive(self.name, field, getattr(self, field))
        for field in ("d_ff", "n_kv_head", "head_dim"):
            if getattr(self, field) is not None:
                _positive(self.name, field, getattr(self, field))
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"model {self.name!r}: d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"model {self.name!r}: n_head={self.n_head} is not a multiple of n_kv_head="
                             f"{self.kv_heads}")
        for field in ("tied", "qkv_bias", "sandwich_norms"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"model {self.name!r}: {field} must be true or false, got {getattr(self, field)!r}")
        if self.family == "gpt2" and (self.n_kv_head, self.head_dim, self.qkv_bias, self.sandwich_norms) != (
                None, None, False, False):
            raise ValueError(f"model {self.name!r}: n_kv_head, head_dim, qkv_bias and sandwich_norms describe the "
                             "llama family; GPT-2 has none of them")

    @property
    def mlp_width(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def n_params(self) -> int:
        """Trainable parameters, counted from the architecture (see :func:`weights`)."""
        return sum(w.size for w in weights(self))


def _positive(name: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model {name!r}: {field} must be a positive int, got {value!r}")


def _llama(name, layers, d, heads, kv, d_ff, vocab, ctx, *, tied=False, head_dim=None, qkv_bias=False,
           sandwich=False) -> DecoderConfig:
    return DecoderConfig(name, layers, d, heads, vocab, ctx, d_ff=d_ff, tied=tied, family="llama", n_kv_head=kv,
                         head_dim=head_dim, qkv_bias=qkv_bias, sandwich_norms=sandwich)


# Presets. GPT-2: Radford et al. 2019 (HF GPT2Config). GPT-J-6B: EleutherAI (28 layers, 4096, 16 heads, vocab 50400,
# context 2048, untied head). GPT-3 175B: Brown et al. 2020, Table 2.1 (96 layers, 12288, 96 heads, context 2048,
# GPT-2's vocabulary). GPT 1T: the 1T configuration of Narayanan et al. 2021 (Megatron-LM), Table 1 (128 layers,
# 25600, 160 heads, vocab 51200, context 2048) -- paper 000 does not give its architecture. Llama family: the
# checkpoints' published config.json files (layers, hidden, heads, kv heads, intermediate, vocab, context).
PRESETS: dict[str, DecoderConfig] = {c.name: c for c in (
    DecoderConfig("gpt2", 12, 768, 12, 50257, 1024),
    DecoderConfig("gpt2-medium", 24, 1024, 16, 50257, 1024),
    DecoderConfig("gpt2-large", 36, 1280, 20, 50257, 1024),
    DecoderConfig("gpt2-xl", 48, 1600, 25, 50257, 1024),
    DecoderConfig("gpt-j-6b", 28, 4096, 16, 50400, 2048, tied=False),
    DecoderConfig("gpt3-175b", 96, 12288, 96, 50257, 2048),
    DecoderConfig("gpt-1t", 128, 25600, 160, 51200, 2048),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
    _llama("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, 32768, qkv_bias=True),
    _llama("gemma-2b", 18, 2048, 8, 1, 16384, 256000, 8192, tied=True, head_dim=256),
    _llama("gemma-7b", 28, 3072, 16, 16, 24576, 256000, 8192, tied=True, head_dim=256),
    _llama("gemma-2-9b", 42, 3584, 16, 8, 14336, 256000, 8192, tied=True, head_dim=256, sandwich=True),
)}

_CONFIG_KEYS = {"name": "name", "n_layer": "n_layer", "d_model": "d_model", "n_embd": "d_model", "n_head": "n_head",
                "vocab": "vocab", "vocab_size": "vocab", "n_ctx": "n_ctx", "n_positions": "n_ctx", "d_ff": "d_ff",
                "n_inner": "d_ff", "tied": "tied", "tie_word_embeddings": "tied", "family": "family",
                "n_kv_head": "n_kv_head", "head_dim": "head_dim", "qkv_bias": "qkv_bias",
                "sandwich_norms": "sandwich_norms"}


def _from_llama_config_json(values: dict, name: str) -> DecoderConfig:
    """A Llama-family ``config.json``, read as the checkpoint loader reads it (same refusals, same defaults)."""
    from dpzero_jax.models.llama_hf import config_from_hf  # imports JAX: only for Llama-family files

    c = config_from_hf(values)
    if c.o_bias:
        raise ValueError(f"model config {name!r}: attention_bias=True (a bias on o_proj) is not modelled by the "
                         "planner")
    return _llama(name, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.kv_heads,
                  c.intermediate_size, c.vocab_size, c.max_position_embeddings, tied=c.tie_word_embeddings,
                  head_dim=c.head_size, qkv_bias=c.qkv_bias, sandwich=c.sandwich_norms)


def config_from_dict(values: dict, name: str = "custom") -> DecoderConfig:
    """A :class:`DecoderConfig` from a mapping; GPT2Config's names (``n_embd``, ``vocab_size``, ``n_positions``,
    ``n_inner``, ``tie_word_embeddings``) are accepted as aliases. Unknown keys are an error, except in a Hugging
    Face ``config.json`` (it has ``model_type``): GPT-2's other keys (dropouts, token ids, activation, ...) do not
    change the memory plan and are ignored; a Llama-family ``model_type`` is read as the checkpoint loader reads it."""
    if not isinstance(values, dict):
        raise ValueError(f"model config {name!r} must be a JSON object, got {type(values).__name__}")
    if "model_type" in values:   # a save_pretrained config.json
        from dpzero_jax.models.llama_hf import MODEL_TYPES

        if values["model_type"] in MODEL_TYPES:
            return _from_llama_config_json(values, name)
        if values["model_type"] != "gpt2":
            raise ValueError(f"model config {name!r}: model_type {values['model_type']!r}; the planner models "
                             f"decoders of model_type 'gpt2' or {', '.join(map(repr, MODEL_TYPES))}")
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
    """A preset name, the path of a JSON file holding a config mapping (or a checkpoint directory with a
    ``config.json``), a mapping, or a :class:`DecoderConfig`."""
    if isinstance(model, DecoderConfig):
        return model
    if isinstance(model, dict):
        return config_from_dict(model)
    if not isinstance(model, str):
        raise ValueError(f"model must be a preset name, a JSON file or a config, got {model!r}")
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"model config file {model!r} does not exist")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"model config file {model!r} is not valid JSON: {error}") from None
        stem = path.parent.name if path.name == "config.json" else path.stem
        return config_from_dict(values, name=values.get("name", stem) if isinstance(values, dict) else model)
    raise ValueError(f"unknown model {model!r}: expected one of {sorted(PRESETS)}, a JSON config file or a "
                     "checkpoint directory")


@dataclasses.dataclass(frozen=True)
class Weight:
    """One trainable array of the decoder.

    ``rows x cols``: a weight viewed as the matrix whose per-example gradient is ``sum_t left_t (x) right_t``
    (``rows`` = input features, ``cols`` = output features; an embedding table is ``vocab x d``); ``cols = 0``
    marks a vector (bias, norm scale) whose per-example gradient is instantiated. ``uses``: layer calls that read it
    (2 for a tied embedding table: lookup and LM head); ``layer``: the layer call it belongs to.
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


def _gpt2_block(h: str, d: int, f: int) -> list[Weight]:
    return [Weight(f"{h}/ln_1/scale", d, 0), Weight(f"{h}/ln_1/bias", d, 0),
            Weight(f"{h}/attn/c_attn/kernel", d, 3 * d), Weight(f"{h}/attn/c_attn/bias", 3 * d, 0),
            Weight(f"{h}/attn/c_proj/kernel", d, d), Weight(f"{h}/attn/c_proj/bias", d, 0),
            Weight(f"{h}/ln_2/scale", d, 0), Weight(f"{h}/ln_2/bias", d, 0),
            Weight(f"{h}/mlp/c_fc/kernel", d, f), Weight(f"{h}/mlp/c_fc/bias", f, 0),
            Weight(f"{h}/mlp/c_proj/kernel", f, d), Weight(f"{h}/mlp/c_proj/bias", d, 0)]


def _llama_block(h: str, c: DecoderConfig) -> list[Weight]:
    d, f, q, kv = c.d_model, c.mlp_width, c.n_head * c.head_size, c.kv_heads * c.head_size
    out = [Weight(f"{h}/input_layernorm/scale", d, 0)]
    for proj, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append(Weight(f"{h}/self_attn/{proj}/kernel", d, width))
        if c.qkv_bias:
            out.append(Weight(f"{h}/self_attn/{proj}/bias", width, 0))
    out += [Weight(f"{h}/self_attn/o_proj/kernel", q, d), Weight(f"{h}/post_attention_layernorm/scale", d, 0)]
    if c.sandwich_norms:
        out += [Weight(f"{h}/pre_feedforward_layernorm/scale", d, 0),
                Weight(f"{h}/post_feedforward_layernorm/scale", d, 0)]
    return out + [Weight(f"{h}/mlp/gate_proj/kernel", d, f), Weight(f"{h}/mlp/up_proj/kernel", d, f),
                  Weight(f"{h}/mlp/down_proj/kernel", f, d)]


def weights(config: DecoderConfig) -> list[Weight]:
    """The trainable arrays of the project's model of this config (:class:`dpzero_jax.models.GPT2` or, unscanned,
    :class:`dpzero_jax.models.Llama`), in forward order, with the paths the engine gives them."""
    d, uses = config.d_model, 2 if config.tied else 1
    if config.family == "gpt2":
        out = [Weight("wte/embedding", config.vocab, d, uses=uses), Weight("wpe/embedding", config.n_ctx, d)]
        for i in range(config.n_layer):
            out += _gpt2_block(f"h/{i}", d, config.mlp_width)
        out += [Weight("ln_f/scale", d, 0), Weight("ln_f/bias", d, 0)]
        head = "lm_head/kernel"
    else:
        out = [Weight("embed_tokens/embedding", config.vocab, d, uses=uses)]
        for i in range(config.n_layer):
            out += _llama_block(f"layers/{i}", config)
        out.append(Weight("norm/scale", d, 0))
        head = "lm_head/kernel"
    if not config.tied:
        out.append(Weight(head, d, config.vocab))
    return out


def lora_weights(config: DecoderConfig, rank: int) -> list[Weight]:
    """The adapters ``dpzero_jax.peft.apply(model, "lora", rank=rank)`` adds with its default targets (every dense
    layer of the blocks' attention and MLP; not the LM head): per ``[rows, cols]`` kernel, ``lora_a`` ``[rows,
    rank]`` and ``lora_b`` ``[rank, cols]``, in forward order."""
    out = []
    for w in weights(config):
        if w.is_matrix and w.path.endswith("/kernel") and w.path.startswith(("h/", "layers/")):
            out += [Weight(f"{w.layer}/lora_a/kernel", w.rows, rank), Weight(f"{w.layer}/lora_b/kernel", rank, w.cols)]
    return out


def activation_bytes_per_token(config: DecoderConfig, seq: int, precision: str) -> tuple[int, int]:
    """``(per block, LM head)`` bytes the backward keeps per token without recomputation (``remat='none'``).

    The residuals the TPU compiler keeps for the project's models (read from its live ranges at the peak of a
    compiled step, ``--xla_dump_to``: a 4-block GPT-2 of width 1024 and a 4-block Llama of width 2048, ``T = 2048``,
    bf16, v5e; GPT-2 XL's 48 blocks on 256 chips agree within 1%), per block and token, with ``c`` the compute
    precision's bytes (2; 4 in fp32):

    * the attention probabilities, fp32 (the models take their softmax in fp32) and their cast for the ``P V``
      product: ``(4 + c) n_head T``;
    * six MLP-wide tensors at ``c`` (the up / gate projections' outputs, the activation's intermediates and the down
      projection's input): ``6 c d_ff``;
    * three fp32 ``d``-vectors per norm (its input, statistics and normalised output in fp32; two norms a block,
      four with sandwich norms): ``12 d`` a norm;
    * three ``d``-vectors at ``c`` (the attention's and the MLP's inputs and the attention output) and the
      attention's ``q, k, v``: ``c (3 d + n_head head_dim + 2 n_kv_head head_dim)``.

    GPT-2 at bf16 (``d_ff = 4 d``): ``84 d + 6 h T`` bytes; Korthikanti et al. 2022 count ``34 d + 5 h T`` for
    their fp16 Megatron block, which keeps neither fp32 norms nor fp32 probabilities. Head: the inputs of the final
    norm and of the LM head (``2 d`` at ``c``) and the fp32 log-probabilities of the loss (``vocab`` fp32 numbers).
    """
    c = 4 if precision == "fp32" else 2
    d = config.d_model
    norms = 4 if config.sandwich_norms else 2
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_size
    block = (4 + c) * config.n_head * seq + 6 * c * config.mlp_width + 12 * d * norms + c * (3 * d + qkv)
    head = c * 2 * d + 4 * config.vocab
    return block, head
