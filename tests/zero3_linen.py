"""A flax.linen decoder for the ZeRO-3 (``strategy="explicit"``) tests of the traced-program front-end: a tied
``nn.Embed`` head (or an untied ``nn.Dense`` one), a bare position table, ``nn.DenseGeneral`` attention, an
``nn.Dense`` MLP, ``nn.LayerNorm`` and a per-block gate; blocks unrolled or ``nn.scan``-ned, optionally under
``nn.remat``; sharded on 8 virtual devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax import sharding

WIDTH, HEADS, SEQ, VOCAB, BATCH = 32, 2, 8, 64, 16


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, h, _=None):
        y = nn.LayerNorm()(h)
        q, k, v = (nn.DenseGeneral((HEADS, self.width // HEADS), name=n)(y) for n in ("query", "key", "value"))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        h = h + nn.DenseGeneral(self.width, axis=(-2, -1), name="out")(y)
        y = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
        gate = self.param("gate", nn.initializers.ones, (4,))   # stacked [L, 4] at L = 4: split on the scan axis
        y = nn.Dense(self.width)(jax.nn.gelu(y))
        return h + (y.reshape(y.shape[:-1] + (4, -1)) * gate[:, None]).reshape(y.shape), None


class Decoder(nn.Module):
    layers: int
    scan: bool
    remat: bool = False
    width: int = WIDTH
    tied: bool = True
    vocab: int = VOCAB

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(self.vocab, self.width)
        h = embed(ids) + self.param("position", nn.initializers.normal(0.02), (SEQ, self.width))
        block = nn.remat(Block) if self.remat else Block
        if self.scan:
            h, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.layers)(self.width)(h)
        else:
            for _ in range(self.layers):
                h, _ = block(self.width)(h)
        h = nn.LayerNorm()(h)
        return embed.attend(h) if self.tied else nn.Dense(self.vocab, use_bias=False, name="head")(h)


def setup(scan: bool, remat: bool = False, width: int = WIDTH, tied: bool = True, vocab: int = VOCAB):
    model = Decoder(4 if scan else 2, scan, remat, width, tied, vocab)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (BATCH, SEQ)), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), ids)["params"]

    def loss_fn(params, batch):
        logp = jax.nn.log_softmax(model.apply({"params": params}, batch["ids"])[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][:, 1:, None], -1)[..., 0], axis=-1)

    return model, params, {"ids": ids}, loss_fn


def rules(min_shard_elements=16, sum_chunk_bytes=sharding.DEFAULT_SUM_CHUNK_BYTES):
    return sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(2, 4)), 3, min_shard_elements,
                                  sum_chunk_bytes)


def assert_sums_close(actual, expected, rtol=1e-4):
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(expected))
    for path_x, y in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
        path, x = path_x
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))
