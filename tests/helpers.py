"""Tiny models, batches and comparison helpers shared by the tests (setups are cached per session)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import reference as ref
from flax import nnx
from jax.extend import core as jcore

import dpzero_jax as dz
from dpzero_jax.models.transformer import DP_LAYERS

B = 5  # batch size of the model setups (3 does not divide it: microbatch padding is exercised)


@dataclasses.dataclass
class Setup:
    name: str
    params: Any
    loss_fn: Callable
    batch: Any
    layer_order: tuple[str, ...]   # layers (parameter parent paths) in forward order

    @functools.cached_property
    def grads(self) -> dict[str, np.ndarray]:
        """Reference per-example gradients ``{path: [B, ...]}``."""
        return ref.per_example_grads(self.loss_fn, self.params, self.batch)

    @functools.cached_property
    def losses(self) -> np.ndarray:
        return ref.per_example_losses(self.loss_fn, self.params, self.batch)

    def reference(self, groups, clip_fn, **kwargs):
        return ref.private_grads(self.grads, groups, clip_fn, layer_order=self.layer_order, **kwargs)

    def group_norms(self, groups) -> np.ndarray:
        group_of, names = ref.group_assignment(groups, list(self.grads), self.layer_order)
        return ref.group_norms(self.grads, group_of, names)


def build(module_cls, config, seed: int):
    """``module_cls(config, rngs=nnx.Rngs(seed))`` with its initialisation compiled as one program (much faster than
    running the initialisers op by op)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: module_cls(config, rngs=nnx.Rngs(seed))))
    state = ref.jit(lambda: nnx.split(module_cls(config, rngs=nnx.Rngs(seed)))[1])()
    return nnx.merge(graphdef, state)


GPT2_LAYERS = ("wte", "wpe", "h/0/ln_1", "h/0/attn/c_attn", "h/0/attn/c_proj", "h/0/ln_2", "h/0/mlp/c_fc",
               "h/0/mlp/c_proj", "ln_f")


@functools.cache
def gpt2(tied: bool = True, dz_nn: bool = False) -> Setup:
    """The bundled GPT-2 (Flax layers: the program front-end), or with ``dz_nn`` the same model from ``dz.layers``
    layers (``layers=DP_LAYERS``: the layers front-end)."""
    config = dz.models.GPT2Config(vocab_size=23, n_positions=12, n_embd=16, n_layer=1, n_head=2,
                                  tie_word_embeddings=tied)
    cls = functools.partial(dz.models.GPT2, layers=DP_LAYERS) if dz_nn else dz.models.GPT2
    model = build(cls, config, 1 if tied else 2)
    params, loss_fn = dz.models.lm_objective(model)
    ids = jnp.asarray(np.random.default_rng(10).integers(0, config.vocab_size, (B, 10)), jnp.int32)
    layers = GPT2_LAYERS + (() if tied else ("lm_head",))
    name = f"gpt2-{'dz-nn-' if dz_nn else ''}{'tied' if tied else 'untied'}"
    return Setup(name, params, loss_fn, {"input_ids": ids}, layers)


@functools.cache
def vit() -> Setup:
    config = dz.models.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_classes=5)
    model = build(dz.models.ViT, config, 3)
    params, loss_fn = dz.models.classification_objective(model)
    rng = np.random.default_rng(11)
    batch = {"image": jnp.asarray(rng.standard_normal((B, 8, 8, 3)), jnp.float32),
             "label": jnp.asarray(rng.integers(0, 5, (B,)), jnp.int32)}
    layers = ("patch_embed", "cls_token", "position", "blocks/0/ln_1", "blocks/0/attn/c_attn",
              "blocks/0/attn/c_proj", "blocks/0/ln_2", "blocks/0/mlp/c_fc", "blocks/0/mlp/c_proj", "ln", "head")
    return Setup("vit", params, loss_fn, batch, layers)


def mlp_batch(seed: int, batch_size: int = B, in_features: int = 12, num_classes: int = 5, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return {"x": np.asarray(scale * rng.standard_normal((batch_size, in_features)), np.float32),
            "label": np.asarray(rng.integers(0, num_classes, (batch_size,)), np.int32)}


@functools.cache
def mlp() -> Setup:
    model = build(dz.models.MLP, dz.models.MLPConfig(in_features=12, hidden=(16, 16), num_classes=5), 4)
    params, loss_fn = dz.models.classification_objective(model, input_key="x")
    return Setup("mlp", params, loss_fn, mlp_batch(12, scale=2.0), ("layers/0", "layers/1", "head"))


class LayersMLP(nnx.Module):
    """``dz.models.MLP`` built from ``dz.layers.Linear`` layers: planned by the layers front-end (its own features --
    fused mode's refusals, auto's memory budget, autotune -- are tested on it)."""

    def __init__(self, config: dz.models.MLPConfig, *, rngs: nnx.Rngs):
        widths = (config.in_features,) + tuple(config.hidden)
        self.layers = nnx.List([dz.layers.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])])
        self.head = dz.layers.Linear(widths[-1], config.num_classes, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers:
            x = jax.nn.tanh(layer(x))
        return self.head(x)


@functools.cache
def layers_mlp() -> Setup:
    model = build(LayersMLP, dz.models.MLPConfig(in_features=12, hidden=(16, 16), num_classes=5), 4)
    params, loss_fn = dz.models.classification_objective(model, input_key="x")
    return Setup("layers-mlp", params, loss_fn, mlp_batch(12, scale=2.0), ("layers/0", "layers/1", "head"))


SETUPS = {"gpt2-tied": lambda: gpt2(True), "gpt2-untied": lambda: gpt2(False),
          "gpt2-dz-nn-tied": lambda: gpt2(True, True), "gpt2-dz-nn-untied": lambda: gpt2(False, True), "vit": vit,
          "mlp": mlp}


def private_fn(loss_fn, cfg, *, use_jit: bool = True):
    fn = dz.private_value_and_grad(loss_fn, cfg)
    return ref.jit(fn) if use_jit else fn


def assert_grads_close(actual_tree, expected: dict[str, np.ndarray], rtol: float = 1e-4, floor: float = 1e-6):
    """Leaf-wise ``|a - e| <= floor * max|e| + rtol * |e|``; the pytree must carry exactly the expected paths."""
    actual = ref.flat(actual_tree)
    assert sorted(actual) == sorted(expected)
    for path, e in expected.items():
        a = actual[path]
        assert a.shape == e.shape, path
        assert np.all(np.isfinite(a)), path
        scale = float(np.max(np.abs(e)))
        np.testing.assert_allclose(a, e, rtol=rtol, atol=floor * scale + 1e-30, err_msg=path)


def squeeze_groups(x: np.ndarray) -> np.ndarray:
    """Reference ``[B, M]`` as the engine reports it: ``[B]`` when ``M == 1``."""
    return x[:, 0] if x.shape[1] == 1 else x


def check_private(setup: Setup, *, clip_fn: str, groups, mode: str, mask=None, include=None, divisor=None,
                  thresholds=None, nonfinite: int = 0, rtol: float = 1e-4, norm_rtol: float = 1e-5, floor: float = 1e-6,
                  **cfg_kwargs):
    """Noiseless private gradient of ``setup`` in ``mode`` against the reference; returns the engine's stats.

    The threshold splits the reference group norms (some examples clipped, some not) unless ``thresholds`` is given.
    include: the examples the reference keeps (default all); ``nonfinite``: how many the engine must report as
    non-finite. Norms are compared on the included examples, clip factors and gradients on all; ``floor``: the
    absolute tolerance of each leaf as a fraction of its largest entry (fp32 sums with cancellation).
    """
    norms = setup.group_norms(groups)
    n_groups = norms.shape[1]
    if thresholds is None:
        r = ref.split_threshold(norms)
        max_grad_norm = r * np.sqrt(n_groups)
    else:
        max_grad_norm = 1.0
        cfg_kwargs["group_thresholds"] = tuple(thresholds)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=float(max_grad_norm), clip_fn=clip_fn, groups=groups,
                      mode=mode, expected_batch_size=divisor, **cfg_kwargs)
    losses, grads, stats = private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0), mask)
    expected, ref_norms, ref_coef = setup.reference(groups, clip_fn, max_grad_norm=max_grad_norm,
                                                    thresholds=thresholds, include=include, divisor=divisor)
    keep = np.ones(B, bool) if include is None else np.asarray(include, bool)
    if thresholds is None and clip_fn != "automatic":
        clipped = ref_coef[keep] < 1
        assert clipped.any() and not clipped.all(), "test setup: the threshold should clip only some examples"
    np.testing.assert_allclose(losses, setup.losses, rtol=1e-5)
    assert stats.norms.shape == squeeze_groups(ref_norms).shape
    np.testing.assert_allclose(np.asarray(stats.norms)[keep], squeeze_groups(ref_norms)[keep], rtol=norm_rtol)
    np.testing.assert_allclose(stats.clip_factors, squeeze_groups(ref_coef), rtol=norm_rtol, atol=1e-7,
                               err_msg="clip factors")
    assert_grads_close(grads, expected, rtol=rtol, floor=floor)
    assert int(stats.num_included) == int(np.sum(keep))
    assert int(stats.num_nonfinite) == nonfinite
    return stats


def subprocess_env(devices: int | None = None) -> dict[str, str]:
    """The environment for a ``python -m dpzero_jax`` subprocess: this one's, with conftest's 8-device flag removed
    from ``XLA_FLAGS`` (its other flags kept) and, with ``devices``, that many virtual CPU devices instead."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    if devices is not None:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags}


def dense_setup(width: int, length: int, key_seed: int, data_seed: int) -> Setup:
    """``tanh(x @ w).mean(T) @ head`` in plain JAX: a ``[width, width]`` weight at ``length`` positions."""
    keys = jax.random.split(jax.random.key(key_seed), 2)
    params = {"w": jax.random.normal(keys[0], (width, width)) / np.sqrt(width),
              "head": jax.random.normal(keys[1], (width, 3)) / np.sqrt(width)}
    rng = np.random.default_rng(data_seed)
    batch = {"x": jnp.asarray(rng.standard_normal((B, length, width)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p["w"]).mean(1)
        return -jnp.take_along_axis(jax.nn.log_softmax(h @ p["head"]), b["y"][:, None], 1)[:, 0]
    return Setup("dense", params, loss_fn, batch, ())


def shapes_in(jaxpr) -> set:
    """The shapes of every value a jaxpr and its sub-jaxprs compute."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in jcore.jaxprs_in_params(eqn.params):
            shapes |= shapes_in(sub)
    return shapes


def per_example_shapes(setup: Setup, cfg, weight_shape: tuple) -> set:
    """Shapes in the traced private step that hold a ``weight_shape`` gradient per example (leading axes of more
    than one element before it; a ``[1, rows, cols]`` sum is not one)."""
    jaxpr = jax.make_jaxpr(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                          jax.random.key(0))
    n = len(weight_shape)
    return {s for s in shapes_in(jaxpr.jaxpr) if s[-n:] == weight_shape and len(s) > n and np.prod(s[:-n]) > 1}


def experiment_module(name: str):
    """``experiments/<name>.py`` loaded as the module ``name`` (registered in ``sys.modules``, so a second load
    reuses the first), for tests of the benchmarks' helpers."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parents[1] / "experiments"
                                                      / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
