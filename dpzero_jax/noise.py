"""Noise: the Gaussian mechanism on the clipped gradient sum, and the normalisation by the expected batch size.

``G = (sum_i C_i g_i + std * N(0, I)) / expected_batch_size`` with ``std = noise_multiplier * ||(R_1..R_M)||``.
Leaf ``j`` of the gradient pytree draws its noise from ``jax.random.fold_in(key, j)``, block by block, so every
coordinate is drawn exactly once from the key the caller passes, whatever the device count.
Dividing by the *expected* batch size (not the realised one, which depends on the data) keeps the sensitivity
analysis exact under Poisson sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def noise_std(noise_multiplier: float, thresholds) -> jax.Array:
    """``sigma * ||(R_1..R_M)||``."""
    return noise_multiplier * jnp.sqrt(jnp.sum(jnp.square(jnp.asarray(thresholds, jnp.float32))))


NOISE_BLOCK = 1 << 16   # elements drawn per random call; part of the definition of the noise for a given key


def _noised_leaf(leaf: jax.Array, key: jax.Array, std, expected_batch_size: float) -> jax.Array:
    """``(leaf + std * N(0, I)) / expected_batch_size`` with the noise drawn ``NOISE_BLOCK`` elements at a time.

    Block ``c`` of the flattened leaf uses ``fold_in(key, c)``. Drawing a large leaf in one call makes XLA hold
    about three copies of it in random bits and intermediates; block by block, only one block's worth.
    """
    size = leaf.size
    flat = leaf.reshape(-1).astype(jnp.float32)
    if size <= NOISE_BLOCK:
        return ((flat + std * jax.random.normal(key, (size,), jnp.float32)) / expected_batch_size).reshape(leaf.shape)
    n_blocks = -(-size // NOISE_BLOCK)
    blocks = jnp.pad(flat, (0, n_blocks * NOISE_BLOCK - size)).reshape(n_blocks, NOISE_BLOCK)

    def noise_block(index, blocks):  # updates the loop carry in place
        noise = jax.random.normal(jax.random.fold_in(key, index), (NOISE_BLOCK,), jnp.float32)
        return blocks.at[index].set((blocks[index] + std * noise) / expected_batch_size)

    blocks = jax.lax.fori_loop(0, n_blocks, noise_block, blocks)
    return blocks.reshape(-1)[:size].reshape(leaf.shape)


def add_noise_and_normalise(clipped_sum, key: jax.Array, std, expected_batch_size: float):
    """``(clipped_sum + std * N(0, I)) / expected_batch_size`` leaf by leaf.

    Leaf ``j`` draws from ``fold_in(key, j)`` (see :func:`_noised_leaf`). Computed in float32 and cast back to each
    leaf's dtype.
    """
    leaves, treedef = jax.tree.flatten(clipped_sum)
    out = [_noised_leaf(leaf, jax.random.fold_in(key, j), std, expected_batch_size).astype(leaf.dtype)
           for j, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)
