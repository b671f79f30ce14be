"""Hugging Face ViT checkpoints (``ViTForImageClassification``, ``ViTModel``) <-> :class:`~dpzero_jax.models.ViT`.

``nn.Linear`` weights are transposed, ``query`` / ``key`` / ``value`` side by side in one ``c_attn`` ``[d, 3d]``;
the patch convolution ``[d, C, P, P]`` becomes Flax's ``[P, P, C, d]``. A missing classifier, or one with another
number of labels, is initialised afresh.
"""

from __future__ import annotations

import numpy as np

from dpzero_jax.models.hf_mapping import Entry, dense, fused_qkv, layer_norm, refuse, same
from dpzero_jax.models.vit import ViTConfig

# transformers' ViTConfig defaults
_DEFAULTS = {"image_size": 224, "patch_size": 16, "num_channels": 3, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072, "layer_norm_eps": 1e-12}


def config_from_hf(c: dict, model_type: str = "vit", scan_layers: bool | None = None,
                   num_labels: int | None = None) -> ViTConfig:
    refuse(c, "qkv_bias", True, "attention without query/key/value biases")
    refuse(c, "hidden_act", "gelu", "another activation than the exact GELU")
    values = {k: c.get(k, v) for k, v in _DEFAULTS.items()}
    for key in ("image_size", "patch_size"):
        value = values[key]
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ValueError(f"config.json: non-square {key} {value!r} is not supported")
            values[key] = value[0]
    return ViTConfig(image_size=values["image_size"], patch_size=values["patch_size"],
                     num_channels=values["num_channels"], hidden_size=values["hidden_size"],
                     num_hidden_layers=values["num_hidden_layers"],
                     num_attention_heads=values["num_attention_heads"],
                     intermediate_size=values["intermediate_size"], num_classes=num_labels,
                     layer_norm_eps=float(values["layer_norm_eps"]))


def entries(c: ViTConfig, prefix: str = "vit.") -> list[Entry]:
    """The :class:`~dpzero_jax.models.hf_mapping.Entry` table of a model with config ``c``."""
    d, p = c.hidden_size, prefix
    out = [Entry("patch_embed/kernel", (f"{p}embeddings.patch_embeddings.projection.weight",),
                 lambda w: w.transpose(2, 3, 1, 0), lambda k: (np.ascontiguousarray(k.transpose(3, 2, 0, 1)),)),
           same("patch_embed/bias", f"{p}embeddings.patch_embeddings.projection.bias"),
           same("cls_token", f"{p}embeddings.cls_token"),
           same("position", f"{p}embeddings.position_embeddings")]
    for i in range(c.num_hidden_layers):
        h, o = f"{p}encoder.layer.{i}", f"blocks/{i}"
        out += layer_norm(f"{o}/ln_1", f"{h}.layernorm_before")
        out += fused_qkv(f"{o}/attn/c_attn", f"{h}.attention.attention", d)
        out += dense(f"{o}/attn/c_proj", f"{h}.attention.output.dense")
        out += layer_norm(f"{o}/ln_2", f"{h}.layernorm_after")
        out += dense(f"{o}/mlp/c_fc", f"{h}.intermediate.dense") + dense(f"{o}/mlp/c_proj", f"{h}.output.dense")
    out += layer_norm("ln", f"{p}layernorm") + dense("head", "classifier", head=True)
    return out


def hf_config(c: ViTConfig) -> dict:
    """The ``config.json`` keys that describe ``c`` (merged over the checkpoint's own on export)."""
    return {"model_type": "vit", "architectures": ["ViTForImageClassification"], "image_size": c.image_size,
            "patch_size": c.patch_size, "num_channels": c.num_channels, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size, "layer_norm_eps": c.layer_norm_eps, "hidden_act": "gelu",
            "qkv_bias": True}
