"""A small convolutional classifier from standard Flax NNX layers (``nnx.Conv``, ``nnx.GroupNorm``, ``nnx.Linear``).

Unlike the other bundled models it uses no :mod:`dpzero_jax.layers` layer: it is an example of a model a user brings as
is: ``"bk"``, ``"ghost"`` and ``"auto"`` compute it through the program front-end (:mod:`dpzero_jax.program`), and
``"vmap"`` (per-example gradients) accepts it like any model. GroupNorm normalises each example on its own, so
per-example gradients stay per-example (BatchNorm would mix the examples of a batch and is not DP-compatible as such).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    image_size: int = 8
    num_channels: int = 1
    widths: tuple[int, int] = (16, 32)
    num_groups: int = 4
    num_classes: int = 10
    dtype: Any = None   # compute dtype of the layers (``None``: the inputs' and parameters' promoted dtype)

    def __post_init__(self):
        if len(self.widths) != 2 or not all(isinstance(w, int) and w > 0 for w in self.widths):
            raise ValueError(f"CNNConfig: widths must be two positive ints, got {self.widths!r}")
        if any(w % self.num_groups for w in self.widths):
            raise ValueError(f"CNNConfig: num_groups={self.num_groups} must divide both widths {self.widths}")

    @property
    def feature_size(self) -> int:
        """The side of the feature map after the stride-2 convolution (SAME padding: ``ceil(image_size / 2)``)."""
        return -(-self.image_size // 2)


class CNN(nnx.Module):
    """``image [B, H, W, C] -> logits [B, num_classes]`` with ``H = W = image_size``, ``C = num_channels``.

    With ``(c1, c2) = widths`` and ``S = ceil(H / 2)``::

        conv1  3x3, stride 1, SAME   [B, H, W, C]   -> [B, H, W, c1]   + GroupNorm + relu
        conv2  3x3, stride 2, SAME   [B, H, W, c1]  -> [B, S, S, c2]   + GroupNorm + relu
        flatten                      [B, S, S, c2]  -> [B, S * S * c2]
        head   Linear                [B, S*S*c2]    -> [B, num_classes]

    The defaults (8x8x1 digits, widths 16 and 32, 4 groups): 160 + 4,640 + 5,130 weights and 96 norm scales and
    biases, about 10k parameters.
    """

    def __init__(self, config: CNNConfig, *, rngs: nnx.Rngs):
        self.config = config
        c1, c2 = config.widths
        dtype = config.dtype
        self.conv1 = nnx.Conv(config.num_channels, c1, kernel_size=(3, 3), padding="SAME", dtype=dtype, rngs=rngs)
        self.norm1 = nnx.GroupNorm(c1, num_groups=config.num_groups, dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(c1, c2, kernel_size=(3, 3), strides=(2, 2), padding="SAME", dtype=dtype, rngs=rngs)
        self.norm2 = nnx.GroupNorm(c2, num_groups=config.num_groups, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(config.feature_size ** 2 * c2, config.num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.config
        if images.ndim != 4 or images.shape[1:] != (c.image_size, c.image_size, c.num_channels):
            raise ValueError(f"images must be [B, {c.image_size}, {c.image_size}, {c.num_channels}], "
                             f"got {images.shape}")
        x = jax.nn.relu(self.norm1(self.conv1(images)))
        x = jax.nn.relu(self.norm2(self.conv2(x)))
        return self.head(x.reshape(x.shape[0], -1))
