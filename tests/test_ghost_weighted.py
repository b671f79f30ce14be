"""Ghost mode's *weighted* leaves: a leaf whose norm needs cross terms between its uses (an embedding tied to its LM
head, a weight passed whole into a scan) is normed from book-keeping's records and summed by the weight path of the
second pullback. Checked against ``vmap(grad)``, with the time rule (``norm_method="fastest"``) that would
instantiate the tied table if its gradient were reused, and by the compiled program: no ``[B, V, d]`` buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import B, Setup, check_private, private_fn

import dpzero_jax as dz
from dpzero_jax.program import ghost as program_ghost
from dpzero_jax.program import mode as program_mode

# The tied table [V, d] is used at 2 T positions, T of them by the dense head. At d = 64 the time rule with reuse
# (book-keeping) instantiates it ((2T)^2 d + T^2 V = 2408448 multiply-adds against 60 V d = 1966080), without reuse
# (ghost mode's weighted leaf) takes the ghost norm (against (60 + T) V d = 3801088); weighted, the second pullback
# holds the scaled head gradients, B T V float32 = 573440 bytes, against book-keeping's 4 (B + 1) V d = 786432.
# At d = 16 both rules instantiate (ghost 1806336 against (60 + T) V d = 950272) and book-keeping is the smaller,
# 4 (B + 1) V d = 196608 bytes against 573440 + 4 B V d.
VOCAB, T, D = 512, 56, 64
NARROW = 16


class TiedLM(nnx.Module):
    def __init__(self, width, rngs):
        self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
        self.mix = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(jnp.tanh(self.mix(self.embed(ids))))


def tied_setup(width: int = D, length: int = T) -> Setup:
    model = TiedLM(width, nnx.Rngs(3))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(4)
    batch = {"ids": jnp.asarray(rng.integers(0, VOCAB, (B, length)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, VOCAB, (B, length)), jnp.int32)}

    def loss_fn(p, b):
        logits = nnx.merge(graphdef, p)(b["ids"])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], -1)[..., 0], axis=-1)
    return Setup("tied", params, loss_fn, batch, ())


@pytest.fixture(scope="module")
def setup():
    return tied_setup()


def _weighted_names(setup, **options):
    """``(weighted leaves' paths, ghost sites' leaves' paths)`` of ghost mode's plan of ``setup``."""
    cfg = dz.DPConfig(mode="ghost", front_end="program", **options)
    plan = program_mode.plan_program(setup.loss_fn, cfg, setup.params, setup.batch,
                                     tuple(ref.paths(setup.params)), B)
    ghost_paths = program_ghost.eligible(plan)
    weighted = program_ghost.weighted(plan, ghost_paths, cfg, B)
    return ({plan.paths[i] for i in weighted},
            {plan.paths[plan.analysis.sites[p].view.leaf] for p in ghost_paths})


def test_the_tied_table_is_weighted_where_that_holds_less(setup):
    weighted, ghost = _weighted_names(setup, norm_method="fastest")
    assert weighted == {"embed/embedding"} and ghost == {"mix/kernel", "mix/bias"}
    assert _weighted_names(tied_setup(NARROW), norm_method="fastest")[0] == set()


@pytest.mark.parametrize("method", ["fastest", "mixed"])
def test_weighted_tied_table_matches_vmap_grad(setup, method):
    check_private(setup, clip_fn="abadi", groups="all-layer", mode="ghost", norm_method=method, front_end="program",
                  floor=1e-4)


def test_weighted_tied_table_normed_by_instantiation_matches_vmap_grad():
    """At 4 positions (B T = 20 < d = 64) the scaled head gradients, 4 B T V bytes, are smaller than the float32
    clipped sum, 4 V d: with ``norm_method="instantiate"`` the table is weighted and instantiated for its norm
    alone; the narrow table at 56 positions stays book-kept. Both exact."""
    short = tied_setup(D, 4)
    assert _weighted_names(short, norm_method="instantiate")[0] == {"embed/embedding"}
    check_private(short, clip_fn="abadi", groups="param-wise", mode="ghost", norm_method="instantiate",
                  front_end="program", floor=1e-4)
    narrow = tied_setup(NARROW)
    check_private(narrow, clip_fn="abadi", groups="param-wise", mode="ghost", norm_method="fastest",
                  front_end="program", floor=1e-4)


def test_explain_reports_the_norm_rule_each_mode_applies(setup):
    """Under the time rule book-keeping instantiates the tied table (and reuses it for the sum); ghost mode sums it
    by the weight path, so instantiation would cost its contraction too, and the ghost norm is cheaper."""
    for mode, expected in (("bk", "instantiate"), ("ghost", "ghost")):
        cfg = dz.DPConfig(mode=mode, norm_method="fastest", front_end="program")
        rows = {r["path"]: r for r in dz.explain_plan(setup.loss_fn, cfg, setup.params, setup.batch).rows}
        assert rows["embed/embedding"]["method"] == expected, mode


def test_time_rule_without_reuse_counts_the_contraction():
    """``shape_rule`` for tied tables at T 1024 (2T positions, T dense): GPT-2 XL's [50257, 1600] is ghost-normed
    without reuse (ghost 2048^2 1600 + 1024^2 50257 = 5.94e10 multiply-adds against (60 + 1024) 50257 1600 = 8.7e10)
    and instantiated with it (against 60 V d = 4.8e9); GPT-2 small's [50304, 768] is instantiated either way (5.59e10
    against 4.2e10)."""
    rule = dz.pergrad.shape_rule
    assert rule("fastest", 2048, 1024, 50257, 1600, reuse=False)
    assert not rule("fastest", 2048, 1024, 50257, 1600, reuse=True)
    assert not rule("fastest", 2048, 1024, 50304, 768, reuse=False)
    assert not rule("fastest", 2048, 1024, 50304, 768, reuse=True)
    assert rule("mixed", 2048, 1024, 50304, 768, reuse=False) == rule("mixed", 2048, 1024, 50304, 768)


def test_no_per_example_table_in_the_compiled_ghost_step(setup):
    """The compiled ghost step under the time rule holds no ``[B, V, d]`` array (book-keeping's does: the control)."""
    shape = f"f32[{B},{VOCAB},{D}]"
    texts = {}
    for mode in ("bk", "ghost"):
        cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode=mode, norm_method="fastest",
                          front_end="program")
        fn = jax.jit(private_fn(setup.loss_fn, cfg, use_jit=False))
        texts[mode] = fn.lower(setup.params, setup.batch, jax.random.key(0), None).compile().as_text()
    assert shape in texts["bk"]
    assert shape not in texts["ghost"]


def test_masks_and_a_nan_example_on_the_weighted_table(setup):
    batch = dict(setup.batch)
    batch["poison"] = jnp.zeros((B,), jnp.float32).at[2].set(jnp.nan)

    def loss_fn(p, b):
        return setup.loss_fn(p, {k: v for k, v in b.items() if k != "poison"}) + b["poison"]
    mask = np.array([True, True, True, False, True])
    include = mask & (np.arange(B) != 2)
    expected, _, _ = ref.private_grads(setup.grads, "all-layer", "abadi", max_grad_norm=1.0, include=include)
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=1.0, mode="ghost", norm_method="fastest",
                      front_end="program")
    _, grads, stats = private_fn(loss_fn, cfg)(setup.params, batch, jax.random.key(0), mask)
    assert int(stats.num_nonfinite) == 1 and int(stats.num_included) == 3
    for path, value in ref.flat(grads).items():
        assert np.all(np.isfinite(value)), path
        np.testing.assert_allclose(value, expected[path], rtol=1e-4, atol=1e-6 * np.max(np.abs(expected[path])),
                                   err_msg=path)


def test_a_weighted_table_is_normed_as_summed_under_a_bfloat16_instantiated_dtype():
    """``instantiated_dtype="bfloat16"`` rounds what book-keeping keeps; a weighted table (here instantiated for its
    norm) keeps nothing and is summed exactly, so it is normed in float32: one example alone under a small threshold
    contributes exactly the threshold."""
    setup = tied_setup(D, 4)
    exact = ref.per_example_grads(setup.loss_fn, setup.params, setup.batch)
    norms = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(B, -1) ** 2, axis=1) for g in exact.values()))
    small = float(np.min(norms)) / 4
    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=small, mode="ghost", norm_method="instantiate",
                      instantiated_dtype="bfloat16", expected_batch_size=1.0, front_end="program")
    _, grads, _ = private_fn(setup.loss_fn, cfg)(setup.params, setup.batch, jax.random.key(0), jnp.arange(B) == 1)
    total = np.sqrt(sum(np.sum(v ** 2) for v in ref.flat(grads).values()))
    assert abs(total / small - 1) < 2e-6, total / small - 1


@pytest.mark.parametrize("vocab, width, length, batch", [(512, 64, 4, 2), (512, 16, 32, 4), (96, 64, 16, 3)])
def test_the_planner_predicts_the_engines_choice(vocab, width, length, batch):
    """``step_memory.tied_table_weighted`` (the planner's shape-level rule) against ``ghost.weighted`` on the bundled
    GPT-2 with a tied table (float32, so the scaled output gradients are 4 bytes per number)."""
    from dpzero_jax import planner, step_memory

    config = dz.models.GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=1, n_head=2,
                                  tie_word_embeddings=True)
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2(config, rngs=nnx.Rngs(0)))
    ids = jnp.zeros((batch, length), jnp.int32)
    cfg = dz.DPConfig(mode="ghost", norm_method="fastest", front_end="program")
    plan = program_mode.plan_program(loss_fn, cfg, params, {"input_ids": ids}, tuple(ref.paths(params)), batch)
    engine = {plan.paths[i] for i in program_ghost.weighted(plan, program_ghost.eligible(plan), cfg, batch)}
    shape = planner.DecoderConfig("tiny", 1, width, 2, vocab, length, tied=True)
    assert any("wte" in p for p in engine) == step_memory.tied_table_weighted(shape, batch, length, 4)


def test_the_planner_predicts_the_engines_choice_in_bfloat16():
    """The same in bfloat16, where the time rule's bound in bytes (``pergrad.kept_outweighs_operands``) decides the
    book-kept alternative: a tied ``[4096, 256]`` table at T 160, 4 sequences. Book-kept, the rule with reuse would
    instantiate it by elements (1.05M within 2x the 0.74M operand elements) but not by bytes (4.19 MB float32 against
    1.47 MB of bf16 operands and ids), so book-keeping holds only its 4.19 MB clipped sum, less than the scaled
    output gradients ``4 x 160 x 4352 x 2`` = 5.57 MB of the weight path: book-kept, not weighted."""
    from dpzero_jax import planner, step_memory

    vocab, width, length, batch = 4096, 256, 160, 4
    config = dz.models.GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=1, n_head=2,
                                  tie_word_embeddings=True)
    model = nnx.eval_shape(lambda: dz.models.GPT2(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    params, loss_fn = dz.models.lm_objective(model)
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    cfg = dz.DPConfig(mode="ghost", norm_method="fastest", front_end="program")
    plan = program_mode.plan_program(loss_fn, cfg, params, {"input_ids": ids}, tuple(ref.paths(params)), batch)
    engine = {plan.paths[i] for i in program_ghost.weighted(plan, program_ghost.eligible(plan), cfg, batch)}
    assert not any("wte" in p for p in engine)
    shape = planner.DecoderConfig("tiny", 1, width, 2, vocab, length, tied=True)
    assert not step_memory.tied_table_weighted(shape, batch, length, 2)


def test_a_weight_shared_across_scan_iterations_is_weighted_and_exact():
    """A ``[16, 16]`` weight passed whole into a 3-iteration scan at 2 positions per iteration: its norm needs the
    iterations' cross terms (ghost form: 2 (3 x 2)^2 < 256), and the scaled output gradients, B x 2 x 16 float32 per
    iteration (640 bytes), are smaller than its float32 clipped sum (1024): weighted, summed by the second pullback's
    transposed scan. Checked against ``vmap(grad)``, mask and all."""
    width, length = 16, 2
    keys = jax.random.split(jax.random.key(5), 3)
    params = {"shared": jax.random.normal(keys[0], (width, width)) / 4,
              "stacked": jax.random.normal(keys[1], (3, width, width)) / 4,
              "head": jax.random.normal(keys[2], (width, 3))}
    rng = np.random.default_rng(8)
    batch = {"x": jnp.asarray(rng.standard_normal((B, length, width)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32)}

    def loss_fn(p, b):
        def layer(h, w):
            return jnp.tanh(h @ p["shared"] + h @ w), None
        h, _ = jax.lax.scan(layer, b["x"], p["stacked"])
        return -jnp.take_along_axis(jax.nn.log_softmax(h.mean(1) @ p["head"]), b["y"][:, None], 1)[:, 0]

    setup = Setup("shared", params, loss_fn, batch, ())
    assert _weighted_names(setup)[0] == {"shared"}
    check_private(setup, clip_fn="abadi", groups="param-wise", mode="ghost", floor=1e-4)
    check_private(setup, clip_fn="automatic", groups="all-layer", mode="ghost", floor=1e-4,
                  mask=np.array([True, False, True, True, True]), include=np.array([True, False, True, True, True]))
