"""Tiny Hugging Face checkpoints built locally with ``transformers`` (no download) for the tests and the notebook.

Each builder writes a ``save_pretrained`` directory (weights + config, and a tokenizer trained here on the embedded
Python help-topics corpus) and returns the torch model in eval mode, for reference outputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

INIT_RANGE = 0.2  # larger than transformers' 0.02, so that logits and gradients are far from zero


def corpus_sample(chars: int = 60_000) -> list[str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:chars]
    return text.splitlines()


def save_gpt2_tokenizer(path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer (GPT-2's kind), with ``<|endoftext|>`` as its only special token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_sample(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(str(path))


def save_bert_tokenizer(path, vocab_size: int = 200) -> None:
    """A WordPiece tokenizer with BERT's special tokens (``[PAD]`` = 0) and ``[CLS] ... [SEP]`` post-processing."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(corpus_sample(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                                       show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(str(path))


def gpt2(path, *, tied: bool = True, n_layer: int = 2, n_embd: int = 32, n_head: int = 4, n_positions: int = 64,
         vocab_size: int = 320, seed: int = 0, tokenizer: bool = True):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                                     n_head=n_head, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                                     initializer_range=INIT_RANGE, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(str(path))
    if tokenizer:
        save_gpt2_tokenizer(path, vocab_size)
    return model


def bert(path, *, roberta: bool = False, num_labels: int = 3, seed: int = 0, tokenizer: bool = True,
         vocab_size: int = 200, layers: int = 2):
    import torch
    import transformers

    torch.manual_seed(seed)
    kind = "Roberta" if roberta else "Bert"
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=72 if roberta else 64, num_labels=num_labels, initializer_range=INIT_RANGE,
        pad_token_id=1 if roberta else 0, attn_implementation="eager")
    model = getattr(transformers, f"{kind}ForSequenceClassification")(config).eval()
    model.save_pretrained(str(path))
    if tokenizer:
        save_bert_tokenizer(path, vocab_size)
    return model


def vit(path, *, num_labels: int = 5, image_size: int = 8, num_channels: int = 3, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.ViTConfig(image_size=image_size, patch_size=4, num_channels=num_channels, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    num_labels=num_labels, initializer_range=INIT_RANGE, attn_implementation="eager")
    model = transformers.ViTForImageClassification(config).eval()
    model.save_pretrained(str(path))
    return model


def token_batch(vocab_size: int, batch: int, length: int, seed: int, low: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, vocab_size, (batch, length)).astype(np.int64)


def write_jsonl(path: Path, records) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


LLAMA_FAMILY = {   # model_type -> (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": False,
                                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                   "original_max_position_embeddings": 16}}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"num_key_value_heads": 1, "head_dim": 16,
                                                  "hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 5,
                                                     "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                                                     "final_logit_softcapping": 3.0}),
}


def llama(path, kind: str = "llama", *, seed: int = 0, vocab_size: int = 320, hidden: int = 32, layers: int = 2,
          tokenizer: bool = True, **overrides):
    """A tiny Llama-family checkpoint (``kind`` one of :data:`LLAMA_FAMILY`): 4 query heads, grouped- or multi-query
    key/value heads, random non-zero norm weights and biases (so that a wrong norm form or a dropped bias shows)."""
    import torch
    import transformers

    config_cls, model_cls, extra = LLAMA_FAMILY[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, max_position_embeddings=64, initializer_range=INIT_RANGE, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attn_implementation="eager", **{**extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param) if "norm" in name and not kind.startswith("gemma")
                            else 0.3 * torch.randn_like(param))
    model.save_pretrained(str(path))
    if tokenizer:
        save_gpt2_tokenizer(path, vocab_size)
    return model
