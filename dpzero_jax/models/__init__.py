"""The bundled models and per-example objectives: GPT-2, the MLP, CNN, ViT, the encoder classifier, BERT / RoBERTa
and the Llama family, all from standard Flax NNX layers (GPT-2 also from ``dz.layers`` layers: ``layers=DP_LAYERS``).

``from_pretrained(path)`` loads a Hugging Face checkpoint directory as the matching model (GPT-2, Llama / Mistral /
Qwen2 / Gemma, BERT / RoBERTa, ViT); each of those models also has ``from_pretrained`` and ``save_pretrained``.
"""

from dpzero_jax.models.bert import BertConfig, BertEncoder
from dpzero_jax.models.cnn import CNN, CNNConfig
from dpzero_jax.models.encoder import Encoder, EncoderConfig
from dpzero_jax.models.gpt2 import GPT2, GPT2Config
from dpzero_jax.models.llama import Llama, LlamaConfig
from dpzero_jax.models.mlp import MLP, MLPConfig
from dpzero_jax.models.objectives import classification_objective, frozen_state, lm_objective, logits_fn
from dpzero_jax.models.pretrained import from_pretrained
from dpzero_jax.models.vit import ViT, ViTConfig

__all__ = ["BertConfig", "BertEncoder", "CNN", "CNNConfig", "Encoder", "EncoderConfig", "GPT2", "GPT2Config", "Llama",
           "LlamaConfig", "MLP", "MLPConfig", "ViT", "ViTConfig", "classification_objective", "from_pretrained",
           "frozen_state", "lm_objective", "logits_fn"]
