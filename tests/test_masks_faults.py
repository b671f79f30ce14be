"""Masks and faulty examples: a masked example contributes exactly nothing; an example with a non-finite loss or a
non-finite gradient anywhere is dropped from every group, counted in ``num_nonfinite``, and the gradient stays finite
-- in every mode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import B, Setup, check_private, gpt2, mlp, private_fn

import dpzero_jax as dz

# (mode, groups, extra config): every mode, with groupings the mode supports
MODE_CONFIGS = [
    ("bk", "all-layer", {}),
    ("bk", "layer-wise", {}),
    ("ghost", "param-wise", {}),
    ("fused", "layer-wise", {}),
    ("fused", "param-wise", {}),
    ("vmap", "layer-wise", {"microbatch_size": 2}),
    ("auto", "all-layer", {}),
]
IDS = [f"{m}-{g}-{e}" for m, g, e in MODE_CONFIGS]
MASK = np.array([True, False, True, True, False])


def with_batch(setup: Setup, **changes) -> Setup:
    batch = {k: np.array(v) for k, v in setup.batch.items()}
    for key, (index, value) in changes.items():
        batch[key][index] = value
    return dataclasses.replace(setup, batch=batch)


@pytest.mark.parametrize("mode, groups, extra", MODE_CONFIGS, ids=IDS)
def test_mask_matches_reference_on_unmasked_examples(mode, groups, extra):
    """Masked examples (one of them NaN) are left out: the result is the reference on the unmasked examples only
    (still divided by B), their clip factors are 0, and the masked NaN is not counted as non-finite."""
    setup = with_batch(mlp(), x=((1, 3), np.nan))
    stats = check_private(setup, clip_fn="abadi", groups=groups, mode=mode, mask=MASK, include=MASK, nonfinite=0,
                          **extra)
    assert np.all(np.asarray(stats.clip_factors)[~MASK] == 0)
    assert int(stats.num_included) == int(MASK.sum())


@pytest.mark.parametrize("mode, groups, extra", MODE_CONFIGS, ids=IDS)
def test_masked_examples_contribute_exactly_zero(mode, groups, extra):
    """Whatever a masked example holds (even NaN), the noised gradient is bit-for-bit the same."""
    setup = mlp()
    cfg = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, groups=groups, mode=mode, **extra)
    fn = private_fn(setup.loss_fn, cfg)
    key = jax.random.key(3)
    _, clean, _ = fn(setup.params, setup.batch, key, MASK)
    poisoned = with_batch(setup, x=(1, np.nan)).batch
    poisoned["x"][4] = 1e6
    _, grads, stats = fn(setup.params, poisoned, key, MASK)
    for path, g in ref.flat(grads).items():
        np.testing.assert_array_equal(g, ref.flat(clean)[path], err_msg=path)
    assert int(stats.num_nonfinite) == 0          # a masked NaN example is not counted as non-finite
    assert int(stats.num_included) == int(MASK.sum())


@pytest.mark.parametrize("mode, groups, extra", MODE_CONFIGS, ids=IDS)
def test_nan_example_is_dropped(mode, groups, extra):
    """An MLP input row containing NaN: non-finite loss and gradients for that example only."""
    setup = with_batch(mlp(), x=((2, 3), np.nan))
    assert np.isnan(setup.losses[2]) and np.isfinite(np.delete(setup.losses, 2)).all()
    include = np.arange(B) != 2
    stats = check_private(setup, clip_fn="abadi", groups=groups, mode=mode, include=include, nonfinite=1, **extra)
    assert np.all(np.asarray(stats.clip_factors)[2] == 0)


@pytest.mark.parametrize("mode, groups, extra", MODE_CONFIGS, ids=IDS)
def test_nonfinite_gradient_in_one_layer_drops_the_whole_example(mode, groups, extra):
    """An infinite input feature saturates tanh: the loss and the later layers' gradients stay finite, but the first
    layer's kernel gradient is inf * 0 = NaN. The example must contribute nothing to any group (in ``fused`` mode,
    where each layer sees only its own groups, nothing to the groups whose norm is non-finite: see the next test)."""
    setup = with_batch(mlp(), x=((1, 0), np.inf))
    assert np.isfinite(setup.losses).all()
    assert np.isnan(setup.grads["layers/0/kernel"][1]).any()
    assert np.isfinite(setup.grads["head/kernel"][1]).all() and np.any(setup.grads["head/kernel"][1] != 0)
    if mode == "fused":
        pytest.skip("fused mode drops the example group by group: test_fused_drops_nonfinite_groups")
    include = np.arange(B) != 1
    stats = check_private(setup, clip_fn="abadi", groups=groups, mode=mode, include=include, nonfinite=1, **extra)
    assert np.all(np.asarray(stats.clip_factors)[1] == 0)


@pytest.mark.parametrize("mode, groups, extra", MODE_CONFIGS, ids=IDS)
def test_nonfinite_loss_with_finite_gradient_is_dropped(mode, groups, extra):
    """A loss that is NaN for one example while its gradient is finite (a NaN data-dependent offset): the example is
    reported as non-finite with clip factor 0, so it must not contribute."""
    base = mlp()

    def loss_fn(params, batch):
        return base.loss_fn(params, batch) + batch["offset"]

    offset = np.zeros(B, np.float32)
    offset[3] = np.nan
    setup = dataclasses.replace(base, loss_fn=loss_fn, batch=dict(base.batch, offset=offset))
    assert np.isnan(setup.losses[3]) and np.isfinite(setup.grads["head/kernel"]).all()
    include = np.arange(B) != 3
    check_private(setup, clip_fn="abadi", groups=groups, mode=mode, include=include, nonfinite=1, **extra)


def test_everything_masked_gives_exact_zero():
    setup = mlp()
    for mode in ("bk", "ghost", "fused", "vmap"):
        cfg = dz.DPConfig(noise_multiplier=0.0, groups="layer-wise", mode=mode, microbatch_size=2)
        _, grads, stats = private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0),
                                                         jnp.zeros((B,), bool))
        for path, g in ref.flat(grads).items():
            assert np.all(g == 0), (mode, path)
        assert int(stats.num_included) == 0 and int(stats.num_nonfinite) == 0
        assert np.all(np.asarray(stats.clip_factors) == 0)


@pytest.mark.parametrize("model, mode, groups", [
    ("gpt2-tied", "bk", "all-layer"),
    ("gpt2-tied", "ghost", "layer-wise"),
    ("gpt2-untied", "fused", "param-wise"),
    ("gpt2-tied", "vmap", ("uniform", 3)),
])
def test_gpt2_mask(model, mode, groups):
    setup = gpt2(model == "gpt2-tied")
    mask = np.array([False, True, True, False, True])
    check_private(setup, clip_fn="abadi", groups=groups, mode=mode, mask=mask, include=mask, microbatch_size=3)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_gpt2_nan_loss_mask_row_is_dropped(mode):
    """A NaN in one example's ``loss_mask`` makes its loss and all its gradients NaN (tied GPT-2)."""
    base = gpt2(True)
    loss_mask = np.ones(base.batch["input_ids"].shape, np.float32)
    loss_mask[0, 4] = np.nan
    setup = dataclasses.replace(base, batch=dict(base.batch, loss_mask=loss_mask))
    include = np.arange(B) != 0
    stats = check_private(setup, clip_fn="global", groups="all-layer", mode=mode, include=include, nonfinite=1)
    assert float(stats.clip_factors[0]) == 0


@pytest.mark.parametrize("groups", ["layer-wise", "param-wise"])
def test_fused_drops_nonfinite_groups(groups):
    """fused mode: an example whose loss is finite but whose norm is non-finite in one group contributes nothing to
    that group, is clipped as usual in the others, and is counted as non-finite."""
    setup = with_batch(mlp(), x=((1, 0), np.inf))
    grads = setup.grads
    group_of, names = ref.group_assignment(groups, list(grads))
    norms = ref.group_norms(grads, group_of, names)
    threshold = ref.split_threshold(norms[np.isfinite(norms)])
    thresholds = np.full(len(names), threshold)
    with np.errstate(invalid="ignore", divide="ignore"):
        coef = np.where(np.isfinite(norms), ref.clip_factors(norms, thresholds, "abadi"), 0.0)
    assert coef[1].min() == 0 and coef[1].max() > 0          # dropped in some group, kept in another
    safe = {p: np.where(coef[:, names.index(group_of[p])].reshape((-1,) + (1,) * (g.ndim - 1)) != 0, g, 0.0)
            for p, g in grads.items()}
    expected = {p: v / B for p, v in ref.clipped_sum(safe, coef, group_of, names).items()}
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=threshold * np.sqrt(len(names)), groups=groups,
                      mode="fused")
    _, out, stats = private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0))
    for path, g in ref.flat(out).items():
        np.testing.assert_allclose(g, expected[path], rtol=1e-4, atol=1e-6 * np.abs(expected[path]).max(),
                                   err_msg=path)
    np.testing.assert_allclose(np.asarray(stats.clip_factors), coef, rtol=1e-5)
    assert int(stats.num_nonfinite) == 1
