"""Randomized-matmul (RMM) linear layers: memory-efficient backprop (paper 002), also under DP.

A linear layer ``y = x . W + b`` whose forward pass computes ``y`` exactly but keeps, for the backward pass, only
``X_proj = S^T X`` and the PRNG key of the sketch ``S`` (never ``S`` itself; see :mod:`dpzero_jax.sketch`). The
backward rematerialises ``S`` from the key and returns

* ``dL/dX = Y W^T`` exactly, ``dL/db = sum Y`` exactly;
* ``dL/dW ~= X_proj^T (S^T Y)``, an unbiased estimate of ``X^T Y`` (``E[S S^T] = I``),

with ``Y = dL/dy``. The activation memory of the layer input shrinks by ``rho = B_proj / n``.

Two layouts (``RMMConfig.projection``):

* ``"rows"`` (paper 002): ``n`` = the flattened batch x positions rows, ``X [n, F]``. Mixes examples: for non-DP
  training only (the DP engine refuses it).
* ``"tokens"`` (DP): ``n = T``, the positions of each example, one ``S [T, k]`` shared by the batch. Example ``i``'s
  weight gradient is estimated by ``G_i = (S^T a_i)^T (S^T g_i)``, which depends on example ``i`` only; under
  :func:`dpzero_jax.private_value_and_grad` the per-example norms are computed on, and the clipping applied to,
  exactly these ``G_i`` -- the gradient that is summed -- in every mode (``bk``, ``ghost``, ``fused``, ``vmap``;
  the mixed rule sees a ``k x k`` Gram). Each clipped ``C_i G_i`` has norm at most the threshold whatever ``S``
  is, and ``S`` is drawn independently of the data, so the sensitivity of the clipped sum, and therefore the
  privacy guarantee of the Gaussian mechanism, is unchanged. See :mod:`dpzero_jax.rules.rmm`.

The key is an explicit array: a fresh one must be supplied every step (:func:`keyed_objective`; reusing a key
reuses ``S``: each step's estimate stays unbiased but the steps' errors are correlated).

Use: ``convert_to_rmm(model, RMMConfig(sketch="gaussian", rate=0.2))`` swaps dense layers -- ``dz.layers.Linear`` /
``DenseGeneral``, and Flax's ``nnx.Linear`` / ``nnx.LinearGeneral`` -- for :class:`RMMDense` in place (same
parameters, same paths); then
``params, loss_for_key = keyed_objective(dz.models.classification_objective, model)`` and, in every step,
``loss_fn = loss_for_key(step_key)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpzero_jax import layers
from dpzero_jax import tape as tape_lib
from dpzero_jax.rules.linear import LINEAR, LinearSpec
from dpzero_jax.rules.rmm import RMM_LINEAR, RMMSpec, positions_view
from dpzero_jax.sketch import PROJECTIONS, SKETCHES, RMMConfig, as_key, project, sketch_matrix

__all__ = ["CONVERTIBLE", "PROJECTIONS", "SKETCHES", "RMMConfig", "RMMDense", "RMMKey", "RMMSpec", "convert_to_rmm",
           "fresh_keys", "keyed_objective", "randomized_dense", "rmm_dense", "sketch_matrix"]

Array = jax.Array


# ----------------------------------------------------------------------------------------------------------------
# The custom_vjp primitive (outside the DP engine: plain autodiff, and the engine's vmap mode).

def _rows_view(x: Array, n_in: int) -> Array:
    """``x [B, *T, *in] -> [n, F]`` with ``n = B * prod(T)``."""
    return x.reshape(-1, math.prod(x.shape[x.ndim - n_in:]))


def _kept(x: Array, key: Array, spec: RMMSpec) -> Array:
    """``X_proj``: ``[k, F]`` (rows) or ``[B, k, F]`` (tokens), in ``x.dtype``."""
    rows = spec.config.projection == "rows"
    view = _rows_view(x, spec.n_in) if rows else positions_view(x, spec.n_in)
    return project(key, view, spec.config.projected_size(view.shape[-2]), spec.config.sketch, after_x=rows)


def _dense(x, kernel, bias, n_in):
    return LINEAR.apply({"kernel": kernel, "bias": bias}, x, LinearSpec(n_in=n_in))


def after(value: Array, dependency: Array, batched: bool) -> Array:
    """``value`` with a data dependency on ``dependency``: ``value + 0 * (one entry of dependency)``.

    XLA schedules for concurrency on CPU and may otherwise run the whole forward pass before any projection
    (keeping every layer input alive: the memory RMM is meant to save) or every weight gradient after the whole
    backward pass; ``lax.optimization_barrier`` does not prevent this (it is removed before scheduling). XLA does
    not fold ``0 * x`` for floats, so the dependency stays. With ``batched`` the entry is taken per example
    (leading axis), so a non-finite example only ever touches itself.
    """
    if batched:
        entry = dependency.reshape(dependency.shape[0], -1)[:, 0].reshape((-1,) + (1,) * (value.ndim - 1))
    else:
        entry = dependency.reshape(-1)[0]
    return value + (entry * 0).astype(value.dtype)


def _randomized_dense_fwd(x, kernel, bias, key, spec: RMMSpec):
    y = _dense(x, kernel, bias, spec.n_in)
    x_proj = _kept(x, key, spec)
    # y (the next layer's input) only once X_proj exists, so that x can be freed right away
    y = after(y, x_proj, batched=spec.config.projection == "tokens")
    return y, (x_proj, key, kernel, bias)


def _randomized_dense_bwd(spec: RMMSpec, residuals, g):
    x_proj, key, kernel, bias = residuals
    n_in = spec.n_in
    in_shape, out_shape = kernel.shape[:n_in], kernel.shape[n_in:]
    lead = g.shape[:g.ndim - len(out_shape)]
    w2 = kernel.reshape(math.prod(in_shape), math.prod(out_shape))
    g_flat = g.reshape(lead + (w2.shape[1],))
    dx = jnp.matmul(g_flat, w2.T.astype(g.dtype)).reshape(lead + in_shape).astype(x_proj.dtype)
    if spec.config.projection == "rows":
        g_view = g_flat.reshape(-1, w2.shape[1])                                    # [n, P]
    else:
        g_view = g_flat.reshape(g.shape[0], -1, w2.shape[1])                        # [B, T, P]
    g_proj = project(key, g_view, x_proj.shape[-2], spec.config.sketch, after_x=spec.config.projection == "rows")
    dw = jnp.einsum("...kf,...kp->fp", x_proj, g_proj.astype(x_proj.dtype), preferred_element_type=jnp.float32)
    dbias = None
    if bias is not None:
        dbias = jnp.sum(g_flat.reshape(-1, w2.shape[1]), axis=0, dtype=jnp.float32).reshape(out_shape)
        dbias = dbias.astype(bias.dtype)
    dx = after(dx, dw, batched=False)     # dL/dx (the backward's next input) only once g has been used for dW
    return dx, dw.reshape(kernel.shape).astype(kernel.dtype), dbias, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _randomized_dense(x, kernel, bias, key, spec: RMMSpec):
    return _dense(x, kernel, bias, spec.n_in)


_randomized_dense.defvjp(_randomized_dense_fwd, _randomized_dense_bwd)


def randomized_dense(x: Array, kernel: Array, bias: Array | None, key, spec: RMMSpec) -> Array:
    """``x [B, *T, *in] . kernel [*in, *out] (+ bias [*out]) -> [B, *T, *out]``, exactly, with the randomized
    weight gradient of paper 002 (Algorithm 1) under ``jax.grad`` / ``jax.vjp``.

    Residuals: ``X_proj`` (``[k, F]`` for ``projection="rows"``, ``[B, k, F]`` for ``"tokens"``), the key, the
    kernel (for ``dL/dx``) and the bias (for its dtype) -- not ``x``. ``key``: a typed or raw PRNG key, an array
    argument (no cotangent).
    """
    if not isinstance(spec, RMMSpec):
        raise TypeError(f"spec must be an RMMSpec, got {type(spec).__name__}")
    return _randomized_dense(x, kernel, bias, as_key(key), spec)


def rmm_dense(x: Array, kernel: Array, bias: Array | None, key, *, config: RMMConfig, n_in: int = 1) -> Array:
    """The RMM linear primitive: ``x [B, *T, *in] . kernel [*in, *out] (+ bias [*out]) -> [B, *T, *out]``.

    Outside the DP engine: :func:`randomized_dense`. Inside :func:`dpzero_jax.private_value_and_grad` (a tape is
    active): the ``rmm_linear`` rule, whose per-example estimates the engine norms and clips (``config.projection``
    must then be ``"tokens"``; the rule refuses ``"rows"``).
    """
    if not isinstance(config, RMMConfig):
        raise TypeError(f"config must be an RMMConfig, got {type(config).__name__}")
    spec = RMMSpec(config=config, n_in=n_in)
    active = tape_lib.current()
    if active is None:
        return randomized_dense(x, kernel, bias, key, spec)
    return active.call(RMM_LINEAR, spec, {"kernel": kernel, "bias": bias, "key": as_key(key)}, x)


# ----------------------------------------------------------------------------------------------------------------
# NNX module and model conversion.

class RMMKey(nnx.Variable):
    """The PRNG key of an RMM layer's sketch: state, not a parameter (replaced every step by :func:`fresh_keys`)."""


class RMMDense(nnx.Module):
    """RMM linear layer ``[B, *T, *in_shape] -> [B, *T, *out_shape]`` (kernel ``[*in_shape, *out_shape]``).

    Holds ``kernel`` and ``bias`` (``nnx.Param``, same names and shapes as ``dz.layers.Linear`` / ``DenseGeneral`` and
    ``nnx.Linear`` / ``LinearGeneral``), the sketch key (:class:`RMMKey`) and its :class:`RMMConfig`; ``dtype``:
    the compute dtype the input, kernel and bias are cast to (``None``: the input's; a converted ``nnx.Linear``
    keeps its own). Build one from scratch with :meth:`create` or from an existing layer with :meth:`from_layer`
    (what :func:`convert_to_rmm` does).
    """

    def __init__(self, kernel: nnx.Param, bias: nnx.Param | None, key, config: RMMConfig, *, n_in: int = 1,
                 dtype=None):
        if not isinstance(config, RMMConfig):
            raise TypeError(f"config must be an RMMConfig, got {type(config).__name__}")
        if not 1 <= n_in < kernel[...].ndim:
            raise ValueError(f"n_in={n_in} must leave at least one output axis of the kernel {kernel[...].shape}")
        self.kernel, self.bias = kernel, bias
        self.key = RMMKey(as_key(key))
        self.config, self.n_in = config, n_in
        self.dtype = None if dtype is None else jnp.dtype(dtype).name

    @classmethod
    def create(cls, in_shape: int | Sequence[int], out_shape: int | Sequence[int], config: RMMConfig, *,
               use_bias: bool = True, kernel_init=None, rngs: nnx.Rngs) -> RMMDense:
        """A freshly initialised layer (LeCun-normal kernel, zero bias), like ``dz.layers.DenseGeneral``."""
        in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
        out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
        init = kernel_init or nnx.initializers.normal(stddev=1.0 / math.sqrt(math.prod(in_shape)))
        kernel = nnx.Param(init(rngs.params(), in_shape + out_shape, jnp.float32))
        bias = nnx.Param(jnp.zeros(out_shape, jnp.float32)) if use_bias else None
        return cls(kernel, bias, rngs.params(), config, n_in=len(in_shape))

    @classmethod
    def from_layer(cls, layer: layers.Linear | layers.DenseGeneral | nnx.Linear | nnx.LinearGeneral, config: RMMConfig,
                   key) -> RMMDense:
        """The RMM version of a dense layer (:data:`CONVERTIBLE`) with the same parameter values (and, for Flax's
        own layers, the same compute dtype)."""
        in_shape, out_shape, dtype = _dense_layout(layer)
        kernel = layer.kernel[...]
        if tuple(kernel.shape) != in_shape + out_shape:
            raise ValueError(f"RMM layers replace unstacked dense layers; this one's kernel has shape "
                             f"{tuple(kernel.shape)} (stacked for a scan, e.g. GPT2Config.scan_layers or "
                             "LlamaConfig.scan_layers): build the model unrolled to use RMM")
        bias = None if layer.bias is None else nnx.Param(layer.bias[...])
        return cls(nnx.Param(kernel), bias, key, config, n_in=len(in_shape), dtype=dtype)

    def __call__(self, x: Array) -> Array:
        kernel = self.kernel[...]
        bias = None if self.bias is None else self.bias[...]
        if self.dtype is not None:   # as Flax's dense layers promote: input and weights in the compute dtype
            x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
            bias = None if bias is None else bias.astype(self.dtype)
        return rmm_dense(x, kernel, bias, self.key[...], config=self.config, n_in=self.n_in)


# The dense layers convert_to_rmm converts: this project's and Flax NNX's own.
CONVERTIBLE = (layers.Linear, layers.DenseGeneral, nnx.Linear, nnx.LinearGeneral)


def _dense_layout(layer) -> tuple[tuple[int, ...], tuple[int, ...], str | None]:
    """``(in_shape, out_shape, compute dtype)`` of a dense layer of :data:`CONVERTIBLE`; a layer whose computation an
    RMM layer would not reproduce (a custom ``dot_general``, ``precision``, contracted axes that are not the
    trailing ones, batch axes) is refused with the reason."""
    if isinstance(layer, (layers.Linear, layers.DenseGeneral)):
        in_shape, out_shape = layers.dense_shapes(layer)
        return tuple(in_shape), tuple(out_shape), None
    if not isinstance(layer, (nnx.Linear, nnx.LinearGeneral)):
        raise TypeError(f"RMM layers replace dz.layers.Linear / DenseGeneral or nnx.Linear / LinearGeneral, got "
                        f"{type(layer).__name__}")
    name = type(layer).__name__
    for attribute in ("dot_general", "dot_general_cls", "precision", "preferred_element_type"):
        if getattr(layer, attribute, None) not in (None, jax.lax.dot_general):   # Flax's defaults
            raise ValueError(f"cannot convert this nnx.{name} to an RMM layer: it sets {attribute}="
                             f"{getattr(layer, attribute)!r}, which an RMM layer does not reproduce")
    if isinstance(layer, nnx.Linear):
        in_shape, out_shape = (layer.in_features,), (layer.out_features,)
    else:
        in_shape, out_shape = tuple(layer.in_features), tuple(layer.out_features)
        trailing = tuple(range(-len(in_shape), 0))
        if tuple(layer.axis) != trailing or layer.batch_axis:
            raise ValueError(f"cannot convert this nnx.LinearGeneral to an RMM layer: it contracts axes "
                             f"{tuple(layer.axis)} with batch axes {dict(layer.batch_axis)}; RMM layers contract the "
                             f"trailing axes {trailing} only")
    return in_shape, out_shape, None if layer.dtype is None else jnp.dtype(layer.dtype).name


def _path_name(path) -> str:
    return "/".join(str(p) for p in path)


def convert_to_rmm(model: nnx.Module, config: RMMConfig | None = None, *, sketch: str | None = None,
                   rate: float | None = None, private: bool | None = None,
                   where: Callable[[str, nnx.Module], bool] | None = None, seed: int = 0) -> nnx.Module:
    """Swap the dense layers of ``model`` (:data:`CONVERTIBLE`: ``dz.layers.Linear`` / ``DenseGeneral``, ``nnx.Linear``
    / ``nnx.LinearGeneral``) for :class:`RMMDense`, in place.

    Give ``config``, or ``sketch`` and ``rate`` (then ``private`` picks the layout: ``True`` -> ``"tokens"``, the
    DP variant; ``False`` -> ``"rows"``, paper 002). ``where(path, layer)`` selects the layers to convert (path
    like ``"h/0/mlp/c_fc"``); by default all. Parameter values and paths are kept (``.../kernel``,
    ``.../bias``), so optimizers, clipping groups and checkpoints are unaffected. Layer ``j`` (in
    ``nnx.iter_modules`` order) gets the initial key ``fold_in(key(seed), j)``. Returns the model (a converted
    layer itself when ``model`` is one).
    """
    if config is None:
        if sketch is None or rate is None or private is None:
            raise ValueError("convert_to_rmm needs config=RMMConfig(...), or sketch, rate and private")
        config = RMMConfig(sketch=sketch, rate=rate, projection="tokens" if private else "rows")
    elif sketch is not None or rate is not None or private is not None:
        raise ValueError("convert_to_rmm: give either config or sketch/rate/private, not both")
    targets = [(path, m) for path, m in nnx.iter_modules(model)
               if isinstance(m, CONVERTIBLE) and (where is None or where(_path_name(path), m))]
    base = jax.random.key(seed)
    for j, (path, layer) in enumerate(targets):
        new = RMMDense.from_layer(layer, config, jax.random.fold_in(base, j))
        if not path:
            return new
        parent = model
        for name in path[:-1]:
            parent = parent[name] if isinstance(name, int) else getattr(parent, name)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
    return model


def rmm_layers(model: nnx.Module) -> dict[str, RMMDense]:
    """``{path: layer}`` of the RMM layers of ``model``."""
    return {_path_name(path): m for path, m in nnx.iter_modules(model) if isinstance(m, RMMDense)}


def fresh_keys(keys: nnx.State, step_key) -> nnx.State:
    """``keys`` (the :class:`RMMKey` state of a model, ``nnx.split(model, RMMKey, ...)[1]``) with leaf ``j``
    replaced by ``fold_in(step_key, j)``: independent sketches per layer, a pure function of the step key."""
    leaves, treedef = jax.tree.flatten(keys)
    step_key = as_key(step_key)
    return jax.tree.unflatten(treedef, [jax.random.fold_in(step_key, j) for j in range(len(leaves))])


def keyed_objective(objective: Callable, model: nnx.Module, *args: Any, **kwargs: Any):
    """``(params, loss_for_key)`` for a model with RMM layers; ``loss_for_key(step_key)`` is the objective's
    ``loss_fn(params, batch) -> [B]`` with fresh sketch keys (:func:`fresh_keys`).

    ``objective`` is one of :mod:`dpzero_jax.models.objectives` (``classification_objective``, ``lm_objective``)
    or anything with the same contract ``objective(model, *args, **kwargs) -> (params, loss_fn)``. Call
    ``loss_for_key`` inside the jitted step with a traced key, e.g. ``fold_in(rmm_root, step)``.
    """
    params, _ = objective(model, *args, **kwargs)
    graphdef, keys, rest = nnx.split(model, RMMKey, ...)

    def loss_for_key(step_key):
        keyed_model = nnx.merge(graphdef, fresh_keys(keys, step_key), rest)
        return objective(keyed_model, *args, **kwargs)[1]

    return params, loss_for_key
