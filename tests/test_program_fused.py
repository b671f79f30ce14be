"""``mode="fused"`` on the traced-program front-end against ``vmap(grad)``: one pullback, each site clipping its own
group in its custom backward.

Flax NNX (Embed, LayerNorm, Conv, Linear), plain JAX (a class token, a position table at constant indices, a layer
scale, ``x.reshape(-1, d) @ W``, fallback leaves: a parameter inside ``lax.cond``, a product of two parameters),
``jax.checkpoint`` blocks of a small decoder; param-wise and layer-wise groups, the three clip functions,
thresholds at call time, masks and a NaN example; the refusals (a group spanning sites, tied weights, a scan); one
backward pass (the forward's operations appear as often as in the non-private gradient, fewer than in ghost's).
Norms rtol 1e-5, clipped gradients rtol 1e-4.
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
from helpers import B, Setup, check_private, gpt2, private_fn, vit

import dpzero_jax as dz

VOCAB, T, D = 13, 6, 8


def token_batch(seed: int):
    rng = np.random.default_rng(seed)
    return {"ids": jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32),
            "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}


def class_loss(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), y[:, None], 1)[:, 0]


class NNXNet(nnx.Module):
    def __init__(self, rngs, bias: bool, dtype=None):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs, dtype=dtype)
        self.ln = nnx.LayerNorm(D, use_bias=bias, rngs=rngs, dtype=dtype)
        self.conv = nnx.Conv(D, D, kernel_size=(3,), use_bias=bias, rngs=rngs, dtype=dtype)
        self.out = nnx.Linear(D, 3, use_bias=bias, rngs=rngs, dtype=dtype)

    def __call__(self, ids):
        h = self.ln(self.embed(ids))
        h = h + jax.nn.gelu(self.conv(h))
        return self.out(h).mean(1)


@functools.cache
def nnx_setup(bias: bool = True, dtype=None) -> Setup:
    graphdef, params = nnx.split(NNXNet(nnx.Rngs(0), bias, dtype), nnx.Param)

    def loss_fn(params, batch):
        return class_loss(nnx.merge(graphdef, params)(batch["ids"]), batch["y"])

    return Setup(f"nnx-{bias}", params, loss_fn, token_batch(1), ())


@functools.cache
def plain_setup() -> Setup:
    keys = jax.random.split(jax.random.key(5), 8)
    params = {"cls": jax.random.normal(keys[0], (1, D)), "position": 0.1 * jax.random.normal(keys[1], (T + 1, D)),
              "layer_scale": jnp.full((D,), 0.5), "w": jax.random.normal(keys[2], (D, D)) / 3,
              "lora_a": jax.random.normal(keys[3], (D, 2)), "lora_b": 0.1 * jax.random.normal(keys[4], (2, D)),
              "head": jax.random.normal(keys[5], (D, 3)), "gate": jnp.asarray(0.3),
              "wpe": 0.3 * jax.random.normal(keys[6], (T + 3, D)), "wp": jax.random.normal(keys[7], (D, D)) / 3}
    rng = np.random.default_rng(3)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, batch):
        x = batch["x"]
        n = x.shape[0]
        positions = jnp.take(p["wpe"], jnp.arange(T + 1), axis=0) @ p["wp"]     # a lookup at constant indices
        h = jnp.concatenate([jnp.broadcast_to(p["cls"][None], (n, 1, D)), x], axis=1) + p["position"] + positions
        h = (h.reshape(-1, D) @ p["w"]).reshape(n, T + 1, D) * p["layer_scale"]
        h = h + h @ (p["lora_a"] @ p["lora_b"])                              # fallback: a product of parameters
        h = jax.lax.cond(True, lambda z: jnp.tanh(z * p["gate"]), lambda z: z, h)   # fallback: inside cond
        return class_loss(h[:, 0] @ p["head"], batch["y"])

    return Setup("plain", params, loss_fn, batch, ())


def _decoder_params(key, layers: int, d: int, vocab: int, length: int, stacked: bool):
    keys = iter(jax.random.split(key, 8 * layers + 3))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) / np.sqrt(shape[0])

    blocks = [{"ln": 1.0 + 0.1 * normal(d), "qkv": normal(d, 3 * d), "qkv_b": 0.1 * normal(3 * d),
               "proj": normal(d, d), "fc": normal(d, 2 * d), "fc_b": 0.1 * normal(2 * d), "fc2": normal(2 * d, d)}
              for _ in range(layers)]
    if stacked:
        blocks = jax.tree.map(lambda *x: jnp.stack(x), *blocks)
    return {"wte": 0.3 * jax.random.normal(next(keys), (vocab, d)),
            "wpe": 0.3 * jax.random.normal(next(keys), (length, d)), "blocks": blocks, "head": normal(d, vocab)}


def _block(p, h, heads: int = 2):
    n, t, d = h.shape

    def norm(x, scale):
        x = x - x.mean(-1, keepdims=True)
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale

    qkv = norm(h, p["ln"]) @ p["qkv"] + p["qkv_b"]
    q, k, v = jnp.split(qkv.reshape(n, t, 3 * heads, d // heads), 3, axis=2)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads), -1e9)
    h = h + jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v).reshape(n, t, d) @ p["proj"]
    return h + jnp.tanh(h @ p["fc"] + p["fc_b"]) @ p["fc2"]


def decoder(layers: int = 2, d: int = 8, vocab: int = VOCAB, length: int = T, batch_size: int = B,
            stacked: bool = False, policy=None) -> Setup:
    """A GPT-style decoder of ``jax.checkpoint`` blocks, unrolled (a Python loop) or scanned (stacked weights)."""
    params = _decoder_params(jax.random.key(3), layers, d, vocab, length, stacked)
    rng = np.random.default_rng(4)
    batch = {"ids": jnp.asarray(rng.integers(0, vocab, (batch_size, length)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, vocab, (batch_size, length)), jnp.int32)}
    block = jax.checkpoint(_block, policy=policy)

    def loss_fn(p, batch):
        ids = batch["ids"]
        h = jnp.take(p["wte"], ids, axis=0) + jnp.take(p["wpe"], jnp.arange(ids.shape[1]), axis=0)
        if stacked:
            h, _ = jax.lax.scan(lambda h, lp: (block(lp, h), None), h, p["blocks"])
        else:
            for lp in p["blocks"]:
                h = block(lp, h)
        logp = jax.nn.log_softmax(h @ p["head"])
        return -jnp.take_along_axis(logp, batch["y"][..., None], -1)[..., 0].mean(-1)

    return Setup("decoder", params, loss_fn, batch, ())


SETUPS = {"nnx": nnx_setup, "plain": plain_setup, "remat": functools.cache(decoder)}


@pytest.mark.parametrize("name", sorted(SETUPS))
@pytest.mark.parametrize("clip_fn", ["abadi", "automatic", "global"])
def test_fused_matches_vmap_grad(name, clip_fn):
    check_private(SETUPS[name](), clip_fn=clip_fn, groups="param-wise", mode="fused", front_end="program",
                  floor=1e-4)


def test_layer_wise_groups_and_a_group_of_fallback_leaves():
    """Layer-wise groups: a kernel and its bias (``dot`` / ``conv`` then ``add``), a norm's scale and bias (``mul``
    then ``add``) are clipped together in the backward of the group's first site, the bias's gradient arriving
    through the link; also inside ``jax.checkpoint`` blocks (a callable grouping each weight with its bias). A group
    of two fallback leaves (the factors of a product) is clipped from their per-example gradients."""
    check_private(nnx_setup(True), clip_fn="abadi", groups="layer-wise", mode="fused", front_end="program")
    check_private(gpt2(False), clip_fn="global", groups="layer-wise", mode="fused", front_end="program")
    check_private(decoder(), clip_fn="automatic", groups=lambda p: p.removesuffix("_b"), mode="fused",
                  front_end="program", floor=1e-4)
    setup = plain_setup()
    groups = {p: ("lora" if p.startswith("lora") else p) for p in ref.paths(setup.params)}
    check_private(setup, clip_fn="automatic", groups=groups, mode="fused", floor=1e-4)


@pytest.mark.parametrize("setup", [lambda: gpt2(False), vit], ids=["gpt2-untied", "vit"])
def test_bundled_models_as_plain_jax(setup):
    """The bundled GPT-2 (position table at constant indices, attention, layer norms) and ViT (patch convolution,
    class token, position table) read as plain JAX programs."""
    check_private(setup(), clip_fn="abadi", groups="param-wise", mode="fused", front_end="program")


def test_bf16_compute_matches_vmap_grad_of_the_same_program():
    """float32 parameters, bfloat16 computation: the weight path's cotangent goes back through the casts."""
    check_private(nnx_setup(True, jnp.bfloat16), clip_fn="abadi", groups="param-wise", mode="fused",
                  front_end="program", rtol=3e-2, norm_rtol=2e-2, floor=3e-2)


def test_checkpoint_policy_and_microbatches():
    check_private(decoder(policy=jax.checkpoint_policies.dots_saveable), clip_fn="abadi", groups="param-wise",
                  mode="fused", microbatch_size=2, floor=1e-4)


def test_thresholds_at_call_time():
    """Adaptive clipping passes traced thresholds into the jitted step: the taps take them as arguments (layer-wise:
    a kernel and its bias clipped together)."""
    setup = nnx_setup(True)
    norms = setup.group_norms("layer-wise")          # [B, M]: per-group thresholds that clip about half
    thresholds = jnp.asarray([ref.split_threshold(norms[:, m]) for m in range(norms.shape[1])], jnp.float32)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, groups="layer-wise", mode="fused", front_end="program")
    fn = ref.jit(lambda params, batch, key, r: dz.private_value_and_grad(setup.loss_fn, cfg)(params, batch, key,
                                                                                             thresholds=r))
    _, grads, stats = fn(setup.params, setup.batch, jax.random.key(0), thresholds)
    expected, norms, coef = setup.reference("layer-wise", "abadi", thresholds=np.asarray(thresholds))
    assert 0 < np.mean(coef < 1) < 1
    np.testing.assert_allclose(stats.norms, norms, rtol=1e-5)
    np.testing.assert_allclose(stats.clip_factors, coef, rtol=1e-5)
    for path, value in ref.flat(grads).items():
        np.testing.assert_allclose(value, expected[path], rtol=1e-4, atol=1e-6 * np.max(np.abs(expected[path])),
                                   err_msg=path)


class FloatNet(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.ln(self.lin(x)))).mean(1)


@functools.cache
def float_setup() -> Setup:
    graphdef, params = nnx.split(FloatNet(nnx.Rngs(2)), nnx.Param)
    rng = np.random.default_rng(9)
    batch = {"x": jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(params, batch):
        return class_loss(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

    return Setup("nnx-float", params, loss_fn, batch, ())


@pytest.mark.parametrize("name, groups", [("nnx", "param-wise"), ("plain", "param-wise"),
                                          ("nnx-float", "layer-wise"), ("nnx-float", "all-layer")])
def test_masks_and_a_nan_example(name, groups):
    """A NaN in an example's input (``plain``, ``nnx-float``) or in its loss (``nnx``), and a masked example
    (``all-layer``: the one group is book-kept in the fused pass, and the example contributes exactly zero too). A
    non-finite loss drops the example from every group (``nnx-float``: kernels and biases clipped together, the
    NaN reaching every site); with a finite loss (``plain``: the head reads the class token, which the NaN never
    reaches) the example is dropped from the groups where its gradient is not finite only -- each site sees its
    own group, as in the layers' fused mode -- and contributes exactly zero there."""
    setup = {"nnx-float": float_setup}.get(name, SETUPS.get(name))()
    batch = dict(setup.batch)
    if "x" in batch:
        batch["x"] = batch["x"].at[3, 0, 0].set(jnp.nan)
        loss_fn = setup.loss_fn
        grads = ref.per_example_grads(loss_fn, setup.params, batch)
    else:
        batch["poison"] = jnp.zeros((B,), jnp.float32).at[3].set(jnp.nan)

        def loss_fn(params, b, inner=setup.loss_fn):
            return inner(params, {k: v for k, v in b.items() if k != "poison"}) + b["poison"]
        grads = {p: g.copy() for p, g in setup.grads.items()}
        for g in grads.values():
            g[3] = np.nan
    mask = np.array([True, False, True, True, True])
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="fused", groups=groups, front_end="program")
    _, out, stats = private_fn(loss_fn, cfg)(setup.params, batch, jax.random.key(0), mask)
    assert int(stats.num_nonfinite) == 1 and int(stats.num_included) == 3
    group_of, names = ref.group_assignment(groups, list(grads))
    threshold = 1.0 / np.sqrt(len(names))
    actual = ref.flat(out)
    dropped = 0
    for m, group in enumerate(names):
        members = [p for p in grads if group_of[p] == group]
        finite = np.all([np.all(np.isfinite(grads[p].reshape(B, -1)), axis=1) for p in members], axis=0)
        include = mask & finite
        dropped += not finite[3]
        clean = {p: np.where(include.reshape((-1,) + (1,) * (grads[p].ndim - 1)), grads[p], 0.0) for p in members}
        expected, _, coef = ref.private_grads(clean, "all-layer", "abadi", thresholds=[threshold], include=include)
        for path in members:
            assert np.all(np.isfinite(actual[path])), path
            np.testing.assert_allclose(actual[path], expected[path], rtol=1e-4,
                                       atol=1e-6 * np.max(np.abs(expected[path])), err_msg=path)
        factors = np.asarray(stats.clip_factors).reshape(B, -1)   # [B] for one group
        np.testing.assert_allclose(factors[:, m], coef[:, 0], rtol=1e-5, err_msg=group)
    assert 0 < dropped and (name != "plain") == (dropped == len(names))


class TiedNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(jnp.tanh(self.lin(self.embed(ids)))).mean(1)


class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, D)(ids)

        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return h + nn.Dense(D, use_bias=False)(jnp.tanh(h)), None

        h, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(h, None)
        return nn.Dense(3, use_bias=False)(h).mean(1)


def _booked_reasons(loss_fn, params, batch, groups) -> str:
    """The ``why`` column of ``explain_plan`` for ``mode="fused"``: the reasons groups are book-kept."""
    report = dz.explain_plan(loss_fn, dz.DPConfig(mode="fused", groups=groups, front_end="program"), params, batch)
    assert report.front_end == "program" and report.mode == "fused"
    return " | ".join(row["why"] for row in report.rows)


def test_groups_that_are_not_local_are_book_kept_in_the_same_pass():
    """A group that no single site can clip (all-layer; a layer-wise block of several matrices; sites in different
    sub-programs; tied weights; sites mixed with fallback parameters) is book-kept inside the fused pass -- its
    sites' operands and output gradients kept until the pullback ends -- while the local groups are clipped in it:
    the same clipped gradient as ``vmap(grad)``'s, and ``explain_plan`` says which groups and why."""
    setup = nnx_setup(True)
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="fused")
    assert "group 'all' spans 7 sites" in _booked_reasons(setup.loss_fn, setup.params, setup.batch, "all-layer")
    blocks = decoder()
    check_private(blocks, clip_fn="automatic", groups="layer-wise", mode="fused")
    assert "group 'blocks/0' has 4 dot / conv / gather sites" in _booked_reasons(blocks.loss_fn, blocks.params,
                                                                                  blocks.batch, "layer-wise")
    ln_together = lambda p: "ln" if p.endswith("/ln") else p   # noqa: E731
    check_private(blocks, clip_fn="abadi", groups=ln_together, mode="fused")
    assert "different sub-programs" in _booked_reasons(blocks.loss_fn, blocks.params, blocks.batch, ln_together)
    graphdef, params = nnx.split(TiedNet(nnx.Rngs(1)), nnx.Param)

    def tied_loss(p, b):
        return class_loss(nnx.merge(graphdef, p)(b["ids"])[:, :3], b["y"])
    tied = Setup("tied", params, tied_loss, token_batch(2), ())
    check_private(tied, clip_fn="abadi", groups="param-wise", mode="fused")
    reasons = _booked_reasons(tied_loss, params, tied.batch, "param-wise")
    assert "'embed/embedding'" in reasons and "tied weights" in reasons
    plain = plain_setup()
    mixed = {p: ("g" if p in ("gate", "head") else p) for p in ref.paths(plain.params)}
    check_private(plain, clip_fn="abadi", groups=mixed, mode="fused", floor=1e-4)
    assert "fallback" in _booked_reasons(plain.loss_fn, plain.params, plain.batch, mixed)
    assert "book-kept" not in _booked_reasons(plain.loss_fn, plain.params, plain.batch, "param-wise")


def test_scanned_leaf_groups_are_book_kept_and_per_iteration_groups_fused():
    """On the program front-end a stacked leaf ``[L, ...]`` is one parameter: its group (param-wise or layer-wise)
    holds every iteration's gradient, so no coefficient is known inside one iteration's backward -- fused book-keeps
    it (and names it); the same model matches ``vmap(grad)``."""
    scanned = decoder(stacked=True)
    check_private(scanned, clip_fn="abadi", groups="param-wise", mode="fused")
    reasons = _booked_reasons(scanned.loss_fn, scanned.params, scanned.batch, "param-wise")
    assert "inside a scan (2 iterations)" in reasons and "stacked over the iterations" in reasons
    model = LinenScanned()
    batch = token_batch(3)
    params = ref.jit(model.init)(jax.random.key(1), batch["ids"])["params"]

    def loss_fn(p, b):
        return class_loss(model.apply({"params": p}, b["ids"]), b["y"])
    check_private(Setup("linen", params, loss_fn, batch, ()), clip_fn="abadi", groups="layer-wise", mode="fused")
    reasons = _booked_reasons(loss_fn, params, batch, "layer-wise")
    assert "ScanCheckpointBlock_0/Dense_0" in reasons and "inside a scan (3 iterations)" in reasons


def _count(jaxpr, names) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name in names
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    total += _count(inner, names)
    return total


def test_one_backward_pass():
    """The forward's own operations (the blocks' ``tanh`` and ``rsqrt``, the remat regions) appear in the fused
    gradient's program exactly as often as in the non-private gradient's -- forward once, one backward that
    recomputes each block once -- and more often in ghost's (two pullbacks: every block recomputed twice)."""
    setup = decoder()

    def non_private(params, batch, key):
        return jax.grad(lambda p: jnp.sum(setup.loss_fn(p, batch)))(params)
    counts = {}
    for name in ("non-DP", "fused", "ghost"):
        fn = non_private if name == "non-DP" else dz.private_value_and_grad(
            setup.loss_fn, dz.DPConfig(groups="param-wise", mode=name, front_end="program"))
        jaxpr = jax.make_jaxpr(fn)(setup.params, setup.batch, jax.random.key(0)).jaxpr
        counts[name] = tuple(_count(jaxpr, {n}) for n in ("tanh", "rsqrt", "remat2", "checkpoint", "dot_general"))
    assert counts["fused"][:4] == counts["non-DP"][:4], counts
    assert all(g >= f for g, f in zip(counts["ghost"][:4], counts["fused"][:4])), counts
    assert counts["ghost"][:4] != counts["fused"][:4], counts
    # dot_generals: fused adds the norms' contractions to the non-private ones; ghost repeats the blocks as well
    assert counts["non-DP"][4] < counts["fused"][4] < counts["ghost"][4], counts


def compiled_temp_bytes(stacked: bool, layers: int = 4, d: int = 128, vocab: int = 256, length: int = 128,
                        batch_size: int = 16) -> dict:
    """``{step: temporary bytes of the compiled gradient (memory_analysis), or the refusal}`` for a remat decoder
    (``jax.checkpoint`` blocks, unrolled or scanned), param-wise groups: non-DP, bk, ghost and fused."""
    setup = decoder(layers, d, vocab, length, batch_size, stacked)

    def non_private(params, batch, key):
        return jax.grad(lambda p: jnp.sum(setup.loss_fn(p, batch)))(params)
    out = {}
    for name in ("non-DP", "bk", "ghost", "fused"):
        fn = non_private if name == "non-DP" else dz.private_value_and_grad(
            setup.loss_fn, dz.DPConfig(noise_multiplier=1.0, groups="param-wise", mode=name, front_end="program"))
        try:
            compiled = jax.jit(fn).lower(setup.params, setup.batch, jax.random.key(0)).compile()
        except ValueError as error:
            out[name] = str(error)
            continue
        out[name] = compiled.memory_analysis().temp_size_in_bytes
    return out


@pytest.mark.slow
def test_no_per_example_weight_gradient_for_the_sum():
    """The weight path puts the clipped sum into the non-private contraction over examples and positions: the
    compiled fused step holds no ``[B, d, p]`` array for the dense weights whose norms are ghost norms (qkv, fc,
    fc2 of a decoder at d 48, T 40, B 6: 2 T^2 < d p); ghost's custom backward forms them under ``vmap``."""
    setup = decoder(2, 48, 72, 40, 6)
    shapes = ("f32[6,48,144]", "f32[6,48,96]", "f32[6,96,48]")
    counts = {}
    for mode in ("fused", "ghost"):
        fn = dz.private_value_and_grad(setup.loss_fn, dz.DPConfig(groups="param-wise", mode=mode,
                                                                  front_end="program"))
        text = jax.jit(fn).lower(setup.params, setup.batch, jax.random.key(0)).compile().as_text()
        counts[mode] = [text.count(shape) for shape in shapes]
    assert counts["fused"] == [0, 0, 0] and min(counts["ghost"]) > 0, counts


@pytest.mark.slow
def test_compiled_memory_of_a_remat_decoder():
    """Temporaries of the compiled step, 4 remat blocks, d 128, T 128, B 16, printed (``-m slow -s``). On XLA:CPU
    (measured on 2026-11-29: unrolled non-DP 77.1, bk 90.0, ghost 110.1, fused 104.3 MiB; scanned non-DP 26.6, bk
    83.0, ghost 32.5, fused 83.1 MiB -- bk 103.0 and fused 107.1 before book-keeping kept each value once and read
    the scanned operands in place) fused holds no records but a finite copy of the operands its weight path keeps;
    scanned, the stacked weights' param-wise groups span the iterations, so fused book-keeps them in its pass (about
    bk's memory), while ghost takes its norms from the rematerialised backward (a third of bk's)."""
    unrolled, scanned = compiled_temp_bytes(False), compiled_temp_bytes(True)
    for name, table in (("unrolled", unrolled), ("scanned", scanned)):
        print(name, {k: f"{v / 2**20:.1f} MiB" if isinstance(v, int) else v for k, v in table.items()})
    assert all(isinstance(v, int) for v in unrolled.values()), unrolled
    assert all(isinstance(v, int) for v in scanned.values()), scanned
    assert scanned["ghost"] < 0.5 * scanned["bk"] and scanned["fused"] < 1.2 * scanned["bk"], scanned
