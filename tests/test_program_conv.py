"""Convolution kernels as factored ``conv`` sites of the program front-end, against ``vmap(grad)``.

nnx.Conv and linen Conv with strides, SAME / VALID / explicit padding, kernel and input dilation, feature groups
(2 and depthwise), 1-D and 2-D NHWC; plain ``lax.conv_general_dilated`` with NCHW / OIHW dimension numbers, inside
``lax.scan`` (a stacked and a shared kernel) and under ``jax.checkpoint``; the bundled CNN with one kernel by the
ghost norm and one instantiated. Norms rtol 1e-5, clipped sums rtol 1e-4. A convolution the rule does not take
(``batch_group_count > 1``) stays an exact ``local`` site.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import B, Setup, build, check_private

import dpzero_jax as dz
from dpzero_jax.models import CNN, CNNConfig, classification_objective
from dpzero_jax.program import mode as program_mode

H, C = 6, 4


def image_batch(seed: int, shape=(B, H, H, C), classes: int = 3):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.standard_normal(shape), jnp.float32),
            "y": jnp.asarray(rng.integers(0, classes, (B,)), jnp.int32)}


def class_loss(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), y[:, None], 1)[:, 0]


class NNXConvs(nnx.Module):
    """2-D NHWC convolutions of every kind on a ``[B, 6, 6, 4]`` image."""

    def __init__(self, rngs):
        self.strided = nnx.Conv(C, 6, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)          # -> 3x3
        self.valid = nnx.Conv(C, 6, (3, 2), padding="VALID", rngs=rngs)                            # -> 4x5
        self.explicit = nnx.Conv(C, 4, (2, 3), padding=((1, 0), (2, 1)), kernel_dilation=(2, 1),
                                 use_bias=False, rngs=rngs)                                          # -> 5x7
        self.upsampled = nnx.Conv(C, 4, (3, 3), input_dilation=(2, 2), padding=((1, 1), (1, 1)),
                                  rngs=rngs)                                                          # -> 11x11
        self.grouped = nnx.Conv(C, 6, (3, 3), feature_group_count=2, padding="SAME", rngs=rngs)    # -> 6x6
        self.depthwise = nnx.Conv(C, C, (3, 3), feature_group_count=C, padding="VALID", rngs=rngs)  # -> 4x4
        self.head = nnx.Linear(6 + 6 + 4 + 4 + 6 + C, 3, rngs=rngs)

    def __call__(self, x):
        branches = [self.strided, self.valid, self.explicit, self.upsampled, self.grouped, self.depthwise]
        pooled = [jnp.mean(jnp.tanh(conv(x)), axis=(1, 2)) for conv in branches]
        return self.head(jnp.concatenate(pooled, axis=-1))


@functools.cache
def nnx_setup() -> Setup:
    model = NNXConvs(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        return class_loss(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

    return Setup("nnx-convs", params, loss_fn, image_batch(1), ())


class LinenConvs(nn.Module):
    """1-D NWC convolutions on ``[B, 9, 4]``: strided VALID, dilated explicit, grouped, input-dilated."""

    @nn.compact
    def __call__(self, x):
        a = nn.Conv(6, (3,), strides=(2,), padding="VALID")(x)                                     # -> 4
        b = nn.Conv(4, (2,), kernel_dilation=(3,), padding=((2, 1),))(x)                            # -> 9
        c = nn.Conv(4, (3,), feature_group_count=2, padding="SAME", use_bias=False)(x)             # -> 9
        d = nn.Conv(4, (3,), input_dilation=(2,), padding=((1, 1),))(jnp.tanh(c))                 # -> 17
        pooled = [jnp.mean(jnp.tanh(h), axis=1) for h in (a, b, d)]
        return nn.Dense(3)(jnp.concatenate(pooled, axis=-1))


@functools.cache
def linen_setup() -> Setup:
    model = LinenConvs()
    batch = image_batch(2, (B, 9, C))
    params = ref.jit(model.init)(jax.random.key(1), batch["x"])["params"]

    def loss_fn(params, batch):
        return class_loss(model.apply({"params": params}, batch["x"]), batch["y"])

    return Setup("linen-convs", params, loss_fn, batch, ())


@functools.cache
def scan_setup(remat: bool = False) -> Setup:
    """Plain ``lax.conv_general_dilated`` (NCHW input, OIHW kernels) in a ``lax.scan`` over 3 layers: a stacked
    kernel (one per layer), a shared kernel (the same at every layer) and a grouped stacked kernel."""
    keys = jax.random.split(jax.random.key(3), 4)
    params = {"stacked": 0.3 * jax.random.normal(keys[0], (3, C, C, 3, 3)),
              "shared": 0.3 * jax.random.normal(keys[1], (C, C, 1, 3)),
              "grouped": 0.3 * jax.random.normal(keys[2], (3, C, C // 2, 2, 2)),
              "head": jax.random.normal(keys[3], (C, 3))}
    dn = ("NCHW", "OIHW", "NCHW")

    def loss_fn(p, batch):
        def block(h, kernels):
            stacked, grouped = kernels
            h = h + jnp.tanh(jax.lax.conv_general_dilated(h, stacked, (1, 1), "SAME", dimension_numbers=dn))
            h = h + jnp.tanh(jax.lax.conv_general_dilated(h, p["shared"], (1, 1), "SAME", dimension_numbers=dn))
            g = jax.lax.conv_general_dilated(h, grouped, (2, 2), "VALID", dimension_numbers=dn,
                                             feature_group_count=2)
            return h + jnp.mean(g, axis=(1, 2, 3), keepdims=True), None

        step = jax.checkpoint(block) if remat else block
        h, _ = jax.lax.scan(step, jnp.transpose(batch["x"], (0, 3, 1, 2)), (p["stacked"], p["grouped"]))
        return class_loss(jnp.mean(h, axis=(2, 3)) @ p["head"], batch["y"])

    return Setup("scan-convs", params, loss_fn, image_batch(4), ())


def _rows(setup: Setup, **cfg_kwargs) -> dict:
    report = dz.explain_plan(setup.loss_fn, dz.DPConfig(**cfg_kwargs), setup.params, setup.batch)
    return {r["path"]: r for r in report.rows}


def test_every_kernel_is_a_conv_site_and_the_rule_decides_from_the_unfolded_sizes():
    rows = _rows(nnx_setup(), norm_method="mixed")
    kernels = [p for p in rows if p.endswith("kernel") and not p.startswith("head")]
    assert len(kernels) == 6 and all(rows[p]["rule"] == "conv" for p in kernels)
    # ghost iff 2 T^2 < rows * cols per feature group: T output positions, rows Cin_g * kh * kw, cols Cout_g
    assert rows["strided/kernel"]["method"] == "ghost"          # T 9: 162 < 36 * 6
    assert rows["strided/kernel"]["per_example_bytes"] == 4 * 9 ** 2
    assert rows["valid/kernel"]["method"] == "instantiate"      # T 20: 800 > 24 * 6
    assert rows["depthwise/kernel"]["method"] == "instantiate"  # T 16, 4 groups of 9 x 1
    assert rows["head/kernel"]["rule"] == "dot"
    assert _rows(nnx_setup(), norm_method="ghost")["valid/kernel"]["method"] == "ghost"
    assert all(r["rule"] == "conv" for p, r in _rows(linen_setup()).items() if "Conv" in p and "kernel" in p)


@pytest.mark.parametrize("setup, mode, clip_fn, groups, method", [
    ("nnx", "bk", "abadi", "param-wise", "mixed"), ("nnx", "ghost", "automatic", "all-layer", "mixed"),
    ("nnx", "bk", "global", "layer-wise", "ghost"), ("nnx", "ghost", "abadi", "param-wise", "instantiate"),
    ("nnx", "bk", "automatic", "param-wise", "fastest"),
    ("linen", "auto", "abadi", "param-wise", "fastest"), ("linen", "ghost", "abadi", "layer-wise", "ghost")])
def test_convolutions_match_vmap_grad(setup, mode, clip_fn, groups, method):
    check_private({"nnx": nnx_setup, "linen": linen_setup}[setup](), clip_fn=clip_fn, groups=groups, mode=mode,
                  norm_method=method, floor=1e-4)


@pytest.mark.parametrize("remat, mode, method", [(False, "bk", "ghost"), (False, "ghost", "mixed"),
                                                 (True, "auto", "instantiate")])
def test_convolutions_inside_a_scan_match_vmap_grad(remat, mode, method):
    setup = scan_setup(remat)
    rows = _rows(setup)
    assert {rows[p]["rule"] for p in ("stacked", "shared", "grouped")} == {"conv"}
    check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode, norm_method=method, floor=1e-4)


@pytest.mark.parametrize("mode, method, kernel", [("bk", "ghost", "xla"), ("bk", "instantiate", "xla"),
                                                  ("ghost", "mixed", "xla"), ("bk", "ghost", "pallas")])
def test_one_kernel_used_twice_gets_its_cross_term(mode, method, kernel):
    """The same kernel at two strides (9 and 36 positions): one factored leaf, the norm with its cross term."""
    keys = jax.random.split(jax.random.key(6), 2)
    params = {"w": 0.3 * jax.random.normal(keys[0], (3, 3, C, 4)), "head": jax.random.normal(keys[1], (8, 3))}
    dn = ("NHWC", "HWIO", "NHWC")

    def loss_fn(p, batch):
        a = jax.lax.conv_general_dilated(batch["x"], p["w"], (2, 2), "SAME", dimension_numbers=dn)
        b = jax.lax.conv_general_dilated(jnp.tanh(batch["x"]), p["w"], (1, 1), "SAME", dimension_numbers=dn)
        pooled = jnp.concatenate([jnp.mean(jnp.tanh(a), axis=(1, 2)), jnp.mean(jnp.tanh(b), axis=(1, 2))], -1)
        return class_loss(pooled @ p["head"], batch["y"])

    setup = Setup("twice", params, loss_fn, image_batch(6), ())
    assert _rows(setup)["w"]["rule"] == "conv"
    check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode, norm_method=method, norm_kernel=kernel,
                  floor=1e-4)


def test_batch_groups_stay_an_exact_local_site():
    """``batch_group_count = 2`` over a per-example axis of 2 images: no conv rule, the local rule is exact."""
    kernel = 0.3 * jax.random.normal(jax.random.key(4), (3, 3, C, 4))
    batch = image_batch(5, (B, 2, H, H, C))

    def loss_fn(p, batch):
        def one(x):   # [2, H, H, C] -> [1, H, H, 4]: the two images' features in two batch groups
            return jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", batch_group_count=2,
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return class_loss(jnp.mean(jax.vmap(one)(batch["x"]), axis=(1, 2, 3))[:, :3], batch["y"])

    setup = Setup("batch-groups", {"w": kernel}, loss_fn, batch, ())
    assert _rows(setup)["w"]["rule"] == "local"
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="bk")


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_bundled_cnn_plans_one_kernel_ghost_and_one_instantiated(mode):
    model = build(CNN, CNNConfig(), 0)
    params, loss_fn = classification_objective(model)
    kx, ky = jax.random.split(jax.random.key(2))
    batch = {"image": jax.random.normal(kx, (B, 8, 8, 1)), "label": jax.random.randint(ky, (B,), 0, 10)}
    cfg = dz.DPConfig(mode=mode, norm_method="mixed")
    rows = {r["path"]: r for r in dz.explain_plan(loss_fn, cfg, params, batch).rows}
    assert rows["conv1/kernel"]["rule"] == "conv" and rows["conv1/kernel"]["method"] == "instantiate"  # T 64
    assert rows["conv2/kernel"]["rule"] == "conv" and rows["conv2/kernel"]["method"] == "ghost"        # T 16
    setup = Setup("cnn", params, loss_fn, batch, ())
    check_private(setup, clip_fn="abadi", groups="all-layer", mode=mode, norm_method="mixed")
    plan = program_mode.plan_program(loss_fn, cfg, params, batch, dz.engine.leaf_paths(params), B)
    assert not plan.analysis.fallback
