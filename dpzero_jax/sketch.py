"""Random sketches for randomized matrix multiplication (paper 002): ``S^T x`` without storing ``S``.

A sketch is a random matrix ``S [n, k]`` with ``E[S S^T] = I_n``, so that ``x^T S S^T y`` is an unbiased estimate
of ``x^T y`` for any ``x [n, F]``, ``y [n, P]`` independent of ``S``. ``S`` is never stored: :func:`project`
recomputes ``S^T x`` from a PRNG key, and projecting ``x`` in the forward pass and ``y`` in the backward pass with
the same key uses the same ``S``.

Sketches (``k`` = the projected size ``B_proj``):

* ``"gaussian"``   i.i.d. ``N(0, 1/k)`` entries (paper 002, eq. 5);
* ``"rademacher"`` i.i.d. ``+-1/sqrt(k)`` entries;
* ``"dct"``        subsampled orthogonal transform with random signs: ``S^T x = sqrt(n/k) P H D x`` with ``D`` a
                   diagonal of random signs, ``H`` the orthonormal DCT-II over the ``n`` axis and ``P`` ``k`` of its
                   ``n`` output rows drawn uniformly without replacement;
* ``"dft"``        the same with ``H`` the discrete Hartley transform ``(Re F - Im F) / sqrt(n)`` (``F`` the DFT
                   matrix): the real orthogonal transform computed by an FFT.

For the orthogonal sketches ``E[P^T P] = (k/n) I`` gives ``E[S S^T] = D H^T H D = I``, and ``k = n`` gives
``S S^T = I`` exactly (the estimate is then exact). Gaussian and Rademacher sketches are drawn in column blocks of
at most ``SKETCH_BLOCK`` entries (block ``c`` from ``fold_in(key, c)``), so a large ``n`` never materialises all
of ``S`` at once; the block width depends only on ``(n, k)``, so ``S`` is the same for every ``x`` it multiplies.
The orthogonal transforms are applied to pieces of at most ``TRANSFORM_PIECE`` entries of ``x`` at a time.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from dpzero_jax import noise
from dpzero_jax.options import OptionGroup, choice, integer, number, option

Array = jax.Array

SKETCHES = ("gaussian", "rademacher", "dct", "dft")
ORTHOGONAL_SKETCHES = ("dct", "dft")
PROJECTIONS = ("rows", "tokens")
RMM_CHOICES = ("none",) + SKETCHES   # a training run's ``rmm`` option (:class:`RMMOptions`)
RATE = number(high=1.0, expected="a compression rate in (0, 1]")   # RMMConfig.rate and RMMOptions.rmm_rate
SKETCH_BLOCK = 1 << 18   # entries of S drawn at once (part of the definition of S for a given key)
TRANSFORM_PIECE = 1 << 16   # entries of x transformed at once by the orthogonal sketches (memory only)


@dataclasses.dataclass(frozen=True)
class RMMConfig:
    """How an RMM layer compresses the input it keeps for the backward pass.

    sketch: one of :data:`SKETCHES`.
    rate: the compression rate ``rho`` in ``(0, 1]``: ``B_proj = round(rho * n)``; or
    size: a fixed ``B_proj`` (exactly one of ``rate`` and ``size``).
    min_size, max_size: ``B_proj`` is clamped to ``[min_size, max_size]`` and then to ``[1, n]``.
    projection: what ``n`` is. ``"rows"``: the flattened batch x positions rows of the layer input (paper 002;
        mixes examples, so not usable under DP clipping). ``"tokens"``: the positions of each example, with one
        ``S [T, k]`` shared by the batch (examples never mix; the DP variant).
    """

    sketch: str = "gaussian"
    rate: float | None = None
    size: int | None = None
    min_size: int = 1
    max_size: int | None = None
    projection: str = "tokens"

    def __post_init__(self):
        if self.sketch not in SKETCHES:
            raise ValueError(f"RMMConfig.sketch={self.sketch!r}: unknown sketch; expected one of {SKETCHES}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"RMMConfig.projection={self.projection!r}: expected one of {PROJECTIONS}")
        if (self.rate is None) == (self.size is None):
            raise ValueError("RMMConfig needs exactly one of rate (the compression rate rho in (0, 1]) and size "
                             f"(a fixed B_proj); got rate={self.rate!r}, size={self.size!r}")
        if self.rate is not None:
            RATE(self.rate, "RMMConfig.rate")
        for name in ("size", "min_size", "max_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"RMMConfig.{name} must be a positive int, got {value!r}")
        if self.max_size is not None and self.max_size < self.min_size:
            raise ValueError(f"RMMConfig: max_size={self.max_size} is below min_size={self.min_size}")

    def projected_size(self, n: int) -> int:
        """``B_proj`` for ``n`` rows (or positions): from ``rate`` or ``size``, clamped to ``[min_size, max_size]``
        and to ``[1, n]``."""
        base = self.size if self.size is not None else math.floor(self.rate * n + 0.5)
        base = max(base, self.min_size)
        if self.max_size is not None:
            base = min(base, self.max_size)
        return max(1, min(base, n))

    def replace(self, **changes) -> RMMConfig:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_static(RMMConfig)


@dataclasses.dataclass(frozen=True)
class RMMOptions(OptionGroup):
    """A training run's randomized-matmul layers (a group of ``TrainConfig``; paper 002): ``rmm`` is ``"none"`` or
    a sketch of :data:`SKETCHES` with which every dense layer with a trainable kernel, except the head, becomes an
    RMM layer keeping ``rmm_rate`` (:class:`RMMConfig`'s ``rate``, the same check) of its input for the backward
    pass; ``rmm_diagnostics_every``: paper 002's D2_SGD, D2_RMM and alpha every that many steps (0: never)."""

    GROUP = "rmm"

    rmm: str = option("none", choice(RMM_CHOICES),
                      "randomized-matmul dense layers (paper 002; every dense layer with a trainable kernel except "
                      "the head): the sketch; dft is the discrete Hartley transform (the real orthogonal transform "
                      "computed by an FFT), dct the DCT-II; default none")
    rmm_rate: float = option(1.0, RATE,
                             "RMM compression rate rho in (0, 1]: the fraction of each layer input kept for the "
                             "backward pass (per example its tokens under DP; the batch's rows with --no-dp)")
    rmm_diagnostics_every: int = option(0, integer(0),
                                        "log D2_SGD, D2_RMM and alpha of each RMM layer every N steps (0: never)")

    def _check_group(self, owner: str) -> None:
        if self.rmm == "none" and (self.rmm_rate != 1.0 or self.rmm_diagnostics_every):
            name = "rmm_rate" if self.rmm_rate != 1.0 else "rmm_diagnostics_every"
            raise ValueError(f"{owner}.{name} applies to RMM layers only; set rmm to one of {RMM_CHOICES[1:]}")


def as_key(key) -> Array:
    """A typed PRNG key from a typed key or a raw ``uint32[2]`` key."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key.astype(jnp.uint32))


def _check(x: Array, k: int, sketch: str) -> int:
    if sketch not in SKETCHES:
        raise ValueError(f"unknown sketch {sketch!r}; expected one of {SKETCHES}")
    if x.ndim < 2:
        raise ValueError(f"project: x must be [..., n, F] (at least 2-D), got shape {x.shape}")
    n = x.shape[-2]
    if not 1 <= k <= n:
        raise ValueError(f"project: projected size k={k} must be in [1, n={n}]")
    return n


def _iid_entries(key: Array, shape: tuple[int, int], sketch: str) -> Array:
    """Unit-variance i.i.d. entries ``[n, kb]``: standard normal or random signs."""
    if sketch == "gaussian":
        return noise.standard_normal(key, shape)
    return jnp.where(noise.random_bits(key, shape) >> 31 == 1, 1.0, -1.0).astype(jnp.float32)


def block_width(n: int, k: int) -> int:
    """Columns of ``S`` drawn per block for the i.i.d. sketches."""
    return max(1, min(k, SKETCH_BLOCK // n))


def _project_iid(key: Array, x32: Array, k: int, sketch: str, ordered: bool) -> Array:
    n = x32.shape[-2]
    width = block_width(n, k)
    n_blocks = -(-k // width)

    def block(block_key):
        s = _iid_entries(block_key, (n, width), sketch)
        return jnp.einsum("nk,...nf->...kf", s, x32, preferred_element_type=jnp.float32)

    if n_blocks == 1:
        out = block(jax.random.fold_in(key, 0))
    elif ordered:   # one block at a time: block c is drawn only once block c - 1 is done
        outs = []
        for c in range(n_blocks):
            block_key = jax.random.fold_in(key, c)
            outs.append(block(block_key if not outs else _drawn_after(block_key, outs[-1])))
        out = jnp.concatenate(outs, axis=-2)
    else:
        blocks = jax.lax.map(lambda c: block(jax.random.fold_in(key, c)), jnp.arange(n_blocks))
        out = jnp.moveaxis(blocks, 0, -3)                                     # [..., blocks, width, F]
        out = out.reshape(out.shape[:-3] + (n_blocks * width, out.shape[-1]))
    return out[..., :k, :] / jnp.sqrt(jnp.float32(k))


def orthogonal_transform(x32: Array, sketch: str) -> Array:
    """``H x`` along axis -2 with ``H`` the orthonormal DCT-II (``"dct"``) or Hartley (``"dft"``) matrix."""
    if sketch == "dct":
        return jax.scipy.fft.dct(x32, type=2, norm="ortho", axis=-2)
    spectrum = jnp.fft.fft(x32, axis=-2)
    return (spectrum.real - spectrum.imag) / jnp.sqrt(jnp.float32(x32.shape[-2]))


def _largest_divisor(m: int, limit: int) -> int:
    return next(d for d in range(max(1, min(m, limit)), 0, -1) if m % d == 0)


def _project_orthogonal(key: Array, x32: Array, k: int, sketch: str) -> Array:
    n, features = x32.shape[-2:]
    sign_key, select_key = jax.random.split(key)
    signs = jnp.where(noise.random_bits(sign_key, (n,)) >> 31 == 1, 1.0, -1.0).astype(jnp.float32)
    rows = jax.random.permutation(select_key, n)[:k]

    def block(x):                                    # [..., n, f] -> [..., k, f]
        transformed = orthogonal_transform(x * signs[:, None], sketch)
        return jnp.take(transformed, rows, axis=-2) * jnp.sqrt(jnp.float32(n / k))

    def pieces(stacked):                             # [p, ...] -> [p, ..., k, f], one piece at a time
        outs = []   # (ordered through the data, not the key: safe under vmap, and each piece's output unchanged)
        for c in range(stacked.shape[0]):
            outs.append(block(stacked[c] if not outs else _after_finite(stacked[c], outs[-1])))
        return jnp.stack(outs)

    # The FFT-based transforms need several temporaries the size of their input: apply them to pieces of at most
    # TRANSFORM_PIECE entries (whole leading items when they fit, otherwise column blocks; columns are independent).
    flat = x32.reshape((-1, n, features))
    count = flat.shape[0]
    if flat.size <= TRANSFORM_PIECE:
        out = block(flat)
    elif n * features <= TRANSFORM_PIECE:
        items = _largest_divisor(count, TRANSFORM_PIECE // (n * features))
        out = pieces(flat.reshape((count // items, items, n, features)))
    else:
        width = _largest_divisor(features, max(1, TRANSFORM_PIECE // (n * count)))
        out = jnp.moveaxis(pieces(jnp.moveaxis(flat.reshape((count, n, features // width, width)), 2, 0)), 0, 2)
    return out.reshape(x32.shape[:-2] + (k, features))


def finite_zero(x: Array, batched: bool = False) -> Array:
    """A float32 zero computed from one entry of ``x`` (per example along the leading axis with ``batched``: shape
    ``[B]``), which XLA cannot fold away: a data dependency that changes no value (non-finite entries are masked,
    so ``value + finite_zero(x)`` equals ``value``) and carries no gradient."""
    anchor = (x.reshape(x.shape[0], -1)[:, 0] if batched else x.reshape(-1)[0]).astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(anchor), anchor, 0.0) * 0.0)


def _after_finite(value: Array, dependency: Array) -> Array:
    """``value`` (unchanged) made to depend on ``dependency``'s data."""
    return value + finite_zero(dependency).astype(value.dtype)


def _drawn_after(key: Array, x: Array) -> Array:
    """The same key, made to depend on the data of ``x`` (``+ 0`` computed from one entry of ``x``).

    Without it the draws of ``S`` depend on the key alone, and XLA:CPU's scheduler hoists them to the start of the
    program (all layers' ``S`` alive at once) or shares the forward and backward draws (each ``S`` alive from the
    forward to the backward pass); ``lax.optimization_barrier`` is removed before scheduling and does not prevent
    this. Non-finite entries are mapped to 0 first, so the key -- and ``S`` -- never changes.
    """
    zero = finite_zero(x).astype(jnp.uint32)
    return jax.random.wrap_key_data(jax.random.key_data(key) + zero, impl=jax.random.key_impl(key))


def project(key, x: Array, k: int, sketch: str, *, after_x: bool = False) -> Array:
    """``S^T x`` along axis -2: ``x [..., n, F] -> [..., k, F]`` with ``S [n, k]`` the sketch drawn from ``key``.

    Computed in float32, returned in ``x.dtype``. The leading axes share one ``S`` (the DP layout ``[B, T, F]``
    projects every example's positions with the same ``S``). ``after_x``: draw ``S`` only once ``x`` exists and
    one block after the other (see :func:`_drawn_after`; worth it for a large ``S``); the result is the same.
    Not under ``jax.vmap`` over ``x``: the key then becomes batched, and XLA's bit generator draws differently for
    a batched key.
    """
    _check(x, k, sketch)
    key = _drawn_after(as_key(key), x) if after_x else as_key(key)
    x32 = x.astype(jnp.float32)
    if sketch in ORTHOGONAL_SKETCHES:
        out = _project_orthogonal(key, x32, k, sketch)
    else:
        out = _project_iid(key, x32, k, sketch, ordered=after_x)
    return out.astype(x.dtype)


def sketch_matrix(key, n: int, k: int, sketch: str) -> Array:
    """The sketch ``S [n, k]`` that :func:`project` applies for ``key`` (explicitly; for tests and diagnostics)."""
    return project(key, jnp.eye(n, dtype=jnp.float32), k, sketch).T
