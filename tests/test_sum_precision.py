"""The privatized sum's sensitivity in mixed precision: adding or removing one example moves the clipped sum by at
most the threshold, in every engine mode and sharding strategy.

A bfloat16 model (float32 master weights cast to bfloat16 at their uses) whose clipped sum were written in bfloat16
-- each device's sum rounded, the devices' sums added in bfloat16 -- would move by more than one example's clipped
contribution when that example is masked out: the rounding error of a sum grows with the sum (about ``2^-8 |sum|``
per coordinate), so near-identical examples, whose clipped gradients add up, expose it (up to 1.5% over the
threshold here, before the sums were accumulated in float32). The reference is the definition of L2 sensitivity and
the clipping bound ``||C_i g_i|| <= C``, not the engine's own output.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpzero_jax as dz
from dpzero_jax import sharding, spmd

BATCH, LENGTH, WIDTH, VOCAB, THRESHOLD = 32, 8, 16, 24, 0.01
BF16 = jnp.bfloat16


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _=None):
        y = nn.Dense(4 * WIDTH, dtype=BF16)(nn.LayerNorm(dtype=BF16)(h))
        return h + nn.Dense(WIDTH, dtype=BF16)(jax.nn.gelu(y)), None


class _Decoder(nn.Module):
    """A tied embedding and head, two scanned blocks (``nn.remat`` around each with ``remat``), all in bfloat16."""
    remat: bool = False

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, WIDTH, dtype=BF16)
        block = nn.remat(_Block) if self.remat else _Block
        h, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(embed(ids))
        return embed.attend(nn.LayerNorm(dtype=BF16)(h))


def _setup(remat: bool):
    model = _Decoder(remat)
    rng = np.random.default_rng(0)
    ids = np.repeat(rng.integers(0, VOCAB, (1, LENGTH)), BATCH, 0)
    ids[:, -1] = rng.integers(0, VOCAB, BATCH)   # near-identical sequences: their clipped gradients add up
    ids = jnp.asarray(ids, jnp.int32)
    params = model.init(jax.random.key(0), ids)["params"]
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["ids"]).astype(jnp.float32)[:, :-1]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][:, 1:, None], -1)[..., 0], axis=-1)
    return params, {"ids": ids}, loss_fn


def _largest_move(summed, params, batch, mask) -> float:
    """``max_j ||S(D) - S(D - j)|| / C`` over a few examples ``j``, ``S`` the noiseless privatized sum."""
    def on_host(tree):   # float64 on the host: the distance is not itself rounded, and needs no collective
        return [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(tree)]

    full = on_host(summed(params, batch, mask))
    moves = []
    for j in range(0, BATCH, BATCH // 4):
        without = on_host(summed(params, batch, mask.at[j].set(False)))
        moves.append(np.sqrt(sum(np.sum(np.square(a - b)) for a, b in zip(full, without))))
    return max(moves) / THRESHOLD


def _config(mode):
    # expected_batch_size=1 and no noise: the returned gradient is the clipped sum itself
    return dz.DPConfig(noise_multiplier=0.0, max_grad_norm=THRESHOLD, mode=mode, expected_batch_size=1)


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
@pytest.mark.parametrize("mode", ["bk", "ghost", "fused", "vmap"])
def test_one_example_moves_the_bf16_sum_by_at_most_the_threshold(mode, remat):
    params, batch, loss_fn = _setup(remat)
    private = dz.private_value_and_grad(loss_fn, _config(mode))
    summed = jax.jit(lambda p, b, m: private(p, b, jax.random.key(0), m)[1])
    move = _largest_move(summed, params, batch, jnp.ones(BATCH, bool))
    assert 0.5 < move <= 1 + 1e-4, move   # clipped (the move is about C), and never more than C


@pytest.mark.parametrize("strategy", ["gspmd", "explicit"])
@pytest.mark.parametrize("mode", ["bk", "ghost", "fused"])
def test_sharded_sums_are_added_over_devices_in_float32(mode, strategy):
    """Eight devices, four examples each, weights under ZeRO-3: every device's sum and their total in float32
    (the explicit strategy gathers bfloat16 weights for the forward, the weight paths' float32 views only for the
    transpose that reduce-scatters the sum)."""
    params, batch, loss_fn = _setup(remat=True)
    mesh = sharding.make_mesh(sharding.MeshShape(data=1, fsdp=8))
    rules = sharding.ShardingRules(mesh, 3)
    split = NamedSharding(mesh, P(("data", "fsdp")))
    cfg = _config(mode)
    if strategy == "gspmd":
        def summed(p, b, m):
            with spmd.batch_sharded(mesh):
                return dz.private_value_and_grad(loss_fn, cfg)(p, b, jax.random.key(0), m)[1]
    else:
        def summed(p, b, m):
            return sharding.explicit_private_gradient(loss_fn, cfg, rules, params)(p, b, jax.random.key(0), m)[1]
    move = _largest_move(jax.jit(summed), jax.device_put(params, rules.params(params)),
                         jax.device_put(batch, split), jax.device_put(jnp.ones(BATCH, bool), split))
    assert 0.5 < move <= 1 + 1e-4, move


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_layers_front_end_sum_is_exact_in_bf16(mode):
    """``dpzero_jax.layers`` layers on bfloat16 activations (``front_end="layers"``): the coefficient-scaled output
    gradients enter the contraction in float32 (before: rounded to bfloat16 first, 1.0002x the threshold here)."""
    from flax import nnx

    class _MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = dz.layers.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
            self.out = dz.layers.Linear(4 * WIDTH, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x.astype(BF16))))

    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    x = np.repeat(rng.normal(size=(1, WIDTH)), BATCH, 0) * (1 + 1e-3 * rng.normal(size=(BATCH, WIDTH)))
    batch = {"x": jnp.asarray(x, jnp.float32), "y": jnp.full(BATCH, 3)}

    def loss_fn(p, b):
        logits = nnx.merge(graphdef, p)(b["x"]).astype(jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]

    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=THRESHOLD, mode=mode, expected_batch_size=1,
                      front_end="layers")
    private = dz.private_value_and_grad(loss_fn, cfg)
    summed = jax.jit(lambda p, b, m: private(p, b, jax.random.key(0), m)[1])
    move = _largest_move(summed, params, batch, jnp.ones(BATCH, bool))
    assert 0.5 < move <= 1 + 1e-5, move
