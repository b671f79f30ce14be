"""Tests for dpzero_jax.sampling: statistics, static shapes, determinism, overflow, epochs."""

import jax
import numpy as np
import pytest
from scipy import stats

from dpzero_jax.sampling import (
    Batch,
    FixedSizeSampler,
    PoissonSampler,
    SamplingOverflowError,
    ShuffledEpochs,
    gather,
)

BASE = jax.random.key(1234)


def _keys(n):
    return [jax.random.fold_in(BASE, i) for i in range(n)]


@pytest.fixture(scope="module")
def poisson_draws():
    n, q, draws = 200, 0.1, 2000
    s = PoissonSampler(n, q)
    return s, [s.sample(k) for k in _keys(draws)]


def test_poisson_inclusion_frequencies(poisson_draws):
    s, batches = poisson_draws
    n, q, d = s.dataset_size, s.sampling_rate, len(batches)
    counts = np.zeros(n)
    for b in batches:
        counts += np.bincount(b.indices[b.mask], minlength=n)
    sigma = np.sqrt(d * q * (1 - q))
    assert np.all(np.abs(counts - d * q) < 6 * sigma)
    sizes = np.array([b.realised_size for b in batches])
    assert abs(sizes.mean() - n * q) < 6 * np.sqrt(n * q * (1 - q) / d)
    assert not any(b.overflowed for b in batches)


def test_poisson_size_distribution_matches_binomial(poisson_draws):
    s, batches = poisson_draws
    n, q, d = s.dataset_size, s.sampling_rate, len(batches)
    sizes = np.array([b.realised_size for b in batches])
    # chi-square over bins [0, 14], 15..25 individually, [26, N]
    edges = [0, *range(15, 27), n + 1]
    cdf = stats.binom.cdf(np.array(edges) - 1, n, q)
    expected = np.diff(cdf) * d
    observed = np.histogram(sizes, bins=edges)[0]
    assert expected.min() > 5
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert stats.chi2.sf(chi2, len(expected) - 1) > 1e-4


def test_poisson_mask_and_padding(poisson_draws):
    s, batches = poisson_draws
    for b in batches[:200]:
        assert b.indices.shape == b.mask.shape == (s.capacity,)
        assert b.indices.dtype == np.int32 and b.mask.dtype == bool
        assert b.mask.sum() == b.realised_size == b.num_selected
        assert np.all(b.mask[: b.realised_size]) and not np.any(b.mask[b.realised_size:])
        assert np.all(b.indices[~b.mask] == 0)
        assert np.all((b.indices >= 0) & (b.indices < s.dataset_size))
        assert len(set(b.indices[b.mask].tolist())) == b.realised_size
    idx, mask, size = batches[0]  # tuple-style unpacking
    assert size == mask.sum()


def test_determinism():
    s = PoissonSampler(500, 0.05)
    k = jax.random.fold_in(BASE, 7)
    a, b = s.sample(k), s.sample(jax.random.fold_in(BASE, 7))
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.mask, b.mask)
    c = s.sample(jax.random.fold_in(BASE, 8))
    assert not np.array_equal(a.indices, c.indices)
    # raw uint32 keys work too and are deterministic
    raw = jax.random.PRNGKey(3)
    np.testing.assert_array_equal(s.sample(raw).indices, s.sample(jax.random.PRNGKey(3)).indices)
    f = FixedSizeSampler(100, 10)
    np.testing.assert_array_equal(f.sample(k).indices, f.sample(k).indices)


def test_overflow_truncate_and_error():
    trunc = PoissonSampler(100, 0.5, capacity=5)
    b = trunc.sample(BASE)
    assert b.overflowed and b.num_selected > 5
    assert b.realised_size == 5 and b.mask.all() and len(set(b.indices.tolist())) == 5
    assert trunc.overflow_probability == pytest.approx(stats.binom.sf(5, 100, 0.5))
    with pytest.raises(SamplingOverflowError):
        PoissonSampler(100, 0.5, capacity=5, overflow="error").sample(BASE)


def test_truncation_is_uniform_subset():
    s = PoissonSampler(20, 1.0, capacity=4)  # all selected, keep 4 of 20
    counts = np.zeros(20)
    for k in _keys(1000):
        b = s.sample(k)
        counts[b.indices] += 1
    p = 4 / 20
    assert np.all(np.abs(counts - 1000 * p) < 6 * np.sqrt(1000 * p * (1 - p)))


@pytest.mark.parametrize("n,q", [(200, 0.1), (60000, 0.004), (10, 0.5), (1, 1.0), (1000, 1.0), (10**6, 1e-5)])
def test_default_capacity_meets_overflow_target(n, q):
    s = PoissonSampler(n, q)
    assert 1 <= s.capacity <= n + 1
    # the target is met on the larger neighbouring dataset (N + 1), which the ledger charges
    assert stats.binom.sf(s.capacity, n + 1, q) <= 1e-9
    assert s.overflow_probability == pytest.approx(stats.binom.sf(s.capacity, n, q))
    assert s.truncation_probability == pytest.approx(stats.binom.sf(s.capacity, n + 1, q))
    if s.capacity > 1:  # minimal
        assert stats.binom.sf(s.capacity - 1, n + 1, q) > 1e-9
    tight = PoissonSampler(n, q, overflow_target=1e-13, capacity_multiple=8)
    assert tight.capacity % 8 == 0 and stats.binom.sf(tight.capacity, n + 1, q) <= 1e-13
    assert tight.capacity - 8 < s.capacity or stats.binom.sf(tight.capacity - 8, n + 1, q) > 1e-13


def test_fixed_size_sampler():
    n, bsz, d = 50, 10, 2000
    f = FixedSizeSampler(n, bsz)
    counts = np.zeros(n)
    for k in _keys(d):
        b = f.sample(k)
        assert b.indices.shape == (bsz,) and b.mask.all() and b.realised_size == bsz and not b.overflowed
        assert len(set(b.indices.tolist())) == bsz
        counts[b.indices] += 1
    p = bsz / n
    assert np.all(np.abs(counts - d * p) < 6 * np.sqrt(d * p * (1 - p)))


@pytest.mark.parametrize("n,bsz", [(20, 5), (23, 5)])
def test_shuffled_epochs(n, bsz):
    with pytest.warns(UserWarning, match="formal"):
        s = ShuffledEpochs(n, bsz)
    spe = s.steps_per_epoch
    epochs = []
    for e in range(3):
        seen = []
        for t in range(e * spe, (e + 1) * spe):
            b = s.sample(BASE, t)
            assert b.indices.shape == b.mask.shape == (bsz,)
            seen += b.indices[b.mask].tolist()
        assert sorted(seen) == list(range(n))
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    np.testing.assert_array_equal(s.sample(BASE, spe + 1).indices, s.sample(BASE, spe + 1).indices)


def test_gather():
    ds = {"x": np.arange(30).reshape(10, 3), "y": np.arange(10)}
    out = gather(ds, np.array([3, 0, 9], np.int32))
    np.testing.assert_array_equal(out["y"], [3, 0, 9])
    assert out["x"].shape == (3, 3)
    with pytest.raises(ValueError):
        gather({"x": np.zeros((3, 2)), "y": np.zeros(4)}, np.array([0]))
    with pytest.raises(ValueError):
        gather(ds, np.array([10]))


@pytest.mark.parametrize(
    "ctor",
    [
        lambda: PoissonSampler(0, 0.1),
        lambda: PoissonSampler(10, 0.0),
        lambda: PoissonSampler(10, 1.5),
        lambda: PoissonSampler(10, float("nan")),
        lambda: PoissonSampler(10, 0.1, capacity=0),
        lambda: PoissonSampler(10, 0.1, overflow="drop"),
        lambda: FixedSizeSampler(10, 11),
        lambda: FixedSizeSampler(10, 0),
        lambda: FixedSizeSampler(2.5, 1),
    ],
)
def test_bad_arguments(ctor):
    with pytest.raises(ValueError):
        ctor()


def test_shuffled_bad_args():
    with pytest.warns(UserWarning):
        s = ShuffledEpochs(10, 3)
    with pytest.raises(ValueError):
        s.sample(BASE, -1)
    with pytest.raises(ValueError):
        ShuffledEpochs(5, 6)
    assert isinstance(s.sample(BASE, 0), Batch)
