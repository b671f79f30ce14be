"""The traced-program interpreter without the batch-of-one axis (``program/unit_axis.py``): every rule computes the
equation's own values, and the private gradient computed so equals ``vmap(grad)`` clipped per example."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpzero_jax as dz
from dpzero_jax.program import interpret, mode, unit_axis
from dpzero_jax.program.analyze import Analysis

T, D, H = 6, 8, 2


def _single_example(x, scale, table):
    """One example's ``[1, T, D]`` through the equations the rules cover (and some they leave alone)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    normed = centred * jax.lax.rsqrt(jnp.mean(centred ** 2, axis=-1, keepdims=True) + 1e-6) * scale
    q = normed.reshape(1, T, H, D // H)
    attended = jax.nn.dot_product_attention(q, q, q, is_causal=True).reshape(1, T, D)
    swapped = jnp.swapaxes(attended, 1, 2)                                      # transpose keeping axis 0
    moved = jnp.transpose(attended[:, :, None], (2, 0, 1, 3))                   # a unit axis moved to the front
    logits = jax.nn.log_softmax(attended @ table.T)                             # a jit (log_softmax)
    picked = jnp.argmax(logits, axis=-1)
    gelu = jax.nn.gelu(jnp.where(attended > 0, attended, 0.1 * attended))
    clipped = jnp.clip(gelu, -0.5, 0.5) ** 3
    return (jnp.sum(swapped ** 2) + jnp.sum(jnp.max(moved, axis=-1)) + jnp.sum(logits * picked[..., None])
            + jnp.sum(clipped) + jnp.sum(jnp.broadcast_to(mean, (1, T, D)) * normed))


def _run(closed, args, squeeze: bool):
    analysis = Analysis(squeeze_unit_axis=squeeze)
    return interpret.run(closed.jaxpr, closed.consts, list(args), analysis, {}, {})


def test_squeezed_program_computes_the_same_values_and_gradients():
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(1, T, D)), jnp.float32), jnp.asarray(rng.normal(size=(D,)), jnp.float32),
            jnp.asarray(rng.normal(size=(5, D)), jnp.float32))
    closed = jax.make_jaxpr(_single_example)(*args)
    rules = [unit_axis.rule(e) for e in closed.jaxpr.eqns]
    assert sum(r is not None for r in rules) >= 10, "the test program should exercise the rules"
    whole = _run(closed, args, squeeze=False)
    squeezed = _run(closed, args, squeeze=True)
    np.testing.assert_array_equal(np.asarray(squeezed[0]), np.asarray(whole[0]))
    np.testing.assert_allclose(float(squeezed[0]), float(_single_example(*args)), rtol=1e-6)
    grads = [jax.grad(lambda *a, s=s: _run(closed, a, s)[0], argnums=(0, 1, 2))(*args) for s in (False, True)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    # under vmap over examples (how the engine runs it)
    batch = jnp.asarray(rng.normal(size=(3, 1, T, D)), jnp.float32)
    per_example = [jax.vmap(lambda x, s=s: _run(closed, (x,) + args[1:], s)[0])(batch) for s in (False, True)]
    np.testing.assert_allclose(np.asarray(per_example[1]), np.asarray(per_example[0]), rtol=1e-6)


@pytest.mark.parametrize("name, shape, params, expected", [
    ("reduce_sum", (1, 1, 4, 5), {"axes": (3,)}, (2, {"axes": (1,)})),
    ("reduce_sum", (1, 4, 5), {"axes": (0, 2)}, None),           # reduces the unit axis itself: left alone
    ("reduce_sum", (1, 4, 5), {"axes": ()}, None),               # reduces nothing
    ("transpose", (1, 4, 5), {"permutation": (0, 2, 1)}, (1, {"permutation": (1, 0)})),
    ("transpose", (1, 1, 4), {"permutation": (1, 2, 0)}, None),
])
def test_rule_parameters(name, shape, params, expected):
    fn = {"reduce_sum": lambda x: jax.lax.reduce_sum_p.bind(x, axes=params["axes"], out_sharding=None),
          "transpose": lambda x: jax.lax.transpose(x, params["permutation"])}[name]
    (eqn,) = jax.make_jaxpr(fn)(jnp.zeros(shape)).jaxpr.eqns
    got = unit_axis.rule(eqn)
    if expected is None:
        assert got is None
    else:
        k, _, new = got
        assert k == expected[0] and {key: new[key] for key in expected[1]} == expected[1]


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        y = nn.LayerNorm()(h)
        y = jax.nn.dot_product_attention(*(nn.DenseGeneral((H, D // H), name=n)(y) for n in "qkv"), is_causal=True)
        h = h + nn.DenseGeneral(D, axis=(-2, -1))(y)
        return h + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(h))))


@pytest.mark.parametrize("mode_name", ["bk", "ghost", "fused"])
def test_private_gradient_on_the_squeezed_program_matches_vmap_grad(mode_name):
    model = _Block()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, T, D)), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(p, batch):
        return jnp.mean(model.apply({"params": p}, batch["x"]) ** 2, axis=(1, 2))

    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=0.05, mode=mode_name, expected_batch_size=4, target="cpu",
                      groups="param-wise" if mode_name == "fused" else "all-layer")
    plan = mode.plan_program(loss_fn, cfg, params, {"x": x}, [str(i) for i in range(len(jax.tree.leaves(params)))],
                             4)
    assert plan.analysis.squeeze_unit_axis
    _, grads, stats = jax.jit(dz.private_value_and_grad(loss_fn, cfg))(params, {"x": x}, jax.random.key(0))
    per = jax.vmap(jax.grad(lambda p, xi: loss_fn(p, {"x": xi[None]})[0]), (None, 0))(params, x)
    if mode_name == "fused":   # param-wise: each leaf clipped at R / sqrt(M)
        leaves, treedef = jax.tree.flatten(per)
        threshold = 0.05 / np.sqrt(len(leaves))
        norms = jnp.stack([jnp.sqrt(jnp.sum(g.reshape(4, -1) ** 2, axis=1)) for g in leaves], axis=1)
        scales = jnp.minimum(1.0, threshold / norms)
        expected = jax.tree.unflatten(treedef, [jnp.tensordot(scales[:, j], g, 1) / 4 for j, g in enumerate(leaves)])
    else:
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(4, -1) ** 2, axis=1) for g in jax.tree.leaves(per)))
        expected = jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1.0, 0.05 / norms), g, 1) / 4, per)
    # atol: the key projection's bias has a zero gradient (softmax ignores a shift), ~1e-8 in rounding
    np.testing.assert_allclose(np.asarray(stats.norms), np.asarray(norms), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)


def test_only_a_cpu_target_squeezes():
    params = {"w": jnp.ones((D, D))}

    def loss_fn(p, batch):
        return jnp.sum(jnp.tanh(batch["x"] @ p["w"]), axis=(1, 2))

    batch = {"x": jnp.ones((2, T, D))}
    for target, expected in (("cpu", True), ("tpu", False), ("gpu", False)):
        cfg = dz.DPConfig(noise_multiplier=0.0, expected_batch_size=2, target=target)
        analysis = mode.plan_program(loss_fn, cfg, params, batch, ["w"], 2).analysis
        assert analysis.squeeze_unit_axis is expected
        assert [site.squeeze for site in analysis.sites.values()] == [expected]


def test_only_jits_without_shardings_of_their_own_are_inlined():
    plain = jax.jit(jnp.tanh)
    pinned = jax.jit(jnp.tanh, out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    x = jnp.ones((1, T, D))
    calls = [jax.make_jaxpr(f)(x).jaxpr.eqns[0] for f in (plain, pinned)]
    assert [interpret._inlinable(eqn) for eqn in calls] == [True, False]
    # the pinned jit is bound as it is; both give the same values squeezed
    closed = jax.make_jaxpr(lambda x: pinned(plain(x) * 2.0))(x)
    np.testing.assert_array_equal(np.asarray(_run(closed, (x,), True)[0]), np.asarray(_run(closed, (x,), False)[0]))
