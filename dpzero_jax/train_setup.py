"""Setting up a training run from its :class:`~dpzero_jax.train_config.TrainConfig`: data, model, PEFT, RMM
layers, devices, the mesh and multi-process start (used by :class:`dpzero_jax.train.Trainer`)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
from flax import nnx

from dpzero_jax import (
    hf,
    models,
    peft,
    rmm,
    rmm_diagnostics,
    sharding,
    text,
)
from dpzero_jax import nn as dz_nn
from dpzero_jax.data import load_dataset
from dpzero_jax.train_config import PRECISIONS, RMM_KEY_TAG, TrainConfig, _hf_path, _mesh_shape


def _load_data(cfg: TrainConfig):
    """``(train, test, label_names)``: the image ``dataset``, or for a Hugging Face text model the tokenised
    ``data`` (:func:`dpzero_jax.text.load_text_dataset`)."""
    path = _hf_path(cfg)
    if path is None:
        return (*load_dataset(cfg.dataset, seed=0), None)
    hf_config = hf.read_config(path)
    model_type = hf_config.get("model_type")
    if model_type not in models.pretrained.SUPPORTED:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; supported architectures: "
                         f"{models.pretrained.ARCHITECTURES}")
    wanted = models.pretrained.CAUSAL_LM if cfg.task == "causal-lm" else ("bert", "roberta", "vit")
    if model_type not in wanted:
        raise ValueError(f"task {cfg.task!r} needs a {' / '.join(wanted)} checkpoint, but {path} holds "
                         f"model_type {model_type!r}")
    if model_type == "vit":
        if cfg.data is not None or cfg.eval_data is not None:
            raise ValueError("a ViT checkpoint trains on the image dataset (--dataset), not on a text data file")
        return (*load_dataset(cfg.dataset, seed=0), None)
    if model_type == "gpt2":
        positions = hf_config.get("n_positions", 1024)
    elif cfg.task == "causal-lm":
        positions = hf_config.get("max_position_embeddings", 2048)
    else:
        positions = models.bert_hf.max_length(hf_config, model_type)
    max_length = cfg.max_length if cfg.max_length is not None else min(128, positions)
    if max_length > positions:
        raise ValueError(f"max_length={max_length} exceeds the {positions} positions of the checkpoint in {path}")
    tokenizer = text.load_tokenizer(cfg.tokenizer or path)
    pad_id = hf_config.get("pad_token_id")
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return text.load_text_dataset(tokenizer, task=cfg.task, max_length=max_length, pad_id=int(pad_id),
                                  vocab_size=int(hf_config.get("vocab_size", 0)) or 1 << 31, data=cfg.data,
                                  eval_data=cfg.eval_data, text_field=cfg.text_field, label_field=cfg.label_field)


def _make_model(cfg: TrainConfig, train_data, rngs: nnx.Rngs, label_names=None, seed: int = 0) -> nnx.Module:
    path = _hf_path(cfg)
    if path is not None:
        kwargs = {"seed": seed}
        if cfg.task == "classification":
            kwargs["num_labels"] = len(label_names) if label_names is not None else int(train_data["label"].max()) + 1
            kwargs["id2label"] = label_names
        if "input_ids" in train_data and cfg.precision != "fp32":
            kwargs["dtype"] = PRECISIONS[cfg.precision]
        if cfg.scan_layers:
            kwargs["scan_layers"] = True
        if cfg.remat != "none":
            kwargs["remat"] = cfg.remat
        model = models.from_pretrained(path, **kwargs)
        if isinstance(model, models.ViT):
            c, shape = model.config, train_data["image"].shape[1:]
            if shape != (c.image_size, c.image_size, c.num_channels):
                raise ValueError(f"the ViT checkpoint in {path} takes {c.image_size}x{c.image_size}x{c.num_channels}"
                                 f" images, the {cfg.dataset} dataset has {'x'.join(map(str, shape))}")
        return model
    image_shape = train_data["image"].shape[1:]
    num_classes = int(train_data["label"].max()) + 1
    if cfg.model == "mlp":
        return models.MLP(models.MLPConfig(in_features=int(np.prod(image_shape)), hidden=cfg.hidden,
                                           num_classes=num_classes), rngs=rngs)
    size, _, channels = image_shape
    if cfg.model == "cnn":
        dtype = None if cfg.precision == "fp32" else PRECISIONS[cfg.precision]   # nnx layers compute in `dtype`
        return models.CNN(models.CNNConfig(image_size=size, num_channels=channels, num_classes=num_classes,
                                           dtype=dtype), rngs=rngs)
    return models.ViT(models.ViTConfig(image_size=size, patch_size=2, num_channels=channels, hidden_size=64,
                                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                       num_classes=num_classes), rngs=rngs)


def _apply_peft(cfg: TrainConfig, model: nnx.Module, key: jax.Array):
    """``(model, trainable filter)`` for ``cfg.peft`` (LoRA adapters drawn from ``key``)."""
    if cfg.peft == "none":
        return peft.apply(model, "full")
    also_train = cfg.peft_also_train
    if also_train is None:  # a classification head is new: train it; a causal LM's head is the pretrained one
        also_train = ("head",) if cfg.peft in ("lora", "bitfit") and cfg.task == "classification" else ()
    options = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": cfg.lora_targets, "key": key} \
        if cfg.peft == "lora" else {}
    return peft.apply(model, cfg.peft, also_train=also_train, **options)


def _apply_rmm(cfg: TrainConfig, model: nnx.Module, trainable: peft.Trainable) -> nnx.Module:
    """``model`` with its dense layers converted to RMM layers (:func:`dpzero_jax.rmm.convert_to_rmm`) for
    ``cfg.rmm`` / ``cfg.rmm_rate``: those whose kernel trains (a frozen layer keeps nothing for a weight gradient,
    so a sketch would only add memory), except the classification head ``head``, which stays exact (its ``[B, d]``
    input has no token axis to compress under DP, and it is small). Layout: per-example tokens (``private=True``,
    the DP variant) unless ``no_dp`` (the batch's rows, as in paper 002)."""
    if cfg.rmm == "none":
        return model
    trained = set(trainable.names)

    def where(path: str, layer) -> bool:
        return path != "head" and not path.startswith("head/") and f"{path}/kernel" in trained

    if not any(where(peft.path_name(path), m) for path, m in nnx.iter_modules(model)
               if isinstance(m, (dz_nn.Linear, dz_nn.DenseGeneral))):   # what convert_to_rmm converts
        raise ValueError(f"TrainConfig.rmm={cfg.rmm!r}: no dpzero_jax.nn dense layer besides the head has a trainable "
                         f"kernel (peft={cfg.peft!r}; Flax's nnx.Linear, as in Llama, is not converted), so there is "
                         f"nothing to convert")
    if cfg.model == "mlp" and not cfg.no_dp:
        warnings.warn("rmm under DP compresses each example's tokens, and the MLP's dense layers see one per "
                      "example: B_proj = 1 keeps the whole input (no memory saved), the orthogonal and Rademacher "
                      "sketches are then exact and the Gaussian one rescales each layer's gradient by a random "
                      "factor; RMM pays off on token models (model='vit')", UserWarning, stacklevel=3)
    return rmm.convert_to_rmm(model, sketch=cfg.rmm, rate=cfg.rmm_rate, private=not cfg.no_dp, where=where)


def rmm_step_key(noise_key: jax.Array) -> jax.Array:
    """The key of the RMM sketches of the step whose noise key is ``noise_key``: ``fold_in(noise_key,
    RMM_KEY_TAG)`` (layer ``j`` then uses ``fold_in(., j)``, :func:`dpzero_jax.rmm.fresh_keys`).

    Fresh sketches every step, a pure function of ``(seed, step)`` (resume is exact). The noise of gradient leaf
    ``j`` is drawn from ``fold_in(noise_key, j)`` with ``j`` far below the tag, so the sketches are independent of
    the noise -- which the privacy analysis needs: it conditions on the data-independent sketch."""
    return jax.random.fold_in(noise_key, RMM_KEY_TAG)


def _diagnostics_fn(loss_fn):
    """Jitted ``fn(params, batch, mask) -> {"rmm/<layer>/<d2_sgd | d2_rmm | alpha>": scalar}``: paper 002's
    diagnostics (:func:`dpzero_jax.rmm_diagnostics.diagnostics_fn`; eqs. 9, 11, 13) of every RMM layer, from its
    exact input and the output gradient of the mean loss over the batch's real examples, in float32. One extra
    forward and backward pass; the exact RMM variances (``T^3`` for the orthogonal sketches) are left out."""
    diagnostics = rmm_diagnostics.diagnostics_fn(loss_fn, exact_variance=False)

    def fn(params, batch, mask):
        return {f"rmm/{path}/{field}": getattr(layer, field) for path, layer in diagnostics(params, batch, mask).items()
                for field in ("d2_sgd", "d2_rmm", "alpha")}

    return jax.jit(fn)


def request_cpu_devices(cfg: TrainConfig) -> None:
    """Ask for the virtual CPU devices this process needs (its share of the mesh); only effective before JAX's
    first operation, and irrelevant on GPU / TPU."""
    shape = _mesh_shape(cfg)
    if shape is None:
        return
    local = shape.size // (cfg.num_processes or 1)
    try:
        if jax.config.jax_num_cpu_devices < local:
            jax.config.update("jax_num_cpu_devices", local)
    except (RuntimeError, TypeError, ValueError):
        pass  # JAX already started: the devices that exist are used


def init_distributed(cfg: TrainConfig) -> None:
    """``jax.distributed.initialize`` for a multi-process run (no-op for a single process or if already done).

    Must run before JAX's first operation in every process. With ``coordinator`` / ``num_processes`` /
    ``process_id`` those are passed; with ``distributed=True`` alone JAX detects the cluster (SLURM, Open MPI, TPU
    pod). On CPU the cross-process collectives use gloo.
    """
    if not (cfg.distributed or cfg.coordinator is not None) or jax.distributed.is_initialized():
        return
    if cfg.num_processes == 1:
        return
    request_cpu_devices(cfg)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (RuntimeError, ValueError):
        pass
    if cfg.coordinator is not None:
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id)
    else:
        jax.distributed.initialize()


def _make_mesh(cfg: TrainConfig):
    """The ``("data", "fsdp")`` mesh of ``cfg`` over the default devices (None: one device, no mesh): from
    :func:`jax.make_mesh`, or hybrid ICI x DCN with ``dcn_mesh`` (:func:`sharding.make_mesh`)."""
    shape = _mesh_shape(cfg)
    if shape is None:
        return None
    request_cpu_devices(cfg)
    available = jax.devices()
    if shape.size > len(available):
        raise ValueError(f"devices={shape.size} but only {len(available)} {available[0].platform} device(s) exist; "
                         f"on a CPU, request virtual devices before JAX starts (the dpzero CLI does; in Python call "
                         f"jax.config.update('jax_num_cpu_devices', {shape.size}) right after importing jax)")
    dcn = None if cfg.dcn_mesh is None else sharding.parse_mesh(cfg.dcn_mesh, "dcn_mesh")
    return sharding.make_mesh(shape, dcn=dcn)
