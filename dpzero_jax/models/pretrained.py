"""Hugging Face checkpoints <-> the models of this package (GPT-2, Llama / Mistral / Qwen2 / Gemma, BERT / RoBERTa,
ViT), without torch. The Llama family's table and config checks are in :mod:`dpzero_jax.models.llama_hf`.

:func:`from_pretrained` reads a ``save_pretrained`` directory (:mod:`dpzero_jax.hf`), checks that ``config.json``
describes something these models compute exactly, maps every tensor onto a parameter (layouts below) and returns
the model; :func:`save` writes the model back (``config.json`` + ``model.safetensors``) so that ``transformers``'
``from_pretrained`` loads it. LoRA adapters are folded into their base weights on export.

Layouts (Hugging Face -> here):

* GPT-2's ``Conv1D`` weights are ``[in, out]`` already; ``c_attn`` ``[d, 3d]`` -> ``[d, 3, H, Dh]`` (q, k, v, then
  heads), ``attn.c_proj`` ``[d, d]`` -> ``[H, Dh, d]``; the LM head is the word embedding when
  ``tie_word_embeddings`` (the default: one array, exported once), else ``lm_head.weight`` ``[V, d]`` transposed.
* BERT / RoBERTa / ViT ``nn.Linear`` weights are ``[out, in]`` and are transposed; ``query``, ``key`` and ``value``
  are stacked into one ``c_attn`` ``[d, 3, H, Dh]``; ViT's patch convolution ``[d, C, P, P]`` becomes the linear map
  on flattened ``(row, column, channel)`` patches, ``[P * P * C, d]``.

A task head (BERT's pooler and classifier, RoBERTa's classifier, ViT's classifier) may be missing from the
checkpoint (e.g. ``BertModel`` weights) or have another number of labels than asked for: it is then initialised
afresh (with a warning), as ``transformers`` does with ``ignore_mismatched_sizes``. Every other tensor must be there
with the shape ``config.json`` implies, or loading fails naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpzero_jax import hf
from dpzero_jax.models import llama_hf
from dpzero_jax.models.bert import BertConfig, BertEncoder
from dpzero_jax.models.gpt2 import GELUS, GPT2, GPT2Config
from dpzero_jax.models.llama import Llama
from dpzero_jax.models.vit import ViT, ViTConfig

SUPPORTED = {"gpt2": GPT2, "bert": BertEncoder, "roberta": BertEncoder, "vit": ViT,
             **{name: Llama for name in llama_hf.MODEL_TYPES}}
ARCHITECTURES = "gpt2 (GPT2LMHeadModel, GPT2Model), llama / mistral / qwen2 / gemma / gemma2 (*ForCausalLM), " \
                "bert / roberta (*ForSequenceClassification, *Model), vit (ViTForImageClassification, ViTModel)"
CAUSAL_LM = ("gpt2", *llama_hf.MODEL_TYPES)   # the model_types that --task causal-lm loads
# tensors that are not weights (causal-mask buffers of old GPT-2 checkpoints, position-id buffers)
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|position_ids|rotary_emb\.inv_freq)$")

__all__ = ["from_pretrained", "save", "SUPPORTED"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter (``path``, ``/``-joined) from one or more checkpoint tensors (``names``)."""

    path: str
    names: tuple[str, ...]
    to_ours: Callable
    to_hf: Callable
    head: bool = False          # part of the task head: may be missing (initialised afresh)


def _same(path, name, head=False):
    return Entry(path, (name,), lambda a: a, lambda w: (w,), head)


def _conv1d(path, name, ours_shape, hf_shape):
    """A GPT-2 ``Conv1D`` tensor: same memory order, reshaped."""
    return Entry(path, (name,), lambda a: a.reshape(ours_shape), lambda w: (w.reshape(hf_shape),))


def _qkv(path, prefix, d, heads):
    """``query``, ``key``, ``value`` ``nn.Linear`` s -> one ``[d, 3, H, Dh]`` kernel and ``[3, H, Dh]`` bias."""
    names = tuple(f"{prefix}.{n}" for n in ("query", "key", "value"))

    def kernel(q, k, v):
        return np.stack([q.T, k.T, v.T], axis=1).reshape(d, 3, heads, d // heads)

    def kernel_hf(w):
        w = w.reshape(d, 3, d)
        return tuple(np.ascontiguousarray(w[:, i].T) for i in range(3))

    def bias(q, k, v):
        return np.stack([q, k, v]).reshape(3, heads, d // heads)

    def bias_hf(b):
        b = b.reshape(3, d)
        return tuple(b[i] for i in range(3))
    return [Entry(f"{path}/kernel", tuple(f"{n}.weight" for n in names), kernel, kernel_hf),
            Entry(f"{path}/bias", tuple(f"{n}.bias" for n in names), bias, bias_hf)]


def _out_proj(path, name, d, heads):
    """An ``nn.Linear`` attention output ``[d, d]`` -> kernel ``[H, Dh, d]``."""
    return [Entry(f"{path}/kernel", (f"{name}.weight",), lambda w: w.T.reshape(heads, d // heads, d),
                  lambda k: (np.ascontiguousarray(k.reshape(d, d).T),)),
            _same(f"{path}/bias", f"{name}.bias")]


def _dense(path, name, head=False):
    return [Entry(f"{path}/kernel", (f"{name}.weight",), lambda w: w.T, lambda k: (np.ascontiguousarray(k.T),),
                  head),
            _same(f"{path}/bias", f"{name}.bias", head)]


def _norm(path, name):
    return [_same(f"{path}/scale", f"{name}.weight"), _same(f"{path}/bias", f"{name}.bias")]


# ---------------------------------------------------------------- GPT-2
def _gpt2_config(c: dict, scan_layers: bool = False) -> GPT2Config:
    _refuse(c, "add_cross_attention", False, "cross-attention")
    _refuse(c, "scale_attn_weights", True, "unscaled attention")
    _refuse(c, "scale_attn_by_inverse_layer_idx", False, "attention scaled by the inverse layer index")
    act = c.get("activation_function", "gelu_new")
    if act not in GELUS:
        raise ValueError(f"config.json: activation_function {act!r} is not supported (one of {tuple(GELUS)})")
    d = GPT2Config()
    return GPT2Config(vocab_size=c.get("vocab_size", d.vocab_size), n_positions=c.get("n_positions", d.n_positions),
                      n_embd=c.get("n_embd", d.n_embd), n_layer=c.get("n_layer", d.n_layer),
                      n_head=c.get("n_head", d.n_head), n_inner=c.get("n_inner"),
                      layer_norm_epsilon=float(c.get("layer_norm_epsilon", d.layer_norm_epsilon)),
                      tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), activation_function=act,
                      scan_layers=scan_layers)


def _gpt2_block(c: GPT2Config, h: str, o: str) -> list[Entry]:
    """One block: checkpoint prefix ``h`` (``transformer.h.3``), parameter prefix ``o`` (``h/3``)."""
    d, heads = c.n_embd, c.n_head
    return _norm(f"{o}/ln_1", f"{h}.ln_1") + _norm(f"{o}/ln_2", f"{h}.ln_2") + [
        _conv1d(f"{o}/attn/c_attn/kernel", f"{h}.attn.c_attn.weight", (d, 3, heads, d // heads), (d, 3 * d)),
        _conv1d(f"{o}/attn/c_attn/bias", f"{h}.attn.c_attn.bias", (3, heads, d // heads), (3 * d,)),
        _conv1d(f"{o}/attn/c_proj/kernel", f"{h}.attn.c_proj.weight", (heads, d // heads, d), (d, d)),
        _same(f"{o}/attn/c_proj/bias", f"{h}.attn.c_proj.bias"),
        _same(f"{o}/mlp/c_fc/kernel", f"{h}.mlp.c_fc.weight"),
        _same(f"{o}/mlp/c_fc/bias", f"{h}.mlp.c_fc.bias"),
        _same(f"{o}/mlp/c_proj/kernel", f"{h}.mlp.c_proj.weight"),
        _same(f"{o}/mlp/c_proj/bias", f"{h}.mlp.c_proj.bias")]


def _gpt2_entries(c: GPT2Config, prefix: str) -> list[Entry]:
    p = prefix
    out = [_same("wte/embedding", f"{p}wte.weight"), _same("wpe/embedding", f"{p}wpe.weight")]
    if c.scan_layers:
        out += _stacked([_gpt2_block(c, f"{p}h.{i}", "h") for i in range(c.n_layer)])
    else:
        for i in range(c.n_layer):
            out += _gpt2_block(c, f"{p}h.{i}", f"h/{i}")
    out += _norm("ln_f", f"{p}ln_f")
    if not c.tie_word_embeddings:
        out.append(Entry("lm_head/kernel", ("lm_head.weight",), lambda w: w.T,
                         lambda k: (np.ascontiguousarray(k.T),)))
    return out


def _stacked(layers: list[list[Entry]]) -> list[Entry]:
    """Entries of stacked blocks from each layer's entries (same paths, same order): the parameter is the layers'
    values stacked on a new leading axis, read from (and written to) every layer's tensors."""
    out = []
    for same_path in zip(*layers):
        widths = np.cumsum([0] + [len(e.names) for e in same_path])

        def to_ours(*arrays, entries=same_path, widths=widths):
            return np.stack([e.to_ours(*arrays[a:b]) for e, a, b in zip(entries, widths[:-1], widths[1:])])

        def to_hf(w, entries=same_path):
            return tuple(t for e, w_layer in zip(entries, w) for t in e.to_hf(w_layer))
        out.append(Entry(same_path[0].path, tuple(n for e in same_path for n in e.names), to_ours, to_hf,
                         same_path[0].head))
    return out


def _gpt2_hf_config(c: GPT2Config) -> dict:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
            "n_positions": c.n_positions, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
            "n_inner": c.n_inner, "layer_norm_epsilon": c.layer_norm_epsilon,
            "tie_word_embeddings": c.tie_word_embeddings, "activation_function": c.activation_function,
            "add_cross_attention": False, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}


# ---------------------------------------------------------------- BERT / RoBERTa
def _bert_config(c: dict, model_type: str, num_labels: int) -> BertConfig:
    _refuse(c, "is_decoder", False, "a decoder (causal) BERT")
    _refuse(c, "add_cross_attention", False, "cross-attention")
    _refuse(c, "position_embedding_type", "absolute", "relative position embeddings")
    _refuse(c, "hidden_act", "gelu", "another activation than the exact GELU")
    problem = c.get("problem_type")
    if problem not in (None, "single_label_classification"):
        raise ValueError(f"config.json: problem_type {problem!r} is not supported (single-label classification "
                         f"with softmax cross-entropy only)")
    d = BertConfig()
    pad = c.get("pad_token_id")
    if pad is None:
        pad = 1 if model_type == "roberta" else 0
    return BertConfig(vocab_size=c.get("vocab_size", d.vocab_size), hidden_size=c.get("hidden_size", d.hidden_size),
                      num_hidden_layers=c.get("num_hidden_layers", d.num_hidden_layers),
                      num_attention_heads=c.get("num_attention_heads", d.num_attention_heads),
                      intermediate_size=c.get("intermediate_size", d.intermediate_size),
                      max_position_embeddings=c.get("max_position_embeddings", d.max_position_embeddings),
                      type_vocab_size=c.get("type_vocab_size", d.type_vocab_size),
                      layer_norm_eps=float(c.get("layer_norm_eps", d.layer_norm_eps)), num_labels=num_labels,
                      pad_token_id=int(pad), model_type=model_type)


def _bert_entries(c: BertConfig, prefix: str) -> list[Entry]:
    d, heads, p = c.hidden_size, c.num_attention_heads, prefix
    out = [_same("word_embeddings/embedding", f"{p}embeddings.word_embeddings.weight"),
           _same("position_embeddings/embedding", f"{p}embeddings.position_embeddings.weight"),
           _same("token_type_embeddings/embedding", f"{p}embeddings.token_type_embeddings.weight")]
    out += _norm("ln_embed", f"{p}embeddings.LayerNorm")
    for i in range(c.num_hidden_layers):
        h, o = f"{p}encoder.layer.{i}", f"layers/{i}"
        out += _qkv(f"{o}/attn/c_attn", f"{h}.attention.self", d, heads)
        out += _out_proj(f"{o}/attn/c_proj", f"{h}.attention.output.dense", d, heads)
        out += _norm(f"{o}/ln_1", f"{h}.attention.output.LayerNorm")
        out += _dense(f"{o}/mlp/c_fc", f"{h}.intermediate.dense") + _dense(f"{o}/mlp/c_proj", f"{h}.output.dense")
        out += _norm(f"{o}/ln_2", f"{h}.output.LayerNorm")
    if c.model_type == "roberta":
        out += _dense("head/dense", "classifier.dense", head=True) + _dense("head/out_proj", "classifier.out_proj",
                                                                           head=True)
    else:
        out += _dense("pooler", f"{p}pooler.dense", head=True) + _dense("head", "classifier", head=True)
    return out


def _bert_hf_config(c: BertConfig) -> dict:
    name = "RobertaForSequenceClassification" if c.model_type == "roberta" else "BertForSequenceClassification"
    return {"model_type": c.model_type, "architectures": [name], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings, "type_vocab_size": c.type_vocab_size,
            "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id, "hidden_act": "gelu",
            "position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}


# ---------------------------------------------------------------- ViT
def _vit_config(c: dict, num_labels: int) -> ViTConfig:
    _refuse(c, "qkv_bias", True, "attention without query/key/value biases")
    _refuse(c, "hidden_act", "gelu", "another activation than the exact GELU")
    d = {"image_size": 224, "patch_size": 16, "num_channels": 3, "hidden_size": 768, "num_hidden_layers": 12,
         "num_attention_heads": 12, "intermediate_size": 3072, "layer_norm_eps": 1e-12}  # HF ViTConfig defaults
    values = {k: c.get(k, v) for k, v in d.items()}
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


def _vit_entries(c: ViTConfig, prefix: str) -> list[Entry]:
    d, heads, p, ps, ch = c.hidden_size, c.num_attention_heads, prefix, c.patch_size, c.num_channels
    out = [Entry("patch_embed/proj/kernel", (f"{p}embeddings.patch_embeddings.projection.weight",),
                 lambda w: w.transpose(2, 3, 1, 0).reshape(ps * ps * ch, d),
                 lambda k: (np.ascontiguousarray(k.reshape(ps, ps, ch, d).transpose(3, 2, 0, 1)),)),
           _same("patch_embed/proj/bias", f"{p}embeddings.patch_embeddings.projection.bias"),
           Entry("cls_token/embedding", (f"{p}embeddings.cls_token",), lambda a: a.reshape(1, d),
                 lambda e: (e.reshape(1, 1, d),)),
           Entry("position/embedding", (f"{p}embeddings.position_embeddings",),
                 lambda a: a.reshape(c.num_patches + 1, d), lambda e: (e.reshape(1, c.num_patches + 1, d),))]
    for i in range(c.num_hidden_layers):
        h, o = f"{p}encoder.layer.{i}", f"blocks/{i}"
        out += _norm(f"{o}/ln_1", f"{h}.layernorm_before")
        out += _qkv(f"{o}/attn/c_attn", f"{h}.attention.attention", d, heads)
        out += _out_proj(f"{o}/attn/c_proj", f"{h}.attention.output.dense", d, heads)
        out += _norm(f"{o}/ln_2", f"{h}.layernorm_after")
        out += _dense(f"{o}/mlp/c_fc", f"{h}.intermediate.dense") + _dense(f"{o}/mlp/c_proj", f"{h}.output.dense")
    out += _norm("ln", f"{p}layernorm") + _dense("head", "classifier", head=True)
    return out


def _vit_hf_config(c: ViTConfig) -> dict:
    return {"model_type": "vit", "architectures": ["ViTForImageClassification"], "image_size": c.image_size,
            "patch_size": c.patch_size, "num_channels": c.num_channels, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size, "layer_norm_eps": c.layer_norm_eps, "hidden_act": "gelu",
            "qkv_bias": True}


# ---------------------------------------------------------------- loading
def _refuse(config: dict, key: str, supported, what: str) -> None:
    value = config.get(key, supported)
    if value != supported:
        raise ValueError(f"config.json: {key}={value!r} ({what}) is not supported; only {key}={supported!r}")


def _normalise(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Old BERT checkpoints name LayerNorm parameters ``gamma`` / ``beta``."""
    out = {}
    for name, value in state.items():
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
        out[re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)] = value
    return out


def _prefix(state: dict, candidates: tuple[str, ...]) -> str:
    for prefix in candidates:
        if any(name.startswith(prefix) for name in state):
            return prefix
    return ""


def _checkpoint_labels(config: dict) -> int:
    if isinstance(config.get("id2label"), dict) and config["id2label"]:
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def _param_nodes(model: nnx.Module) -> dict[str, nnx.Param]:
    return {"/".join(str(k) for k in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param)}


def _labels(hf_config: dict, num_labels: int, id2label) -> None:
    """Set ``id2label`` / ``label2id`` of ``hf_config`` for ``num_labels`` classes (names kept when they fit)."""
    if id2label is not None:
        names = [str(id2label[i]) for i in range(num_labels)] if isinstance(id2label, dict) else \
            [str(n) for n in id2label]
        if len(names) != num_labels:
            raise ValueError(f"id2label names {len(names)} labels but num_labels={num_labels}")
    else:
        old = hf_config.get("id2label")
        if isinstance(old, dict) and len(old) == num_labels:
            names = [str(old.get(str(i), old.get(i, f"LABEL_{i}"))) for i in range(num_labels)]
        else:
            names = [f"LABEL_{i}" for i in range(num_labels)]
    hf_config["id2label"] = {str(i): n for i, n in enumerate(names)}
    hf_config["label2id"] = {n: i for i, n in enumerate(names)}
    hf_config.pop("num_labels", None)


def from_pretrained(path, *, num_labels: int | None = None, id2label=None, dtype=None, seed: int = 0,
                    scan_layers: bool | None = None, remat: str = "none"):
    """The model of a Hugging Face ``save_pretrained`` directory: :class:`~dpzero_jax.models.GPT2`,
    :class:`~dpzero_jax.models.BertEncoder` (BERT, RoBERTa) or :class:`~dpzero_jax.models.ViT`, by ``model_type``.

    ``num_labels`` / ``id2label`` (encoders and ViT): the classes of the head; a head of another size, or missing, is
    initialised afresh from ``seed``. ``dtype``: activation compute dtype (GPT-2, BERT). Weights are fp32.
    ``scan_layers`` (decoders): blocks stacked and scanned; ``None``: the model's default (GPT-2: unrolled,
    :class:`~dpzero_jax.models.Llama` and its family -- Llama, Mistral, Qwen2, Gemma -- scanned). ``remat``
    (scanned decoders): ``"none"``, ``"block"`` or ``"dots"``, what each block's backward recomputes
    (:data:`dpzero_jax.models.gpt2.REMAT`).
    """
    return load(path, num_labels=num_labels, id2label=id2label, dtype=dtype, seed=seed, scan_layers=scan_layers,
                remat=remat)


def load(path, *, expect=None, num_labels=None, id2label=None, dtype=None, seed: int = 0,
         scan_layers: bool | None = None, remat: str = "none"):
    hf_config = hf.read_config(path)
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"{Path(path) / hf.CONFIG}: model_type {model_type!r} is not supported; supported "
                         f"architectures: {ARCHITECTURES}")
    cls = SUPPORTED[model_type]
    if expect is not None and cls is not expect:
        raise ValueError(f"{path} holds a {model_type} checkpoint: load it with dz.models.{cls.__name__}"
                         f".from_pretrained (or dz.models.from_pretrained)")
    if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int)
                                   or num_labels < 1):
        raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")
    state = _normalise(hf.read_state_dict(path))
    reinit_head, checkpoint_labels = False, None
    if cls in (GPT2, Llama) and (num_labels is not None or id2label is not None):
        raise ValueError(f"{model_type} is loaded as a causal language model: num_labels and id2label do not apply")
    if cls is Llama:
        config = dataclasses.replace(llama_hf.config_from_hf(hf_config, True if scan_layers is None else scan_layers),
                                     remat=remat)
        entries = llama_hf.entries(config, _prefix(state, ("model.",)))
        build = functools.partial(Llama, config, dtype=dtype)
    elif cls is GPT2:
        config = dataclasses.replace(_gpt2_config(hf_config, bool(scan_layers)), remat=remat)
        entries = _gpt2_entries(config, _prefix(state, ("transformer.",)))
        build = functools.partial(GPT2, config, dtype=dtype)
    else:
        if scan_layers or remat != "none":
            raise ValueError(f"scan_layers and remat apply to decoders only; {path} holds a {model_type} checkpoint")
        checkpoint_labels = _checkpoint_labels(hf_config)
        if num_labels is None:
            num_labels = len(id2label) if id2label is not None else checkpoint_labels
        reinit_head = num_labels != checkpoint_labels
        _labels(hf_config, num_labels, id2label)
        if cls is BertEncoder:
            config = _bert_config(hf_config, model_type, num_labels)
            entries = _bert_entries(config, _prefix(state, (f"{model_type}.",)))
            build = functools.partial(BertEncoder, config, dtype=dtype)
        else:
            if dtype is not None:
                raise ValueError("ViT takes its compute dtype from its input images: dtype does not apply")
            config = _vit_config(hf_config, num_labels)
            entries = _vit_entries(config, _prefix(state, ("vit.",)))
            build = functools.partial(ViT, config)

    model = nnx.eval_shape(lambda: build(rngs=nnx.Rngs(params=seed)))
    nodes = _param_nodes(model)
    covered = {e.path for e in entries}
    if covered != set(nodes):  # the tables above and the modules must describe the same parameters
        raise AssertionError(f"internal: mapping mismatch {sorted(covered ^ set(nodes))}")
    values, fresh, missing, used = {}, [], [], set()
    for entry in entries:
        present = all(n in state for n in entry.names)
        if entry.head and (reinit_head or not present):
            fresh.append(entry.path)
            used.update(n for n in entry.names if n in state)
            continue
        if not present:
            missing.extend(n for n in entry.names if n not in state)
            continue
        arrays = [np.asarray(state[n]) for n in entry.names]
        used.update(entry.names)
        expected = tuple(nodes[entry.path].get_value().shape)
        try:
            value = entry.to_ours(*[a.astype(np.float32) for a in arrays])
        except ValueError:
            value = None
        if value is None or tuple(value.shape) != expected:
            shapes = ", ".join(f"{n} {tuple(a.shape)}" for n, a in zip(entry.names, arrays))
            raise ValueError(f"{path}: shape mismatch: {shapes} cannot be the parameter {entry.path} of shape "
                             f"{expected} that config.json implies")
        values[entry.path] = value
    if missing:
        listing = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"{path}: the checkpoint lacks tensors a {model_type} model with this config.json needs: "
                         f"{listing}")
    if cls in (GPT2, Llama) and config.tie_word_embeddings and "lm_head.weight" in state:
        used.add("lm_head.weight")  # tied: the head is the word embedding (transformers ignores this copy too)
    unused = sorted(n for n in state if n not in used and not _BUFFERS.search(n))
    if unused:
        listing = ", ".join(unused[:8]) + (f", ... ({len(unused)} in all)" if len(unused) > 8 else "")
        warnings.warn(f"{path}: tensors not used by {cls.__name__}: {listing}", stacklevel=3)
    if fresh:
        why = (f"the checkpoint's head has {checkpoint_labels} labels, {num_labels} asked for") if reinit_head \
            else "not in the checkpoint"
        warnings.warn(f"{path}: initialising {', '.join(fresh)} afresh ({why}); train it before use", stacklevel=3)
        init = jax.jit(lambda: {p: v.get_value() for p, v in _param_nodes(build(rngs=nnx.Rngs(params=seed))).items()
                                if p in fresh})()
        values.update(init)
    for name, node in nodes.items():
        node.set_value(jnp.asarray(values[name], jnp.float32))
    hf_config.pop("torch_dtype", None)
    hf_config["dtype"] = "float32"
    model.hf_config = json.dumps(hf_config, sort_keys=True)
    return model


# ---------------------------------------------------------------- export
def save(model: nnx.Module, path, *, max_shard_bytes: int = hf.MAX_SHARD_BYTES):
    """Write ``model`` (GPT2, BertEncoder or ViT; LoRA adapters folded in) as a ``transformers`` checkpoint.

    ``path``: a local directory (returned as a ``pathlib.Path``) or a ``gs://`` / ``s3://`` ... URL (returned as an
    ``etils.epath.Path``): the checkpoint is then written to a local temporary directory and its files streamed
    there (:func:`dpzero_jax.rundir.upload_directory`). Past ``max_shard_bytes`` the weights are written in shards
    with an index (:func:`dpzero_jax.hf.write_checkpoint`)."""
    from dpzero_jax import peft, rundir

    model = peft.merge_lora(model)
    if isinstance(model, GPT2):
        c = model.config
        entries, derived = _gpt2_entries(c, "transformer."), _gpt2_hf_config(c)
    elif isinstance(model, Llama):
        c = model.config
        entries, derived = llama_hf.entries(c), llama_hf.hf_config(c)
    elif isinstance(model, BertEncoder):
        c = model.config
        entries, derived = _bert_entries(c, f"{c.model_type}."), _bert_hf_config(c)
        num_labels = c.num_labels
    elif isinstance(model, ViT):
        c = model.config
        entries, derived = _vit_entries(c, "vit."), _vit_hf_config(c)
        num_labels = c.num_classes
    else:
        raise TypeError(f"save_pretrained supports GPT2, Llama, BertEncoder and ViT, not {type(model).__name__}")
    hf_config = json.loads(model.hf_config) if getattr(model, "hf_config", None) else {}
    hf_config.update(derived)
    if not isinstance(model, (GPT2, Llama)):
        _labels(hf_config, num_labels, None)
    hf_config.pop("torch_dtype", None)
    hf_config["dtype"] = "float32"
    values = {name: np.asarray(node.get_value(), np.float32) for name, node in _param_nodes(model).items()}
    if {e.path for e in entries} != set(values):
        extra = sorted(set(values) - {e.path for e in entries})
        raise ValueError(f"save_pretrained: parameters {extra[:8]} have no Hugging Face counterpart")
    tensors = {}
    for entry in entries:
        tensors.update(zip(entry.names, entry.to_hf(values[entry.path]), strict=True))
    if not rundir.is_remote(path):
        return hf.write_checkpoint(path, hf_config, tensors, max_shard_bytes=max_shard_bytes)
    with tempfile.TemporaryDirectory(prefix="dpzero-export-") as local:
        hf.write_checkpoint(local, hf_config, tensors, max_shard_bytes=max_shard_bytes)
        return rundir.upload_directory(Path(local), path)


def bert_max_length(hf_config: dict, model_type: str) -> int:
    """The longest sequence a BERT / RoBERTa ``config.json`` has positions for."""
    positions = int(hf_config.get("max_position_embeddings", 512))
    if model_type != "roberta":
        return positions
    pad = hf_config.get("pad_token_id")
    return positions - (1 if pad is None else int(pad)) - 1
