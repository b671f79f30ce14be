"""Sketches of randomized matmul: E[S S^T] = I by Monte Carlo, entry distributions, the orthogonal transforms
against matrices written out here, full-rate orthogonal sketches are exact, block-wise drawing, config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from dpzero_jax import sketch as sk

N, K, DRAWS = 6, 3, 4000


def draws(sketch: str, n: int = N, k: int = K, count: int = DRAWS) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), count)
    return np.asarray(ref.jit(jax.vmap(lambda key: sk.sketch_matrix(key, n, k, sketch)))(keys), np.float64)


@pytest.mark.parametrize("sketch", sk.SKETCHES)
def test_sketch_is_unbiased(sketch):
    """Every entry of the Monte Carlo mean of S S^T is within 5 standard errors of the identity."""
    s = draws(sketch)
    outer = np.einsum("rnk,rmk->rnm", s, s)
    mean, stderr = outer.mean(0), outer.std(0) / math.sqrt(DRAWS)
    z = np.abs(mean - np.eye(N)) / np.maximum(stderr, 1e-6)    # (entries that are constant: float32 rounding)
    assert z.max() < 5, (sketch, z.max())


def test_iid_entries():
    gaussian, rademacher = draws("gaussian"), draws("rademacher")
    np.testing.assert_allclose(np.abs(rademacher), 1 / math.sqrt(K), rtol=1e-6)
    assert abs(np.mean(rademacher > 0) - 0.5) < 5 * 0.5 / math.sqrt(rademacher.size)
    var = gaussian.var()
    assert abs(var * K - 1) < 5 * math.sqrt(2 / gaussian.size), var * K    # N(0, 1/k)


def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II: ``H[c, t] = w_c cos(pi (2t + 1) c / (2n))``."""
    c, t = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    weight = np.where(c == 0, math.sqrt(1 / n), math.sqrt(2 / n))
    return weight * np.cos(np.pi * (2 * t + 1) * c / (2 * n))


def hartley_matrix(n: int) -> np.ndarray:
    """Discrete Hartley transform ``H[c, t] = (cos + sin)(2 pi c t / n) / sqrt(n)``."""
    c, t = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    angle = 2 * np.pi * c * t / n
    return (np.cos(angle) + np.sin(angle)) / math.sqrt(n)


@pytest.mark.parametrize("sketch,matrix", [("dct", dct_matrix), ("dft", hartley_matrix)])
@pytest.mark.parametrize("k", [7, 3])
def test_orthogonal_sketch_structure(sketch, matrix, k):
    """``S^T = sqrt(n/k) P H D``: each row of ``S^T`` is a distinct row of ``H`` times one shared sign pattern; at
    ``k = n``, ``S S^T = I`` exactly."""
    n = 7
    h = matrix(n)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-12)
    s_t = np.asarray(sk.sketch_matrix(jax.random.key(3), n, k, sketch), np.float64).T * math.sqrt(k / n)
    used, signs = [], np.full((k, n), np.nan)
    for r, row in enumerate(s_t):
        matches = [c for c in range(n) if np.allclose(np.abs(row), np.abs(h[c]), atol=1e-5)]
        assert len(matches) == 1
        used.append(matches[0])
        defined = np.abs(h[matches[0]]) > 1e-3
        signs[r, defined] = row[defined] / h[matches[0]][defined]
    np.testing.assert_allclose(np.abs(signs[~np.isnan(signs)]), 1, atol=1e-4)
    for t in range(n):   # one sign per position t, shared by the rows: the diagonal D
        column = signs[:, t][~np.isnan(signs[:, t])]
        assert len(column) and np.all(np.sign(column) == np.sign(column[0]))
    assert len(set(used)) == k
    if k == n:
        full = np.asarray(sk.sketch_matrix(jax.random.key(3), n, n, sketch), np.float64)
        np.testing.assert_allclose(full @ full.T, np.eye(n), atol=1e-5)


@pytest.mark.parametrize("sketch", sk.SKETCHES)
def test_project_is_one_linear_map(sketch):
    """``project`` applies the same ``S`` whatever the trailing width and leading axes: it is ``S^T x`` with
    ``S = sketch_matrix(...)``, including when the i.i.d. sketches are drawn in several blocks."""
    n, k = 2100, 300
    if sketch in ("gaussian", "rademacher"):
        assert -(-k // sk.block_width(n, k)) > 1, "test setup: several blocks"
    x = jax.random.normal(jax.random.key(1), (2, n, 3))
    y = jax.random.normal(jax.random.key(2), (n, 5))
    key = jax.random.key(9)
    s = np.asarray(sk.sketch_matrix(key, n, k, sketch), np.float64)
    np.testing.assert_allclose(sk.project(key, x, k, sketch), np.einsum("nk,bnf->bkf", s, x), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(sk.project(key, y, k, sketch), s.T @ np.asarray(y), rtol=2e-4, atol=2e-4)
    raw = jax.random.key_data(key)
    np.testing.assert_array_equal(sk.project(raw, y, k, sketch), sk.project(key, y, k, sketch))
    np.testing.assert_array_equal(sk.project(key, y, k, sketch, after_x=True), sk.project(key, y, k, sketch))
    if sketch in sk.ORTHOGONAL_SKETCHES:   # applied piece by piece: whole leading items, or column blocks
        assert 40 * n > sk.TRANSFORM_PIECE >= n
        for shape in ((40, n, 1), (n, 40)):
            z = jax.random.normal(jax.random.key(3), shape)
            for after_x in (False, True):
                np.testing.assert_allclose(sk.project(key, z, k, sketch, after_x=after_x),
                                           np.einsum("nk,...nf->...kf", s, z), rtol=2e-4, atol=2e-4)


def test_projected_size():
    assert sk.RMMConfig(rate=0.5).projected_size(10) == 5
    assert sk.RMMConfig(rate=0.25).projected_size(10) == 3        # round half up
    assert sk.RMMConfig(rate=0.1).projected_size(4) == 1          # at least one row
    assert sk.RMMConfig(rate=1.0).projected_size(7) == 7
    assert sk.RMMConfig(size=8).projected_size(100) == 8
    assert sk.RMMConfig(size=8).projected_size(5) == 5            # never more than n
    assert sk.RMMConfig(rate=0.1, min_size=16).projected_size(100) == 16
    assert sk.RMMConfig(rate=0.5, max_size=20).projected_size(100) == 20


@pytest.mark.parametrize("kwargs,message", [
    (dict(sketch="hadamard", rate=0.5), "unknown sketch"),
    (dict(rate=0.0), "rate must be a compression rate in"),
    (dict(rate=1.5), "rate must be a compression rate in"),
    (dict(rate=float("nan")), "rate must be a compression rate in"),
    (dict(), "exactly one of rate"),
    (dict(rate=0.5, size=4), "exactly one of rate"),
    (dict(size=0), "size must be a positive int"),
    (dict(rate=0.5, min_size=4, max_size=2), "max_size=2 is below min_size=4"),
    (dict(rate=0.5, projection="batch"), "projection"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sk.RMMConfig(**kwargs)


def test_project_errors():
    x = jnp.ones((4, 3))
    with pytest.raises(ValueError, match="unknown sketch"):
        sk.project(jax.random.key(0), x, 2, "srht")
    with pytest.raises(ValueError, match=r"k=5 must be in \[1, n=4\]"):
        sk.project(jax.random.key(0), x, 5, "gaussian")
    with pytest.raises(ValueError, match="at least 2-D"):
        sk.project(jax.random.key(0), jnp.ones(4), 2, "gaussian")
