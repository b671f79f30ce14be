"""Per-example objectives: turn an NNX model into ``(params, loss_fn)`` with ``loss_fn(params, batch) -> [B]``.

``trainable`` (an NNX filter, default ``nnx.Param``) selects the variables that go into ``params``; every other
variable is closed over by ``loss_fn`` as a constant: frozen, it costs no norm and gets no gradient. PEFT passes
the filter of :func:`dpzero_jax.peft.apply`.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.filterlib import Filter


def _split(model: nnx.Module, trainable: Filter):
    graphdef, params, rest = nnx.split(model, trainable, ...)
    return graphdef, params, rest


def lm_objective(model: nnx.Module, *, trainable: Filter = nnx.Param):
    """Next-token cross-entropy, averaged over each example's positions.

    batch: ``{"input_ids": int32 [B, T]}`` and optionally ``"loss_mask": [B, T]`` (1 where the token at ``t+1`` is
    a target). Returns ``(params, loss_fn)``; ``loss_fn(params, batch) -> [B]``.
    """
    graphdef, params, rest = _split(model, trainable)

    def loss_fn(params, batch):
        ids = batch["input_ids"]
        logits = nnx.merge(graphdef, params, rest)(ids)[:, :-1].astype(jnp.float32)
        targets = ids[:, 1:]
        token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        weights = batch.get("loss_mask")
        weights = jnp.ones_like(token_loss) if weights is None else weights[:, 1:].astype(jnp.float32)
        return jnp.sum(token_loss * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)

    return params, loss_fn


def classification_objective(model: nnx.Module, input_key: str = "image", *, trainable: Filter = nnx.Param):
    """Softmax cross-entropy. batch: ``{input_key: [B, ...], "label": int32 [B]}``. Returns ``(params, loss_fn)``."""
    graphdef, params, rest = _split(model, trainable)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params, rest)(batch[input_key]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])

    return params, loss_fn


def logits_fn(model: nnx.Module, *, trainable: Filter = nnx.Param):
    """``(params, apply)`` with ``apply(params, inputs) -> logits``, for evaluation."""
    graphdef, params, rest = _split(model, trainable)
    return params, lambda params, inputs: nnx.merge(graphdef, params, rest)(inputs)
