"""A ViT classifier from standard Flax layers: a patch convolution, a bare class token and position table, pre-LN
blocks (:mod:`dpzero_jax.models.transformer`), as Hugging Face's ``ViTForImageClassification`` lays them out."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from dpzero_jax.models.transformer import class_token_and_positions, encoder_blocks, prepend_class_token


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int = 32
    patch_size: int = 4
    num_channels: int = 3
    hidden_size: int = 192
    num_hidden_layers: int = 6
    num_attention_heads: int = 3
    intermediate_size: int = 768
    num_classes: int = 10
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig: image_size={self.image_size} is not divisible by "
                             f"patch_size={self.patch_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("ViTConfig: hidden_size must be divisible by num_attention_heads")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(nnx.Module):
    """``image [B, H, W, C] -> logits [B, num_classes]`` (classification from the class token).

    ``from_pretrained(path)`` loads a Hugging Face ViT checkpoint directory (channels last here: transpose
    ``pixel_values [B, C, H, W]`` to ``[B, H, W, C]``), ``save_pretrained(path)`` writes one.
    """

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.hf_config: str | None = None       # the checkpoint's config.json (JSON text), kept for export
        d = config.hidden_size
        p = config.patch_size
        self.patch_embed = nnx.Conv(config.num_channels, d, (p, p), strides=(p, p), padding="VALID", rngs=rngs)
        self.cls_token, self.position = class_token_and_positions(d, config.num_patches + 1, rngs=rngs)
        self.blocks = encoder_blocks(d, config.num_attention_heads, config.intermediate_size,
                                     config.num_hidden_layers, config.layer_norm_eps, rngs=rngs)
        self.ln = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, use_fast_variance=False, rngs=rngs)
        self.head = nnx.Linear(d, config.num_classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.config
        if images.ndim != 4 or images.shape[1:] != (c.image_size, c.image_size, c.num_channels):
            raise ValueError(f"images must be [B, {c.image_size}, {c.image_size}, {c.num_channels}], "
                             f"got {images.shape}")
        patches = self.patch_embed(images)                                   # [B, H / P, W / P, d]
        patches = patches.reshape(patches.shape[0], -1, patches.shape[-1])   # [B, N, d]
        x = prepend_class_token(patches, self.cls_token[...], self.position[...])   # [B, N + 1, d]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))

    @classmethod
    def from_pretrained(cls, path, *, num_labels: int | None = None, id2label=None, seed: int = 0) -> ViT:
        """A Hugging Face ViT checkpoint directory (see :func:`dpzero_jax.models.from_pretrained`)."""
        from dpzero_jax.models import pretrained

        return pretrained.load(path, expect=cls, num_labels=num_labels, id2label=id2label, seed=seed)

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads (``ViTForImageClassification``)."""
        from dpzero_jax.models import pretrained

        pretrained.save(self, path)
