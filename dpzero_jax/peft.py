"""Parameter-efficient fine-tuning (PEFT): LoRA, BiTFiT and linear probing of models built from DP layers or from
Flax's own (``nnx.Linear`` / ``nnx.LinearGeneral`` targets).

:func:`apply` turns a model into ``(model, trainable)``: the model to train (for LoRA a copy with adapters inserted;
the input model is never modified) and the NNX filter of its trainable parameters, which the objectives take::

    model, trainable = dz.peft.apply(model, "lora", rank=8, alpha=16.0, key=jax.random.key(1))
    params, loss_fn = dz.models.classification_objective(model, trainable=trainable)

Everything the filter leaves out stays in the model and is closed over by ``loss_fn`` as a constant. The engine
recognises parameters by identity as leaves of ``params``, so a frozen weight is not a parameter at all: a layer call
without trainable arrays is an ordinary computation (no probe, sink, norm, per-example or clipped gradient), and
frozen weights appear nowhere in the gradient pytree (nothing to communicate or to update).

Methods:

* ``"lora"``: each targeted dense layer ``y = base(x)`` becomes ``base(x) + (alpha / rank) * B(A(x))`` with
  ``A: [*in, rank]`` (``N(0, 1/fan_in)`` from ``key``) and ``B: [rank, *out]`` (zeros, so the model's function is
  unchanged at the start). ``A`` and ``B`` are DP dense layers (:class:`~dpzero_jax.layers.DenseGeneral` without bias):
  the linear rule gives their exact per-example norms (``A``'s input is ``x``, ``B``'s input is ``A x``). Only ``A``
  and ``B`` train; the base kernel and bias are frozen.
* ``"bitfit"``: every parameter named ``bias`` trains -- dense layers and LayerNorms alike (BiTFiT trains the biases
  of all layers) -- nothing else. A bias's per-example gradient is ``sum_t g_t``: book-keeping keeps the output
  gradient and no layer input for these calls (on either front end).
* ``"linear-probe"``: the parameters of the classification head (``head``, default ``head`` or ``lm_head``) train,
  nothing else. A tied LM head (the embedding table) cannot be probed alone.
* ``"full"``: every ``nnx.Param`` trains (the model is returned unchanged).

``also_train`` adds parameters trained in full to any method (e.g. a new classification head next to LoRA).

Patterns (``targets``, ``head``, ``also_train``) are regular expressions matched against whole trailing components
of a ``/``-joined path, and select a module or parameter together with everything under it: ``"c_attn"`` selects
``blocks/0/attn/c_attn``, ``"attn"`` every projection of every attention module, ``"layers/\\d+"`` the hidden
layers of the MLP, ``"head"`` the parameters ``head/kernel`` and ``head/bias`` (but not ``lm_head``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax import layers
from dpzero_jax.models import llama, transformer
from dpzero_jax.options import OptionGroup, choice, integer, number, option, patterns

METHODS = ("full", "lora", "bitfit", "linear-probe")
PEFT_METHODS = ("none", "lora", "bitfit", "linear-probe")   # a training run's ``peft`` option ("none": "full")
LORA_RANK = integer(1, "a positive int")   # add_lora's rank and PeftOptions.lora_rank
LORA_ALPHA = number()
DEFAULT_HEAD = "head|lm_head"
DENSE_TYPES = (layers.Linear, layers.DenseGeneral, nnx.Linear, nnx.LinearGeneral)

Path = tuple  # an NNX path: a tuple of attribute names (str) and list indices (int)


def path_name(path: Path) -> str:
    """``("blocks", 0, "attn")`` -> ``"blocks/0/attn"``."""
    return "/".join(str(k) for k in path)


@dataclasses.dataclass(frozen=True)
class Trainable:
    """NNX filter selecting the parameters (``nnx.Param``) at ``paths``; pass it as ``trainable=`` to an objective."""

    paths: frozenset[Path]

    def __call__(self, path: Path, value) -> bool:
        return isinstance(value, nnx.Param) and tuple(path) in self.paths

    @property
    def names(self) -> list[str]:
        """The selected parameters as sorted ``/``-joined paths."""
        return sorted(path_name(p) for p in self.paths)


class LoRA(nnx.Module):
    """A frozen dense layer with a low-rank adapter: ``base(x) + (alpha / rank) * lora_b(lora_a(x))``.

    ``x [B, *T, *in] -> [B, *T, *out]``; ``lora_a.kernel: [*in, rank]``, ``lora_b.kernel: [rank, *out]`` (with the
    leading axes of a stacked base kernel ``[*S, *in, *out]`` in front: ``[*S, *in, rank]``, ``[*S, rank, *out]``).
    """

    def __init__(self, base: layers.Linear | layers.DenseGeneral | nnx.Linear | nnx.LinearGeneral, *, rank: int,
                 alpha: float, key: jax.Array):
        in_shape, out_shape = layers.dense_shapes(base)
        self.base = base
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank
        rngs = nnx.Rngs(params=key)
        self.lora_a = layers.DenseGeneral(in_shape, (rank,), use_bias=False, rngs=rngs)
        self.lora_b = layers.DenseGeneral((rank,), out_shape, use_bias=False,
                                          kernel_init=nnx.initializers.zeros_init(), rngs=rngs)
        stack = layers.stacked_axes(base)
        if stack:   # a stacked (scanned) layer: one adapter per slice, drawn like the unstacked one
            init = nnx.initializers.normal(stddev=1.0 / math.sqrt(math.prod(in_shape)))
            self.lora_a.kernel = nnx.Param(init(jax.random.fold_in(key, 1), stack + in_shape + (rank,), jnp.float32))
            self.lora_b.kernel = nnx.Param(jnp.zeros(stack + (rank,) + out_shape, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


def _compile(pattern: str, what: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"peft: {what} patterns must be non-empty strings, got {pattern!r}")
    try:
        return re.compile(rf"(?:.*/)?(?:{pattern})")
    except re.error as error:
        raise ValueError(f"peft: {what} pattern {pattern!r} is not a valid regular expression: {error}") from None


def _selects(pattern: re.Pattern, path: Path) -> bool:
    """Whether ``pattern`` matches trailing components of ``path`` or of one of its ancestors."""
    names = [str(k) for k in path]
    return any(pattern.fullmatch("/".join(names[:k])) for k in range(1, len(names) + 1))


def _as_patterns(value, what: str) -> list[str]:
    patterns = [value] if isinstance(value, str) else list(value)
    if not patterns:
        raise ValueError(f"peft: {what} must name at least one pattern, got {value!r}")
    return patterns


def _params(model: nnx.Module) -> list[Path]:
    return [tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)]


def _select(paths: Sequence[Path], patterns: Sequence[str], what: str, available: str) -> list[Path]:
    """The paths selected by any of ``patterns``; every pattern must select something."""
    selected = []
    for pattern in patterns:
        compiled = _compile(pattern, what)
        hits = [p for p in paths if _selects(compiled, p)]
        if not hits:
            names = sorted(path_name(p) for p in paths)
            listing = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
            raise ValueError(f"peft: {what} pattern {pattern!r} matches no {available} of the model; "
                             f"{available}s: {listing or 'none'}")
        selected.extend(h for h in hits if h not in selected)
    return selected


def _dense_layers(model: nnx.Module) -> dict[Path, nnx.Module]:
    return {tuple(path): module for path, module in nnx.iter_modules(model) if isinstance(module, DENSE_TYPES)}


def default_lora_targets(model: nnx.Module) -> list[Path]:
    """The dense layers of the transformer blocks' attention and MLP if the model has any, else every dense layer."""
    modules = {tuple(path): module for path, module in nnx.iter_modules(model)}
    dense = [p for p, m in modules.items() if isinstance(m, DENSE_TYPES)]
    blocks = (transformer.Attention, transformer.MLP, llama.LlamaAttention, llama.LlamaMLP)
    in_blocks = [p for p in dense if any(isinstance(modules.get(p[:k]), blocks) for k in range(len(p)))]
    return sorted(in_blocks or dense, key=path_name)


def _node(model, path: Path):
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _replace(model, path: Path, new) -> None:
    parent, key = _node(model, path[:-1]), path[-1]
    if isinstance(key, int):
        parent[key] = new
    else:
        setattr(parent, key, new)


def _check_lora_options(rank, alpha, key):
    LORA_RANK(rank, "peft: LoRA rank")
    LORA_ALPHA(alpha, "peft: LoRA alpha")
    if key is None:
        raise ValueError("peft: LoRA needs key= (the PRNG key that initialises the adapters' A matrices)")


def add_lora(model: nnx.Module, *, rank: int, alpha: float, key: jax.Array,
             targets: str | Sequence[str] | None = None) -> tuple[nnx.Module, list[Path]]:
    """A copy of ``model`` with a :class:`LoRA` adapter around each targeted dense layer, and the adapter kernels'
    paths. ``targets``: patterns (module docstring), default :func:`default_lora_targets`."""
    _check_lora_options(rank, alpha, key)
    model = nnx.clone(model)
    dense = _dense_layers(model)
    if targets is None:
        chosen = default_lora_targets(model)
        if not chosen:
            raise ValueError("peft: the model has no dense layer (dpzero_jax.layers.Linear / DenseGeneral, "
                             "nnx.Linear / LinearGeneral) for LoRA")
    else:
        chosen = _select(list(dense), _as_patterns(targets, "LoRA target"), "LoRA target", "dense layer")
    chosen = sorted(chosen, key=path_name)
    keys = jax.random.split(key, len(chosen))
    adapters = []
    for path, layer_key in zip(chosen, keys):
        _replace(model, path, LoRA(dense[path], rank=int(rank), alpha=alpha, key=layer_key))
        adapters += [path + ("lora_a", "kernel"), path + ("lora_b", "kernel")]
    return model, adapters


def apply(model: nnx.Module, method: str | None, *, rank: int = 8, alpha: float = 16.0,
          targets: str | Sequence[str] | None = None, head: str | Sequence[str] = DEFAULT_HEAD,
          also_train: str | Sequence[str] = (), key: jax.Array | None = None) -> tuple[nnx.Module, Trainable]:
    """``(model, trainable)`` for PEFT ``method`` (``"lora"``, ``"bitfit"``, ``"linear-probe"``, ``"full"``/``None``).

    rank, alpha, targets, key: LoRA only (``key`` required). head: the linear-probe patterns. also_train: patterns of
    parameters trained in full in addition (any method). Pass ``trainable`` to
    :func:`~dpzero_jax.models.classification_objective` / ``lm_objective`` / ``logits_fn`` with the returned model.
    """
    method = "full" if method is None else method
    if method not in METHODS:
        raise ValueError(f"peft: unknown method {method!r}; expected one of {METHODS} (or None for 'full')")
    if targets is not None and method != "lora":
        raise ValueError(f"peft: targets={targets!r} applies to LoRA only, not to method {method!r}")
    if method == "lora":
        model, selected = add_lora(model, rank=rank, alpha=alpha, key=key, targets=targets)
    else:
        params = _params(model)
        if method == "full":
            selected = params
        elif method == "bitfit":
            selected = [p for p in params if p[-1] == "bias"]
            if not selected:
                raise ValueError("peft: BiTFiT needs bias parameters, but the model has none")
        else:
            try:
                selected = _select(params, _as_patterns(head, "head"), "head", "parameter")
            except ValueError as error:
                raise ValueError(f"{error} (linear probing trains the head alone; a tied LM head is the embedding "
                                 "table and cannot be probed alone)") from None
    extra = _as_patterns(also_train, "also_train") if also_train else []
    if extra:
        selected = selected + _select(_params(model), extra, "also_train", "parameter")
    return model, Trainable(frozenset(selected))


@dataclasses.dataclass(frozen=True)
class PeftOptions(OptionGroup):
    """A training run's parameter-efficient fine-tuning (a group of ``TrainConfig``): ``peft`` is ``"none"`` (every
    parameter trains), ``"lora"``, ``"bitfit"`` or ``"linear-probe"`` (:func:`apply`); ``lora_rank`` /
    ``lora_alpha`` (the checks of :func:`add_lora`) / ``lora_targets`` (path patterns; None: every dense layer but
    the head); ``peft_also_train``: patterns trained in full besides the method's (None: ``("head",)`` for LoRA and
    BiTFiT on a classifier, whose head is new; ``()``: nothing more)."""

    GROUP = "peft"

    peft: str = option("none", choice(PEFT_METHODS),
                       "parameter-efficient fine-tuning: which parameters train (default none: all)")
    lora_rank: int = option(8, LORA_RANK, "LoRA rank (default 8)")
    lora_alpha: float = option(16.0, LORA_ALPHA, "LoRA alpha (default 16)")
    lora_targets: tuple[str, ...] | None = option(
        None, patterns().or_none(), "comma-separated path patterns of the dense layers that get adapters")
    peft_also_train: tuple[str, ...] | None = option(
        None, patterns().or_none(), "comma-separated patterns trained in full besides the PEFT method's (default: "
        "head for lora/bitfit); 'none' for nothing")

    def _check_group(self, owner: str) -> None:
        if self.lora_targets is not None and self.peft != "lora":
            raise ValueError(f"{owner}.lora_targets applies to peft='lora' only, not peft={self.peft!r}")


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with every :class:`LoRA` adapter folded into its base layer: the base kernel becomes
    ``W + (alpha / rank) * A B`` (contracted over the rank) and the wrapper is replaced by the base layer, so the
    model has its original structure and function (e.g. for export). The input model is not modified."""
    model = nnx.clone(model)
    adapters = [tuple(path) for path, module in nnx.iter_modules(model) if isinstance(module, LoRA)]
    for path in sorted(adapters, key=len, reverse=True):  # innermost first (adapters are not nested in practice)
        lora = _node(model, path)
        base = lora.base
        stack = layers.stacked_axes(base)
        a, b = lora.lora_a.kernel[...], lora.lora_b.kernel[...]
        flat_a = a.reshape((math.prod(stack), -1, lora.rank))
        flat_b = b.reshape((math.prod(stack), lora.rank, -1))
        delta = jnp.matmul(flat_a, flat_b).reshape(base.kernel[...].shape)
        base.kernel.set_value(base.kernel[...] + lora.scale * delta.astype(base.kernel[...].dtype))
        if path:
            _replace(model, path, base)
        else:
            model = base
    return model
