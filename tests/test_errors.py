"""Validation and error messages: DPConfig fields, unsupported parameters, shapes, groups, fused-mode limits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import B, Setup, build, check_private, gpt2, layers_mlp, mlp, mlp_batch, private_fn

import dpzero_jax as dz

# ---------------------------------------------------------------------------------------------------------------
# DPConfig


@pytest.mark.parametrize("field, value", [
    ("noise_multiplier", -1.0),
    ("noise_multiplier", float("nan")),
    ("noise_multiplier", True),
    ("noise_multiplier", "1.0"),
    ("max_grad_norm", 0.0),
    ("max_grad_norm", -2.0),
    ("max_grad_norm", float("inf")),
    ("max_grad_norm", None),
    ("gamma", 0.0),
    ("gamma", -0.1),
    ("clip_fn", "clip"),
    ("clip_fn", "Abadi"),
    ("mode", "book-keeping"),
    ("mode", None),
    ("norm_method", "fast"),
    ("target", "tpu-v5e"),
    ("groups", "layerwise"),
    ("groups", ("uniform", 0)),
    ("groups", ("uniform", 2.0)),
    ("groups", ("chunks", 2)),
    ("groups", ["uniform", 2]),
    ("groups", 3),
    ("expected_batch_size", 0),
    ("expected_batch_size", -4.0),
    ("expected_batch_size", float("inf")),
    ("microbatch_size", 0),
    ("microbatch_size", 2.0),
    ("microbatch_size", True),
    ("group_thresholds", (1.0, 0.0)),
    ("group_thresholds", (1.0, -1.0)),
    ("group_thresholds", (float("nan"),)),
])
def test_dpconfig_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        dz.DPConfig(**{field: value})


@pytest.mark.parametrize("value", [("a", "b"), 5])
def test_dpconfig_rejects_non_numeric_group_thresholds_naming_the_field(value):
    with pytest.raises(ValueError, match="group_thresholds"):
        dz.DPConfig(group_thresholds=value)


def test_dpconfig_accepts_valid_values_and_is_frozen():
    cfg = dz.DPConfig(noise_multiplier=0, max_grad_norm=2, clip_fn="global", groups=("uniform", 2), mode="fused",
                      norm_method="instantiate", expected_batch_size=64, microbatch_size=3, gamma=0.1,
                      group_thresholds=[1, 2])
    assert cfg.group_thresholds == (1.0, 2.0)
    assert dz.DPConfig(groups={"a": "x"}).groups == {"a": "x"}
    assert callable(dz.DPConfig(groups=lambda p: p).groups)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mode = "bk"
    assert cfg.replace(mode="bk").mode == "bk" and cfg.mode == "fused"
    with pytest.raises(ValueError, match="mode"):
        cfg.replace(mode="nope")


def test_private_value_and_grad_needs_a_dpconfig():
    with pytest.raises(TypeError, match="DPConfig"):
        dz.private_value_and_grad(lambda p, b: b, {"noise_multiplier": 1.0})


# ---------------------------------------------------------------------------------------------------------------
# Parameters used outside the DP layers


class RawBias(nnx.Module):
    """A Linear followed by a raw ``nnx.Param`` bias added outside any DP layer."""

    def __init__(self, config, *, rngs):
        self.lin = dz.layers.Linear(6, 4, use_bias=False, rngs=rngs)
        self.b = nnx.Param(jnp.linspace(-1.0, 1.0, 4))

    def __call__(self, x):
        return jnp.tanh(self.lin(x)) + self.b[...]


def raw_bias_setup() -> Setup:
    model = build(RawBias, None, 0)
    params, loss_fn = dz.models.classification_objective(model, input_key="x")
    return Setup("raw-bias", params, loss_fn, mlp_batch(30, in_features=6, num_classes=4), ("lin", "b"))


def test_raw_param_outside_layers_runs_fused_on_the_traced_program():
    """The traced-program front-end takes fused mode over when its groups are local to one layer call: the kernel
    and the raw bias added after it form one (tests/test_program_fused.py: what it book-keeps instead)."""
    setup = raw_bias_setup()
    for groups in ("param-wise", "all-layer"):
        check_private(setup, clip_fn="abadi", groups=groups, mode="fused")


def test_raw_param_rejected_with_front_end_layers():
    setup = raw_bias_setup()
    cfg = dz.DPConfig(noise_multiplier=0.0, mode="bk", front_end="layers")
    with pytest.raises(dz.UnsupportedParameterError, match=r"\['b'\].*front_end"):
        private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0))


def test_raw_param_norms_exact_in_bk_and_vmap():
    """The traced-program front-end takes over in bk and ghost modes: no parameter is refused."""
    setup = raw_bias_setup()
    for mode in ("bk", "ghost", "vmap"):
        norms = ref.jit(lambda p, b, mode=mode: dz.per_example_grad_norms(setup.loss_fn, p, b, mode=mode))(
            setup.params, setup.batch)
        np.testing.assert_allclose(norms, setup.group_norms("all-layer")[:, 0], rtol=1e-5)
    with pytest.raises(dz.UnsupportedParameterError, match="'b'.*front_end"):
        dz.per_example_grad_norms(setup.loss_fn, setup.params, setup.batch, front_end="layers")


@pytest.mark.parametrize("clip_fn, groups, microbatch", [("abadi", "all-layer", None), ("global", "param-wise", 2),
                                                         ("automatic", "layer-wise", 1)])
def test_raw_param_works_in_vmap_and_bk_modes(clip_fn, groups, microbatch):
    setup = raw_bias_setup()
    for mode in ("vmap", "bk"):
        check_private(setup, clip_fn=clip_fn, groups=groups, mode=mode, microbatch_size=microbatch)


def test_frozen_raw_param_is_fine():
    """A raw array closed over (not in params) is a constant, not a trainable parameter."""
    model = build(RawBias, None, 0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    trainable = {"lin": params["lin"]}
    frozen_bias = params["b"]

    def loss_fn(trainable, batch):
        state = nnx.State({"lin": trainable["lin"], "b": frozen_bias})
        logits = nnx.merge(graphdef, state, rest)(batch["x"])
        return -jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), batch["label"]]

    setup = Setup("frozen", trainable, loss_fn, mlp_batch(31, in_features=6, num_classes=4), ("lin",))
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="ghost")


def test_integer_parameter_rejected():
    params = {"w": jnp.ones((3, 2)), "step": jnp.zeros((), jnp.int32)}

    def loss_fn(p, b):
        return jnp.sum(dz.ops.dense(b["x"], p["w"]), axis=1)

    with pytest.raises(TypeError, match="step"):
        dz.private_value_and_grad(loss_fn, dz.DPConfig(mode="vmap"))(params, {"x": jnp.ones((B, 3))},
                                                                      jax.random.key(0))


# ---------------------------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("use_jit", [False, True])
def test_loss_must_be_per_example(use_jit):
    setup = mlp()

    def mean_loss(params, batch):
        return jnp.mean(setup.loss_fn(params, batch))

    def matrix_loss(params, batch):
        return jnp.stack([setup.loss_fn(params, batch)] * 2, axis=1)

    for loss_fn in (mean_loss, matrix_loss):
        for mode in ("bk", "vmap"):
            fn = private_fn(loss_fn, dz.DPConfig(mode=mode), use_jit=use_jit)
            with pytest.raises(ValueError, match=r"per-example losses of shape \[B\]"):
                fn(setup.params, setup.batch, jax.random.key(0))


@pytest.mark.parametrize("mask", [np.ones(B - 1, bool), np.ones((B, 1), bool), np.ones((), bool)])
def test_wrong_mask_shape(mask):
    setup = mlp()
    fn = private_fn(setup.loss_fn, dz.DPConfig(mode="bk"))
    with pytest.raises(ValueError, match="mask must have shape"):
        fn(setup.params, setup.batch, jax.random.key(0), mask)


def test_inputs_without_a_clear_meaning_are_refused():
    """An empty batch, no parameters, no key, a float mask (read as nonzero == True, not as a weight) and a groups
    mapping naming a path that is not a parameter: each refused by a message that names it."""
    setup = mlp()
    fn = private_fn(setup.loss_fn, dz.DPConfig(mode="bk"), use_jit=False)
    empty = jax.tree.map(lambda x: x[:0], setup.batch)
    with pytest.raises(ValueError, match="the batch is empty"):
        fn(setup.params, empty, jax.random.key(0))
    with pytest.raises(ValueError, match="params has no arrays"):
        private_fn(lambda p, b: jnp.sum(b["x"], axis=1), dz.DPConfig(mode="bk"), use_jit=False)(
            {}, setup.batch, jax.random.key(0))
    with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
        fn(setup.params, setup.batch, None)
    with pytest.raises(TypeError, match="mask must be a boolean"):
        fn(setup.params, setup.batch, jax.random.key(0), np.full(B, 0.5, np.float32))
    paths = ref.flat(setup.params)
    mapping = {**{path: "all" for path in paths}, "not/a/param": "all"}
    with pytest.raises(ValueError, match=r"not parameters: \['not/a/param'\]"):
        private_fn(setup.loss_fn, dz.DPConfig(mode="bk", groups=mapping), use_jit=False)(
            setup.params, setup.batch, jax.random.key(0))


def test_inconsistent_batch_axis():
    setup = mlp()
    batch = dict(setup.batch, label=np.zeros(B + 1, np.int32))
    with pytest.raises(ValueError, match="leading batch axis"):
        private_fn(setup.loss_fn, dz.DPConfig(mode="bk"))(setup.params, batch, jax.random.key(0))


# ---------------------------------------------------------------------------------------------------------------
# Groups


def test_groups_mapping_missing_a_parameter():
    setup = mlp()
    mapping = {p: "g" for p in setup.grads if p != "layers/1/bias"}
    with pytest.raises(ValueError, match="layers/1/bias"):
        private_fn(setup.loss_fn, dz.DPConfig(groups=mapping, mode="bk"))(setup.params, setup.batch,
                                                                           jax.random.key(0))


@pytest.mark.parametrize("k", [4, 10])
def test_uniform_groups_more_than_layers(k):
    setup = mlp()   # 3 layers
    with pytest.raises(ValueError, match=r"more groups than the model has layers \(3\)"):
        private_fn(setup.loss_fn, dz.DPConfig(groups=("uniform", k), mode="bk"))(setup.params, setup.batch,
                                                                                  jax.random.key(0))


def test_uniform_groups_one_per_layer():
    stats = check_private(mlp(), clip_fn="abadi", groups=("uniform", 3), mode="ghost")
    assert stats.norms.shape == (B, 3)


def test_group_thresholds_length_must_match():
    setup = mlp()
    cfg = dz.DPConfig(groups="layer-wise", group_thresholds=(1.0, 2.0), mode="bk")
    with pytest.raises(ValueError, match="group_thresholds has 2 entries but there are 3 groups"):
        private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0))


# ---------------------------------------------------------------------------------------------------------------
# Fused mode limits


@pytest.mark.parametrize("groups", ["all-layer", ("uniform", 2)])
def test_fused_rejects_groups_spanning_layers(groups):
    setup = layers_mlp()   # the layers front-end (the program front-end book-keeps such groups)
    with pytest.raises(ValueError, match="spans .* layer calls"):
        private_fn(setup.loss_fn, dz.DPConfig(groups=groups, mode="fused"))(setup.params, setup.batch,
                                                                             jax.random.key(0))


def test_fused_rejects_user_groups_spanning_layers():
    setup = layers_mlp()
    mapping = {p: "A" if p.endswith("kernel") else "B" for p in setup.grads}
    with pytest.raises(ValueError, match="fused"):
        private_fn(setup.loss_fn, dz.DPConfig(groups=mapping, mode="fused"))(setup.params, setup.batch,
                                                                              jax.random.key(0))


def test_fused_accepts_user_groups_inside_layers():
    setup = mlp()
    mapping = {p: ref.parent(p) + ("-w" if p.endswith("kernel") else "-b") for p in setup.grads}
    check_private(setup, clip_fn="automatic", groups=mapping, mode="fused")


@pytest.mark.parametrize("groups", ["layer-wise", "param-wise"])
def test_fused_rejects_tied_weights(groups):
    """On the layers front-end (the program front-end's fused mode clips a tied table's uses together)."""
    setup = gpt2(True, dz_nn=True)
    with pytest.raises(ValueError, match="wte/embedding.*tied"):
        private_fn(setup.loss_fn, dz.DPConfig(groups=groups, mode="fused"))(setup.params, setup.batch,
                                                                             jax.random.key(0))


def test_per_example_grad_norms_rejects_unknown_mode():
    setup = mlp()
    with pytest.raises(ValueError, match="mode"):
        dz.per_example_grad_norms(setup.loss_fn, setup.params, setup.batch, mode="fused")


# ---------------------------------------------------------------------------------------------------------------
# NNX models that update their own state in the loss


class _StatefulNet(nnx.Module):
    def __init__(self, layer: str, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.middle = nnx.Dropout(0.5, rngs=rngs) if layer == "dropout" else nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.middle(jax.nn.relu(self.hidden(x))))


@pytest.mark.parametrize("layer", ["dropout", "batchnorm"])
def test_stateful_layers_in_training_mode_are_named(layer):
    """Flax's own ``TraceContextError`` (a state update inside the engine's per-example trace) became a message
    naming the cause and the fix, in ``nnx_private_step`` and the trainer; ``model.eval()`` trains."""
    import optax

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(64, 8)).astype(np.float32), "y": rng.integers(0, 3, 64)}
    batch = {k: jnp.asarray(v[:4]) for k, v in data.items()}
    model = _StatefulNet(layer, nnx.Rngs(0))
    step = dz.nnx_private_step(loss_fn, dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0))
    with pytest.raises(ValueError, match="updates its own state while computing the loss"):
        step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), batch, jax.random.key(0))
    with pytest.raises(ValueError, match="model.eval()"):   # at once: the trainer's loss check compiles the loss
        dz.PrivateTrainer(_StatefulNet(layer, nnx.Rngs(0)), loss_fn, optax.sgd(0.1), data, batch_size=8, steps=1,
                          epsilon=3.0, delta=1e-3)
    trainer = dz.PrivateTrainer(_StatefulNet(layer, nnx.Rngs(0)), loss_fn, optax.sgd(0.1), data, batch_size=8,
                                steps=1, epsilon=3.0, delta=1e-3, check_loss=False)
    with pytest.raises(ValueError, match="model.eval()"):
        trainer.fit()
    model.eval()
    losses, _ = step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), batch, jax.random.key(0))
    assert losses.shape == (4,) and bool(jnp.all(jnp.isfinite(losses)))


def test_dpzero_jax_nn_holds_the_dp_specific_layers_and_says_where_the_others_went():
    """``dpzero_jax.nn`` keeps only the layers whose behaviour is DP-specific (RMM, LoRA); the layers front-end's
    dense, embedding and norm classes live in ``dpzero_jax.layers``, and asking ``dz.nn`` for one names its new home
    and the standard layer to use instead."""
    assert sorted(dz.nn.__all__) == ["LoRA", "RMMDense"]
    assert dz.nn.RMMDense is dz.rmm.RMMDense and dz.nn.LoRA is dz.peft.LoRA
    for name in ("Linear", "DenseGeneral", "Embed", "LayerNorm", "RMSNorm", "PatchEmbed"):
        assert isinstance(getattr(dz.layers, name), type)
        with pytest.raises(AttributeError, match=rf"dpzero_jax\.nn\.{name} moved to dpzero_jax\.layers\.{name}.*"
                                                 r"standard Flax layers"):
            getattr(dz.nn, name)
    with pytest.raises(AttributeError, match="no attribute 'Conv'"):
        _ = dz.nn.Conv
