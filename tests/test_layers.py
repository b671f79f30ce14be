"""Each DP layer type on its own: per-example norms for every norm method and clipped gradients in the factored
modes, against ``vmap(grad)``; both branches of the mixed ghost-norm rule; tied weights with their cross terms."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import B, Setup, check_private

import dpzero_jax as dz

NORM_METHODS = ("mixed", "ghost", "instantiate")


def randomize(module: nnx.Module, seed: int) -> nnx.Module:
    """Replace every array of the module (parameters and frozen variables) by N(0, 0.5^2) draws (vectors centred on
    1, so norm scales are around 1) so that no gradient is degenerate. Works on abstract modules
    (``nnx.eval_shape``): nothing is initialised op by op."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [(0.5 * rng.standard_normal(x.shape) + (1.0 if len(x.shape) == 1 else 0.0)).astype(np.float32)
           for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, [jnp.asarray(v) for v in new]))


def layer_setup(name: str, module: nnx.Module, forward: Callable, inputs: dict, seed: int = 0) -> Setup:
    """A per-example loss ``sum(sin(y) * w + 0.1 y^2)`` on the output ``y = forward(module, inputs)``."""
    module = randomize(module, seed)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss_fn(params, batch):
        y = forward(nnx.merge(graphdef, params, rest), batch).astype(jnp.float32)
        per_position = jnp.sin(y) * batch["w"] + 0.1 * jnp.square(y)
        return jnp.sum(per_position.reshape(y.shape[0], -1), axis=1)

    out = jax.eval_shape(lambda: forward(module, inputs))
    batch = dict(inputs, w=normal(seed + 100, out.shape))
    layers = tuple(dict.fromkeys(ref.parent(p) for p in ref.paths(params)))
    return Setup(name, params, loss_fn, batch, layers)


def abstract(constructor: Callable) -> nnx.Module:
    """The module ``constructor()`` builds, with shapes only (its parameters are drawn by :func:`randomize`)."""
    return nnx.eval_shape(constructor)


def normal(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def token_ids(seed, shape, vocab):
    """Random ids with guaranteed repeats within each example (exercises the token-equality Gram)."""
    ids = np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)
    if ids.ndim > 1 and ids.shape[1] > 1:
        ids[:, -1] = ids[:, 0]
    return jnp.asarray(ids)


class Tied(nnx.Module):
    """Embed tokens, a nonlinearity, then logits against the same table (the tied LM head)."""

    def __init__(self, vocab, features, *, head_bias=False, rngs):
        self.embed = dz.layers.Embed(vocab, features, rngs=rngs)
        self.norm = dz.layers.LayerNorm(features)
        self.head_bias = nnx.Param(jnp.zeros((vocab,))) if head_bias else None

    def __call__(self, ids):
        h = jnp.tanh(self.norm(self.embed(ids)))
        if self.head_bias is None:
            return self.embed.attend(h)
        return dz.ops.dense_transposed(h, self.embed.embedding[...], self.head_bias[...])


class Transposed(nnx.Module):
    """``dense_transposed`` with its own (untied) kernel ``[V, d]`` and bias ``[V]``."""

    def __init__(self, d, v, *, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (v, d)))
        self.bias = nnx.Param(jnp.zeros((v,)))

    def __call__(self, x):
        return dz.ops.dense_transposed(x, self.kernel[...], self.bias[...])


class Reused(nnx.Module):
    """One Linear applied twice (weight sharing by reuse): both its kernel and bias are used by two calls."""

    def __init__(self, d, *, rngs):
        self.lin = dz.layers.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return self.lin(jnp.tanh(self.lin(x)))


class PartlyFrozen(nnx.Module):
    """A layer whose kernel is a frozen ``nnx.Variable`` (not a Param) while its bias trains, and a layer called but
    whose output is discarded (zero gradient)."""

    def __init__(self, *, rngs):
        self.first = dz.layers.Linear(4, 3, rngs=rngs)
        self.discarded = dz.layers.Linear(4, 3, rngs=rngs)
        self.frozen_kernel = nnx.Variable(jnp.zeros((3, 3)))
        self.bias = nnx.Param(jnp.zeros((3,)))
        self.ln = dz.layers.LayerNorm(3)

    def __call__(self, x):
        h = jnp.tanh(self.first(x))
        self.discarded(x)
        return self.ln(dz.ops.dense(h, self.frozen_kernel[...], self.bias[...]))


class Stack(nnx.Module):
    """Token + positional embeddings, RMSNorm, DenseGeneral to heads and back, LayerNorm, Linear."""

    def __init__(self, *, rngs):
        self.tok = dz.layers.Embed(11, 8, rngs=rngs)
        self.pos = dz.layers.Embed(6, 8, rngs=rngs)
        self.rms = dz.layers.RMSNorm(8)
        self.up = dz.layers.DenseGeneral((8,), (2, 4), rngs=rngs)
        self.down = dz.layers.DenseGeneral((2, 4), (8,), use_bias=False, rngs=rngs)
        self.ln = dz.layers.LayerNorm(8)
        self.out = dz.layers.Linear(8, 3, rngs=rngs)

    def __call__(self, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = self.rms(self.tok(ids) + self.pos(positions))
        x = x + self.down(jax.nn.gelu(self.up(x)))
        return self.out(self.ln(x))


def on(key):
    """Forward that feeds ``batch[key]`` to the module."""
    return lambda module, batch: module(batch[key])


def positional(module, batch):
    """Positional embedding of ``arange(T)`` for each example, modulated by per-example inputs."""
    x = batch["x"]
    return module(jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])) * x


def _cases():
    rngs = lambda: nnx.Rngs(0)  # noqa: E731
    nn = dz.layers
    return {
        "linear-2d-bias": (lambda: nn.Linear(6, 5, rngs=rngs()), on("x"), {"x": normal(1, (B, 6))}),
        "linear-3d-nobias": (lambda: nn.Linear(6, 5, use_bias=False, rngs=rngs()), on("x"),
                             {"x": normal(2, (B, 4, 6))}),
        "linear-2d-nobias": (lambda: nn.Linear(6, 5, use_bias=False, rngs=rngs()), on("x"), {"x": normal(23, (B, 6))}),
        "linear-3d-bias": (lambda: nn.Linear(6, 5, rngs=rngs()), on("x"), {"x": normal(24, (B, 4, 6))}),
        "linear-4d": (lambda: nn.Linear(6, 5, rngs=rngs()), on("x"), {"x": normal(3, (B, 2, 3, 6))}),
        "densegeneral-multi-out": (lambda: nn.DenseGeneral((8,), (3, 2, 4), rngs=rngs()), on("x"),
                                   {"x": normal(4, (B, 4, 8))}),
        "densegeneral-multi-in-nobias": (lambda: nn.DenseGeneral((2, 4), (8,), use_bias=False, rngs=rngs()), on("x"),
                                         {"x": normal(5, (B, 4, 2, 4))}),
        "densegeneral-multi-in-out-2d": (lambda: nn.DenseGeneral((2, 3), (2, 5), rngs=rngs()), on("x"),
                                         {"x": normal(6, (B, 2, 3))}),
        "embed-tokens": (lambda: nn.Embed(7, 5, rngs=rngs()), on("ids"), {"ids": token_ids(7, (B, 6), 7)}),
        "embed-positions": (lambda: nn.Embed(6, 5, rngs=rngs()), positional, {"x": normal(8, (B, 6, 5))}),
        "embed-no-positions": (lambda: nn.Embed(7, 5, rngs=rngs()), on("ids"), {"ids": token_ids(9, (B,), 7)}),
        "layernorm-3d": (lambda: nn.LayerNorm(6), on("x"), {"x": normal(10, (B, 4, 6))}),
        "layernorm-2d": (lambda: nn.LayerNorm(6), on("x"), {"x": normal(11, (B, 6))}),
        "layernorm-scale-only": (lambda: nn.LayerNorm(6, use_bias=False), on("x"), {"x": normal(12, (B, 4, 6))}),
        "layernorm-bias-only": (lambda: nn.LayerNorm(6, use_scale=False), on("x"), {"x": normal(13, (B, 4, 6))}),
        "rmsnorm": (lambda: nn.RMSNorm(6), on("x"), {"x": normal(14, (B, 4, 6))}),
        "rmsnorm-2d": (lambda: nn.RMSNorm(6), on("x"), {"x": normal(25, (B, 6))}),
        "patch-embed": (lambda: nn.PatchEmbed(2, 3, 5, rngs=rngs()), on("image"), {"image": normal(15, (B, 4, 4, 3))}),
        "dense-transposed": (lambda: Transposed(5, 7, rngs=rngs()), on("x"), {"x": normal(16, (B, 4, 5))}),
        "tied-embed-attend": (lambda: Tied(7, 5, rngs=rngs()), on("ids"), {"ids": token_ids(17, (B, 6), 7)}),
        "reused-linear": (lambda: Reused(5, rngs=rngs()), on("x"), {"x": normal(18, (B, 3, 5))}),
        "stack": (lambda: Stack(rngs=rngs()), on("ids"), {"ids": token_ids(19, (B, 6), 11)}),
        "partly-frozen": (lambda: PartlyFrozen(rngs=rngs()), on("x"), {"x": normal(22, (B, 2, 4))}),
    }


CASES = _cases()
SHARED = {"tied-embed-attend", "reused-linear"}   # parameters used by two layer calls: no fused mode
_SETUPS: dict[str, Setup] = {}


def setup_of(name: str) -> Setup:
    if name not in _SETUPS:
        constructor, forward, inputs = CASES[name]
        _SETUPS[name] = layer_setup(name, abstract(constructor), forward, inputs, seed=len(_SETUPS))
    return _SETUPS[name]


NORM_LAYERS = {"layernorm-3d", "layernorm-2d", "layernorm-scale-only", "layernorm-bias-only", "rmsnorm", "rmsnorm-2d"}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_norms_every_method(name):
    setup = setup_of(name)
    expected = setup.group_norms("all-layer")[:, 0]
    assert np.all(expected > 0)
    if name == "partly-frozen":
        assert "frozen_kernel" not in setup.grads and np.all(setup.grads["discarded/kernel"] == 0)
    # norm layers have only directly instantiated gradients: the norm method does not apply to them
    methods = ("mixed",) if name in NORM_LAYERS else NORM_METHODS

    def all_norms(params, batch):
        return {(mode, method): dz.per_example_grad_norms(setup.loss_fn, params, batch, norm_method=method, mode=mode)
                for mode in ("bk", "ghost") for method in methods}

    for (mode, method), norms in ref.jit(all_norms)(setup.params, setup.batch).items():
        np.testing.assert_allclose(norms, expected, rtol=1e-5, err_msg=f"{name}: mode={mode} norm_method={method}")


@pytest.mark.parametrize("mode", ["bk", "ghost", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_private_grads(name, mode):
    if mode == "fused" and name in SHARED:
        pytest.skip("fused mode rejects shared parameters (tested in test_errors)")
    check_private(setup_of(name), clip_fn="abadi", groups="param-wise", mode=mode)


def test_layers_outside_the_engine_are_plain_layers():
    lin = randomize(abstract(lambda: dz.layers.Linear(6, 5, rngs=nnx.Rngs(0))), 1)
    dg = randomize(abstract(lambda: dz.layers.DenseGeneral((2, 3), (4, 5), rngs=nnx.Rngs(0))), 2)
    emb = randomize(abstract(lambda: dz.layers.Embed(7, 6, rngs=nnx.Rngs(0))), 3)
    ln = randomize(abstract(lambda: dz.layers.LayerNorm(6)), 4)
    rms = randomize(abstract(lambda: dz.layers.RMSNorm(6)), 5)
    pe = randomize(abstract(lambda: dz.layers.PatchEmbed(2, 3, 5, rngs=nnx.Rngs(0))), 6)
    x, x2, image = normal(1, (B, 4, 6)), normal(2, (B, 3, 2, 3)), normal(6, (B, 4, 4, 3))
    ids = token_ids(3, (B, 4), 7)

    @ref.jit
    def pairs(x, x2, image, ids):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        patches = jnp.stack([image[:, i:i + 2, j:j + 2, :].reshape(B, -1) for i in (0, 2) for j in (0, 2)], axis=1)
        kernel = lin.kernel[...]
        return {
            "linear": (lin(x), x @ kernel + lin.bias[...]),
            "dense_general": (dg(x2), jnp.einsum("btij,ijkl->btkl", x2, dg.kernel[...]) + dg.bias[...]),
            "embed": (emb(ids), emb.embedding[...][ids]),
            "attend": (emb.attend(x), x @ emb.embedding[...].T),
            "layer_norm": (ln(x), (x - mean) / jnp.sqrt(var + 1e-5) * ln.scale[...] + ln.bias[...]),
            "rms_norm": (rms(x), x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * rms.scale[...]),
            "patch_embed": (pe(image), patches @ pe.proj.kernel[...] + pe.proj.bias[...]),
            # plain jax.grad flows through the primitives
            "grad": (jax.grad(lambda k: jnp.sum(dz.ops.dense(x, k) ** 2))(kernel),
                     jnp.einsum("bti,btj->ij", x, 2 * (x @ kernel))),
        }

    for name, (actual, expected) in pairs(x, x2, image, ids).items():
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_private_grads_without_jit():
    setup = setup_of("linear-3d-nobias")
    r = ref.split_threshold(setup.group_norms("all-layer"))
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=r, mode="ghost")
    _, grads, stats = dz.private_value_and_grad(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0))
    expected, norms, coef = setup.reference("all-layer", "abadi", max_grad_norm=r)
    np.testing.assert_allclose(stats.norms, norms[:, 0], rtol=1e-5)
    np.testing.assert_allclose(stats.clip_factors, coef[:, 0], rtol=1e-5)
    scale = np.abs(expected["kernel"]).max()
    np.testing.assert_allclose(grads["kernel"], expected["kernel"], rtol=1e-4, atol=1e-6 * scale)


# ---------------------------------------------------------------------------------------------------------------
# The mixed ghost-norm rule: ghost iff 2 T^2 < p * d (decided per weight from static shapes).

def _outer(batch, positions, rows, cols):
    return dz.pergrad.Outer(left=jnp.zeros((batch, positions, rows)), right=jnp.zeros((batch, positions, cols)),
                            rows=rows, shape=(rows, cols))


@pytest.mark.parametrize("positions, rows, cols, ghost", [
    (8, 4, 4, False),     # 128 > 16
    (2, 64, 64, True),    # 8 < 4096
    (4, 4, 8, False),     # 32 == 32: not strictly less
    (4, 3, 11, True),     # 32 < 33
    (1, 1, 3, True),      # [B, d] input: T = 1
])
def test_use_ghost_rule(positions, rows, cols, ghost):
    u = _outer(2, positions, rows, cols)
    assert dz.pergrad.use_ghost([u], "mixed") is ghost
    assert dz.pergrad.use_ghost([u], "ghost") is True
    assert dz.pergrad.use_ghost([u], "instantiate") is False
    # tied uses: the positions of all uses count
    assert dz.pergrad.use_ghost([u, u], "mixed") is (2 * (2 * positions) ** 2 < rows * cols)


@pytest.mark.parametrize("positions, ghost", [(1024, False), (128, True)])
def test_fastest_rule_for_a_tied_table_at_gpt2_small_sizes(positions, ghost):
    """A tied table [V, d] = [50304, 768]: the embedding's use (ids) and the head's (the [T, V] output gradient on
    the left). Ghost costs the right Grams of every pair of uses, (2T)^2 d, plus the head's left Gram, T^2 V;
    instantiating and reusing costs 60 per element, 60 V d: at T 1024, 3.2e9 + 5.3e10 > 2.3e9 (instantiate); at
    T 128, 5.0e7 + 8.2e8 < 2.3e9 (ghost). An embedding alone keeps the space rule (its left Gram is a test)."""
    vocab, width = 50304, 768
    embed = dz.pergrad.Outer(left=jnp.zeros((1, positions), jnp.int32), right=jnp.zeros((1, positions, width)),
                             rows=vocab, shape=(vocab, width), left_is_ids=True)
    head = jax.ShapeDtypeStruct((1, positions, vocab), jnp.float32)   # shapes only: no [T, V] array is made
    head = dz.pergrad.Outer(left=head, right=jnp.zeros((1, positions, width)), rows=vocab, shape=(vocab, width))
    ghost_cost = (2 * positions) ** 2 * width + positions ** 2 * vocab
    assert (ghost_cost < 60 * vocab * width) is ghost
    assert dz.pergrad.use_ghost([embed, head], "fastest") is ghost
    assert dz.pergrad.use_ghost([embed], "fastest") is (2 * positions ** 2 < vocab * width)


def _forbid(monkeypatch, name):
    """Make a norm branch of dpzero_jax.pergrad fail loudly if the engine takes it for a weight."""
    original = getattr(dz.pergrad, name)

    def forbidden(*args, **kwargs):
        if name == "instantiate" and isinstance(args[0], dz.pergrad.Direct):
            return original(*args, **kwargs)   # biases are always instantiated
        raise AssertionError(f"pergrad.{name} called for a weight")

    monkeypatch.setattr(dz.pergrad, name, forbidden)


BRANCH_CASES = {
    # name: (in, out, T, branch the mixed rule must take)
    "small-weight-long-sequence": (4, 4, 8, "instantiate"),
    "large-weight-short-sequence": (64, 64, 2, "ghost"),
}


@pytest.mark.parametrize("case", list(BRANCH_CASES))
def test_mixed_rule_branches(case, monkeypatch):
    d_in, d_out, positions, branch = BRANCH_CASES[case]
    setup = layer_setup(case, abstract(lambda: dz.layers.Linear(d_in, d_out, rngs=nnx.Rngs(0))), on("x"),
                        {"x": normal(20, (B, positions, d_in))})
    expected = setup.group_norms("all-layer")[:, 0]
    kernel_norms = np.sqrt(np.sum(np.square(setup.grads["kernel"]).reshape(B, -1), axis=1))
    _forbid(monkeypatch, "_gram" if branch == "instantiate" else "instantiate")

    def norms(method, mode):
        return ref.jit(lambda p, b: dz.per_example_grad_norms(setup.loss_fn, p, b, norm_method=method, mode=mode))(
            setup.params, setup.batch)

    other = "ghost" if branch == "instantiate" else "instantiate"
    for mode in ("bk", "ghost"):
        np.testing.assert_allclose(norms("mixed", mode), expected, rtol=1e-5)
        np.testing.assert_allclose(norms(branch, mode), expected, rtol=1e-5)
        with pytest.raises(AssertionError, match="called for a weight"):
            norms(other, mode)
    stats = check_private(setup, clip_fn="abadi", groups="param-wise", mode="fused", norm_method="mixed")
    np.testing.assert_allclose(stats.norms[:, list(ref.paths(setup.params)).index("kernel")], kernel_norms, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Tied weights: the per-example gradient of a table used by the embedding and the head is the sum of both uses, and
# its norm contains the cross term 2 <G_embed, G_head>.

def test_tied_norm_includes_cross_term():
    setup = setup_of("tied-embed-attend")
    table = setup.params["embed"]["embedding"][...]
    ids, w = setup.batch["ids"], setup.batch["w"]

    def two_tables(embed_table, head_table, ids, w, norm):
        h = jnp.tanh(dz.ops.layer_norm(jnp.take(embed_table, ids, axis=0), norm["scale"], norm["bias"]))
        y = h @ head_table.T
        return jnp.sum(jnp.sin(y) * w + 0.1 * y * y)

    norm = {"scale": setup.params["norm"]["scale"][...], "bias": setup.params["norm"]["bias"][...]}
    g_embed, g_head = ref.jit(jax.vmap(jax.grad(two_tables, argnums=(0, 1)), in_axes=(None, None, 0, 0, None)))(
        table, table, ids, w, norm)
    tied = np.asarray(g_embed + g_head, np.float64)
    np.testing.assert_allclose(tied, setup.grads["embed/embedding"], rtol=1e-4, atol=1e-6)
    separate = np.sum(np.square(np.asarray(g_embed, np.float64)), (1, 2)) + np.sum(
        np.square(np.asarray(g_head, np.float64)), (1, 2))
    together = np.sum(np.square(tied), (1, 2))
    assert np.all(np.abs(together - separate) > 1e-3 * together), "the cross term should matter in this test"
    others = sum(np.sum(np.square(g).reshape(B, -1), 1) for p, g in setup.grads.items() if p != "embed/embedding")

    def all_norms(params, batch):
        return {(mode, method): dz.per_example_grad_norms(setup.loss_fn, params, batch, norm_method=method, mode=mode)
                for mode in ("bk", "ghost") for method in NORM_METHODS}

    for (mode, method), norms in ref.jit(all_norms)(setup.params, setup.batch).items():
        np.testing.assert_allclose(norms ** 2, together + others, rtol=2e-5, err_msg=f"{mode} {method}")


@pytest.mark.parametrize("mode", ["bk", "ghost", "vmap"])
def test_tied_head_with_bias(mode):
    """A tied head with its own trainable bias: the bias is used once, the table twice, in the same layer call."""
    setup = layer_setup("tied-bias", abstract(lambda: Tied(7, 5, head_bias=True, rngs=nnx.Rngs(1))), on("ids"),
                        {"ids": token_ids(21, (B, 6), 7)})

    def all_norms(params, batch):
        return {method: dz.per_example_grad_norms(setup.loss_fn, params, batch, norm_method=method, mode=mode)
                for method in NORM_METHODS}

    for method, norms in ref.jit(all_norms)(setup.params, setup.batch).items():
        np.testing.assert_allclose(norms, setup.group_norms("all-layer")[:, 0], rtol=1e-5, err_msg=method)
    check_private(setup, clip_fn="abadi", groups="param-wise", mode=mode)
    check_private(setup, clip_fn="automatic", groups="all-layer", mode=mode)
