"""Noise: the Gaussian mechanism on the clipped gradient sum, and the normalisation by the expected batch size.

``G = (sum_i C_i g_i + std * N(0, I)) / expected_batch_size`` with ``std = noise_multiplier * ||(R_1..R_M)||``.
Leaf ``j`` of the gradient pytree draws its noise from ``jax.random.fold_in(key, j)`` (with the blocked generator,
the small leaves together from ``fold_in(key, number of leaves)``), so every coordinate is drawn exactly once from
the key the caller passes. Two generators (``DPConfig.noise_rng``):

* ``"blocked"``: XLA's ``RngBitGenerator`` (Threefry), block by block in place (:func:`standard_normal`); fastest on
  one device, but its values depend on the block layout, not on a coordinate's global index.
* ``"partitionable"``: ``jax.random.normal`` with JAX's partitionable Threefry (``jax_threefry_partitionable``,
  on by default): the bits of a coordinate are a function of ``(key, global index)`` only. Under ``jax.jit`` with a
  sharded gradient, each device draws exactly its own shard (no communication, nothing drawn twice) and the
  noise -- hence the update -- is identical on 1, 2, 4 or 8 devices. The sharded trainer uses it.
Dividing by the *expected* batch size (not the realised one, which depends on the data) keeps the sensitivity
analysis exact under Poisson sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpzero_jax.clipping import l2_sensitivity


def noise_std(noise_multiplier: float, thresholds) -> jax.Array:
    """``sigma * ||(R_1..R_M)||`` (the sensitivity is :func:`dpzero_jax.clipping.l2_sensitivity`)."""
    return noise_multiplier * l2_sensitivity(thresholds)


def _bit_generator_state(key: jax.Array) -> jax.Array:
    """The ``uint32[4]`` state of XLA's threefry bit generator, derived from a JAX PRNG key."""
    words = [jax.random.key_data(jax.random.fold_in(key, i)).reshape(-1) for i in (0, 1)]
    return jnp.concatenate(words).astype(jnp.uint32)[:4]


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform ``uint32`` bits of the given shape from XLA's ``RngBitGenerator`` (Threefry-2x32), a deterministic
    function of ``key``; the source of :func:`standard_normal` (and of the random signs of
    :mod:`dpzero_jax.sketch`)."""
    _, bits = jax.lax.rng_bit_generator(_bit_generator_state(key), shape, jnp.uint32,
                                        algorithm=jax.lax.RandomAlgorithm.RNG_THREE_FRY)
    return bits


def standard_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``N(0, 1)`` float32 samples, a deterministic function of ``key``.

    Bits come from XLA's ``RngBitGenerator`` with the Threefry-2x32 algorithm (the same generator as
    ``jax.random``'s default, expanded by XLA into one fused loop); they become normals exactly as in
    ``jax.random.normal``: a uniform on (-1, 1) from the top 23 bits, then ``sqrt(2) * erfinv``. On XLA:CPU this is
    about 3x faster than ``jax.random.normal`` and needs no temporary buffer, which matters because the noise has
    as many coordinates as the model has parameters.
    """
    bits = random_bits(key, shape)
    unit = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0   # [0, 1)
    lowest = jnp.nextafter(jnp.float32(-1.0), jnp.float32(0.0))
    return jnp.float32(2.0**0.5) * jax.lax.erf_inv(jnp.maximum(lowest, 2.0 * unit - 1.0))


NOISE_RNGS = ("blocked", "partitionable")


def add_noise_and_normalise(clipped_sum, key: jax.Array, std, expected_batch_size: float, rng: str = "blocked"):
    """``(clipped_sum + std * N(0, I)) / expected_batch_size`` leaf by leaf.

    Leaf ``j`` draws from ``fold_in(key, j)`` with the generator ``rng`` (module doc); with ``"blocked"``, the leaves
    of at most ``NOISE_BLOCK`` elements are instead concatenated in flatten order and drawn as one vector from
    ``fold_in(key, number of leaves)``. Every coordinate is still drawn exactly once. Computed in float32 and cast
    back to each leaf's dtype.
    """
    if rng not in NOISE_RNGS:
        raise ValueError(f"noise rng must be one of {NOISE_RNGS}, got {rng!r}")
    if rng == "partitionable" and not jax.config.jax_threefry_partitionable:
        raise ValueError("noise_rng='partitionable' needs jax.config.jax_threefry_partitionable=True (the default); "
                         "it was turned off")
    noised = _noised_leaf if rng == "blocked" else _noised_leaf_partitionable
    leaves, treedef = jax.tree.flatten(clipped_sum)
    small = [j for j, leaf in enumerate(leaves) if leaf.size <= NOISE_BLOCK] if rng == "blocked" else []
    out = [None] * len(leaves)
    if len(small) > 1:
        # One draw for all the small leaves (biases, norm scales, small kernels): one generator in the program
        # instead of one per leaf (each costs ~0.2 s of XLA compile time on CPU), from a key no leaf uses.
        flat = jnp.concatenate([leaves[j].reshape(-1).astype(jnp.float32) for j in small])
        flat = noised(flat, jax.random.fold_in(key, len(leaves)), std, expected_batch_size)
        offset = 0
        for j in small:
            out[j] = flat[offset:offset + leaves[j].size].reshape(leaves[j].shape).astype(leaves[j].dtype)
            offset += leaves[j].size
    for j, leaf in enumerate(leaves):
        if out[j] is None:
            out[j] = noised(leaf, jax.random.fold_in(key, j), std, expected_batch_size).astype(leaf.dtype)
    return jax.tree.unflatten(treedef, out)


def privatize(clipped_sum, key: jax.Array, noise_multiplier: float, sensitivity, expected_batch_size: float,
              rng: str = "blocked"):
    """The Gaussian mechanism and the normalisation: ``(clipped_sum + noise_multiplier * sensitivity * N(0, I)) /
    expected_batch_size``, leaf by leaf as :func:`add_noise_and_normalise` draws it from ``key``; with
    ``noise_multiplier == 0`` only the division (no draw). The one place both :func:`dpzero_jax.private_value_and_grad`
    and :func:`dpzero_jax.gaussian_privatizer` noise a gradient. ``sensitivity``: a float32 scalar, e.g.
    :func:`dpzero_jax.clipping.l2_sensitivity` of the thresholds.
    """
    if noise_multiplier > 0:
        std = noise_multiplier * jnp.asarray(sensitivity, jnp.float32)
        return add_noise_and_normalise(clipped_sum, key, std, expected_batch_size, rng)
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / expected_batch_size).astype(g.dtype), clipped_sum)


def _noised_leaf_partitionable(leaf: jax.Array, key: jax.Array, std, expected_batch_size: float) -> jax.Array:
    """``(leaf + std * N(0, I)) / expected_batch_size`` in float32; noise from ``jax.random.normal(key, shape)``."""
    return (leaf.astype(jnp.float32) + std * jax.random.normal(key, leaf.shape, jnp.float32)) / expected_batch_size


NOISE_BLOCK = 1 << 16   # elements per draw for large leaves; part of the definition of the noise for a given key


def _noised_leaf(leaf: jax.Array, key: jax.Array, std, expected_batch_size: float) -> jax.Array:
    """``(leaf + std * N(0, I)) / expected_batch_size`` in float32.

    A leaf larger than ``NOISE_BLOCK`` is noised block by block in place (block ``c`` from ``fold_in(key, c)``):
    drawing it in one go would make XLA keep a second copy of the gradient alive.
    """
    size = leaf.size
    flat = leaf.reshape(-1).astype(jnp.float32)
    if size <= NOISE_BLOCK:
        return ((flat + std * standard_normal(key, (size,))) / expected_batch_size).reshape(leaf.shape)
    n_blocks = -(-size // NOISE_BLOCK)
    blocks = jnp.pad(flat, (0, n_blocks * NOISE_BLOCK - size)).reshape(n_blocks, NOISE_BLOCK)

    def noise_block(index, blocks):
        noise = standard_normal(jax.random.fold_in(key, index), (NOISE_BLOCK,))
        return blocks.at[index].set((blocks[index] + std * noise) / expected_batch_size)

    blocks = jax.lax.fori_loop(0, n_blocks, noise_block, blocks)
    return blocks.reshape(-1)[:size].reshape(leaf.shape)
