"""Per-example objectives: turn an NNX model into ``(params, loss_fn)`` with ``loss_fn(params, batch) -> [B]``.

``trainable`` (an NNX filter, default ``nnx.Param``) selects the variables that go into ``params``; every other
variable is frozen: it costs no norm and gets no gradient. PEFT passes the filter of :func:`dpzero_jax.peft.apply`.
By default ``loss_fn`` closes over the frozen variables, which then enter a jitted program as constants. Under
``jax.jit`` with large frozen weights (LoRA on a big model) pass them instead: ``loss_fn(params, batch,
frozen=frozen_state(model, trainable))`` with ``frozen`` an argument of the jitted function -- then they are
(sharded) arguments, not constants folded into the program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.filterlib import Filter


def _split(model: nnx.Module, trainable: Filter):
    graphdef, params, rest = nnx.split(model, trainable, ...)
    return graphdef, params, rest


def frozen_state(model: nnx.Module, trainable: Filter = nnx.Param) -> nnx.State:
    """The variables of ``model`` that ``trainable`` leaves out (the ``frozen`` argument of the objectives)."""
    return _split(model, trainable)[2]


def token_cross_entropy(logits, targets):
    """``-log softmax(logits)[target]``: ``logits [..., V]`` float, ``targets [...]`` int -> ``[...]``.

    The target's logit is picked by comparing ``targets`` with ``arange(V)``, not gathered: the gradient of the pick
    is then elementwise and fuses into the softmax's, where a gather's is a scatter-add into the flattened logits
    gradient (compiled for TPU with the vocabulary minor, that scatter made XLA copy the float32 ``[T, V]`` gradient
    into another layout first). The value is the same (one logit plus zeros).
    """
    picked = jnp.sum(jnp.where(targets[..., None] == jnp.arange(logits.shape[-1]), logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def lm_objective(model: nnx.Module, *, trainable: Filter = nnx.Param):
    """Next-token cross-entropy, averaged over each example's positions.

    batch: ``{"input_ids": int32 [B, T]}`` and optionally ``"loss_mask": [B, T]`` (1 where the token at ``t+1`` is
    a target; with right padding, the padding mask itself: a padded token is never a target, and causal attention
    keeps it out of every earlier position, so padding contributes nothing). Returns ``(params, loss_fn)``;
    ``loss_fn(params, batch, frozen=None) -> [B]`` (``frozen``: see the module docstring).
    """
    graphdef, params, rest = _split(model, trainable)

    def loss_fn(params, batch, frozen=None):
        ids = batch["input_ids"]
        logits = nnx.merge(graphdef, params, rest if frozen is None else frozen)(ids)[:, :-1].astype(jnp.float32)
        targets = ids[:, 1:]
        token_loss = token_cross_entropy(logits, targets)
        weights = batch.get("loss_mask")
        weights = jnp.ones_like(token_loss) if weights is None else weights[:, 1:].astype(jnp.float32)
        return jnp.sum(token_loss * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)

    return params, loss_fn


def _inputs(batch, input_key):
    """The model's arguments: ``batch[input_key]`` (one positional input) or, for a tuple of keys, those entries of
    the batch as keyword arguments (e.g. ``("input_ids", "attention_mask")`` for a text encoder)."""
    if isinstance(input_key, str):
        return (batch[input_key],), {}
    return (), {k: batch[k] for k in input_key}


def classification_objective(model: nnx.Module, input_key: str | tuple[str, ...] = "image", *,
                             trainable: Filter = nnx.Param):
    """Softmax cross-entropy. batch: ``{input_key: [B, ...], "label": int32 [B]}`` (``input_key`` a tuple: several
    inputs passed by name). Returns ``(params, loss_fn)``; ``loss_fn(params, batch, frozen=None) -> [B]``."""
    graphdef, params, rest = _split(model, trainable)

    def loss_fn(params, batch, frozen=None):
        args, kwargs = _inputs(batch, input_key)
        logits = nnx.merge(graphdef, params, rest if frozen is None else frozen)(*args, **kwargs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])

    return params, loss_fn


def logits_fn(model: nnx.Module, *, trainable: Filter = nnx.Param):
    """``(params, apply)`` with ``apply(params, inputs, frozen=None) -> logits``, for evaluation (``inputs`` a dict:
    passed to the model as keyword arguments)."""
    graphdef, params, rest = _split(model, trainable)

    def apply(params, inputs, frozen=None):
        model = nnx.merge(graphdef, params, rest if frozen is None else frozen)
        return model(**inputs) if isinstance(inputs, dict) else model(inputs)

    return params, apply
