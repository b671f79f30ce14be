"""A GPT-2-style decoder from standard Flax layers (``nnx.Embed`` with a tied ``attend`` head, ``nnx.Linear``,
``nnx.LayerNorm``): learned positions, pre-LN blocks, GELU MLP, tied or untied LM head; its blocks unrolled (a list)
or stacked and scanned (``scan_layers``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax.models.transformer import FLAX_LAYERS, Block, LayerSet
from dpzero_jax.spmd import constrain_batch

# GELU variants by their Hugging Face names: the tanh approximation ("gelu_new", GPT-2's) or the exact erf form
GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None          # MLP width; default 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    activation_function: str = "gelu_new"   # one of GELUS
    # Blocks stacked on a leading [n_layer] axis (parameters ``h/...``) and applied with one ``lax.scan``: one block in
    # the compiled program at any depth (private gradients via the traced-program front-end, which keeps the scan).
    # Unrolled (False): a list, parameters ``h/0/...``, ``h/1/...``.
    scan_layers: bool = False
    # activation memory of the scanned blocks (one of REMAT): see ``rematerialised``
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT2Config.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"GPT2Config.scan_layers must be a bool, got {self.scan_layers!r}")
        check_remat("GPT2Config", self.remat, self.scan_layers)
        if self.activation_function not in GELUS:
            raise ValueError(f"GPT2Config.activation_function must be one of {tuple(GELUS)}, "
                             f"got {self.activation_function!r}")


class GPT2(nnx.Module):
    """``input_ids [B, T] -> logits [B, T, vocab_size]``.

    ``dtype``: the compute dtype of the activations (``None``: that of the weights as built, fp32); weights stay as
    stored. Casting the parameters to bfloat16 after building does not change it (Flax's ``Embed`` keeps the dtype
    it was built with, and every later layer promotes to it): pass ``dtype`` to compute in 16 bits.
    ``layers``: the layer classes (:data:`~dpzero_jax.models.transformer.FLAX_LAYERS`, Flax's own: the traced-program
    front-end plans the private gradient, as for a user's model; ``DP_LAYERS``: the same computation and parameters
    from ``dz.layers`` layers, planned from the layers' calls).
    ``from_pretrained(path)`` loads a Hugging Face GPT-2 checkpoint directory, ``save_pretrained(path)`` writes one.
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs, dtype=None, layers: LayerSet = FLAX_LAYERS):
        self.config = config
        self.dtype = None if dtype is None else jnp.dtype(dtype).name
        self.hf_config: str | None = None       # the checkpoint's config.json (JSON text), kept for export
        d, compute = config.n_embd, None if dtype is None else jnp.dtype(dtype)
        self.wte = layers.embed(config.vocab_size, d, stddev=0.02, dtype=compute, rngs=rngs)
        self.wpe = layers.embed(config.n_positions, d, stddev=0.01, dtype=compute, rngs=rngs)
        block = functools.partial(Block, d, config.n_head, config.n_inner or 4 * d, causal=True,
                                  approximate_gelu=GELUS[config.activation_function], eps=config.layer_norm_epsilon,
                                  layers=layers, dtype=compute)
        if config.scan_layers:
            self.h = stacked_blocks(block, config.n_layer, rngs)
        else:
            self.h = nnx.List([block(rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = layers.norm(d, eps=config.layer_norm_epsilon, dtype=compute, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else layers.linear(d, config.vocab_size, use_bias=False,
                                                                              dtype=compute, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        batch, length = input_ids.shape
        if length > self.config.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions={self.config.n_positions}")
        positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
        x = self.wte(input_ids) + self.wpe(positions)
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if self.config.scan_layers:
            x = scan_blocks(self.h, x, self.config.remat)
        else:
            for block in self.h:
                x = block(x)
        x = self.ln_f(x)
        return self.wte.attend(x) if self.lm_head is None else self.lm_head(x)

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, seed: int = 0, scan_layers: bool = False,
                        remat: str = "none") -> GPT2:
        """A Hugging Face GPT-2 checkpoint directory (see :func:`dpzero_jax.models.from_pretrained`);
        ``scan_layers``: stack its blocks and scan over them, ``remat``: what each block's backward recomputes
        (:class:`GPT2Config`)."""
        from dpzero_jax.models import pretrained

        return pretrained.load(path, expect=cls, dtype=dtype, seed=seed, scan_layers=scan_layers,
                               remat=remat)

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads (``GPT2LMHeadModel``)."""
        from dpzero_jax.models import pretrained

        pretrained.save(self, path)


def stacked_blocks(make_block, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """``count`` blocks ``make_block(rngs=...)`` as one module whose parameters have a leading ``[count]`` axis,
    each block initialised from its own split of ``rngs``."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs):
        return make_block(rngs=rngs)
    return make(rngs)


def scan_blocks(blocks: nnx.Module, x: jax.Array, remat: str = "none") -> jax.Array:
    """``x [B, T, d]`` through the stacked ``blocks`` in order: one ``lax.scan`` over the leading axis of their state
    (trainable and frozen leaves alike, as a PEFT split leaves them); each block rematerialised by ``remat``. The
    carry is split over the batch under a GSPMD step (:func:`dpzero_jax.spmd.constrain_batch`; else unchanged)."""
    graphdef, state = nnx.split(blocks)

    def step(x, layer):
        return constrain_batch(nnx.merge(graphdef, layer)(constrain_batch(x))), None
    return constrain_batch(jax.lax.scan(rematerialised(step, remat), constrain_batch(x), state)[0])


# What the backward of a scanned block finds stored from its forward (``remat``):
#   "none"   every intermediate the backward needs (fastest; activation memory grows with depth x block size);
#   "block"  only the block's input: the whole block's forward runs again in the backward (least memory);
#   "dots"   the block's input and the outputs of its matmuls without batch dimensions (the projections); norms,
#            activations and attention scores are recomputed (MaxText's usual trade).
REMAT = ("none", "block", "dots")


def check_remat(owner: str, remat, scan_layers: bool) -> None:
    if remat not in REMAT:
        raise ValueError(f"{owner}.remat must be one of {REMAT}, got {remat!r}")
    if remat != "none" and not scan_layers:
        raise ValueError(f"{owner}.remat={remat!r} applies to scanned blocks: set scan_layers=True")


def rematerialised(step, remat: str):
    """The scan body ``step(carry, layer) -> (carry, out)`` under ``jax.checkpoint`` with the policy ``remat`` names
    (:data:`REMAT`). The private gradient sees a ``checkpoint`` region inside the scan: the traced-program front-end
    keeps it, so the norms come out of the rematerialised backward."""
    if remat == "none":
        return step
    policy = None if remat == "block" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(step, policy=policy, prevent_cse=False)
