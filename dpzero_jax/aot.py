"""A decoder's ZeRO training step compiled ahead of time for a target: its per-device memory as the compiler reports it.

:mod:`dpzero_jax.planner` estimates a step's memory from formulas; this module asks the compiler instead. It builds
the project's model for a :class:`~dpzero_jax.decoder_shapes.DecoderConfig` (or a checkpoint's ``config.json``) with
abstract weights (``nnx.eval_shape``: nothing is allocated), the training step the trainer runs (gradient, cast to
the float32 master, the ZeRO stage's gradient layout, ``optax.adam``; DP: :func:`dpzero_jax.private_value_and_grad`
with ``mode="auto"`` and the partitionable noise), lowers it with the ZeRO stage's shardings on a mesh of the
target's devices and compiles it. Nothing runs.

Targets: a TPU topology name (``"v5e:16x16"``, ``"v5p:4x4x8"``: compiled by ``libtpu`` on any host, TPU or not --
``pip install -e ".[tpu-aot]"`` in an environment of its own, see ``experiments/bench_compiled.py``), or
``"local"``: this process's own devices (a GPU host's GPUs; on a CPU host the CPU devices, whose compiler lays
buffers out otherwise than a TPU's or GPU's).

``dpzero plan ... --compile TARGET`` prints the figures beside the plan (:func:`compiled_memory` for the non-private
and the private step). The TPU compiler refuses some programs larger than a chip -- the refusal is then the result,
with the bytes it needed and the bytes the chip has (:class:`CompiledMemory` ``refused``) -- but not all of them, so
:attr:`CompiledMemory.fits` also compares the total with the device's memory (:func:`device_memory`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time

TPU_INSTALL_HINT = ('compiling for a TPU topology needs libtpu (the TPU compiler): pip install -e ".[tpu-aot]" in '
                    'an environment of its own (jax[tpu] at the version of jax)')
STRATEGIES = ("gspmd", "explicit")
# HBM per chip of the TPU generations a topology name starts with (Google Cloud's figures): what a `local` GPU's
# bytes_limit is for a GPU. A TPU target needs no such check: the TPU compiler refuses a step whose buffers need more
# than the chip's usable HBM (v5e: 15.75 of its 16 GiB), so a step it returns fits (CompiledMemory.fits)
TPU_HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 10**9, "v6e": 32 * 2**30}

# the TPU compiler's two out-of-memory phrasings: "Used 29.3G of 15.75G hbm" and "the total memory required for HLO
# temporaries (16.16G) exceeds available HBM (15.75G)"
_USED = (re.compile(r"Used\s+([\d.]+)([KMGT]?)\s+of\s+([\d.]+)([KMGT]?)\s+hbm", re.IGNORECASE),
         re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)",
                    re.IGNORECASE))
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def refusal(message: str) -> dict:
    """``{"used_bytes", "hbm_bytes"}`` stated by a TPU compiler's out-of-memory message, or ``{}``."""
    match = next((m for m in (pattern.search(message) for pattern in _USED) if m), None)
    if not match:
        return {}
    used, used_unit, hbm, hbm_unit = match.groups()
    return {"used_bytes": int(float(used) * _UNIT[used_unit.upper()]),
            "hbm_bytes": int(float(hbm) * _UNIT[hbm_unit.upper()])}


def is_oom(error: BaseException) -> bool:
    """Whether a compile failed for lack of memory (the compilers' phrasings)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text.lower()


def target_devices(target: str, count: int | None = None) -> list:
    """The devices a step is compiled for: a TPU topology's (``"v5e:16x16"``; ``count``, if given, must be their
    number) or, for ``"local"``, the first ``count`` of ``jax.devices()`` (all without ``count``)."""
    import jax

    if target == "local":
        if count is not None:   # on a CPU host, as many virtual devices (only before JAX's first operation)
            from dpzero_jax.train_setup import request_cpu_device_count

            request_cpu_device_count(count)
        devices = jax.devices()
        if count is not None and count > len(devices):
            raise ValueError(f"compile target 'local' has {len(devices)} {devices[0].platform} device(s), fewer than "
                             f"the {count} planned; plan for this host's devices or compile for a TPU topology")
        return devices if count is None else devices[:count]
    if not re.fullmatch(r"v\d+[a-z]*(?:-\w+)?:\d+(?:x\d+)+", target):
        raise ValueError(f"compile target {target!r}: expected 'local' or a TPU topology name such as 'v5e:16x16' "
                         "or 'v5p:4x4x8'")
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(TPU_INSTALL_HINT)
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name=target).devices
    except Exception as error:   # libtpu's own message names what it does not know
        raise ValueError(f"compile target {target!r}: libtpu does not describe this topology ({error})") from None
    if count is not None and count != len(devices):
        raise ValueError(f"compile target {target!r} has {len(devices)} chips; the plan is for {count} devices "
                         f"(pass --devices {len(devices)})")
    return list(devices)


def model_config(config, seq: int, remat: str):
    """The project's model config for a :class:`~dpzero_jax.decoder_shapes.DecoderConfig` (its sizes; layers
    scanned, ``remat`` as given): a ``GPT2Config`` (family ``gpt2``) or a ``LlamaConfig`` (``llama``: grouped
    queries, Qwen2's q/k/v biases, Gemma 2's sandwich norms; Gemma's embedding scaling and soft-caps are not in a
    DecoderConfig -- compile a checkpoint's ``config.json`` for them). A GPT-2's context covers ``seq``."""
    from dpzero_jax.models.gpt2 import GPT2Config
    from dpzero_jax.models.llama import LlamaConfig

    if config.family == "gpt2":
        return GPT2Config(vocab_size=config.vocab, n_positions=max(config.n_ctx, seq), n_embd=config.d_model,
                          n_layer=config.n_layer, n_head=config.n_head, n_inner=config.d_ff,
                          tie_word_embeddings=config.tied, scan_layers=True, remat=remat)
    return LlamaConfig(vocab_size=config.vocab, hidden_size=config.d_model, intermediate_size=config.mlp_width,
                       num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                       num_key_value_heads=config.n_kv_head, head_dim=config.head_dim,
                       max_position_embeddings=max(config.n_ctx, seq), qkv_bias=config.qkv_bias,
                       tie_word_embeddings=config.tied, sandwich_norms=config.sandwich_norms, scan_layers=True,
                       remat=remat)


def abstract_model(config, dtype, lora_rank: int = 0):
    """``(graphdef, params, frozen, trainable)`` of the model of ``config`` (a ``GPT2Config`` or ``LlamaConfig``)
    computing in ``dtype``, every array a ``jax.ShapeDtypeStruct``. With ``lora_rank`` the LoRA adapters on the
    default targets are the ``params`` and the base is ``frozen``, stored as the trainer stores it (a Llama's
    matrices in ``dtype``: ``train_step.matrices_in``)."""
    import jax
    from flax import nnx

    from dpzero_jax import peft
    from dpzero_jax.models.gpt2 import GPT2, GPT2Config
    from dpzero_jax.models.llama import Llama
    from dpzero_jax.train_step import matrices_in

    holder = {"filter": nnx.Param}

    def make():
        cls = GPT2 if isinstance(config, GPT2Config) else Llama
        model = cls(config, rngs=nnx.Rngs(0), dtype=dtype)
        if lora_rank:
            model, holder["filter"] = peft.apply(model, "lora", rank=lora_rank, key=jax.random.key(1))
        return model

    model = nnx.eval_shape(make)
    graphdef, params, frozen = nnx.split(model, holder["filter"], ...)
    if not isinstance(config, GPT2Config):
        frozen = jax.eval_shape(lambda f: matrices_in(f, dtype), frozen)
    return graphdef, params, frozen, holder["filter"]


def training_step(graphdef, params, trainable, rules, dp_config, strategy: str = "gspmd", learning_rate=1e-4):
    """``(step, tx)``: ``step(params, opt_state, batch, key, mask, frozen) -> (params, opt_state, loss)`` as the
    trainer's: the gradient of the masked batch (``dp_config``: a :class:`~dpzero_jax.DPConfig`, the private
    gradient; None: the mean loss's), cast to each parameter's dtype, laid out by ``rules.grads``, ``optax.adam``.
    ``strategy``: ``"gspmd"`` (one jit, the activations split over the batch: :func:`dpzero_jax.spmd.batch_sharded`)
    or ``"explicit"`` (:func:`dpzero_jax.sharding.explicit_private_gradient` / ``explicit_mean_gradient``).
    ``params``: the abstract trainable parameters the objective's model is rebuilt with (the frozen weights come as
    the step's argument)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dpzero_jax import sharding
    from dpzero_jax.engine import private_value_and_grad
    from dpzero_jax.models.objectives import lm_objective

    known = STRATEGIES + ("gspmd-nohint",)   # the last: gspmd without the activation hint (experiments only)
    if strategy not in known:
        raise ValueError(f"strategy must be one of {known}, got {strategy!r}")

    def objective(frozen):   # built inside the step: the frozen weights are its arguments, not constants
        _, fn = lm_objective(nnx.merge(graphdef, params, frozen), trainable=trainable)
        return fn

    def loss_of_frozen(q, batch, frozen):   # the explicit strategy's: the frozen weights enter its shard_map sharded
        return objective(frozen)(q, batch)

    if strategy == "explicit":
        def gradient(p, batch, key, mask, frozen):
            if dp_config is None:
                return sharding.explicit_mean_gradient(loss_of_frozen, rules, params)(p, batch, key, mask,
                                                                                      frozen=frozen)
            return sharding.explicit_private_gradient(loss_of_frozen, dp_config, rules, params)(
                p, batch, key, mask, frozen=frozen)
    elif dp_config is None:
        def gradient(p, batch, key, mask, frozen):
            def mean_loss(q):
                losses = objective(frozen)(q, batch)
                w = mask.astype(losses.dtype)
                return jnp.sum(losses * w) / jnp.maximum(jnp.sum(w), 1.0), losses
            (_, losses), grads = jax.value_and_grad(mean_loss, has_aux=True)(p)
            return losses, grads
    else:
        def gradient(p, batch, key, mask, frozen):
            losses, grads, _ = private_value_and_grad(objective(frozen), dp_config)(p, batch, key, mask)
            return losses, grads

    tx = optax.adam(learning_rate)
    grad_shardings = rules.grads(params)

    def step(p, opt_state, batch, key, mask, frozen):
        if strategy == "gspmd":   # activations split over the batch (dpzero_jax.spmd), as the trainer does
            with rules.gspmd_hint():
                losses, grads = gradient(p, batch, key, mask, frozen)
        else:
            losses, grads = gradient(p, batch, key, mask, frozen)
        grads = jax.tree.map(lambda g, q: g.astype(q.dtype), grads, p)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        updates, opt_state = tx.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        w = mask.astype(jnp.float32)
        return p, opt_state, jnp.sum(jnp.where(mask, losses.astype(jnp.float32), 0.0)) / jnp.maximum(jnp.sum(w), 1.0)

    return step, tx


def lower_step(step, tx, rules, params, frozen, global_batch: int, seq: int):
    """The jitted ``step`` lowered on abstract arguments with the rules' shardings (parameters and optimizer state
    donated, as the trainer donates them): ``(lowered, seconds)``."""
    import jax
    import jax.numpy as jnp

    opt_state = jax.eval_shape(tx.init, params)
    batch = {"input_ids": jax.ShapeDtypeStruct((global_batch, seq), jnp.int32)}
    mask = jax.ShapeDtypeStruct((global_batch,), jnp.bool_)
    key = jax.eval_shape(lambda: jax.random.key(0))
    shardings = (rules.params(params), rules.opt_state(opt_state), rules.batch(batch), rules.replicated,
                 rules.batch(mask), rules.params(frozen))
    args = (params, opt_state, batch, key, mask, frozen)
    args = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), args, shardings)
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1), in_shardings=shardings,
                      out_shardings=(shardings[0], shardings[1], rules.replicated)).lower(*args)
    return lowered, time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """One compiled step's bytes per device (``memory_analysis()``), or the compiler's refusal.

    ``total_bytes``: arguments + temporaries + the outputs not aliased to a donated argument, by
    ``memory_analysis()``'s accounting (``docs/planner.md`` compares it with the plan). ``peak_bytes``: the compiler's
    own high-water mark of the step's device memory (``peak_memory_in_bytes``; None where the compiler does not
    report one): the most bytes live at once. On a TPU the two differ: ``temp_size_in_bytes`` also counts buffers
    outside the HBM heap (the on-chip VMEM scratch among them), so the total can exceed a chip whose HBM holds the
    step (GPT-2 XL's private step without remat on 256 v5e chips: total 16.40 GiB, peak 15.06 GiB, accepted against
    the chip's usable 15.75 GiB). ``refused``: the compiler's out-of-memory message (then ``needed_bytes`` /
    ``available_bytes`` where it states them, the other figures None)."""

    target: str
    private: bool
    devices: int
    mesh: str
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    seconds: float = 0.0
    refused: str | None = None
    needed_bytes: int | None = None
    available_bytes: int | None = None
    hbm_bytes: int | None = None   # the device's memory where known (TPU_HBM_BYTES; a GPU's bytes_limit)
    peak_bytes: int | None = None  # the compiler's peak_memory_in_bytes, where it reports one

    @property
    def total_bytes(self) -> int | None:
        if self.refused is not None:
            return None
        return self.argument_bytes + self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0)

    @property
    def fits(self) -> bool | None:
        """Whether the step fits one device. A TPU target (a topology): the compiler's verdict -- it refuses a step
        whose buffers exceed the chip's usable HBM and returns one that fits (``bench_compiled.fits``, criterion
        ``"compiler"``). A local device: False if the total exceeds its memory (XLA:GPU allocates arguments,
        outputs and one temporary buffer of ``temp_size_in_bytes``); None where the device's memory is unknown
        (a CPU)."""
        if self.refused is not None:
            return False
        if not self.target.startswith("local"):
            return True
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}


def device_memory(target: str, device) -> int | None:
    """Bytes of memory of one device of ``target``: a TPU generation's HBM (:data:`TPU_HBM_BYTES`, by the topology
    name's prefix), a local device's ``bytes_limit`` where its runtime reports one (GPUs), else None (CPU)."""
    if target != "local":
        return TPU_HBM_BYTES.get(target.split(":")[0].split("-")[0])
    try:
        return int((device.memory_stats() or {})["bytes_limit"])
    except Exception:   # no statistics on this platform (CPU)
        return None


def compiled_memory(model, target: str, *, devices: int | None, batch: int, seq: int, precision: str = "bf16",
                    zero: int = 3, remat: str = "block", lora_rank: int = 0, shards: int | None = None,
                    private: bool = True, strategy: str = "gspmd") -> CompiledMemory:
    """The training step of ``model`` (a preset name, a checkpoint directory or ``config.json``, a JSON config file,
    a mapping or a :class:`~dpzero_jax.decoder_shapes.DecoderConfig`; a Llama-family or GPT-2 ``config.json`` is
    built exactly as the checkpoint loader builds it) compiled for ``target`` (see :func:`target_devices`) on a
    ``(data, fsdp)`` mesh with ``fsdp = shards`` (default: every device), ``batch`` sequences of ``seq`` tokens over
    all devices, weights at ``precision`` for compute (fp32 masters), ZeRO stage ``zero``, ``remat`` ``"none"`` /
    ``"block"`` / ``"dots"``, LoRA adapters of rank ``lora_rank`` (0: full fine-tuning). ``private``: the DP step
    (``mode="auto"``, noise included) or the plain mean gradient."""
    import jax

    from dpzero_jax import sharding
    from dpzero_jax.config import DPConfig
    from dpzero_jax.decoder_shapes import resolve_model
    from dpzero_jax.train_config import PRECISIONS

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    chips = target_devices(target, devices)
    count = len(chips)
    fsdp = count if shards is None else shards
    if fsdp < 1 or count % fsdp:
        raise ValueError(f"shards={fsdp} must divide the {count} devices")
    if batch % count:
        raise ValueError(f"batch={batch} must be a multiple of the {count} devices")
    config = _exact_config(model, seq, remat) or model_config(resolve_model(model), seq, remat)
    graphdef, params, frozen, trainable = abstract_model(config, PRECISIONS[precision], lora_rank)
    mesh = sharding.make_mesh(sharding.MeshShape(data=count // fsdp, fsdp=fsdp), devices=chips)
    rules = sharding.ShardingRules(mesh, zero)
    platform = "tpu" if target != "local" else jax.devices()[0].platform
    dp_config = None
    if private:
        dp_config = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, mode="auto", expected_batch_size=batch,
                             noise_rng="partitionable", target=platform if platform in ("cpu", "gpu", "tpu") else None)
    step, tx = training_step(graphdef, params, trainable, rules, dp_config, strategy)
    label = target if target != "local" else f"local:{platform}"
    mesh_text = f"data={count // fsdp},fsdp={fsdp}"
    hbm = device_memory(target, chips[0])
    start = time.perf_counter()
    try:
        lowered, _ = lower_step(step, tx, rules, params, frozen, batch, seq)
        memory = lowered.compile().memory_analysis()
    except Exception as error:
        if not is_oom(error):
            raise
        stated = refusal(str(error))
        return CompiledMemory(label, private, count, mesh_text, seconds=time.perf_counter() - start,
                              refused=" ".join(str(error).split())[:500], needed_bytes=stated.get("used_bytes"),
                              available_bytes=stated.get("hbm_bytes"), hbm_bytes=hbm)
    return CompiledMemory(label, private, count, mesh_text, int(memory.argument_size_in_bytes),
                          int(memory.output_size_in_bytes), int(memory.alias_size_in_bytes),
                          int(memory.temp_size_in_bytes), time.perf_counter() - start, hbm_bytes=hbm,
                          peak_bytes=int(getattr(memory, "peak_memory_in_bytes", 0) or 0) or None)


def _exact_config(model, seq: int, remat: str):
    """A checkpoint directory's or ``config.json``'s model config as the loader reads it (layers scanned, ``remat``),
    or None for anything else (a preset, a planner JSON, a mapping)."""
    import json
    from pathlib import Path

    if not isinstance(model, str):
        return None
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.name != "config.json" or not path.is_file():
        return None
    values = json.loads(path.read_text())
    if not isinstance(values, dict) or "model_type" not in values:
        return None
    from dpzero_jax.models import gpt2_hf, llama_hf

    if values["model_type"] in llama_hf.MODEL_TYPES:
        config = llama_hf.config_from_hf(values, scan_layers=True)
    elif values["model_type"] == "gpt2":
        config = gpt2_hf.config_from_hf(values, scan_layers=True)
        config = dataclasses.replace(config, n_positions=max(config.n_positions, seq))
    else:
        return None   # resolve_model refuses it with its message
    return dataclasses.replace(config, remat=remat)
