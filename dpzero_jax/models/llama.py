"""A Llama-family decoder (Llama 2 / 3, Mistral, Qwen2, Gemma 1 and 2) from standard Flax NNX layers.

Rotary position embeddings (the checkpoint's scaling: none, ``linear`` or ``llama3``), grouped- / multi-query
attention through ``jax.nn.dot_product_attention`` (causal, optional sliding window, padding mask as an argument),
gated MLPs (SwiGLU, or GeGLU for Gemma), RMSNorm (Gemma's ``(1 + w)`` form), tied or untied LM head, Gemma's
``sqrt(d)``-scaled embedding; Gemma 2's attention and final logit soft-capping, pre/post-FFN norms, alternating
sliding-window layers (a per-layer flag scanned with the weights, selecting a band mask) and
``query_pre_attn_scalar`` (soft-capped scores: attention written out, since ``dot_product_attention`` has no cap).
The layers are stacked on a leading ``[num_hidden_layers]`` axis and applied with one ``lax.scan`` by default
(``scan_layers``). Built on ``nnx.Linear`` / ``nnx.Embed`` / ``nnx.RMSNorm`` rather than on
:mod:`dpzero_jax.layers`: its private gradients come from the traced-program front-end, like any model a user brings.

Parameter names follow the Hugging Face module names (``layers/self_attn/q_proj/kernel``, ``layers/mlp/gate_proj``,
...), so that LoRA targets read the same as in ``peft``: ``q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax.models.gpt2 import check_remat, rematerialised, stacked_blocks
from dpzero_jax.spmd import constrain_batch

# activations by their Hugging Face names: SiLU (SwiGLU) or GELU, tanh-approximated or exact (GeGLU)
ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
               "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
               "gelu": functools.partial(jax.nn.gelu, approximate=False)}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None   # None: multi-head (= num_attention_heads); 1: multi-query
    head_dim: int | None = None              # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"               # one of ROPE_TYPES
    # "dynamic" (NTK-aware, recomputed for sequences past max_position_embeddings): the default frequencies at every
    # length the model accepts (it refuses longer sequences), its factor kept for export
    rope_factor: float = 1.0                 # "linear" / "llama3" / "yarn" / "dynamic"
    rope_low_freq_factor: float = 1.0        # "llama3"
    rope_high_freq_factor: float = 4.0       # "llama3"
    rope_original_max_position: int = 8192   # "llama3" / "yarn"
    # "yarn" (Peng et al., 2023): frequencies blended between interpolated (/ factor) and kept over the dimensions
    # whose rotations in the original context lie between beta_slow and beta_fast (the range floored / ceiled with
    # truncate); cos and sin scaled by rope_attention_factor
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    hidden_act: str = "silu"                 # one of ACTIVATIONS
    qkv_bias: bool = False                   # biases on q/k/v (Qwen2; Llama's attention_bias)
    o_bias: bool = False                     # bias on o_proj (Llama's attention_bias)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None        # Mistral: a query attends to the last `sliding_window` positions
    gemma: bool = False                      # Gemma: (1 + w) RMSNorm and embedding scaled by sqrt(hidden_size)
    # Gemma 2: logits soft-capped as cap * tanh(x / cap), attention scores then the LM head's; the attention scale
    # query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); norms around the attention and the MLP outputs;
    # per-layer sliding windows (True: the layer uses sliding_window, False: full attention)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sandwich_norms: bool = False
    sliding_layers: tuple[bool, ...] | None = None
    scan_layers: bool = True
    remat: str = "none"                      # activation memory of the scanned layers (dpzero_jax.models.gpt2.REMAT)
    model_type: str = "llama"                # the Hugging Face model_type written on export

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}; give head_dim")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"LlamaConfig.hidden_act must be one of {tuple(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"LlamaConfig.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "yarn" and not (self.rope_factor >= 1.0 and self.rope_beta_fast > self.rope_beta_slow > 0
                                             and self.rope_attention_factor > 0):
            raise ValueError(f"LlamaConfig: yarn RoPE needs rope_factor >= 1, rope_beta_fast > rope_beta_slow > 0 and "
                             f"a positive rope_attention_factor, got {self.rope_factor}, {self.rope_beta_fast}, "
                             f"{self.rope_beta_slow}, {self.rope_attention_factor}")
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig: rotary embeddings need an even head_dim, got {self.head_size}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"LlamaConfig.sliding_window must be None or a positive int, got {self.sliding_window!r}")
        if self.sliding_layers is not None and (len(self.sliding_layers) != self.num_hidden_layers
                                                or self.sliding_window is None):
            raise ValueError(f"LlamaConfig.sliding_layers needs sliding_window and one flag per layer "
                             f"({self.num_hidden_layers}), got {self.sliding_layers!r}")
        check_remat("LlamaConfig", self.remat, self.scan_layers)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def inverse_frequencies(self) -> jax.Array:
        """``[head_dim / 2]`` rotary frequencies, with the checkpoint's scaling."""
        dim = self.head_size
        inv = 1.0 / (self.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
        if self.rope_type == "linear":
            return inv / self.rope_factor
        if self.rope_type == "llama3":   # long wavelengths slowed by `factor`, short kept, a smooth blend between
            old = self.rope_original_max_position
            wavelength = 2 * math.pi / inv
            smooth = (old / wavelength - self.rope_low_freq_factor) / \
                (self.rope_high_freq_factor - self.rope_low_freq_factor)
            blended = (1 - smooth) * inv / self.rope_factor + smooth * inv
            inv = jnp.where(wavelength > old / self.rope_low_freq_factor, inv / self.rope_factor,
                            jnp.where(wavelength < old / self.rope_high_freq_factor, inv, blended))
        if self.rope_type == "yarn":
            low, high = (dim * math.log(self.rope_original_max_position / (rotations * 2 * math.pi))
                         / (2 * math.log(self.rope_theta)) for rotations in (self.rope_beta_fast, self.rope_beta_slow))
            if self.rope_truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            high = high + 0.001 if low == high else high
            # 0: the frequency as it is, 1: divided by the factor, a linear ramp between low and high
            ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
            inv = inv / self.rope_factor * ramp + inv * (1.0 - ramp)
        return inv

    @property
    def rope_scaling_of_cos_sin(self) -> float:
        """The factor on the rotary cos and sin (YaRN's attention factor; 1 otherwise)."""
        return self.rope_attention_factor if self.rope_type == "yarn" else 1.0


def rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [B, T, N, Dh]`` rotated by position: halves ``(x1, x2)`` -> ``(x1 cos - x2 sin, x2 cos + x1 sin)``;
    ``cos``, ``sin``: ``[T, Dh / 2]``."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class OffsetRMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + scale)`` over the last axis (``scale`` starts at zero)."""

    def __init__(self, dim: int, *, eps: float):
        self.eps = eps
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.scale[...])).astype(x.dtype)


def _norm(c: LlamaConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
    if c.gemma:
        return OffsetRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
    return nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, use_fast_variance=False, dtype=dtype, rngs=rngs)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def _capped_attention(q, k, v, mask, scale: float, cap: float):
    """Causal attention with soft-capped scores (which ``jax.nn.dot_product_attention`` does not offer):
    ``q [B, T, H, Dh]``, ``k``, ``v [B, T, K, Dh]``, ``mask`` broadcastable to ``[B, 1, T, T]`` or None."""
    batch, length, heads, dim = q.shape
    groups = heads // k.shape[2]
    q = q.reshape(batch, length, k.shape[2], groups, dim)
    scores = softcap(jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) * scale, cap)
    allowed = jnp.tril(jnp.ones((length, length), bool))
    if mask is not None:
        allowed = allowed & mask[:, :, None]             # [B, 1, 1, T, T]
    weights = jax.nn.softmax(jnp.where(allowed, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(batch, length, heads, dim)


class LlamaAttention(nnx.Module):
    """``x [B, T, d] -> [B, T, d]``: ``H`` query heads sharing ``K`` key/value heads (``H % K == 0``)."""

    def __init__(self, c: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.kv_heads, c.head_size
        self.window = None if c.sliding_layers is not None else c.sliding_window   # per layer: a mask instead
        self.cap = c.attn_softcap
        self.scale = (c.query_pre_attn_scalar or c.head_size) ** -0.5
        d, hd = c.hidden_size, c.head_size
        linear = functools.partial(nnx.Linear, dtype=dtype, rngs=rngs)
        self.q_proj = linear(d, self.heads * hd, use_bias=c.qkv_bias)
        self.k_proj = linear(d, self.kv_heads * hd, use_bias=c.qkv_bias)
        self.v_proj = linear(d, self.kv_heads * hd, use_bias=c.qkv_bias)
        self.o_proj = linear(self.heads * hd, d, use_bias=c.o_bias)

    def __call__(self, x, cos, sin, mask):
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.kv_heads, self.head_dim)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if self.cap is not None:
            out = _capped_attention(q, k, v, mask, self.scale, self.cap)
        else:
            window = None if self.window is None or self.window >= length else (self.window - 1, 0)
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=window,
                                               scale=self.scale)
        return self.o_proj(out.reshape(batch, length, self.heads * self.head_dim))


class LlamaMLP(nnx.Module):
    """``x [B, T, d] -> down(act(gate(x)) * up(x)) [B, T, d]`` (SwiGLU with SiLU, GeGLU with GELU)."""

    def __init__(self, c: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.act = c.hidden_act
        self.gate_proj = linear(c.hidden_size, c.intermediate_size)
        self.up_proj = linear(c.hidden_size, c.intermediate_size)
        self.down_proj = linear(c.intermediate_size, c.hidden_size)

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
    """A pre-norm decoder layer: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``; with ``sandwich_norms`` (Gemma 2)
    ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``+ post_feedforward_layernorm(mlp(pre_feedforward_layernorm(.)))``."""

    def __init__(self, c: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.sandwich = c.sandwich_norms
        self.input_layernorm = _norm(c, dtype, rngs)
        self.self_attn = LlamaAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _norm(c, dtype, rngs)
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(c, dtype, rngs)
            self.post_feedforward_layernorm = _norm(c, dtype, rngs)
        self.mlp = LlamaMLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
    """``input_ids [B, T] (, attention_mask [B, T]) -> logits [B, T, vocab_size]``.

    ``attention_mask``: 1 for real tokens, 0 for padding (keys at padded positions are not attended to); right
    padding needs none, since a causal model's real tokens never see the padding after them.
    ``dtype``: the compute dtype of the activations (``None``: fp32); weights stay fp32.
    ``from_pretrained(path)`` loads a Hugging Face Llama / Mistral / Qwen2 / Gemma checkpoint directory,
    ``save_pretrained(path)`` writes one.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=None):
        self.config = config
        self.dtype = None if dtype is None else jnp.dtype(dtype).name
        self.hf_config: str | None = None       # the checkpoint's config.json (JSON text), kept for export
        c = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        layer = functools.partial(LlamaLayer, c, dtype=dtype)
        if c.scan_layers:
            self.layers = stacked_blocks(layer, c.num_hidden_layers, rngs)
        else:
            self.layers = nnx.List([layer(rngs=rngs) for _ in range(c.num_hidden_layers)])
        self.norm = _norm(c, dtype, rngs)
        self.lm_head = None if c.tie_word_embeddings else nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False,
                                                                      dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        c = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        length = input_ids.shape[1]
        if length > c.max_position_embeddings:
            raise ValueError(f"sequence length {length} exceeds max_position_embeddings={c.max_position_embeddings}")
        x = self.embed_tokens(input_ids)
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if c.gemma:   # the normaliser rounded to the activations' dtype, as transformers does
            x = x * jnp.asarray(math.sqrt(c.hidden_size), x.dtype)
        angles = jnp.arange(length, dtype=jnp.float32)[:, None] * c.inverse_frequencies()[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if c.rope_scaling_of_cos_sin != 1.0:
            cos, sin = cos * c.rope_scaling_of_cos_sin, sin * c.rope_scaling_of_cos_sin
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask {attention_mask.shape} must have the shape of input_ids "
                                 f"{input_ids.shape}")
            mask = attention_mask.astype(bool)[:, None, None, :]      # [B, 1, 1, T_k]
        # per-layer windows (Gemma 2, Qwen2): a layer's [T, T] band mask, selected by its flag (scanned with its
        # weights)
        sliding = jnp.asarray(c.sliding_layers or (False,) * c.num_hidden_layers)
        offsets = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
        band = offsets < (c.sliding_window or length)

        def layer_mask(slides):
            if c.sliding_layers is None:
                return mask
            local = jnp.where(slides, band, True)[None, None]              # [1, 1, T, T]
            return local if mask is None else local & mask

        if c.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def step(x, layer_and_flag):   # the carry split over the batch under a GSPMD step (spmd.constrain_batch)
                layer, slides = layer_and_flag
                y = nnx.merge(graphdef, layer)(constrain_batch(x), cos, sin, layer_mask(slides))
                return constrain_batch(y), None
            x = constrain_batch(jax.lax.scan(rematerialised(step, c.remat), constrain_batch(x), (state, sliding))[0])
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, layer_mask(sliding[i]))
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return softcap(logits, c.final_softcap)

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, seed: int = 0, scan_layers: bool = True,
                        remat: str = "none") -> Llama:
        """A Hugging Face Llama / Mistral / Qwen2 / Gemma checkpoint directory (see
        :func:`dpzero_jax.models.from_pretrained`); ``scan_layers``: stacked layers, one ``lax.scan``; ``remat``:
        what each layer's backward recomputes (:data:`dpzero_jax.models.gpt2.REMAT`)."""
        from dpzero_jax.models import pretrained

        return pretrained.load(path, expect=cls, dtype=dtype, seed=seed, scan_layers=scan_layers,
                               remat=remat)

    def save_pretrained(self, path, *, max_shard_bytes: int | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads (``*ForCausalLM``); sharded with
        an index past ``max_shard_bytes`` (default 5 GiB)."""
        from dpzero_jax import hf
        from dpzero_jax.models import pretrained

        pretrained.save(self, path, max_shard_bytes=max_shard_bytes or hf.MAX_SHARD_BYTES)
