"""The engine with ``norm_kernel="pallas"`` (the tiled kernels of ``dpzero_jax_kernels.ghost_norm``, interpreted on
CPU) against per-example gradients from ``vmap(grad)``: every mode that computes norms from factored gradients, tied
weights, microbatches, the flop-based mixed rule, and a kernel-backed engine inside ``jax.shard_map`` with the batch
sharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import SETUPS, check_private, mlp, mlp_batch

import dpzero_jax as dz
from dpzero_jax import pergrad

CASES = [
    # model, mode, clip_fn, groups, extra config
    ("gpt2-tied", "bk", "abadi", "all-layer", {}),
    ("gpt2-tied", "bk", "automatic", "param-wise", {"norm_method": "instantiate"}),
    ("gpt2-tied", "ghost", "abadi", "layer-wise", {}),
    ("gpt2-tied", "ghost", "global", "all-layer", {"norm_method": "instantiate"}),
    ("gpt2-untied", "fused", "abadi", "layer-wise", {}),
    ("gpt2-untied", "fused", "automatic", "param-wise", {"norm_method": "instantiate"}),
    ("gpt2-untied", "ghost", "automatic", "param-wise", {"norm_method": "ghost"}),
    ("vit", "bk", "global", "layer-wise", {"norm_method": "fastest"}),
    ("vit", "fused", "abadi", "param-wise", {}),
    ("mlp", "bk", "abadi", "all-layer", {"microbatch_size": 3}),
    ("mlp", "auto", "automatic", ("uniform", 2), {}),
]


@pytest.mark.parametrize("model, mode, clip_fn, groups, extra", CASES,
                         ids=[f"{m}-{mo}-{c}-{g}-{e}" for m, mo, c, g, e in CASES])
def test_modes_with_pallas_kernels(model, mode, clip_fn, groups, extra):
    check_private(SETUPS[model](), clip_fn=clip_fn, groups=groups, mode=mode, norm_kernel="pallas", **extra)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="GPU kernels take 16-bit inputs; these models are float32")
@pytest.mark.parametrize("model, mode", [("gpt2-untied", "bk"), ("gpt2-dz-nn-untied", "bk"),
                                         ("gpt2-dz-nn-untied", "ghost"), ("gpt2-dz-nn-untied", "fused")])
def test_pallas_kernels_are_in_the_program(model, mode):
    """Book-keeping on both front ends; ghost and fused on the layers front-end (on the program front-end they form
    each example's norm inside its own backward, with XLA)."""
    setup = SETUPS[model]()
    cfg = dz.DPConfig(noise_multiplier=0.0, mode=mode, groups="layer-wise", norm_kernel="pallas")
    program = str(jax.make_jaxpr(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                                 jax.random.key(0)))
    assert "ghost_gram_sq_norm" in program and "weighted_sum" in program
    xla = str(jax.make_jaxpr(dz.private_value_and_grad(setup.loss_fn, cfg.replace(norm_kernel="auto")))(
        setup.params, setup.batch, jax.random.key(0)))
    assert "pallas_call" not in xla  # auto is XLA on CPU


def test_config_validates_norm_kernel():
    assert dz.DPConfig().norm_kernel == "auto"
    with pytest.raises(ValueError, match="DPConfig.norm_kernel must be one of .*, got 'triton'"):
        dz.DPConfig(norm_kernel="triton")


def _outer(rng, batch, positions, rows, cols, ids=False):
    left = (rng.integers(0, rows, (batch, positions)).astype(np.int32) if ids
            else rng.standard_normal((batch, positions, rows)).astype(np.float32))
    right = rng.standard_normal((batch, positions, cols)).astype(np.float32)
    return pergrad.Outer(jnp.asarray(left), jnp.asarray(right), rows, (rows, cols), left_is_ids=ids)


def _explicit(use: pergrad.Outer) -> np.ndarray:
    left = np.eye(use.rows)[np.asarray(use.left)] if use.left_is_ids else np.asarray(use.left, np.float64)
    return np.einsum("btr,btc->brc", left, np.asarray(use.right, np.float64))


@pytest.mark.parametrize("method", ["ghost", "instantiate", "mixed"])
def test_tied_uses_norm_and_clipped_sum(method):
    """One weight used by two dense calls and two embedding lookups: every cross term, with the kernels."""
    rng = np.random.default_rng(0)
    uses = [_outer(rng, 3, 9, 12, 20), _outer(rng, 3, 5, 12, 20), _outer(rng, 3, 7, 12, 20, ids=True),
            _outer(rng, 3, 4, 12, 20, ids=True)]
    total = sum(_explicit(u) for u in uses)
    np.testing.assert_allclose(pergrad.sq_norm(uses, method, "pallas"), np.sum(total ** 2, axis=(1, 2)), rtol=1e-5)
    dense = uses[:2]
    np.testing.assert_allclose(pergrad.sq_norm(dense, method, "pallas"),
                               np.sum(sum(_explicit(u) for u in dense) ** 2, axis=(1, 2)), rtol=1e-5)
    coef = np.asarray([0.5, 0.0, 2.0], np.float32)
    np.testing.assert_allclose(pergrad.weighted_sum(uses, jnp.asarray(coef), "pallas"),
                               np.tensordot(coef, total, axes=1), rtol=1e-5, atol=1e-5)


def test_mixed_rule_decides_on_flops_with_kernels():
    def dense(positions, rows=1024, cols=1024):
        return [pergrad.Outer(jax.ShapeDtypeStruct((4, positions, rows), jnp.float32),
                              jax.ShapeDtypeStruct((4, positions, cols), jnp.float32), rows, (rows, cols))]

    # XLA: space rule 2 T^2 < rows cols (ghost below T ~ 724 for 1024 x 1024); kernels: T (rows + cols) < 2 rows cols.
    assert pergrad.use_ghost(dense(512), "mixed", "xla") and pergrad.use_ghost(dense(512), "mixed", "pallas")
    assert not pergrad.use_ghost(dense(800), "mixed", "xla") and pergrad.use_ghost(dense(800), "mixed", "pallas")
    assert not pergrad.use_ghost(dense(2048), "mixed", "pallas")
    assert pergrad.use_ghost(dense(2048), "ghost", "pallas")
    assert not pergrad.use_ghost(dense(8), "instantiate", "pallas")


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_kernel_backed_norms_inside_shard_map(mode):
    """Per-example norms with the kernels inside ``jax.shard_map`` over 8 devices, the batch sharded: each device
    runs the kernels on its own examples (pallas_call has no partitioning rule)."""
    setup = mlp()
    batch = mlp_batch(21, batch_size=16, scale=2.0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    spec = jax.sharding.PartitionSpec("data")

    def local_norms(batch):
        return dz.per_example_grad_norms(setup.loss_fn, setup.params, batch, mode=mode, norm_kernel="pallas")

    sharded = jax.jit(jax.shard_map(local_norms, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False))
    norms = sharded(jax.device_put(batch, jax.sharding.NamedSharding(mesh, spec)))
    grads = ref.per_example_grads(setup.loss_fn, setup.params, batch)
    expected = np.sqrt(sum(np.sum(g.reshape(16, -1) ** 2, axis=1) for g in grads.values()))
    np.testing.assert_allclose(norms, expected, rtol=1e-5)
    assert norms.shape == (16,)


@pytest.mark.parametrize("size", [pergrad.SMALL_DIRECT, pergrad.SMALL_DIRECT + 1])
def test_direct_clipped_sum_on_both_sides_of_the_small_leaf_rule(size):
    """Instantiated per-example gradients: a multiply-and-reduce up to ``SMALL_DIRECT`` elements per example, the
    contraction above it; the same sum either way, an inactive example's NaN row contributing nothing."""
    rng = np.random.default_rng(1)
    value = rng.standard_normal((4, size)).astype(np.float32).reshape(4, 1, size)
    value[1] = np.nan
    coef = np.asarray([0.5, 0.0, -2.0, 1.5], np.float32)
    got = pergrad.weighted_sum([pergrad.Direct(jnp.asarray(value))], jnp.asarray(coef))
    want = np.tensordot(coef[[0, 2, 3]].astype(np.float64), value[[0, 2, 3]].astype(np.float64), axes=1)
    assert got.shape == (1, size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
