"""The public pieces for a user's loop (dpzero_jax.optax_dp): clipped_grad, gaussian_privatizer, nnx_private_step.

References are written here: per-example gradients by ``jax.vmap(jax.grad)`` clipped in the test, the textbook
bound ``||(R_1..R_M)||``, and the empirical std of the noise."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpzero_jax as dz
from dpzero_jax import ops

B, D, H, C = 6, 5, 7, 3
THRESHOLDS = (0.03, 0.02)        # layer-wise: l1, l2 (small, so that most examples are clipped in both groups)


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"l1": {"kernel": jax.random.normal(k1, (D, H)), "bias": 0.1 * jax.random.normal(k3, (H,))},
            "l2": {"kernel": jax.random.normal(k2, (H, C)), "bias": jnp.zeros((C,))}}


def logits_of(params, x, dense):
    h = jnp.tanh(dense(x, params["l1"]["kernel"], params["l1"]["bias"]))
    return dense(h, params["l2"]["kernel"], params["l2"]["bias"])


def plain_dense(x, kernel, bias):
    return x @ kernel + bias


def losses_of(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def loss_fn(params, batch):                            # DP layers (ops.dense): every mode works
    return losses_of(logits_of(params, batch["x"], ops.dense), batch["y"])


def loss_with_aux(params, batch):
    logits = logits_of(params, batch["x"], ops.dense)
    return losses_of(logits, batch["y"]), {"logits": logits, "note": jnp.arange(3)}


@pytest.fixture(scope="module")
def setup():
    params = init_params(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": 3.0 * jax.random.normal(kx, (B, D)), "y": jax.random.randint(ky, (B,), 0, C)}
    return params, batch


def reference_clipped(params, batch, thresholds, clip_fn="abadi", gamma=0.01):
    """Per-example gradients (vmap of grad of the plain-jnp loss), clipped layer-wise here."""
    def example_loss(p, x, y):
        return losses_of(logits_of(p, x[None], plain_dense), y[None])[0]

    grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
    contributions = {}
    for layer, r in zip(("l1", "l2"), thresholds):
        norm = jnp.sqrt(sum(jnp.sum(g.reshape(B, -1) ** 2, 1) for g in grads[layer].values()))
        factor = {"abadi": jnp.minimum(1.0, r / norm), "automatic": r / (norm + gamma),
                  "global": (norm < r).astype(jnp.float32)}[clip_fn]
        contributions[layer] = {name: g * factor.reshape((B,) + (1,) * (g.ndim - 1))
                                for name, g in grads[layer].items()}
    return contributions


def flat_per_example(tree):
    return jnp.concatenate([leaf.reshape(B, -1) for leaf in jax.tree.leaves(tree)], axis=1)


@pytest.mark.parametrize("clip_fn", ["abadi", "automatic", "global"])
@pytest.mark.parametrize("mode", ["bk", "vmap"])
def test_clipped_grad_sum_and_sensitivity_bound(setup, clip_fn, mode):
    params, batch = setup
    thresholds = THRESHOLDS if clip_fn != "global" else (50.0, 50.0)   # global: keep (some) examples
    cfg = dz.DPConfig(noise_multiplier=3.0, groups="layer-wise", group_thresholds=thresholds, clip_fn=clip_fn,
                      mode=mode)
    fn = jax.jit(dz.clipped_grad(loss_fn, cfg))
    out = fn(params, batch)
    bound = math.sqrt(sum(r * r for r in thresholds))
    assert isinstance(out, dz.ClippedGrad) and out.aux is None
    assert float(out.l2_sensitivity) == pytest.approx(bound, rel=1e-6)
    np.testing.assert_allclose(out.thresholds, thresholds, rtol=1e-7)
    reference = reference_clipped(params, batch, thresholds, clip_fn)
    for got, want in zip(jax.tree.leaves(out.grad_sum), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want.sum(0), rtol=2e-5, atol=2e-6)
    contribution_norms = jnp.linalg.norm(flat_per_example(reference), axis=1)
    assert float(jnp.max(contribution_norms)) <= bound * (1 + 1e-6)
    if clip_fn == "abadi":                    # examples clipped in both groups attain the bound
        clipped_in_both = np.all(np.asarray(out.stats.clip_factors) < 1, axis=1)
        assert clipped_in_both.sum() >= B // 2
        np.testing.assert_allclose(contribution_norms[clipped_in_both], bound, rtol=1e-5)
    assert out.stats.norms.shape == (B, 2) and out.stats.clip_factors.shape == (B, 2)
    assert int(out.stats.num_included) == B and int(out.stats.num_nonfinite) == 0
    np.testing.assert_allclose(out.losses, loss_fn(params, batch), rtol=1e-5)   # jitted against eager: float32 order
    # add/remove adjacency directly: dropping any one example moves the sum by at most the sensitivity
    for j in range(B):
        removed = fn(params, batch, jnp.arange(B) != j)
        moved = jnp.sqrt(sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(out.grad_sum),
                                                                    jax.tree.leaves(removed.grad_sum))))
        assert float(moved) <= bound * (1 + 1e-5)
        assert int(removed.stats.num_included) == B - 1


def test_has_aux_returns_aux_unchanged(setup):
    params, batch = setup
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=0.5, mode="bk")
    out = jax.jit(dz.clipped_grad(loss_with_aux, cfg, has_aux=True))(params, batch)
    np.testing.assert_allclose(out.aux["logits"], logits_of(params, batch["x"], plain_dense), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.aux["note"], np.arange(3))
    plain = dz.clipped_grad(loss_fn, cfg)(params, batch)
    for a, b in zip(jax.tree.leaves(out.grad_sum), jax.tree.leaves(plain.grad_sum)):   # jitted vs eager
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    key = jax.random.key(3)
    (losses, aux), grads, _ = dz.private_value_and_grad(loss_with_aux, cfg.replace(noise_multiplier=1.0),
                                                        has_aux=True)(params, batch, key)
    _, grads_plain, _ = dz.private_value_and_grad(loss_fn, cfg.replace(noise_multiplier=1.0))(params, batch, key)
    np.testing.assert_allclose(losses, loss_fn(params, batch), rtol=1e-5)
    np.testing.assert_allclose(aux["logits"], out.aux["logits"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_plain)):
        np.testing.assert_array_equal(a, b)


def test_has_aux_errors_name_the_problem(setup):
    params, batch = setup
    cfg = dz.DPConfig(mode="bk")
    pair = r"has_aux=True: loss_fn must return a pair \(losses \[B\], aux\), got an array of shape \(6,\)"
    with pytest.raises(ValueError, match=pair):
        dz.clipped_grad(loss_fn, cfg, has_aux=True)(params, batch)
    with pytest.raises(ValueError, match="pass has_aux=True"):
        dz.clipped_grad(loss_with_aux, cfg)(params, batch)


def test_privatizer_noise_std():
    sigma, sensitivity, expected = 1.3, 0.7, 8.0
    tx = dz.gaussian_privatizer(sigma, sensitivity, expected, jax.random.key(5))
    tree = {"big": jnp.zeros((400, 500)), "small": jnp.full((1000,), 16.0)}    # 200k > one noise block
    noised, _ = jax.jit(tx.update)(tree, tx.init(tree))
    std = sigma * sensitivity / expected
    for leaf in (noised["big"].ravel(), noised["small"] - 2.0):
        n = leaf.size
        # sample std: relative standard error 1/sqrt(2n); mean: standard error std/sqrt(n); 5 standard errors
        assert float(jnp.std(leaf)) == pytest.approx(std, rel=5 / math.sqrt(2 * n))
        assert abs(float(jnp.mean(leaf))) < 5 * std / math.sqrt(n)
    assert noised["big"].dtype == jnp.float32 and noised["big"].shape == (400, 500)
    zero = dz.gaussian_privatizer(0.0, sensitivity, expected, jax.random.key(5))
    plain, _ = zero.update(tree, zero.init(tree))
    np.testing.assert_array_equal(plain["small"], 2.0)


def test_privatizer_key_evolution():
    key = jax.random.key(11)
    tx = dz.gaussian_privatizer(1.0, 1.0, 4.0, key)
    tree = {"w": jnp.zeros((50,))}
    state0 = tx.init(tree)
    assert isinstance(state0, dz.GaussianPrivatizerState) and int(state0.count) == 0
    update = jax.jit(tx.update)
    first, state1 = update(tree, state0)
    second, state2 = update(tree, state1)
    assert int(state1.count) == 1 and int(state2.count) == 2
    assert bool(jnp.all(jax.random.key_data(state2.key) == jax.random.key_data(key)))   # the state carries the key
    assert not np.allclose(first["w"], second["w"])                                     # a fresh key per update
    again, _ = update(tree, dz.gaussian_privatizer(1.0, 1.0, 4.0, key).init(tree))
    np.testing.assert_array_equal(first["w"], again["w"])                                # same key reproduces
    other, _ = update(tree, dz.gaussian_privatizer(1.0, 1.0, 4.0, jax.random.key(12)).init(tree))
    assert not np.allclose(first["w"], other["w"])
    # update t uses fold_in(key, t): the noise of update 1 with unit std is N(0, I) / 4 from that key
    direct = dz.noise.add_noise_and_normalise(tree, jax.random.fold_in(key, 1), 1.0, 4.0)
    np.testing.assert_array_equal(second["w"], direct["w"])


def test_privatizer_rejects_bad_arguments():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        dz.gaussian_privatizer(-1.0, 1.0, 4.0, key)
    with pytest.raises(ValueError, match="l2_sensitivity must be > 0"):
        dz.gaussian_privatizer(1.0, 0.0, 4.0, key)
    with pytest.raises(ValueError, match="expected_batch_size"):
        dz.gaussian_privatizer(1.0, 1.0, float("nan"), key)
    with pytest.raises(ValueError, match="key must be a PRNG key"):
        dz.gaussian_privatizer(1.0, 1.0, 4.0, 3)
    tx = dz.gaussian_privatizer(1.0, 1.0, 4.0, key)
    with pytest.raises(ValueError, match="int32 leaf of shape"):
        tx.update({"w": jnp.zeros((2,), jnp.int32)}, tx.init(None))


@pytest.mark.parametrize("groups", ["all-layer", "layer-wise"])
def test_chain_update_equals_private_value_and_grad(setup, groups):
    """Update t of ``chain(privatizer(key), sgd)`` is sgd's update of ``private_value_and_grad`` with key
    ``fold_in(key, t)``: bit for bit when both run op by op (eagerly); under two separate ``jax.jit`` programs XLA
    may fuse the clipped sum differently (rounding only; the noise is the same draw)."""
    params, batch = setup
    cfg = dz.DPConfig(noise_multiplier=1.1, max_grad_norm=0.5, groups=groups, mode="bk", expected_batch_size=5.0)
    key = jax.random.key(7)
    sgd = optax.sgd(0.1)
    for jit in (False, True):
        wrap = jax.jit if jit else (lambda f: f)
        clipped = wrap(dz.clipped_grad(loss_fn, cfg))
        private = wrap(dz.private_value_and_grad(loss_fn, cfg))
        out = clipped(params, batch)
        tx = optax.chain(dz.gaussian_privatizer(cfg.noise_multiplier, out.l2_sensitivity, cfg.expected_batch_size,
                                                key), sgd)
        state = tx.init(params)
        for step in range(2):
            updates, state = wrap(tx.update)(out.grad_sum, state, params)
            _, grads, _ = private(params, batch, jax.random.fold_in(key, step))
            expected, _ = sgd.update(grads, sgd.init(params), params)
            for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
                if jit:
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
                else:
                    np.testing.assert_array_equal(a, b)
        noise_scale = 0.1 * cfg.noise_multiplier * float(out.l2_sensitivity) / cfg.expected_batch_size
        assert float(jnp.std(updates["l1"]["kernel"])) > 0.3 * noise_scale      # the noise is there


class StandardMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.l2 = nnx.Linear(H, C, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def test_nnx_private_step_equals_private_value_and_grad(setup):
    _, batch = setup
    cfg = dz.DPConfig(noise_multiplier=0.8, max_grad_norm=1.0, mode="vmap")
    key = jax.random.key(9)

    def model_loss(model, batch):
        return losses_of(model(batch["x"]), batch["y"])

    model = StandardMLP(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(jnp.array, params)                             # a copy: the step updates the model
    _, grads, _ = dz.private_value_and_grad(lambda p, b: model_loss(nnx.merge(graphdef, p, rest), b), cfg)(
        params, batch, key)
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    losses, stats = dz.nnx_private_step(model_loss, cfg)(model, optimizer, batch, key)
    assert losses.shape == (B,) and int(stats.num_included) == B
    after = nnx.state(model, nnx.Param)
    for new, old, g in zip(jax.tree.leaves(after), jax.tree.leaves(params), jax.tree.leaves(grads)):
        np.testing.assert_allclose(new, old - 0.5 * g, rtol=1e-6, atol=1e-7)
    # Standard nnx layers in book-keeping mode (the traced-program front-end): the same update as vmap's.
    model_bk = StandardMLP(nnx.Rngs(0))
    optimizer_bk = nnx.Optimizer(model_bk, optax.sgd(0.5), wrt=nnx.Param)
    dz.nnx_private_step(model_loss, cfg.replace(mode="bk"))(model_bk, optimizer_bk, batch, key)
    for new, ref_new in zip(jax.tree.leaves(nnx.state(model_bk, nnx.Param)), jax.tree.leaves(after)):
        np.testing.assert_allclose(new, ref_new, rtol=1e-5, atol=1e-6)


def test_privatizer_inside_nnx_optimizer():
    """The privatizer's key lives in an ``nnx.Optimizer``'s state and advances across jitted updates."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    key = jax.random.key(4)
    optimizer = nnx.Optimizer(model, optax.chain(dz.gaussian_privatizer(1.0, 1.0, 4.0, key), optax.sgd(1.0)),
                              wrt=nnx.Param)
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    before = jax.tree.map(jnp.array, nnx.state(model, nnx.Param))

    @nnx.jit
    def update(model, optimizer, grad_sum):
        optimizer.update(model, grad_sum)

    update(model, optimizer, zeros)
    update(model, optimizer, zeros)
    # sgd(1) of (0 + N(0, I)) / 4 twice: params - noise_0 - noise_1, noise_t drawn from fold_in(key, t), std 1/4
    noises = [dz.noise.add_noise_and_normalise(zeros, jax.random.fold_in(key, t), 1.0, 4.0) for t in (0, 1)]
    for new, old, n0, n1 in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(before),
                                jax.tree.leaves(noises[0]), jax.tree.leaves(noises[1])):
        np.testing.assert_allclose(new, old - n0 - n1, rtol=1e-6, atol=1e-7)
        assert float(jnp.max(jnp.abs(new - old))) > 0
