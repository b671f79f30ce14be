"""Book-keeping on scanned layers keeps each per-example operand in the layout the scan leaves it.

The per-example pass leaves a scanned site's recorded operands and output gradients ``[L, B, ...]`` (iterations,
then examples); the factored uses are blocks first (``sites.factored``), so the instantiated gradients, their norms
and the clipped sum read them where they are. Until 2026-11-29 the examples were moved first, and XLA transposed
every such array (twice where a unit axis stood between the moves): about 0.1x of the 48-layer depth benchmark's
step. Checked here: values against ``vmap(grad)`` (a Flax linen ``nn.scan`` decoder block and a plain-JAX scan of
a per-head einsum, whose dot batch axis makes blocks of its own; masks and a NaN example), the compiled program
holding no transpose of an ``[L, B, ...]`` array that swaps its iterations and examples, and each value kept once:
inside a scan every kept value is a stacked output of its own, so two projections of one input share one record
(``Analysis.shared_records``); a bias, a local site, keeps nothing but its per-example gradient
(``program.local_tap``; until 2026-11-29 it shared its dense layer's output gradient, ``shared_gradient``).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import B, Setup, check_private

import dpzero_jax as dz
from dpzero_jax.layer_plan import leaf_paths
from dpzero_jax.program import mode

L, T, D, VOCAB = 3, 6, 8, 11


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        x = nn.LayerNorm()(h)
        y = nn.DenseGeneral((2, D // 2), name="heads")(x)
        gate = nn.DenseGeneral((2, D // 2), name="gate")(x)     # the same input: its record is the heads' record
        h = h + nn.DenseGeneral(D, axis=(-2, -1), name="merge")(jnp.tanh(y) * jax.nn.sigmoid(gate))
        return h + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(h))), None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, D)(ids)
        h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)()(h, None)
        return nn.Dense(3)(h).mean(1)


def linen_setup() -> Setup:
    rng = np.random.default_rng(0)
    batch = {"ids": jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}
    model = Decoder()
    params = model.init(jax.random.key(1), batch["ids"])["params"]

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["ids"])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1)[:, 0]

    return Setup("linen scan", params, loss_fn, batch, ())


def einsum_setup(nan_example: int | None = None) -> Setup:
    """A plain-JAX scan over per-head weights ``w [L, H, d, e]`` used by ``bthd,hde->bthe`` (a dot batch axis)."""
    keys = jax.random.split(jax.random.key(2), 3)
    params = {"w": 0.5 * jax.random.normal(keys[0], (L, 2, 4, 4)),
              "scale": 1.0 + 0.1 * jax.random.normal(keys[1], (L, 4))}
    x = np.array(jax.random.normal(keys[2], (B, T, 2, 4)))
    if nan_example is not None:
        x[nan_example, 1] = np.nan
    batch = {"x": jnp.asarray(x)}

    def loss_fn(p, batch):
        def body(h, layer):
            w, scale = layer
            return jnp.tanh(jnp.einsum("bthd,hde->bthe", h, w)) * scale, None
        h, _ = jax.lax.scan(body, batch["x"], (p["w"], p["scale"]))
        return jnp.sum(jnp.square(h), axis=(1, 2, 3))

    return Setup("einsum scan", params, loss_fn, batch, ())


@pytest.mark.parametrize("groups", ["all-layer", "param-wise"])
def test_linen_scan_matches_vmap_grad(groups):
    check_private(linen_setup(), clip_fn="abadi", groups=groups, mode="bk",
                  mask=np.array([1, 1, 0, 1, 1], bool), include=[1, 1, 0, 1, 1])


def test_per_head_blocks_match_vmap_grad_with_a_nan_example():
    check_private(einsum_setup(nan_example=3), clip_fn="abadi", groups="all-layer", mode="bk",
                  include=[1, 1, 1, 0, 1], nonfinite=1)


@pytest.mark.parametrize("reduced_from", [2, 10_000])
def test_both_forms_of_the_blocked_clipped_sum_match_vmap_grad(monkeypatch, reduced_from):
    """``pergrad.weighted_blocks`` contracts the examples of fewer than ``REDUCED_BLOCKS`` blocks and reduces the
    scaled rows of more (a deep scan); both exact, a NaN example kept out of either. The norms instantiated, so
    that the clipped sums are formed from the kept per-example gradients (1, 3 and 6 blocks here)."""
    monkeypatch.setattr(dz.pergrad, "REDUCED_BLOCKS", reduced_from)
    check_private(einsum_setup(nan_example=3), clip_fn="abadi", groups="all-layer", mode="bk",
                  include=[1, 1, 1, 0, 1], nonfinite=1, norm_method="instantiate")
    check_private(linen_setup(), clip_fn="abadi", groups="all-layer", mode="bk", norm_method="instantiate",
                  mask=np.array([1, 1, 0, 1, 1], bool), include=[1, 1, 0, 1, 1])


def _swapped_stacks(hlo: str) -> list[str]:
    """Transposes in ``hlo`` that exchange the iterations and examples of an ``[L, B, ...]`` (or ``[B, L, ...]``)
    float array."""
    swapped = re.compile(rf"= f32\[({L},{B}|{B},{L}),[\d,]*\]\S* transpose\(\S+\), dimensions=\{{1,0[,}}]")
    return [line.strip()[:160] for line in hlo.splitlines() if swapped.search(line)]


@pytest.mark.parametrize("make", [linen_setup, einsum_setup])
def test_scanned_operands_are_not_transposed(make):
    setup = make()
    cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, mode="bk")
    grad = jax.jit(dz.private_value_and_grad(setup.loss_fn, cfg))
    hlo = grad.lower(setup.params, setup.batch, jax.random.key(0)).compile().as_text()
    assert re.search(rf"f32\[{L},{B},", hlo), "test setup: the program should hold per-example arrays [L, B, ...]"
    assert _swapped_stacks(hlo) == []


def test_each_value_is_kept_once():
    setup = linen_setup()
    cfg = dz.DPConfig(mode="bk", front_end="program")
    plan = mode.plan_program(setup.loss_fn, cfg, setup.params, setup.batch, leaf_paths(setup.params), B)
    sites = plan.analysis.sites

    def path_of(leaf_path):
        (found,) = [p for p, s in sites.items() if plan.paths[s.view.leaf] == leaf_path]
        return found

    block = "ScanBlock_0"
    assert plan.analysis.shared_records == {path_of(f"{block}/gate/kernel"): path_of(f"{block}/heads/kernel")}
    shared = {plan.paths[sites[p].view.leaf]: plan.paths[sites[q].view.leaf]
              for p, q in plan.analysis.shared_gradient.items()}
    expected = {f"{block}/{layer}/bias": f"{block}/{layer}/kernel"
                for layer in ("heads", "gate", "merge", "Dense_0", "Dense_1")}
    assert shared == expected | {"Dense_0/bias": "Dense_0/kernel"}

    leaves, batch_leaves = jax.tree.leaves(setup.params), jax.tree.leaves(setup.batch)
    _, records, probe_ct, _, tapped = mode._pass(plan, leaves, batch_leaves)
    for path, first in plan.analysis.shared_records.items():
        assert records[path] is records[first]
    # a bias is a local site: book-keeping taps it (program.local_tap), so it keeps neither operands nor its output
    # gradient -- its probe's cotangent is its per-example gradient, [L, B, *bias] -- and reads no one's
    for path in plan.analysis.shared_gradient:
        site = sites[path]
        assert path in tapped and path not in records
        assert probe_ct[path].shape == tuple(site.lengths) + (B,) + tuple(site.view.chain[0].invars[0].aval.shape)


def test_an_output_used_twice_keeps_its_own_gradient():
    """``y = x @ w`` feeds the bias ``y + b`` and the loss directly: ``y``'s output gradient is not the shift's,
    so nothing is shared, and the values still match ``vmap(grad)``."""
    keys = jax.random.split(jax.random.key(5), 3)
    params = {"w": jax.random.normal(keys[0], (L, D, D)) / np.sqrt(D), "b": 0.1 * jax.random.normal(keys[1], (L, D))}
    batch = {"x": jax.random.normal(keys[2], (B, T, D))}

    def loss_fn(p, batch):
        def body(h, layer):
            w, b = layer
            y = h @ w
            return jnp.tanh(y + b) + 0.5 * y, None
        h, _ = jax.lax.scan(body, batch["x"], (p["w"], p["b"]))
        return jnp.sum(jnp.square(h), axis=(1, 2))

    setup = Setup("output used twice", params, loss_fn, batch, ())
    plan = mode.plan_program(loss_fn, dz.DPConfig(mode="bk"), params, batch, leaf_paths(params), B)
    assert plan.analysis.shared_gradient == {} and plan.analysis.shared_records == {}
    check_private(setup, clip_fn="abadi", groups="param-wise", mode="bk")
