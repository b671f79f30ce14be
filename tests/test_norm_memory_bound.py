"""The time rule's memory bound: book-keeping instantiates a per-example gradient (and keeps it for the clipped sum)
only where it holds at most ``INSTANTIATION_MEMORY_BOUND`` (2) times the per-example operands the ghost norm keeps.

Counts by hand: a ``[rows, cols]`` weight at ``T`` positions per example; the ghost norm costs ``T^2 (rows + cols)``
multiply-adds, instantiation with reuse ``60 rows cols``; the operands are ``T (rows + cols)`` elements, an
embedding's ``T (1 + cols)`` (its ids count one each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import B, Setup, check_private, dense_setup, per_example_shapes

import dpzero_jax as dz
from dpzero_jax import norm_rules


def test_the_bound_is_twice_the_operands():
    assert norm_rules.INSTANTIATION_MEMORY_BOUND == 2
    assert norm_rules.operand_elements(197, 197, 768, 3072) == 197 * (768 + 3072)
    # a tied table: T lookups (ids, output gradient) and T head positions (output gradient, input)
    assert norm_rules.operand_elements(2048, 1024, 50257, 1600) == 1024 * (50257 + 1600) + 1024 * (1 + 1600)


@pytest.mark.parametrize("positions, rows, cols, reuse, ghost", [
    # ViT-B/16's MLP at T 197: time alone says instantiate (149M >= 142M multiply-adds), but 2.36M elements are
    # 3.1x the 0.76M operands: ghost, where the instantiated gradient would be kept (reuse)
    (197, 768, 3072, True, True),
    # without reuse the gradient is not kept: the time rule alone, (60 + 197) rows cols = 606M > 149M, ghost
    (197, 768, 3072, False, True),
    # ViT-B/16's attention output [768, 768]: 59.6M ghost >= 35.4M, 0.59M elements 1.95x the 0.30M operands: kept
    (197, 768, 768, True, False),
    # bench_overhead's W3 MLP [256, 1024] at T 128: 1.6x its operands, and 21.0M ghost >= 15.7M: instantiated
    (128, 256, 1024, True, False),
    # a [768, 768] weight at T 160: time says instantiate (39.3M >= 35.4M), 0.59M elements 2.4x the 0.25M operands
    (160, 768, 768, True, True),
    # ... at T 200: 61.4M >= 35.4M and 0.59M within 2x 0.31M: instantiated
    (200, 768, 768, True, False),
])
def test_shape_rule_with_the_bound(positions, rows, cols, reuse, ghost):
    time_ghost = positions ** 2 * (rows + cols) < (60 + (0 if reuse else positions)) * rows * cols
    memory_ghost = reuse and rows * cols > 2 * positions * (rows + cols)
    assert (time_ghost or memory_ghost) is ghost
    assert norm_rules.shape_rule("fastest", positions, positions, rows, cols, reuse) is ghost
    # explain_plan's reason: only where the bound alone decides
    note = norm_rules.bound_note("fastest", positions, positions, rows, cols, reuse)
    assert bool(note) is (memory_ghost and not time_ghost)
    if note:
        assert f"{rows * cols / (positions * (rows + cols)):.1f}x its operands (more than 2x)" in note
    # the other rules do not look at the bound
    assert norm_rules.shape_rule("mixed", positions, positions, rows, cols, reuse) is (2 * positions ** 2 < rows * cols)
    assert norm_rules.shape_rule("instantiate", positions, positions, rows, cols, reuse) is False


def test_gpt2_small_tied_table_stays_instantiated():
    """GPT-2 small's tied [50304, 768] at T 1024 (bench_compiled's TPU shapes): 38.6M elements against 53.1M
    operands (the head's [T, V] output gradient), within the bound: instantiated and reused, as before it."""
    operands = norm_rules.operand_elements(2048, 1024, 50304, 768)
    assert 50304 * 768 < 2 * operands
    assert not norm_rules.shape_rule("fastest", 2048, 1024, 50304, 768, reuse=True)


WIDTH = 768


@pytest.fixture(scope="module", params=[160, 200], ids=["T160-bound", "T200-time"])
def dense(request):
    return request.param, dense_setup(WIDTH, request.param, key_seed=21, data_seed=22)


def test_program_front_end_bk_respects_the_bound(dense):
    """A plain-JAX ``[768, 768]`` weight: at T 160 book-keeping under the time rule takes the ghost norm (the bound),
    its traced step holds no per-example ``[768, 768]`` array; at T 200 it instantiates. Exact against
    ``vmap(grad)`` either way."""
    length, setup = dense
    bound = length == 160
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk", norm_method="fastest",
                      groups="param-wise", front_end="program")
    rows = {r["path"]: r for r in dz.explain_plan(setup.loss_fn, cfg, setup.params, setup.batch).rows}
    assert rows["w"]["method"] == ("ghost" if bound else "instantiate")
    assert rows["w"]["per_example_bytes"] == 4 * (length ** 2 if bound else WIDTH * WIDTH)
    assert ("memory bound" in rows["w"]["why"]) is bound and rows["head"]["why"] == ""
    assert bool(per_example_shapes(setup, cfg, (WIDTH, WIDTH))) is not bound
    check_private(setup, clip_fn="abadi", groups="param-wise", mode="bk", norm_method="fastest",
                  front_end="program")


def test_auto_on_a_tpu_target_applies_the_bound(dense):
    """``norm_method="auto"`` for a TPU (``target="tpu"``) is the time rule: the plan is the one above."""
    length, setup = dense
    report = dz.explain_plan(setup.loss_fn, dz.DPConfig(mode="bk", target="tpu"), setup.params, setup.batch)
    assert {r["path"]: r["method"] for r in report.rows}["w"] == ("ghost" if length == 160 else "instantiate")


class _LayersDense(nnx.Module):
    """The same model from ``dz.layers`` layers (the layers front-end)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.w = dz.layers.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.head = dz.layers.Linear(WIDTH, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.w(x)).mean(1))


def test_layers_front_end_bk_respects_the_bound():
    model = _LayersDense(rngs=nnx.Rngs(5))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(23)
    batch = {"x": jnp.asarray(rng.standard_normal((B, 160, WIDTH)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        logits = nnx.merge(graphdef, p)(b["x"])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]

    setup = Setup("dz-dense-768", params, loss_fn, batch, ())
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk", norm_method="fastest",
                      groups="param-wise")
    report = dz.explain_plan(loss_fn, cfg, params, batch)
    assert report.front_end == "layers"
    rows = {r["path"]: r for r in report.rows}
    assert rows["w/kernel"]["method"] == "ghost"
    assert "2.4x its operands" in rows["w/kernel"]["why"]      # 768^2 / (160 * 1536)
    assert not per_example_shapes(setup, cfg, (WIDTH, WIDTH))
    check_private(setup, clip_fn="abadi", groups="param-wise", mode="bk", norm_method="fastest")



# The bound in bytes (the program front-end knows the dtypes): a tied [V, d] table at T positions per example,
# used by a lookup and the head (2T positions, T dense). At V 4096, d 256, T 160 the time rule with reuse
# instantiates it (ghost 320^2 256 + 160^2 4096 = 131.1M multiply-adds against 60 V d = 62.9M), the bound in
# elements lets it (V d = 1.05M within 2x the 0.74M operand elements: 160 (4096 + 256) + 160 (1 + 256)), and the
# rule without reuse takes the ghost norm ((60 + 160) V d = 230.7M). Counted in bytes, a float32 gradient of
# 4.19 MB against bfloat16 operands of 1.47 MB (the head's [T, V] output gradient and [T, d] input, the lookup's
# ids and [T, d] output gradient) is more than 2x: ghost, summed from the operands. Kept in bfloat16 (2.10 MB), or
# against float32 operands (2.95 MB), it is within 2x: instantiated.
TABLE_V, TABLE_D, TABLE_T = 4096, 256, 160


class _TiedTable(nnx.Module):
    def __init__(self, dtype, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(TABLE_V, TABLE_D, dtype=dtype, rngs=rngs)
        self.mix = nnx.Linear(TABLE_D, TABLE_D, dtype=dtype, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(jnp.tanh(self.mix(self.embed(ids))))


def _tied_table_setup(dtype) -> Setup:
    graphdef, params = nnx.split(_TiedTable(dtype, rngs=nnx.Rngs(31)), nnx.Param)
    rng = np.random.default_rng(32)
    batch = {"ids": jnp.asarray(rng.integers(0, TABLE_V, (B, TABLE_T)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, TABLE_V, (B, TABLE_T)), jnp.int32)}

    def loss_fn(p, b):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, p)(b["ids"]).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], -1)[..., 0], axis=-1)
    return Setup(f"tied-table-{jnp.dtype(dtype).name}", params, loss_fn, batch, ())


@pytest.fixture(scope="module")
def bf16_table():
    return _tied_table_setup(jnp.bfloat16)


def _table_row(setup, **options):
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="bk", norm_method="fastest",
                      front_end="program", **options)
    return {r["path"]: r for r in dz.explain_plan(setup.loss_fn, cfg, setup.params, setup.batch).rows}[
        "embed/embedding"], cfg


def test_the_bound_in_bytes_ghost_norms_a_bf16_tied_table(bf16_table):
    row, cfg = _table_row(bf16_table)
    assert row["method"] == "ghost"
    assert "bytes" in row["why"] and "2.8x its operands' bytes" in row["why"]     # 4194304 / 1474880
    # the engine as explained: no per-example [V, d] array in the traced step, and exact against vmap(grad)
    assert not per_example_shapes(bf16_table, cfg, (TABLE_V, TABLE_D))
    check_private(bf16_table, clip_fn="abadi", groups="all-layer", mode="bk", norm_method="fastest",
                  front_end="program", rtol=3e-2, norm_rtol=2e-2, floor=3e-2)
    # fused mode book-keeps the tied table's group (two sites) in its one pass: the same rule, the same sum
    check_private(bf16_table, clip_fn="abadi", groups="layer-wise", mode="fused", norm_method="fastest",
                  front_end="program", rtol=3e-2, norm_rtol=2e-2, floor=3e-2)


def test_the_bound_in_bytes_keeps_what_holds_within_it(bf16_table):
    row, cfg = _table_row(bf16_table, instantiated_dtype="bfloat16")
    assert row["method"] == "instantiate"
    assert per_example_shapes(bf16_table, cfg, (TABLE_V, TABLE_D))
    row, _ = _table_row(_tied_table_setup(jnp.float32))
    assert row["method"] == "instantiate" and row["why"] == ""
