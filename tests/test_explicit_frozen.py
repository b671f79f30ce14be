"""Frozen variables (a PEFT base model) under the ``explicit`` strategy at ZeRO-3: they enter the ``shard_map`` as
shards and each is gathered where the traced program uses it, as a parameter is, instead of being captured whole
by the step (``dpzero_jax.frozen_shards``).

The model is the flax.linen decoder of ``zero3_linen.py`` (``nn.scan`` over ``nn.remat`` blocks, a tied table) on
8 virtual devices with its matrices and table frozen and its biases, norms, gates and position table trained.
References are independent of the engine: ``jax.vmap(jax.grad)`` per-example gradients of the trained leaves on
whole arrays, clipped and summed in the test; ``jax.grad`` of the mean loss; the model's own forward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zero3_linen import BATCH, assert_sums_close, setup
from zero3_linen import rules as make_rules

from dpzero_jax import DPConfig, sharding

MAX_GRAD_NORM = 0.05


def _split(params):
    """``(trained, frozen)``: the kernels and the table frozen (2-D and up, the position table aside), the rest
    trained."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = {jax.tree_util.keystr(path): x for path, x in flat}
    frozen = {k for k, x in keys.items() if x.ndim >= 3 or k == "['Embed_0']['embedding']"}
    trained = jax.tree.map_with_path(lambda p, x: None if jax.tree_util.keystr(p) in frozen else x, params)
    base = jax.tree.map_with_path(lambda p, x: x if jax.tree_util.keystr(p) in frozen else None, params)
    return trained, base


def _merge(trained, frozen):
    return jax.tree.map(lambda t, f: f if t is None else t, trained, frozen, is_leaf=lambda x: x is None)


@pytest.fixture(scope="module")
def model():
    _, params, batch, loss_fn = setup(scan=True, remat=True)
    trained, frozen = _split(params)
    assert sum(x.size for x in jax.tree.leaves(frozen)) > 4 * sum(x.size for x in jax.tree.leaves(trained))

    def loss(trained, batch, frozen=None):
        return loss_fn(_merge(trained, frozen), batch)

    return trained, frozen, batch, loss


def _placed(rules, tree):
    return jax.device_put(tree, rules.params(tree))


def _reference(loss, trained, frozen, batch, mask):
    """``sum_i mask_i min(1, R / ||g_i||) g_i / B``: one all-layer group over the trained leaves."""
    per_example = jax.vmap(jax.grad(lambda p, ids: loss(p, {"ids": ids[None]}, frozen=frozen)[0]),
                           in_axes=(None, 0))(trained, batch["ids"])
    norms = jnp.sqrt(sum(jnp.sum(jnp.square(g.reshape(BATCH, -1)), axis=1) for g in jax.tree.leaves(per_example)))
    scale = jnp.minimum(1.0, MAX_GRAD_NORM / norms) * mask
    return jax.tree.map(lambda g: jnp.einsum("b,b...->...", scale, g) / BATCH, per_example)


@pytest.mark.parametrize("mode", ["bk", "ghost", "fused"])
def test_private_gradient_with_sharded_frozen_variables_equals_vmap_grad(model, mode):
    trained, frozen, batch, loss = model
    rules = make_rules()
    mask = jnp.ones((BATCH,), bool).at[5].set(False)
    dp = DPConfig(noise_multiplier=0.0, max_grad_norm=MAX_GRAD_NORM, expected_batch_size=BATCH, mode=mode,
                  front_end="program", noise_rng="partitionable")
    gradient = sharding.explicit_private_gradient(loss, dp, rules, trained)
    step = jax.jit(lambda p, b, m, f: gradient(p, b, jax.random.key(0), m, frozen=f)[1])
    actual = step(_placed(rules, trained), batch, mask, _placed(rules, frozen))
    assert_sums_close(actual, _reference(loss, trained, frozen, batch, mask))


def test_mean_gradient_and_forward_with_sharded_frozen_variables(model):
    trained, frozen, batch, loss = model
    rules = make_rules()
    mask = jnp.ones((BATCH,), bool).at[2].set(False)
    gradient = sharding.explicit_mean_gradient(loss, rules, trained)
    _, actual = jax.jit(lambda p, b, m, f: gradient(p, b, None, m, frozen=f))(
        _placed(rules, trained), batch, mask, _placed(rules, frozen))
    expected = jax.grad(lambda p: jnp.sum(loss(p, batch, frozen=frozen) * mask) / jnp.sum(mask))(trained)
    assert_sums_close(actual, expected)

    model_def = setup(scan=True, remat=True)[0]

    def apply_fn(p, ids, frozen=None):
        return model_def.apply({"params": _merge(p, frozen)}, ids)

    apply = sharding.explicit_apply(apply_fn, rules, trained)
    logits = jax.jit(lambda p, ids, f: apply(p, ids, frozen=f))(_placed(rules, trained), batch["ids"],
                                                                 _placed(rules, frozen))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(apply_fn(trained, batch["ids"], frozen)),
                               rtol=1e-5, atol=1e-5)


def _all_gathers(text: str) -> list[tuple[int, ...]]:
    """Output shapes of the compiled program's all-gathers."""
    return [tuple(int(n) for n in dims.split(",") if n)
            for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(", text)]


def test_each_frozen_matrix_is_gathered_one_layer_at_a_time(model):
    """Compiled private step: no all-gather makes a stacked frozen matrix whole (``[L, ...]``); each layer's slice is
    gathered in the scan. The same loss capturing the frozen variables (the strategy before) gathers them whole."""
    trained, frozen, batch, loss = model
    rules = make_rules()
    stacked = {tuple(x.shape) for x in jax.tree.leaves(frozen) if x.ndim >= 3}
    per_layer = {s[1:] for s in stacked}
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=MAX_GRAD_NORM, expected_batch_size=BATCH, mode="bk",
                  front_end="program", noise_rng="partitionable")
    mask = jnp.ones((BATCH,), bool)
    placed_trained, placed_frozen = _placed(rules, trained), _placed(rules, frozen)

    passed = sharding.explicit_private_gradient(loss, dp, rules, trained)
    text = jax.jit(lambda p, b, m, f: passed(p, b, jax.random.key(0), m, frozen=f)[1]).lower(
        placed_trained, batch, mask, placed_frozen).compile().as_text()
    shapes = _all_gathers(text)
    assert not stacked & set(shapes)
    assert per_layer <= set(shapes)

    def captured(p, b, m, f):   # the step's argument captured by the loss, not passed to the gradient
        def captured_loss(q, batch):
            return loss(q, batch, frozen=f)
        return sharding.explicit_private_gradient(captured_loss, dp, rules, trained)(p, b, jax.random.key(0), m)[1]

    text = jax.jit(captured).lower(placed_trained, batch, mask, placed_frozen).compile().as_text()
    assert stacked & set(_all_gathers(text))
