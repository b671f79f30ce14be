"""Noise: the Gaussian mechanism on the clipped gradient sum, and the normalisation by the expected batch size.

``G = (sum_i C_i g_i + std * N(0, I)) / expected_batch_size`` with ``std = noise_multiplier * ||(R_1..R_M)||``.
Leaf ``j`` of the gradient pytree draws its noise from ``jax.random.fold_in(key, j)`` (with the blocked generator,
the small leaves together from ``fold_in(key, number of leaves)``; see :func:`add_noise_and_normalise`), so every
coordinate is drawn exactly once from the key the caller passes. Two generators (``DPConfig.noise_rng``; its default
``"auto"`` is ``"blocked"`` on a CPU and ``"partitionable"`` on a GPU or TPU, see :func:`resolve_rng`):

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
import numpy as np

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
NOISE_RNG_OPTIONS = ("auto", *NOISE_RNGS)


def resolve_rng(rng: str, target: str | None = None) -> str:
    """The generator ``rng`` names; ``"auto"``: ``"blocked"`` when the step runs on a CPU (``target``; ``None``:
    ``jax.default_backend()``), ``"partitionable"`` on a GPU or TPU.

    The blocked generator's loop over ``NOISE_BLOCK``-element blocks runs one block after another: on XLA:CPU each
    iteration is a fused loop over the block (about 3x faster than ``jax.random.normal``, no temporary), but on a GPU
    every iteration is a handful of tiny kernels -- GPT-2 small's 163M coordinates are 2,479 iterations, measured on an
    H200 at 1.3 s a step against 31 ms for the whole non-private step (``docs/benchmarks/gpu.md``). The partitionable
    generator is one elementwise computation per leaf, fused into the noised update. With
    ``jax_threefry_partitionable`` turned off, ``"auto"`` is ``"blocked"`` everywhere.
    """
    if rng not in NOISE_RNG_OPTIONS:
        raise ValueError(f"noise rng must be one of {NOISE_RNG_OPTIONS}, got {rng!r}")
    if rng != "auto":
        return rng
    on_cpu = (target or jax.default_backend()) == "cpu"
    return "blocked" if on_cpu or not jax.config.jax_threefry_partitionable else "partitionable"


def add_noise_and_normalise(clipped_sum, key: jax.Array, std, expected_batch_size: float, rng: str = "auto"):
    """``(clipped_sum + std * N(0, I)) / expected_batch_size`` leaf by leaf.

    ``rng``: see :func:`resolve_rng` (``"auto"``: by ``jax.default_backend()``). With ``"partitionable"``, leaf
    ``j`` draws from ``fold_in(key, j)``. With ``"blocked"``, the leaves of at most ``NOISE_BLOCK`` elements are
    concatenated in flatten order into one vector ``s`` whose key is ``fold_in(key, number of leaves)``; the other
    leaves keep ``fold_in(key, j)``. When ``s`` is the only vector and has at most ``NOISE_BLOCK`` elements, it is
    one draw from its key; otherwise ``s`` and every large leaf are drawn block by block in place (block ``c`` from
    ``fold_in(its key, c)``) by one loop (:func:`_noised_vectors`). Every coordinate is drawn exactly once.
    Computed in float32 and cast back to each leaf's dtype.
    """
    rng = resolve_rng(rng)
    if rng == "partitionable" and not jax.config.jax_threefry_partitionable:
        raise ValueError("noise_rng='partitionable' needs jax.config.jax_threefry_partitionable=True (the default); "
                         "it was turned off")
    leaves, treedef = jax.tree.flatten(clipped_sum)
    if not leaves:
        return clipped_sum
    if rng == "partitionable":
        return jax.tree.unflatten(treedef, [
            _noised_leaf_partitionable(leaf, jax.random.fold_in(key, j), std, expected_batch_size).astype(leaf.dtype)
            for j, leaf in enumerate(leaves)])
    small = [j for j, leaf in enumerate(leaves) if leaf.size <= NOISE_BLOCK]
    large = [j for j, leaf in enumerate(leaves) if leaf.size > NOISE_BLOCK]
    # The small leaves (biases, norm scales, small kernels) are drawn together as one more vector, from a key no leaf
    # uses; with the large ones, everything comes from one generator (each costs ~0.5 s of XLA compile time on CPU).
    vectors = [leaves[j] for j in large]
    if small:
        vectors.append(jnp.concatenate([leaves[j].reshape(-1).astype(jnp.float32) for j in small]))
    if any(v.size > NOISE_BLOCK for v in vectors):
        noised = _noised_vectors(vectors, key, large + [len(leaves)] * bool(small), std, expected_batch_size)
    else:   # small leaves only, at most NOISE_BLOCK elements in all: one draw of exactly their size
        normal = standard_normal(jax.random.fold_in(key, len(leaves)), vectors[0].shape)
        noised = [(vectors[0] + std * normal) / expected_batch_size]
    out = [None] * len(leaves)
    for j, value in zip(large, noised):
        out[j] = value.astype(leaves[j].dtype)
    offset = 0
    for j in small:
        out[j] = noised[-1][offset:offset + leaves[j].size].reshape(leaves[j].shape).astype(leaves[j].dtype)
        offset += leaves[j].size
    return jax.tree.unflatten(treedef, out)


def privatize(clipped_sum, key: jax.Array, noise_multiplier: float, sensitivity, expected_batch_size: float,
              rng: str = "auto"):
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


def _noised_vectors(leaves, key: jax.Array, indices, std, expected_batch_size: float) -> list[jax.Array]:
    """``(leaf + std * N(0, I)) / expected_batch_size`` in float32 for each of ``leaves``.

    Each leaf is noised block by block in place, block ``c`` of ``leaves[j]`` (elements ``[c * NOISE_BLOCK, (c + 1)
    * NOISE_BLOCK)`` of the flattened leaf) from ``fold_in(fold_in(key, indices[j]), c)``; a last partial block takes
    the first elements of its draw. Drawing a large leaf in one go would make XLA keep a second copy of the gradient
    alive. One loop visits the blocks of all the leaves with one generator in its body; the block's owner is updated
    under a ``cond``, in place, on the flattened leaf itself (a float32 leaf is neither padded nor copied).
    """
    flats = [leaf.reshape(-1).astype(jnp.float32) for leaf in leaves]
    n_blocks = [-(-flat.size // NOISE_BLOCK) for flat in flats]
    owner = jnp.asarray(np.repeat(np.arange(len(flats)), n_blocks), jnp.int32)
    leaf_index = jnp.asarray(np.repeat(np.asarray(indices), n_blocks), jnp.int32)
    local = jnp.asarray(np.concatenate([np.arange(n) for n in n_blocks]), jnp.int32)

    def updater(size: int):
        full, tail = divmod(size, NOISE_BLOCK)

        def full_block(flat, c, normal):
            start = c * NOISE_BLOCK
            block = jax.lax.dynamic_slice(flat, (start,), (NOISE_BLOCK,))
            return jax.lax.dynamic_update_slice(flat, (block + std * normal) / expected_batch_size, (start,))

        def last_block(flat, c, normal):
            return flat.at[full * NOISE_BLOCK:].set((flat[full * NOISE_BLOCK:] + std * normal[:tail])
                                                    / expected_batch_size)
        if not tail:
            return full_block
        if not full:
            return last_block
        return lambda flat, c, normal: jax.lax.cond(c < full, full_block, last_block, flat, c, normal)

    updaters = [updater(flat.size) for flat in flats]

    def noise_block(step, flats):
        owner_now, c = owner[step], local[step]
        normal = standard_normal(jax.random.fold_in(jax.random.fold_in(key, leaf_index[step]), c), (NOISE_BLOCK,))
        return tuple(jax.lax.cond(owner_now == j, update, lambda f, c, n: f, flat, c, normal)
                     for j, (flat, update) in enumerate(zip(flats, updaters)))

    flats = jax.lax.fori_loop(0, int(sum(n_blocks)), noise_block, tuple(flats))
    return [flat.reshape(leaf.shape) for flat, leaf in zip(flats, leaves)]
