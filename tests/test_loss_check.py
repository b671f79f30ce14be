"""``dz.check_per_example_loss``: losses that couple the examples of a batch are refused, per-example ones pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import gpt2, vit

import dpzero_jax as dz
from dpzero_jax import rmm

B, D, H = 6, 5, 7


def _data():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {"w1": 0.5 * jax.random.normal(k1, (D, H)), "w2": 0.5 * jax.random.normal(k2, (H,))}
    batch = {"x": jax.random.normal(k3, (B, D)), "y": jnp.linspace(-1.0, 1.0, B)}
    return params, batch


def _per_example(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.square(hidden @ params["w2"] - batch["y"])


def test_a_per_example_loss_passes():
    params, batch = _data()
    assert dz.check_per_example_loss(_per_example, params, batch) is None


def test_a_per_example_loss_with_a_nan_example_passes():
    params, batch = _data()
    batch = {"x": batch["x"].at[2].set(jnp.nan), "y": batch["y"]}
    assert np.isnan(np.asarray(_per_example(params, batch))[2])
    assert dz.check_per_example_loss(_per_example, params, batch) is None


def test_a_finite_loss_with_a_non_finite_gradient_passes():
    params, batch = _data()
    batch = {"x": batch["x"].at[1].set(0.0), "y": batch["y"]}

    def norm_loss(params, batch):   # example 1: sqrt at 0, a finite loss whose gradient is NaN
        return jnp.sqrt(jnp.sum(jnp.square(batch["x"] @ params["w1"]), axis=1))

    grads = jax.grad(lambda p: jnp.sum(norm_loss(p, batch)))(params)
    assert np.isfinite(np.asarray(norm_loss(params, batch))).all() and not np.isfinite(np.asarray(grads["w1"])).all()
    assert dz.check_per_example_loss(norm_loss, params, batch) is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_half_precision_model_passes_and_its_coupling_is_refused(dtype):
    params, batch = _data()
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    batch = jax.tree.map(lambda x: x.astype(dtype), batch)
    assert _per_example(params, batch).dtype == dtype
    dz.check_per_example_loss(_per_example, params, batch)
    with pytest.raises(ValueError, match="couples the examples"):
        dz.check_per_example_loss(lambda p, b: _per_example(p, b) - jnp.mean(_per_example(p, b)), params, batch)


def test_a_loss_with_aux():
    params, batch = _data()

    def with_aux(params, batch):
        losses = _per_example(params, batch)
        return losses, {"mean": jnp.mean(losses)}   # a batch statistic in the aux is no coupling

    assert dz.check_per_example_loss(with_aux, params, batch, has_aux=True) is None
    with pytest.raises(ValueError, match="must return a pair"):
        dz.check_per_example_loss(_per_example, params, batch, has_aux=True)


def test_a_batch_mean_in_the_loss_is_refused_by_value():
    params, batch = _data()

    def centred(params, batch):   # each loss minus the batch's mean loss
        losses = _per_example(params, batch)
        return losses - jnp.mean(losses) + 1.0

    with pytest.raises(dz.loss_check.CoupledLossError, match="couples the examples of the batch: 6 of 6 per-example"):
        dz.check_per_example_loss(centred, params, batch)


def test_a_coupling_of_the_gradient_only_is_refused():
    params, batch = _data()

    def coupled(params, batch):   # the same values as _per_example, but every example's gradient has the mean's
        losses = _per_example(params, batch)
        mean = jnp.mean(losses)
        return losses + (mean - jax.lax.stop_gradient(mean))

    np.testing.assert_allclose(coupled(params, batch), _per_example(params, batch), rtol=1e-6)
    with pytest.raises(ValueError, match="through its gradient.*'w1'"):
        dz.check_per_example_loss(coupled, params, batch)


class _Net(nn.Module):
    norm: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(H)(x)
        h = nn.BatchNorm(use_running_average=False)(h) if self.norm == "batch" else nn.LayerNorm()(h)
        return nn.Dense(1)(jax.nn.relu(h))[:, 0]


@pytest.mark.parametrize("norm, coupled", [("layer", False), ("batch", True)])
def test_flax_layer_norm_passes_and_batch_norm_in_training_mode_is_refused(norm, coupled):
    _, batch = _data()
    net = _Net(norm)
    variables = net.init(jax.random.key(0), batch["x"])
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def loss_fn(params, batch):
        out, _ = net.apply({"params": params, **state}, batch["x"], mutable=list(state))
        return jnp.square(out - batch["y"])

    if coupled:
        with pytest.raises(ValueError, match="couples the examples"):
            dz.check_per_example_loss(loss_fn, params, batch)
    else:
        dz.check_per_example_loss(loss_fn, params, batch)


def test_bad_inputs_are_named():
    params, batch = _data()
    with pytest.raises(ValueError, match="at least 2 examples"):
        dz.check_per_example_loss(_per_example, params, jax.tree.map(lambda x: x[:1], batch))
    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\]"):
        dz.check_per_example_loss(lambda p, b: jnp.mean(_per_example(p, b)), params, batch)
    with pytest.raises(ValueError, match="rtol and atol"):
        dz.check_per_example_loss(_per_example, params, batch, rtol=-1.0)


@pytest.mark.parametrize("name", ["gpt2-flax", "gpt2-dz-nn", "vit"])
def test_the_bundled_models_losses_are_per_example(name):
    setup = {"gpt2-flax": lambda: gpt2(), "gpt2-dz-nn": lambda: gpt2(dz_nn=True), "vit": vit}[name]()
    dz.check_per_example_loss(setup.loss_fn, setup.params, setup.batch)


@pytest.mark.parametrize("private", [True, False])
def test_rmm_layers_private_layout_passes_and_the_rows_sketch_is_refused(private):
    """The RMM layers' randomized backward: the DP layout (``"tokens"``: each example's positions sketched on their
    own) is per-example; paper 002's ``"rows"`` layout sketches the rows of the whole batch together, which
    couples the examples' weight gradients -- the check sees it in the gradient."""
    config = dz.models.GPT2Config(vocab_size=23, n_positions=12, n_embd=16, n_layer=1, n_head=2)
    model = rmm.convert_to_rmm(dz.models.GPT2(config, rngs=nnx.Rngs(0)), sketch="gaussian", rate=0.5,
                               private=private)
    params, loss_for_key = rmm.keyed_objective(dz.models.lm_objective, model)
    batch = {"input_ids": jnp.asarray(np.random.default_rng(0).integers(0, 23, (4, 10)), jnp.int32)}
    if private:
        dz.check_per_example_loss(loss_for_key(jax.random.key(3)), params, batch)
    else:
        with pytest.raises(dz.loss_check.CoupledLossError, match="through its gradient"):
            dz.check_per_example_loss(loss_for_key(jax.random.key(3)), params, batch)
