"""Models built only from DP layers, and per-example objectives."""

from dpzero_jax.models.encoder import Encoder, EncoderConfig
from dpzero_jax.models.gpt2 import GPT2, GPT2Config
from dpzero_jax.models.mlp import MLP, MLPConfig
from dpzero_jax.models.objectives import classification_objective, lm_objective, logits_fn
from dpzero_jax.models.vit import ViT, ViTConfig

__all__ = ["Encoder", "EncoderConfig", "GPT2", "GPT2Config", "MLP", "MLPConfig", "ViT", "ViTConfig",
           "classification_objective", "lm_objective", "logits_fn"]
