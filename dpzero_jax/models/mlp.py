"""A small multilayer perceptron classifier from standard Flax NNX layers (``nnx.Linear``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    in_features: int = 64
    hidden: tuple[int, ...] = (128, 128)
    num_classes: int = 10
    dtype: Any = None   # the layers' compute dtype (None: promoted from inputs and parameters); parameters: float32


class MLP(nnx.Module):
    """``x [B, ...] -> logits [B, num_classes]`` (inputs flattened); tanh activations."""

    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
        self.config = config
        widths = (config.in_features,) + tuple(config.hidden)
        self.layers = nnx.List([nnx.Linear(a, b, dtype=config.dtype, rngs=rngs)
                                for a, b in zip(widths[:-1], widths[1:])])
        self.head = nnx.Linear(widths[-1], config.num_classes, dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.config.in_features:
            raise ValueError(f"MLP expects {self.config.in_features} input features per example, got {x.shape[1]}")
        for layer in self.layers:
            x = jax.nn.tanh(layer(x))
        return self.head(x)
