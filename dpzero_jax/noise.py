"""Noise: the Gaussian mechanism on the clipped gradient sum, and the normalisation by the expected batch size.

``G = (sum_i C_i g_i + std * N(0, I)) / expected_batch_size`` with ``std = noise_multiplier * ||(R_1..R_M)||``.
Leaf ``j`` of the gradient pytree gets ``jax.random.normal(jax.random.fold_in(key, j), leaf.shape)`` -- JAX's
partitionable Threefry (``jax_threefry_partitionable``, on by default), whose bits for a coordinate are a function of
``(key, the coordinate's index in the leaf)`` only -- so every coordinate is drawn exactly once from the key the
caller passes, and the noise, hence the update, is the same on any backend, on 1, 2, 4 or 8 devices and under any
sharding. Two ways of computing those same values (``DPConfig.noise_rng``; its default ``"auto"`` is ``"blocked"``
on a CPU and ``"partitionable"`` on a GPU or TPU, see :func:`resolve_rng`):

* ``"blocked"``: Threefry on the coordinates' counters written out as elementwise operations
  (:func:`threefry_2x32`, :func:`normal_at`), two loops over blocks of coordinates updated in place
  (:func:`_noised_in_blocks`); fastest on one CPU, no gradient-sized temporary, two generators in the program
  whatever the number of leaves;
* ``"partitionable"``: ``jax.random.normal``, one elementwise computation that XLA fuses into the noised update;
  the leaves' keys derived in one call and the small leaves of one shape drawn in one (:func:`_noised_partitionable`);
  under ``jax.jit`` with a sharded gradient each device draws exactly its own shard.

(A key of another PRNG implementation than Threefry is drawn by ``jax.random.normal`` either way.) Dividing by the
*expected* batch size (not the realised one, which depends on the data) keeps the sensitivity analysis exact under
Poisson sampling.
"""

from __future__ import annotations

import math

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
    function of ``key``: the random signs and Gaussian entries of :mod:`dpzero_jax.sketch` (not the privacy noise,
    which :func:`add_noise_and_normalise` draws)."""
    _, bits = jax.lax.rng_bit_generator(_bit_generator_state(key), shape, jnp.uint32,
                                        algorithm=jax.lax.RandomAlgorithm.RNG_THREE_FRY)
    return bits


def standard_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``N(0, 1)`` float32 samples from :func:`random_bits`, mapped to normals as ``jax.random.normal`` maps its bits
    (a uniform on (-1, 1) from the top 23 bits, then ``sqrt(2) * erfinv``): the Gaussian sketch's entries."""
    bits = random_bits(key, shape)
    unit = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0   # [0, 1)
    lowest = jnp.nextafter(jnp.float32(-1.0), jnp.float32(0.0))
    return jnp.float32(2.0**0.5) * jax.lax.erf_inv(jnp.maximum(lowest, 2.0 * unit - 1.0))


NOISE_RNGS = ("blocked", "partitionable")
NOISE_RNG_OPTIONS = ("auto", *NOISE_RNGS)


def resolve_rng(rng: str, target: str | None = None) -> str:
    """How the noise is computed (both give the same values, see the module doc); ``"auto"``: ``"blocked"`` when the
    step runs on a CPU (``target``; ``None``: ``jax.default_backend()``), ``"partitionable"`` on a GPU or TPU.

    The blocked loop runs one block after another: on XLA:CPU each iteration is one fused, vectorised loop over the
    block (about 3x faster than ``jax.random.normal`` there, no temporary), but on a GPU every iteration is a handful
    of tiny kernels -- GPT-2 small's 163M coordinates are 2,479 iterations, measured on an H200 at 1.3 s a step
    against 31 ms for the whole non-private step (``docs/benchmarks/gpu.md``). ``jax.random.normal`` is one
    elementwise computation per leaf (per shape of small leaf), fused into the noised update. With
    ``jax_threefry_partitionable`` turned off (``jax.random.normal`` then draws other values), ``"auto"`` is
    ``"blocked"`` everywhere.
    """
    if rng not in NOISE_RNG_OPTIONS:
        raise ValueError(f"noise rng must be one of {NOISE_RNG_OPTIONS}, got {rng!r}")
    if rng != "auto":
        return rng
    on_cpu = (target or jax.default_backend()) == "cpu"
    return "blocked" if on_cpu or not jax.config.jax_threefry_partitionable else "partitionable"


def add_noise_and_normalise(clipped_sum, key: jax.Array, std, expected_batch_size: float, rng: str = "auto"):
    """``(clipped_sum + std * N(0, I)) / expected_batch_size`` leaf by leaf, leaf ``j``'s noise
    ``jax.random.normal(fold_in(key, j), leaf.shape)`` whichever ``rng`` computes it (see :func:`resolve_rng`;
    ``"auto"``: by ``jax.default_backend()``). Computed in float32 and cast back to each leaf's dtype."""
    rng = resolve_rng(rng)
    if rng == "partitionable" and not jax.config.jax_threefry_partitionable:
        raise ValueError("noise_rng='partitionable' needs jax.config.jax_threefry_partitionable=True (the default); "
                         "it was turned off")
    leaves, treedef = jax.tree.flatten(clipped_sum)
    if not leaves:
        return clipped_sum
    if rng == "partitionable" or not _is_threefry(key):
        return jax.tree.unflatten(treedef, _noised_partitionable(leaves, key, std, expected_batch_size))
    return jax.tree.unflatten(treedef, _noised_in_blocks(leaves, key, std, expected_batch_size))


GROUPED_DRAW_MAX = 1 << 16   # leaves of at most this many elements are drawn together with the others of their shape


def _noised_partitionable(leaves, key: jax.Array, std, expected_batch_size: float) -> list[jax.Array]:
    """``(leaf + std * N(0, I)) / expected_batch_size`` in float32, cast back, leaf ``j``'s noise
    ``jax.random.normal(fold_in(key, j), leaf.shape)``: the keys derived by one ``fold_in`` mapped over the leaf
    indices, and the leaves of at most ``GROUPED_DRAW_MAX`` elements (biases, norm scales) drawn by one
    ``jax.random.normal`` mapped over the keys of each shape (``jax.vmap``: row ``r`` is exactly key ``r``'s draw);
    each larger leaf is drawn on its own, a computation XLA fuses into that leaf's update. Why: JAX writes each
    Threefry call out in full on a GPU or TPU (~230 operations; a loop on a CPU), and two calls a leaf made the
    noise most of a private step's program (GPT-2 small lowered for CUDA: 68k of its 90k operations, against 10k for
    the whole non-private step; ``experiments/lowered_size.py``, ``docs/benchmarks/gpu.md``). Larger leaves are not
    grouped because their mapped draw is written to memory before use (compiled for TPU, Llama-2-7B's scanned
    weights grouped by shape added 0.07 GiB of temporaries a chip). A key of another implementation (``rbg``:
    mapped over keys, its draws are not each key's own) is drawn leaf by leaf."""
    if not _is_threefry(key):
        return [_noised_leaf(leaf, jax.random.normal(jax.random.fold_in(key, j), leaf.shape, jnp.float32), std,
                             expected_batch_size) for j, leaf in enumerate(leaves)]
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(len(leaves), dtype=jnp.uint32))
    out: list = [None] * len(leaves)
    small: dict[tuple[int, ...], list[int]] = {}
    for j, leaf in enumerate(leaves):
        if leaf.size <= GROUPED_DRAW_MAX:
            small.setdefault(tuple(leaf.shape), []).append(j)
        else:
            out[j] = _noised_leaf(leaf, jax.random.normal(keys[j], leaf.shape, jnp.float32), std,
                                  expected_batch_size)
    for shape, members in small.items():
        draws = jax.vmap(lambda k, shape=shape: jax.random.normal(k, shape, jnp.float32))(keys[np.asarray(members)])
        for row, j in enumerate(members):
            out[j] = _noised_leaf(leaves[j], draws[row], std, expected_batch_size)
    return out


def _noised_leaf(leaf: jax.Array, normal: jax.Array, std, expected_batch_size: float) -> jax.Array:
    """``(leaf + std * normal) / expected_batch_size`` in float32, cast back to the leaf's dtype."""
    return ((leaf.astype(jnp.float32) + std * normal) / expected_batch_size).astype(leaf.dtype)


def _is_threefry(key: jax.Array) -> bool:
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):   # a raw uint32 key: the default implementation
        key = jax.random.wrap_key_data(key)
    return str(jax.random.key_impl(key)) == "threefry2x32"


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


# --- Threefry on counters: the partitionable values, computed in blocks -------------------------------------------

_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry_2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011): key words ``k0, k1``, counter words ``x0, x1`` (uint32,
    broadcast together) -> two uint32 output words. The function ``jax.extend.random.threefry_2x32`` computes, written
    as plain elementwise operations so that XLA:CPU fuses all 20 rounds into one vectorised loop (JAX's own lowering
    runs its rounds as a loop over whole arrays, about 3x slower there). Written with ``lax`` operations: each
    ``jax.numpy`` operator is a function compiled for its operands' shapes, which made the first trace of this
    function at a new block size take ~0.1 s."""
    shape = np.broadcast_shapes(*(np.shape(v) for v in (k0, k1, x0, x1)))
    k0, k1, x0, x1 = (_uint32_like(v, shape) for v in (k0, k1, x0, x1))
    lax = jax.lax
    ks = (k0, k1, lax.bitwise_xor(lax.bitwise_xor(k0, k1), np.uint32(0x1BD11BDA)))
    x0, x1 = lax.add(x0, ks[0]), lax.add(x1, ks[1])
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = lax.add(x0, x1)
            rotated = lax.bitwise_or(lax.shift_left(x1, np.uint32(r)), lax.shift_right_logical(x1, np.uint32(32 - r)))
            x1 = lax.bitwise_xor(rotated, x0)
        x0 = lax.add(x0, ks[(i + 1) % 3])
        x1 = lax.add(lax.add(x1, ks[(i + 2) % 3]), np.uint32(i + 1))
    return x0, x1


def _uint32_like(value, shape: tuple[int, ...]) -> jax.Array:
    """``value`` as uint32 with ``shape`` (NumPy broadcasting; a scalar stays a scalar: ``lax`` broadcasts those)."""
    value = jnp.asarray(value, jnp.uint32)
    if value.ndim == 0 or value.shape == shape:
        return value
    value = value.reshape((1,) * (len(shape) - value.ndim) + value.shape)
    return jax.lax.broadcast_in_dim(value, shape, tuple(range(len(shape))))


_LOWEST = np.nextafter(np.float32(-1.0), np.float32(0.0))


def normal_at(key_words, index) -> jax.Array:
    """``N(0, 1)`` float32 values at flat positions ``index`` (uint32) of a draw keyed by ``key_words`` (uint32
    ``(k0, k1)``, broadcast with ``index``): exactly ``jax.random.normal(key, shape).reshape(-1)[index]`` under
    ``jax_threefry_partitionable`` (JAX's default), for draws of fewer than ``2**32`` elements. The bits of position
    ``i`` are the XOR of Threefry's two output words for the counter ``(0, i)``; the top 23 become a uniform on
    ``[nextafter(-1, 0), 1)``, mapped to a normal by ``sqrt(2) * erfinv`` -- JAX's own steps, one by one."""
    lax = jax.lax
    k0, k1 = key_words
    index = jnp.asarray(index, jnp.uint32)
    y0, y1 = threefry_2x32(k0, k1, lax.full_like(index, 0), index)
    bits = lax.bitwise_xor(y0, y1)
    mantissa = lax.bitwise_or(lax.shift_right_logical(bits, np.uint32(9)), np.uint32(0x3F800000))
    unit = lax.sub(lax.bitcast_convert_type(mantissa, jnp.float32), np.float32(1.0))
    uniform = lax.max(_LOWEST, lax.add(lax.mul(unit, np.float32(1.0) - _LOWEST), _LOWEST))
    return lax.mul(np.float32(np.sqrt(2.0)), lax.erf_inv(uniform))


NOISE_BLOCK = 1 << 16        # coordinates per iteration of the loop over large leaves (the values do not depend on it)
SMALL_NOISE_BLOCK = 1 << 10  # coordinates per iteration of the loop over small leaves
SMALL_LEAF = 1 << 14         # leaves of at most this many elements are small
SWITCH_GROUP = 8             # small leaves updated under one conditional
MAX_SEPARATE_SMALL = 48      # more small leaves than this are packed into one vector instead
ONE_LOOP_SMALL = 16          # up to this many small leaves may share the large leaves' loop (see _noised_in_blocks)


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A Threefry key's two uint32 words (a raw ``uint32[2]`` key is one already)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = key.astype(jnp.uint32).reshape(2)
    return words[0], words[1]


def fold_in_words(key_words, data) -> tuple[jax.Array, jax.Array]:
    """The key words of ``jax.random.fold_in(key, data)`` for a Threefry key and uint32 ``data`` (elementwise):
    Threefry's output for the counter ``(0, data)``, as JAX computes it."""
    k0, k1 = key_words
    return threefry_2x32(k0, k1, jnp.zeros_like(data), data)


def _noised_in_blocks(leaves, key: jax.Array, std, expected_batch_size: float) -> list[jax.Array]:
    """``(leaf + std * N(0, I)) / expected_batch_size`` in float32, cast back, for every leaf: leaf ``j``'s noise
    :func:`normal_at` of ``fold_in(key, j)`` at each of its flat positions, as ``jax.random.normal`` would draw it.

    Every leaf is flattened (a float32 leaf is neither padded nor copied) and noised in place, block by block, by a
    loop (:func:`_noise_loop`) that draws each block's normals and adds them to the block's vector. Two layouts:

    * up to ``MAX_SEPARATE_SMALL`` leaves of at most ``SMALL_LEAF`` elements: two loops, over the blocks of
      ``NOISE_BLOCK`` coordinates of the larger leaves and of ``SMALL_NOISE_BLOCK`` of the small ones -- or, with at
      most ``ONE_LOOP_SMALL`` small leaves whose whole blocks add at most half the larger leaves' draws (a scanned
      model's stacked biases and norm scales), the one loop of ``NOISE_BLOCK`` blocks for every leaf: the second
      loop's conditionals cost more to compile than the padded draws cost to run (48 scanned layers of width 64:
      noise + adamw compiled in 0.78-0.79 s against 0.89-0.99 s, the noise in 15.2 against 15.2-15.7 ms). Every
      leaf comes out as a buffer of its own, updated by kernels that depend on its shape only: XLA:CPU compiles one
      kernel for all the leaves of a shape, and likewise for the optimiser's update that reads them (about 10 ms of
      compile time per distinct kernel; W3's private training step: 273 distinct kernels with the other layout, 217
      with this one);
    * more small leaves (the per-layer biases and norm scales of an unrolled model): the leaves of at most
      ``NOISE_BLOCK`` elements are concatenated into one more vector of a single loop, drawn with each position's
      leaf key and index looked up, and read back at their offsets (a kernel per leaf, and its optimiser kernels
      distinct), because every iteration of the small leaves' loop evaluates one conditional per group of them:
      an unrolled 48-layer decoder of width 64, 772 leaves, spent 0.57x its non-private step in that loop.

    Two generators in the program whatever the number of leaves (each costs ~0.1 s of XLA:CPU compile time); the
    step's peak memory stays at the non-DP level (drawing a large leaf in one go made XLA keep extra gradient-sized
    copies).
    """
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    if max(sizes, default=0) >= 2 ** 31:   # positions are uint32 counters, block starts int32 offsets
        raise ValueError(f"the blocked noise generator draws leaves of fewer than 2**31 elements; a leaf has "
                         f"{max(sizes)}: use DPConfig(noise_rng='partitionable')")
    out = [(leaf.astype(jnp.float32) / expected_batch_size).astype(leaf.dtype) if n == 0 else None   # empty leaves
           for leaf, n in zip(leaves, sizes)]
    root = _key_words(key)

    def flat(j):
        return leaves[j].reshape(-1).astype(jnp.float32)

    def unflat(j, vector):
        return vector.reshape(leaves[j].shape).astype(leaves[j].dtype)

    small = [j for j, n in enumerate(sizes) if 0 < n <= SMALL_LEAF]
    if len(small) <= MAX_SEPARATE_SMALL:
        large = [j for j, n in enumerate(sizes) if n > SMALL_LEAF]
        if len(small) <= ONE_LOOP_SMALL and len(small) * NOISE_BLOCK <= sum(sizes[j] for j in large) // 2:
            large, small = sorted(large + small), []   # a few small leaves: one loop (see the docstring)
        for block, group_size, chosen in ((NOISE_BLOCK, 1, large), (SMALL_NOISE_BLOCK, SWITCH_GROUP, small)):
            if chosen:
                noised = _noise_loop([flat(j) for j in chosen], chosen, root, block, group_size, std,
                                     expected_batch_size)
                for j, vector in zip(chosen, noised):
                    out[j] = unflat(j, vector)
        return out
    large = [j for j, n in enumerate(sizes) if n > NOISE_BLOCK]
    packed = [j for j, n in enumerate(sizes) if 0 < n <= NOISE_BLOCK]
    total = sum(sizes[j] for j in packed)
    # NOISE_BLOCK coordinates a block; with the leaves all packed and fewer together, half of them: two iterations,
    # because XLA inlines a loop of one and then copies the generator into every leaf's slice
    block = NOISE_BLOCK if large else min(NOISE_BLOCK, -(-total // 2))
    flats = [flat(j) for j in large] + [jnp.concatenate([flat(j) for j in packed])]
    noised = _noise_loop(flats, large + [-1], root, block, 1, std, expected_batch_size,
                         packed=[(j, sizes[j]) for j in packed])
    for j, vector in zip(large, noised):
        out[j] = unflat(j, vector)
    offset = 0
    for j in packed:
        out[j] = unflat(j, noised[-1][offset:offset + sizes[j]])
        offset += sizes[j]
    return out


def _noise_loop(flats, indices, root, block: int, group_size: int, std, expected_batch_size: float, packed=None):
    """The loop of :func:`_noised_in_blocks` over the blocks of ``block`` coordinates of the float32 vectors
    ``flats`` (leaf ``indices[v]`` of the gradient each), vector after vector: an iteration draws its block from
    the key ``fold_in(root, indices[v])`` at the block's positions and adds it to vector ``v`` in place, under
    conditionals over groups of ``group_size`` vectors: 1 for large ones (a conditional passing several vectors
    makes XLA copy the ones it passes through, 3x the loop's time for 1M-element vectors), ``SWITCH_GROUP`` for
    small ones (one ``cond`` per group and a ``switch`` in it: each conditional's predicate is one more kernel to
    compile, and XLA's copy insertion grows like the cube of a conditional's operands -- 100 small leaves under one
    ``switch`` took 11 s to compile). ``packed``: ``[(leaf index, size), ...]`` of the leaves concatenated in the
    last vector (its ``indices`` entry unused), whose blocks draw each position from its own leaf's key.
    Returns the noised vectors, in order."""
    n_blocks = [-(-flat.size // block) for flat in flats]
    owner = np.repeat(np.arange(len(flats)), n_blocks)
    groups = [list(range(lo, min(lo + group_size, len(flats)))) for lo in range(0, len(flats), group_size)]
    # per block (int32 constants, read in the loop): its leaf's index (its key), its first position in the leaf, its
    # vector's group and place in the group -- four vectors, so that reading any of them is one kernel for XLA:CPU
    per_block = [jnp.asarray(column.astype(np.int32)) for column in (
        np.repeat(np.asarray(indices), n_blocks), np.concatenate([np.arange(n) * block for n in n_blocks]),
        owner // group_size, owner % group_size)]
    lax = jax.lax
    # the int32 scalars the loop compares with (group numbers, the start of each vector's last partial block), as
    # values XLA cannot fold into the comparisons: every comparison is then the same kernel (XLA:CPU compiles one per
    # distinct computation, ~5-10 ms each, and a constant operand made each group's predicate distinct)
    opaque = _opaque_int32([*range(len(groups)), *((flat.size // block) * block for flat in flats)])
    group_number, tail_start = opaque[:len(groups)], opaque[len(groups):]
    if packed:   # per position of the packed vector (constants): which of its leaves, and where in that leaf
        padded = n_blocks[-1] * block
        leaf_of = np.repeat(np.arange(len(packed)), [n for _, n in packed])
        index_of = np.concatenate([np.arange(n) for _, n in packed])
        leaf_of = np.concatenate([leaf_of, np.full(padded - leaf_of.size, len(packed) - 1)])
        index_of = np.concatenate([index_of, np.zeros(padded - index_of.size, np.int64)])
        leaf_of = jnp.asarray(leaf_of.astype(np.uint16 if len(packed) <= 2 ** 16 else np.uint32))
        index_of = jnp.asarray(index_of.astype(np.uint16 if block <= 2 ** 16 else np.uint32))
        packed_keys = fold_in_words(root, jnp.asarray([j for j, _ in packed], jnp.uint32))   # [packed leaves] each

        def packed_normal(start, leaf):
            del leaf
            at = (start,)
            which = lax.convert_element_type(lax.dynamic_slice(leaf_of, at, (block,)), jnp.int32)
            index = lax.convert_element_type(lax.dynamic_slice(index_of, at, (block,)), jnp.uint32)
            return normal_at((packed_keys[0][which], packed_keys[1][which]), index)

    def block_normal(start, leaf):
        # positions from an iota made here, in the loop, which fuses into the generator (an array captured from
        # outside the loop would be one more block-sized buffer)
        position = lax.add(lax.convert_element_type(start, jnp.uint32), lax.iota(jnp.uint32, block))
        return normal_at(fold_in_words(root, lax.convert_element_type(leaf, jnp.uint32)), position)

    std = jnp.asarray(std, jnp.float32)
    divisor = np.float32(expected_batch_size)

    def noised(current, normal):   # (current + std * normal) / expected_batch_size, in float32
        return lax.div(lax.add(current, lax.mul(std, normal)), divisor)

    def updater(size: int, tail_at):
        full, tail = divmod(size, block)

        def full_block(flat, start, normal):
            current = lax.dynamic_slice(flat, (start,), (block,))
            return lax.dynamic_update_slice(flat, noised(current, normal), (start,))

        def last_block(flat, start, normal):
            current = lax.slice(flat, (full * block,), (size,))
            return lax.dynamic_update_slice(flat, noised(current, lax.slice(normal, (0,), (tail,))), (full * block,))
        if not tail:
            return full_block
        if not full:
            return last_block
        return lambda flat, start, normal: lax.cond(lax.lt(start, tail_at), full_block, last_block, flat, start,
                                                    normal)

    updaters = [updater(flat.size, tail_at) for flat, tail_at in zip(flats, tail_start)]

    def group_update(members):
        if len(members) == 1:
            return lambda member, group, start, normal: (updaters[members[0]](group[0], start, normal),)

        def update(member, group, start, normal):
            def branch(i):
                return lambda grp, s, n: (*grp[:i], updaters[members[i]](grp[i], s, n), *grp[i + 1:])
            return jax.lax.switch(member, [branch(i) for i in range(len(members))], group, start, normal)
        return update

    updates = [group_update(members) for members in groups]

    def noise_block(step, flats):
        leaf, start, group_of_block, member = (lax.dynamic_index_in_dim(column, step, 0, keepdims=False)
                                               for column in per_block)
        if packed and len(flats) == 1:   # every block is the packed vector's: one generator, no cond
            normal = packed_normal(start, leaf)
        elif packed:
            normal = lax.cond(lax.eq(group_of_block, group_number[-1]), packed_normal, block_normal,
                              start, leaf)
        else:
            normal = block_normal(start, leaf)
        out = []
        for g, (members, update) in enumerate(zip(groups, updates)):
            group = tuple(flats[v] for v in members)
            if len(groups) == 1:
                out += update(member, group, start, normal)
            else:
                out += lax.cond(lax.eq(group_of_block, group_number[g]), update, _unchanged, member, group, start,
                                normal)
        return tuple(out)

    return jax.lax.fori_loop(0, int(sum(n_blocks)), noise_block, tuple(flats))


def _opaque_int32(values) -> list[jax.Array]:
    """int32 scalars equal to ``values`` behind an optimisation barrier, for the noise loop's body: read there, they
    reach XLA:CPU's kernels as loop parameters, not folded constants (outside a loop XLA folds a barrier's constants
    all the same)."""
    return list(jax.lax.optimization_barrier(tuple(jnp.int32(v) for v in values)))


def _unchanged(member, group, start, normal):
    """The branch of a group of vectors the block is not in."""
    del member, start, normal
    return group
