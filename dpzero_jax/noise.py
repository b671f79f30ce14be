"""Noise: the Gaussian mechanism on the clipped gradient sum, and the normalisation by the expected batch size.

``G = (sum_i C_i g_i + std * N(0, I)) / expected_batch_size`` with ``std = noise_multiplier * ||(R_1..R_M)||``.
Leaf ``j`` of the gradient pytree draws its noise from ``jax.random.fold_in(key, j)``, so every coordinate is drawn
exactly once, from the key the caller passes; with a sharded gradient each device draws only its own shard.
Dividing by the *expected* batch size (not the realised one, which depends on the data) keeps the sensitivity
analysis exact under Poisson sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def noise_std(noise_multiplier: float, thresholds) -> jax.Array:
    """``sigma * ||(R_1..R_M)||``."""
    return noise_multiplier * jnp.sqrt(jnp.sum(jnp.square(jnp.asarray(thresholds, jnp.float32))))


def add_noise_and_normalise(clipped_sum, key: jax.Array, std, expected_batch_size: float):
    """``(clipped_sum + std * N(0, I)) / expected_batch_size`` leaf by leaf.

    Computed in float32 and cast back to each leaf's dtype.
    """
    leaves, treedef = jax.tree.flatten(clipped_sum)
    out = []
    for j, leaf in enumerate(leaves):
        noise = jax.random.normal(jax.random.fold_in(key, j), leaf.shape, jnp.float32)
        out.append(((leaf.astype(jnp.float32) + std * noise) / expected_batch_size).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, out)
