"""Hugging Face checkpoints <-> the models of this package (GPT-2, Llama / Mistral / Qwen2 / Gemma, BERT / RoBERTa,
ViT), without torch, driven by one table of architectures (:data:`ARCHITECTURE_TABLE`).

:func:`from_pretrained` reads a ``save_pretrained`` directory (:mod:`dpzero_jax.hf`), finds the architecture of its
``model_type``, checks that ``config.json`` describes something the model computes exactly, maps every tensor onto
a parameter and returns the model; :func:`save` writes the model back (``config.json`` + ``model.safetensors``) so
that ``transformers``' ``from_pretrained`` loads it. LoRA adapters are folded into their base weights on export.
Each architecture's config checks and tensor layouts are in its mapping module (:mod:`~dpzero_jax.models.gpt2_hf`,
:mod:`~dpzero_jax.models.llama_hf`, :mod:`~dpzero_jax.models.bert_hf`, :mod:`~dpzero_jax.models.vit_hf`), written
with the helpers of :mod:`~dpzero_jax.models.hf_mapping`; adding one is an entry in the table, a model file and a
mapping module.

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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpzero_jax import hf
from dpzero_jax.models import bert_hf, gpt2_hf, llama_hf, vit_hf
from dpzero_jax.models.bert import BertEncoder
from dpzero_jax.models.gpt2 import GPT2
from dpzero_jax.models.hf_mapping import Architecture
from dpzero_jax.models.llama import Llama
from dpzero_jax.models.vit import ViT

# The architectures, one entry each: a new one is an entry here, its model file and its mapping module.
ARCHITECTURE_TABLE: tuple[Architecture, ...] = (
    Architecture(("gpt2",), GPT2, causal_lm=True, config=gpt2_hf.config_from_hf, entries=gpt2_hf.entries,
                 hf_config=gpt2_hf.hf_config, prefixes=lambda model_type: ("transformer.",),
                 export_prefix=lambda c: "transformer."),
    Architecture(tuple(llama_hf.MODEL_TYPES), Llama, causal_lm=True,
                 config=lambda c, model_type, scan_layers=None, num_labels=None: llama_hf.config_from_hf(
                     c, True if scan_layers is None else scan_layers),
                 entries=llama_hf.entries, hf_config=llama_hf.hf_config, prefixes=lambda model_type: ("model.",),
                 export_prefix=lambda c: "model."),
    Architecture(("bert", "roberta"), BertEncoder, causal_lm=False, config=bert_hf.config_from_hf,
                 entries=bert_hf.entries, hf_config=bert_hf.hf_config,
                 prefixes=lambda model_type: (f"{model_type}.",), export_prefix=lambda c: f"{c.model_type}.",
                 num_labels=lambda c: c.num_labels),
    Architecture(("vit",), ViT, causal_lm=False, config=vit_hf.config_from_hf, entries=vit_hf.entries,
                 hf_config=vit_hf.hf_config, prefixes=lambda model_type: ("vit.",), export_prefix=lambda c: "vit.",
                 num_labels=lambda c: c.num_classes, takes_dtype=False),
)
BY_MODEL_TYPE = {t: arch for arch in ARCHITECTURE_TABLE for t in arch.model_types}
SUPPORTED = {t: arch.model for t, arch in BY_MODEL_TYPE.items()}
ARCHITECTURES = "gpt2 (GPT2LMHeadModel, GPT2Model), llama / mistral / qwen2 / gemma / gemma2 (*ForCausalLM), " \
                "bert / roberta (*ForSequenceClassification, *Model), vit (ViTForImageClassification, ViTModel)"
CAUSAL_LM = tuple(t for t, arch in BY_MODEL_TYPE.items() if arch.causal_lm)   # the model_types --task causal-lm loads
# tensors that are not weights (causal-mask buffers of old GPT-2 checkpoints, position-id buffers)
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|position_ids|rotary_emb\.inv_freq)$")

__all__ = ["from_pretrained", "save", "SUPPORTED", "ARCHITECTURE_TABLE"]


# ---------------------------------------------------------------- loading
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
    arch = BY_MODEL_TYPE[model_type]
    cls = arch.model
    if expect is not None and cls is not expect:
        raise ValueError(f"{path} holds a {model_type} checkpoint: load it with dz.models.{cls.__name__}"
                         f".from_pretrained (or dz.models.from_pretrained)")
    if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int)
                                   or num_labels < 1):
        raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")
    state = _normalise(hf.read_state_dict(path))
    reinit_head, checkpoint_labels = False, None
    if arch.causal_lm:
        if num_labels is not None or id2label is not None:
            raise ValueError(f"{model_type} is loaded as a causal language model: num_labels and id2label do not "
                             "apply")
        config = dataclasses.replace(arch.config(hf_config, model_type, scan_layers=scan_layers), remat=remat)
    else:
        if scan_layers or remat != "none":
            raise ValueError(f"scan_layers and remat apply to decoders only; {path} holds a {model_type} checkpoint")
        checkpoint_labels = _checkpoint_labels(hf_config)
        if num_labels is None:
            num_labels = len(id2label) if id2label is not None else checkpoint_labels
        reinit_head = num_labels != checkpoint_labels
        _labels(hf_config, num_labels, id2label)
        config = arch.config(hf_config, model_type, num_labels=num_labels)
    if not arch.takes_dtype and dtype is not None:
        raise ValueError(f"{cls.__name__} takes its compute dtype from its inputs: dtype does not apply")
    entries = arch.entries(config, _prefix(state, arch.prefixes(model_type)))
    build = functools.partial(cls, config, **({"dtype": dtype} if arch.takes_dtype else {}))

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
    if arch.causal_lm and config.tie_word_embeddings and "lm_head.weight" in state:
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
    arch = next((a for a in ARCHITECTURE_TABLE if isinstance(model, a.model)), None)
    if arch is None:
        names = ", ".join(a.model.__name__ for a in ARCHITECTURE_TABLE)
        raise TypeError(f"save_pretrained supports {names}, not {type(model).__name__}")
    c = model.config
    entries = arch.entries(c, arch.export_prefix(c))
    hf_config = json.loads(model.hf_config) if getattr(model, "hf_config", None) else {}
    hf_config.update(arch.hf_config(c))
    if not arch.causal_lm:
        _labels(hf_config, arch.num_labels(c), None)
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
