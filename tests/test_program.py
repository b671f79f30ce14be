"""The traced-program front-end against ``vmap(grad)``: models written with standard libraries only.

Flax NNX (Linear, LinearGeneral, Einsum, Embed with a tied ``attend`` head, LayerNorm, RMSNorm, Conv, GroupNorm,
MultiHeadAttention), flax.linen (Dense, DenseGeneral, Conv, Embed, LayerNorm, ``nn.scan`` over ``nn.remat``
blocks) and plain JAX (a bare class token, an added position table, a layer scale, ``x.reshape(-1, d) @ W``, a
parameter inside ``lax.cond``, a product of two parameters). Norms rtol 1e-5, clipped gradients rtol 1e-4.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import B, Setup, check_private, dense_setup, gpt2, per_example_shapes, private_fn

import dpzero_jax as dz
from dpzero_jax.program import explanation
from dpzero_jax.program import mode as program_mode

VOCAB, T, D = 19, 6, 8


def token_batch(seed: int):
    rng = np.random.default_rng(seed)
    return {"ids": jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32),
            "y": jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32)}


def token_loss(logits, y):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1)[..., 0], axis=-1)


class NNXZoo(nnx.Module):
    def __init__(self, rngs, dtype=None):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs, dtype=dtype)
        self.position = nnx.Param(0.1 * jax.random.normal(jax.random.key(7), (T, D)))
        self.ln = nnx.LayerNorm(D, rngs=rngs, dtype=dtype)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs, dtype=dtype,
                                           use_bias=False)  # a key bias has a zero gradient (softmax shift)
        self.rms = nnx.RMSNorm(D, rngs=rngs, dtype=dtype)
        self.up = nnx.LinearGeneral(D, (2, D), rngs=rngs, dtype=dtype)
        self.mix = nnx.Einsum("bthd,hde->bte", (2, D, D), (D,), rngs=rngs, dtype=dtype)
        self.conv = nnx.Conv(D, D, kernel_size=(3,), rngs=rngs, dtype=dtype)
        self.gn = nnx.GroupNorm(D, num_groups=2, rngs=rngs, dtype=dtype)
        self.out = nnx.Linear(D, D, rngs=rngs, dtype=dtype)

    def __call__(self, ids):
        h = self.embed(ids) + self.position[...]
        h = h + self.attn(self.ln(h))
        h = h + self.mix(jax.nn.gelu(self.up(self.rms(h))))
        h = h + self.out(jax.nn.relu(self.gn(self.conv(h))))
        return self.embed.attend(h)


def nnx_setup(dtype=None) -> Setup:
    model = NNXZoo(nnx.Rngs(0), dtype=dtype)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        return token_loss(nnx.merge(graphdef, params)(batch["ids"]), batch["y"])

    return Setup("nnx-zoo", params, loss_fn, token_batch(1), ())


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        y = nn.LayerNorm()(h)
        y = nn.DenseGeneral((2, D // 2))(y).reshape(h.shape)
        y = nn.Conv(D, kernel_size=(3,))(jax.nn.gelu(y))
        return h + nn.Dense(D)(y), None


class LinenScanned(nn.Module):
    layers: int = 3

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D)
        h = embed(ids)
        blocks = nn.scan(nn.remat(LinenBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.layers)
        h, _ = blocks()(h, None)
        return embed.attend(nn.LayerNorm()(h))


def linen_setup(layers: int = 3) -> Setup:
    model = LinenScanned(layers)
    batch = token_batch(2)
    params = ref.jit(model.init)(jax.random.key(1), batch["ids"])["params"]

    def loss_fn(params, batch):
        return token_loss(model.apply({"params": params}, batch["ids"]), batch["y"])

    return Setup("linen-scan", params, loss_fn, batch, ())


def plain_setup() -> Setup:
    keys = jax.random.split(jax.random.key(5), 6)
    params = {"cls": jax.random.normal(keys[0], (1, D)), "position": 0.1 * jax.random.normal(keys[1], (T + 1, D)),
              "layer_scale": jnp.full((D,), 0.5), "w": jax.random.normal(keys[2], (D, D)) / 3,
              "lora_a": jax.random.normal(keys[3], (D, 2)), "lora_b": 0.1 * jax.random.normal(keys[4], (2, D)),
              "head": jax.random.normal(keys[5], (D, 3)), "gate": jnp.asarray(0.3)}
    rng = np.random.default_rng(3)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, batch):
        x = batch["x"]
        n = x.shape[0]
        h = jnp.concatenate([jnp.broadcast_to(p["cls"][None], (n, 1, D)), x], axis=1) + p["position"]
        h = (h.reshape(-1, D) @ p["w"]).reshape(n, T + 1, D) * p["layer_scale"]
        h = h + h @ (p["lora_a"] @ p["lora_b"])
        h = jax.lax.cond(True, lambda z: jnp.tanh(z * p["gate"]), lambda z: z, h)
        logits = h[:, 0] @ p["head"]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1)[:, 0]

    return Setup("plain", params, loss_fn, batch, ())


SETUPS = {"nnx": functools.cache(nnx_setup), "linen": functools.cache(linen_setup),
          "plain": functools.cache(plain_setup)}


@pytest.mark.parametrize("name", sorted(SETUPS))
@pytest.mark.parametrize("mode, clip_fn, groups, microbatch", [
    ("bk", "abadi", "all-layer", None), ("auto", "automatic", "layer-wise", None), ("bk", "global", "param-wise", 2),
    ("ghost", "abadi", "param-wise", None), ("ghost", "automatic", "all-layer", 3)])
def test_program_front_end_matches_vmap_grad(name, mode, clip_fn, groups, microbatch):
    check_private(SETUPS[name](), clip_fn=clip_fn, groups=groups, mode=mode, microbatch_size=microbatch, floor=1e-4)


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_masks_and_a_nan_example(name):
    setup = SETUPS[name]()
    key = "ids" if "ids" in setup.batch else "x"
    batch = dict(setup.batch)
    if key == "x":
        batch["x"] = batch["x"].at[3, 0, 0].set(jnp.nan)
        poisoned = Setup(setup.name, setup.params, setup.loss_fn, batch, ())
    else:  # ids cannot carry a NaN: the example brings a NaN term into its own loss instead
        batch["poison"] = jnp.zeros((B,), jnp.float32).at[3].set(jnp.nan)

        def loss_fn(params, b, inner=setup.loss_fn):
            return inner(params, {k: v for k, v in b.items() if k != "poison"}) + b["poison"]
        poisoned = Setup(setup.name, setup.params, loss_fn, batch, ())
    mask = np.array([True, False, True, True, True])
    include = mask & (np.arange(B) != 3)
    clean = {p: np.where(include.reshape((-1,) + (1,) * (g.ndim - 1)), np.nan_to_num(g), 0.0)
             for p, g in setup.grads.items()} if key == "x" else setup.grads
    expected, _, _ = ref.private_grads(clean, "param-wise", "abadi", max_grad_norm=1.0, include=include)
    for mode in ("bk", "ghost"):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode=mode, groups="param-wise")
        _, grads, stats = private_fn(poisoned.loss_fn, cfg)(poisoned.params, poisoned.batch, jax.random.key(0), mask)
        assert int(stats.num_nonfinite) == 1 and int(stats.num_included) == 3
        for path, value in ref.flat(grads).items():
            assert np.all(np.isfinite(value)), (mode, path)
            np.testing.assert_allclose(value, expected[path], rtol=1e-4, atol=1e-6 * np.max(np.abs(expected[path])),
                                       err_msg=f"{mode} {path}")


def scales_setup() -> Setup:
    """Scale parameters multiplied into per-example data every way a model writes them: broadcast by NumPy rules
    (``[d]`` against ``[T, d]``), reshaped to ``[1, 1, d]``, per position (``[T, 1]``), broadcast explicitly over an
    axis the data does not have either (``[1, 1] * broadcast_to(s, (T, d))``), and a scalar gate."""
    keys = jax.random.split(jax.random.key(11), 6)
    params = {"w": jax.random.normal(keys[0], (D, D)) / 3, "feature": 1.0 + 0.1 * jax.random.normal(keys[1], (D,)),
              "shaped": 1.0 + 0.1 * jax.random.normal(keys[2], (1, 1, D)),
              "position": 1.0 + 0.1 * jax.random.normal(keys[3], (T, 1)),
              "spread": 0.1 * jax.random.normal(keys[4], (D,)), "gate": jnp.asarray(0.7),
              "head": jax.random.normal(keys[5], (D, 3))}
    rng = np.random.default_rng(4)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, batch):
        x = batch["x"]
        h = jnp.tanh(x @ p["w"]) * p["feature"]
        h = h * p["shaped"] * p["position"]
        h = h + jnp.mean(x, axis=(1, 2), keepdims=True) * jnp.broadcast_to(p["spread"], (x.shape[0], T, D))
        logits = (h * p["gate"]).mean(axis=1) @ p["head"]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1)[:, 0]

    return Setup("scales", params, loss_fn, batch, ())


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_scale_sites_are_one_contraction_and_match_vmap_grad(mode, monkeypatch):
    """A product with a broadcast parameter is one contraction of the output gradient with the data
    (``sites.scale_grad``), not a product then a reduction (which XLA:CPU runs 10-40x slower on the per-example
    arrays' unit axes); its values against ``vmap(grad)``."""
    from dpzero_jax.program import sites
    contracted = []
    real = sites.scale_grad

    def counting(site, ops, g):
        out = real(site, ops, g)
        if out is not None:
            contracted.append(site.view.leaf)
        return out
    monkeypatch.setattr(sites, "scale_grad", counting)
    check_private(scales_setup(), clip_fn="abadi", groups="param-wise", mode=mode, floor=1e-4)
    # the leaves in sorted order: feature, gate, head, position, shaped, spread, w
    assert sorted(set(contracted)) == [0, 1, 3, 4, 5]


def test_tied_embedding_is_factored_with_its_cross_term():
    setup = SETUPS["nnx"]()
    cfg = dz.DPConfig(mode="bk")
    plan = program_mode.plan_program(setup.loss_fn, cfg, setup.params, setup.batch,
                                     dz.engine.leaf_paths(setup.params), B)
    rows = {r["path"]: r for r in explanation.explain(plan, setup.params, cfg)}
    assert rows["embed/embedding"]["rule"] == "dot+gather"
    assert rows["conv/kernel"]["rule"] == "conv" and rows["attn/query/kernel"]["rule"] == "dot"
    assert not plan.analysis.fallback
    plain = program_mode.plan_program(SETUPS["plain"]().loss_fn, cfg, SETUPS["plain"]().params,
                                      SETUPS["plain"]().batch, dz.engine.leaf_paths(SETUPS["plain"]().params), B)
    why = {r["path"]: (r["rule"], r["why"]) for r in explanation.explain(plain, SETUPS["plain"]().params, cfg)}
    assert why["gate"][0] == "fallback" and "cond" in why["gate"][1]
    assert why["lora_a"][0] == "fallback" and why["w"][0] == "dot" and why["cls"][0] == "local"


def _count(jaxpr, name: str) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
            total += _count(sub, name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                total += _count(inner, name)
    return total


def test_scan_stays_a_scan():
    """The private gradient's program does not grow with the number of scanned layers."""
    counts = {}
    for layers in (2, 5):
        setup = linen_setup(layers)
        cfg = dz.DPConfig(noise_multiplier=1.0, mode="bk")
        jaxpr = jax.make_jaxpr(dz.private_value_and_grad(setup.loss_fn, cfg))(setup.params, setup.batch,
                                                                               jax.random.key(0))
        counts[layers] = (_count(jaxpr.jaxpr, "dot_general"), _count(jaxpr.jaxpr, "scan"),
                          _count(jaxpr.jaxpr, "remat2") + _count(jaxpr.jaxpr, "checkpoint"))
    assert counts[2] == counts[5]
    assert counts[2][1] >= 1 and counts[2][2] >= 1


def test_bundled_gpt2_through_the_program_front_end():
    """The bundled model's DP layers are plain JAX to the program front-end: the same gradient."""
    check_private(gpt2(True), clip_fn="abadi", groups="layer-wise", mode="bk", front_end="program")


def test_bf16_compute_matches_vmap_grad_of_the_same_program():
    setup = nnx_setup(jnp.bfloat16)
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="bk", rtol=3e-2, norm_rtol=2e-2, floor=3e-2)


def test_fused_mode_book_keeps_groups_no_site_can_clip():
    setup = SETUPS["nnx"]()     # all-layer: one group over every site (tests/test_program_fused.py: what fused does)
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="fused")
    with pytest.raises(ValueError, match="front_end"):
        dz.DPConfig(front_end="nope")


def test_explain_plan_for_both_front_ends():
    setup = SETUPS["plain"]()
    report = dz.explain_plan(setup.loss_fn, dz.DPConfig(), setup.params, setup.batch)
    assert report.front_end == "program" and report.mode == "bk"
    rows = {r["path"]: r for r in report.rows}
    assert rows["gate"]["method"] == "fallback" and rows["w"]["rule"] == "dot"
    assert rows["cls"]["per_example_bytes"] == 4 * D
    text = str(report)
    assert "front end: program" in text and "lora_b" in text and "cond" in text
    scanned = SETUPS["linen"]()     # nn.remat blocks: auto computes their norms in the rematerialised backward
    assert dz.explain_plan(scanned.loss_fn, dz.DPConfig(), scanned.params, scanned.batch).mode == "ghost"
    bundled = gpt2(True)      # standard Flax layers: the program front-end
    report = dz.explain_plan(bundled.loss_fn, dz.DPConfig(), bundled.params, bundled.batch)
    assert report.front_end == "program" and report.mode == "bk"
    dz_nn = gpt2(True, dz_nn=True)
    layers = dz.explain_plan(dz_nn.loss_fn, dz.DPConfig(), dz_nn.params, dz_nn.batch)
    assert layers.front_end == "layers" and layers.mode == "bk"
    assert {r["path"]: r["rule"] for r in layers.rows}["wte/embedding"] == "embed+linear"


@jax.custom_vjp
def straight_through_round(x, w):
    """``round(x * w)`` whose gradient is that of ``x * w`` (a straight-through estimator)."""
    return jnp.round(x * w)


straight_through_round.defvjp(lambda x, w: (jnp.round(x * w), (x, w)),
                              lambda saved, g: (g * saved[1], jnp.sum(g * saved[0], axis=0)))


def test_custom_derivatives_are_kept():
    """A custom-VJP function of a parameter and the data is one opaque site: its own backward is the one used (an
    inlined primal would give round's zero gradient)."""
    keys = jax.random.split(jax.random.key(8), 2)
    params = {"w": 1.0 + jax.random.uniform(keys[0], (D,)), "head": jax.random.normal(keys[1], (D, 3))}
    rng = np.random.default_rng(4)
    batch = {"x": jnp.asarray(3 * rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        h = jax.vmap(straight_through_round, in_axes=(0, None))(b["x"], p["w"]).mean(1)
        return -jnp.take_along_axis(jax.nn.log_softmax(h @ p["head"]), b["y"][:, None], 1)[:, 0]

    setup = Setup("ste", params, loss_fn, batch, ())
    assert np.all(np.abs(setup.grads["w"]) > 0)
    for mode in ("bk", "ghost"):
        check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode)


def test_scan_with_shared_and_stacked_weights_and_a_nested_scan():
    """A weight passed whole into a scan (the same at every iteration: its iterations add up, cross terms included),
    a stacked weight sliced per iteration, and a scan inside the scan body."""
    keys = jax.random.split(jax.random.key(11), 4)
    params = {"shared": jax.random.normal(keys[0], (D, D)) / 3, "stacked": jax.random.normal(keys[1], (3, D, D)) / 3,
              "inner": jax.random.normal(keys[2], (2, D)) * 0.5, "head": jax.random.normal(keys[3], (D, 3))}
    rng = np.random.default_rng(6)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        def layer(h, w):
            h = jnp.tanh(h @ p["shared"] + h @ w)

            def inner(g, scale):
                return g * scale + 0.1 * g, None
            h, _ = jax.lax.scan(inner, h, p["inner"])
            return h, None
        h, _ = jax.lax.scan(layer, b["x"], p["stacked"])
        return -jnp.take_along_axis(jax.nn.log_softmax(h.mean(1) @ p["head"]), b["y"][:, None], 1)[:, 0]

    setup = Setup("scans", params, loss_fn, batch, ())
    for mode in ("bk", "ghost"):
        check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode, floor=1e-4)
    rows = {r["path"]: r for r in dz.explain_plan(loss_fn, dz.DPConfig(), params, batch).rows}
    assert rows["shared"]["rule"] == "dot" and rows["stacked"]["rule"] == "dot" and rows["inner"]["rule"] == "local"


def test_position_tables_at_constant_indices_are_sites_not_fallbacks():
    """``wpe[jnp.arange(T)]`` (GPT-2's position table: a gather at constant indices) is a ``gather`` site and a
    ``dynamic_slice`` at constant starts a ``local`` one; also when the looked-up rows meet a weight before any data."""
    keys = jax.random.split(jax.random.key(12), 4)
    params = {"wpe": 0.3 * jax.random.normal(keys[0], (T + 2, D)), "wte": 0.3 * jax.random.normal(keys[1], (T + 3, D)),
              "w": jax.random.normal(keys[2], (D, D)) / 3, "head": jax.random.normal(keys[3], (D, 3))}
    rng = np.random.default_rng(7)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        positions = jnp.take(p["wpe"], jnp.arange(T), axis=0) @ p["w"]        # no data before the dot
        h = jnp.tanh(b["x"] + positions + jax.lax.dynamic_slice_in_dim(p["wte"], 1, T))
        return -jnp.take_along_axis(jax.nn.log_softmax(h.mean(1) @ p["head"]), b["y"][:, None], 1)[:, 0]

    setup = Setup("positions", params, loss_fn, batch, ())
    rows = {r["path"]: r for r in dz.explain_plan(loss_fn, dz.DPConfig(), params, batch).rows}
    assert (rows["wpe"]["rule"], rows["wte"]["rule"], rows["w"]["rule"]) == ("gather", "local", "dot")
    for mode in ("bk", "ghost"):
        check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode, floor=1e-4)


def test_uses_under_stop_gradient_carry_no_gradient_and_force_no_fallback():
    """A parameter also used under ``lax.stop_gradient`` (a frozen copy, a target network): that use passes no
    gradient, so it is a constant to the plan -- the other use stays a ``dot`` site instead of making the whole leaf
    a fallback -- and the clipped gradients equal ``vmap(grad)``'s."""
    keys = jax.random.split(jax.random.key(13), 2)
    params = {"w": jax.random.normal(keys[0], (D, D)) / 3, "head": jax.random.normal(keys[1], (D, 3))}
    rng = np.random.default_rng(8)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p["w"])
        frozen = jax.lax.stop_gradient(p)                                       # no gradient through it
        target = jnp.tanh(b["x"] @ frozen["w"].T) @ frozen["head"]
        logits = h.mean(1) @ p["head"] + 0.5 * target.mean(1)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]

    rows = {r["path"]: r for r in dz.explain_plan(loss_fn, dz.DPConfig(), params, batch).rows}
    assert (rows["w"]["rule"], rows["head"]["rule"]) == ("dot", "dot")
    setup = Setup("stop-gradient", params, loss_fn, batch, ())
    for mode in ("bk", "ghost"):
        check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode)


def test_pallas_norm_kernels_on_the_program_front_end():
    """``norm_kernel="pallas"`` (interpreted on CPU) computes the factored norms and sums of program sites too."""
    check_private(SETUPS["plain"](), clip_fn="abadi", groups="param-wise", mode="bk", norm_kernel="pallas",
                  floor=1e-4)


def test_fastest_rule_in_explain_ghost_and_bk():
    """A dense weight ``[128, 128]`` at T 64: the space rule (``"mixed"``) picks the ghost norm (2 T^2 = 8192 <
    16384), the FLOP rule (``"fastest"``) instantiation (ghost T^2 (rows + cols) = 1048576 multiply-adds against
    60 rows cols = 983040 for instantiation with reuse). ``explain_plan`` reports the rule book-keeping applies, and
    ghost and book-keeping give exact norms and clipped gradients under both rules."""
    width, length = 128, 64
    setup = dense_setup(width, length, key_seed=11, data_seed=12)
    params, loss_fn, batch = setup.params, setup.loss_fn, setup.batch
    for method, expected in (("mixed", "ghost"), ("fastest", "instantiate")):
        cfg = dz.DPConfig(norm_method=method, front_end="program")
        rows = {r["path"]: r for r in dz.explain_plan(loss_fn, cfg, params, batch).rows}
        assert rows["w"]["method"] == expected, method
        assert rows["w"]["per_example_bytes"] == 4 * (length ** 2 if expected == "ghost" else width * width)
        for mode in ("bk", "ghost"):
            check_private(setup, clip_fn="abadi", groups="all-layer", mode=mode, norm_method=method,
                          front_end="program")


def test_ghost_and_fused_time_rule_counts_the_instantiation_they_do_not_reuse():
    """Ghost mode sums every weight by its second pullback, and fused mode's taps return ``C g`` to the weight path,
    so the time rule never reuses an instantiated gradient there: it counts the instantiation's own contraction,
    ``(60 + T) rows cols`` = 2031616 multiply-adds for a ``[128, 128]`` weight at T 64, against the ghost norm's
    1048576, and both take the ghost norm where book-keeping (which reuses the gradient for the sum) instantiates.
    ``explain_plan`` says so per mode, the traced ghost and fused steps hold no per-example ``[128, 128]`` gradient
    (book-keeping's does), and all stay exact."""
    width, length = 128, 64
    setup = dense_setup(width, length, key_seed=13, data_seed=14)
    params, loss_fn, batch = setup.params, setup.loss_fn, setup.batch

    def per_example_weight_grads(mode):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode=mode, norm_method="fastest",
                          groups="param-wise", front_end="program")
        return per_example_shapes(setup, cfg, (width, width))

    for mode, expected in (("bk", "instantiate"), ("ghost", "ghost"), ("fused", "ghost")):
        cfg = dz.DPConfig(mode=mode, norm_method="fastest", groups="param-wise", front_end="program")
        report = dz.explain_plan(loss_fn, cfg, params, batch)
        assert report.mode == mode
        assert {r["path"]: r for r in report.rows}["w"]["method"] == expected, mode
    assert per_example_weight_grads("bk")
    assert not per_example_weight_grads("fused") and not per_example_weight_grads("ghost")
    for mode in ("ghost", "fused"):
        check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode, norm_method="fastest",
                      front_end="program")


class _DPLayersDense(nnx.Module):
    """``tanh(x @ w).mean(T) @ head`` from ``dz.layers`` layers (the layers front-end)."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.w = dz.layers.Linear(width, width, use_bias=False, rngs=rngs)
        self.head = dz.layers.Linear(width, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.w(x)).mean(1))


def test_fastest_rule_in_explain_on_the_layers_front_end():
    """The same ``[128, 128]`` weight at T 64 in a ``dz.layers.Linear``: ``explain_plan`` reports ghost under the space
    rule and instantiation under the FLOP rule (the hand counts of the test above), and its per-example bytes; the
    layers front-end's book-keeping is exact under both. Its ghost and fused taps take the FLOP rule without reuse
    (the ghost norm here), as the program front-end's do."""
    width, length = 128, 64
    model = _DPLayersDense(width, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(13)
    batch = {"x": jnp.asarray(rng.standard_normal((B, length, width)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        logits = nnx.merge(graphdef, p)(b["x"])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]

    setup = Setup("dz-dense", params, loss_fn, batch, ())
    for method, expected in (("mixed", "ghost"), ("fastest", "instantiate")):
        report = dz.explain_plan(loss_fn, dz.DPConfig(norm_method=method), params, batch)
        rows = {r["path"]: r for r in report.rows}
        assert report.front_end == "layers"
        assert rows["w/kernel"]["method"] == expected, method
        assert rows["w/kernel"]["per_example_bytes"] == 4 * (length ** 2 if expected == "ghost" else width * width)
        check_private(setup, clip_fn="abadi", groups="all-layer", mode="bk", norm_method=method)
    # norm_method="auto" on a CPU: the time rule for book-keeping, the space rule for ghost (no reuse to count)
    for mode, expected in (("auto", "instantiate"), ("bk", "instantiate"), ("ghost", "ghost")):
        report = dz.explain_plan(loss_fn, dz.DPConfig(mode=mode, target="cpu"), params, batch)
        assert {r["path"]: r["method"] for r in report.rows}["w/kernel"] == expected, mode
    # the time rule in ghost's and fused's taps counts the instantiation they would not reuse (the program front-end's
    # test above): the ghost norm, no per-example [128, 128] gradient in the traced step, exact
    for mode in ("ghost", "fused"):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode=mode, norm_method="fastest",
                          groups="param-wise")
        report = dz.explain_plan(loss_fn, cfg, params, batch)
        assert (report.front_end, report.mode) == ("layers", mode)
        assert {r["path"]: r["method"] for r in report.rows}["w/kernel"] == "ghost", mode
        assert not per_example_shapes(setup, cfg, (width, width)), mode
        check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode, norm_method="fastest")
