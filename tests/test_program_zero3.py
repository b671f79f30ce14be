"""ZeRO-3 layer-by-layer gathering (``strategy="explicit"``) for any JAX model, on the traced program: a flax.linen
decoder (tied ``nn.Embed`` head, a bare position table, ``nn.DenseGeneral`` attention, ``nn.Dense`` MLP,
``nn.LayerNorm``, a per-block gate; blocks unrolled or ``nn.scan``-ned, with ``nn.remat``; ``zero3_linen.py``) on 8
virtual devices: the private clipped sums. The non-private steps and the trainer: ``test_program_zero3_steps.py``.

References are independent of the engine: ``jax.vmap(jax.grad)`` per-example gradients on whole parameters,
clipped and summed in the test; the model's own forward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from zero3_linen import BATCH, SEQ, VOCAB, assert_sums_close, setup
from zero3_linen import rules as make_rules

from dpzero_jax import DPConfig, sharding
from dpzero_jax.engine import clipped_grad_sum


def _reference_clipped_sum(loss_fn, params, batch, mask, max_grad_norm, groups, per_iteration=False):
    """Clipped per-example gradients summed, from ``vmap(grad)``: one group (``all-layer``), one per leaf
    (``param-wise``) or per parent path (``layer-wise``; with ``per_iteration`` a scanned block's stacked leaves
    split into one group per layer), each with threshold R / sqrt(M)."""
    per_example = jax.vmap(jax.grad(lambda p, ids: loss_fn(p, {"ids": ids[None]})[0]), in_axes=(None, 0))(
        params, batch["ids"])
    paths = ["/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(per_example)]
    leaves = jax.tree.leaves(per_example)
    parts = []   # (group key, leaf index, iteration or None, per-example gradient [B, ...])
    for i, (path, g) in enumerate(zip(paths, leaves)):
        key = {"all-layer": "all", "param-wise": path}.get(groups, path.rsplit("/", 1)[0])
        if per_iteration and path.startswith("Scan"):
            parts += [((key, t), i, t, g[:, t]) for t in range(g.shape[1])]
        else:
            parts.append((key, i, None, g))
    names = list(dict.fromkeys(key for key, *_ in parts))
    sq = {name: 0.0 for name in names}
    for key, _, _, g in parts:
        sq[key] = sq[key] + jnp.sum(jnp.square(g.reshape(BATCH, -1)), axis=1)
    threshold = max_grad_norm / np.sqrt(len(names))
    sums = [jnp.zeros(g.shape[1:]) for g in leaves]
    for key, i, t, g in parts:
        part = jnp.einsum("b,b...->...", jnp.minimum(1.0, threshold / jnp.sqrt(sq[key])) * mask, g)
        sums[i] = part if t is None else sums[i].at[t].set(part)
    return jax.tree.unflatten(jax.tree.structure(per_example), sums)


def _explicit_clipped_sum(loss_fn, dp, rules, params, by_layer=True):
    layout = sharding.ShardLayout(rules, params) if by_layer else None
    clipped = clipped_grad_sum(loss_fn, dp, layout=layout)
    summed = sharding.explicit_gradient(lambda p, b, m: clipped(p, b, m)[:2], rules, params,
                                        gather_by_layer=by_layer)
    batch = {"ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)}
    return jax.jit(lambda p, b, m: summed(p, b, m)[1], in_shardings=(rules.params(params), rules.batch(batch),
                                                                      rules.batch(0)),
                   out_shardings=rules.grads(params))


@pytest.mark.parametrize("mode, scan, remat, groups, microbatch, scan_groups", [
    ("bk", False, False, "all-layer", None, "whole"),
    ("bk", True, False, "param-wise", 1, "whole"),   # 2 examples per device one at a time, sums as shards
    ("ghost", False, False, "param-wise", None, "whole"),
    ("ghost", True, True, "all-layer", None, "whole"),
    ("fused", False, False, "layer-wise", None, "whole"),   # bias and scale linked to their kernel's tap
    ("fused", True, True, "layer-wise", None, "per-iteration"),   # each layer's slice a group of its own
    ("auto", True, True, "all-layer", None, "whole"),
])
def test_clipped_sum_on_shards_equals_vmap_grad(mode, scan, remat, groups, microbatch, scan_groups):
    _, params, batch, loss_fn = setup(scan, remat)
    rules = make_rules()
    specs = jax.tree.leaves(rules.params(params), is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    assert sum(s.spec != P() for s in specs) > len(specs) // 2          # most leaves arrive as shards
    mask = jnp.ones((BATCH,), bool).at[3].set(False)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode=mode, groups=groups,
                  front_end="program", microbatch_size=microbatch, scan_groups=scan_groups)
    actual = _explicit_clipped_sum(loss_fn, dp, rules, params)(params, batch, mask)
    assert_sums_close(actual, _reference_clipped_sum(loss_fn, params, batch, mask, 0.05, groups,
                                                      scan_groups == "per-iteration"))


@pytest.mark.parametrize("scan", [False, True])
def test_each_use_gathers_its_shard_and_no_weight_stays_whole(scan):
    """Compiled book-keeping step on the shards: more all-gathers than sharded leaves (each weight gathered again
    in the backward pass) and temporaries below those of the same step gathering every weight first by more than
    half the parameters' bytes (each whole clipped sum is reduce-scattered before the next is formed)."""
    _, params, batch, loss_fn = setup(scan, width=128)
    rules = make_rules(1024)
    sharded = [x for x in jax.tree.leaves(params) if sharding.weight_spec(x.shape, 4) != P()]
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode="bk",
                  front_end="program")
    mask = jnp.ones((BATCH,), bool)
    found = {}
    for by_layer in (True, False):
        executable = _explicit_clipped_sum(loss_fn, dp, rules, params, by_layer).lower(params, batch, mask).compile()
        found[by_layer] = (executable.as_text().count(" all-gather("), executable.memory_analysis().temp_size_in_bytes)
    assert found[False][0] == len(sharded)
    assert found[True][0] > len(sharded) + 4
    assert found[False][1] - found[True][1] > 0.5 * param_bytes


@pytest.mark.parametrize("mode, vocab, tied, microbatch", [
    ("bk", 64, True, None),       # the table [64, 32] split on its rows: pieces of columns; the tied head's too
    ("bk", 66, True, 1),          # pieces of rows, summed one example at a time
    ("fused", 66, True, None),    # [66, 32] split on its columns: pieces of rows (ids outside a piece add nothing)
    ("fused", 64, False, None),   # an untied lookup, clipped at its site otherwise: book-kept to be summed in pieces
])
def test_a_table_sum_formed_in_pieces_equals_vmap_grad(mode, vocab, tied, microbatch):
    """``ShardingRules.sum_chunk_bytes`` below the table's float32 bytes: its clipped sum is formed and
    reduce-scattered piece by piece (one more ``reduce_scatter`` a piece in the lowered step), with the values
    of ``vmap(grad)``, a masked example included."""
    _, params, batch, loss_fn = setup(False, tied=tied, vocab=vocab)
    table = params["Embed_0"]["embedding"]
    mask = jnp.ones((BATCH,), bool).at[3].set(False)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode=mode,
                  groups="layer-wise", front_end="program", microbatch_size=microbatch)
    lowered = {}
    for chunk_bytes in (sharding.DEFAULT_SUM_CHUNK_BYTES, table.size * 4 // 4):   # whole / in 4 pieces
        rules = make_rules(sum_chunk_bytes=chunk_bytes)
        step = _explicit_clipped_sum(loss_fn, dp, rules, params)
        lowered[chunk_bytes] = step.lower(params, batch, mask).as_text().count("reduce_scatter")
        if chunk_bytes != sharding.DEFAULT_SUM_CHUNK_BYTES:
            dim = sharding.ShardLayout(rules, params).dim("Embed_0/embedding")
            assert dim == (0 if vocab == 64 else 1)
            assert_sums_close(step(params, batch, mask),
                              _reference_clipped_sum(loss_fn, params, batch, mask, 0.05, "layer-wise"))
    whole, pieces = lowered.values()
    assert pieces == whole + 3


def _gspmd_clipped_sum(loss_fn, dp, rules, params):
    """The clipped sum as the trainer's GSPMD step traces it (:meth:`ShardingRules.gspmd_hint`), jitted with the
    stage's shardings."""
    clipped = clipped_grad_sum(loss_fn, dp)
    batch = {"ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)}

    def summed(p, b, m):
        with rules.gspmd_hint():
            return clipped(p, b, m)[1]
    return jax.jit(summed, in_shardings=(rules.params(params), rules.batch(batch), rules.batch(0)),
                   out_shardings=rules.grads(params))


@pytest.mark.parametrize("mode, vocab, tied, pieces", [
    ("bk", 64, True, 4),          # the table [64, 32] split on its rows: pieces of columns
    ("fused", 66, True, 4),       # [66, 32] split on its columns: pieces of rows
    ("fused", 64, False, 0),      # an untied lookup: clipped at its site (book-kept to be cut under explicit only)
    ("ghost", 64, True, 0),       # ghost's weight path sums a tied table (no book-kept sum to cut)
])
def test_gspmd_forms_a_table_sum_in_pieces_equal_to_vmap_grad(mode, vocab, tied, pieces):
    """GSPMD at stage 3 with ``sum_chunk_bytes`` a quarter of the table's float32 bytes: its clipped sum is formed in
    four pieces, each constrained to the table's split (one more sharding constraint a piece in the traced step),
    with the values of ``vmap(grad)``, a masked example included (8 devices). What it saves is the TPU compiler's
    to show (XLA:CPU partitions this step otherwise): ``tests/test_tpu_aot.py``."""
    _, params, batch, loss_fn = setup(False, tied=tied, vocab=vocab)
    table = params["Embed_0"]["embedding"]
    mask = jnp.ones((BATCH,), bool).at[3].set(False)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode=mode,
                  groups="layer-wise", front_end="program")
    constraints = []
    for chunk_bytes in (sharding.DEFAULT_SUM_CHUNK_BYTES, table.size * 4 // 4):
        step = _gspmd_clipped_sum(loss_fn, dp, make_rules(sum_chunk_bytes=chunk_bytes), params)
        constraints.append(str(jax.make_jaxpr(step)(params, batch, mask)).count("sharding_constraint"))
        assert_sums_close(step(params, batch, mask),
                          _reference_clipped_sum(loss_fn, params, batch, mask, 0.05, "layer-wise"))
    assert constraints[1] == constraints[0] + pieces


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "64MiB"])
def test_sum_chunk_bytes_must_be_a_positive_number_of_bytes(value):
    with pytest.raises(ValueError, match="sum_chunk_bytes"):
        make_rules(sum_chunk_bytes=value)


@pytest.mark.parametrize("strategy", ["explicit", "gspmd"])
@pytest.mark.parametrize("mode, tied", [("fused", False), ("bk", True), ("ghost", True), ("ghost", False)])
def test_the_plan_names_a_table_summed_in_pieces(mode, tied, strategy):
    """``explain_plan(..., rules=..., strategy=...)`` says which table a ZeRO-3 layout sums in pieces (and why fused
    book-keeps an untied lookup under ``explicit``; under ``gspmd`` fused clips it at its site, as
    ``program_fused`` does); without rules, or with pieces larger than the table, it says nothing of the kind; nor
    in ghost mode, whose weight path sums this table (tied: weighted; untied: a ghost site)."""
    import dpzero_jax as dz

    _, params, batch, loss_fn = setup(False, tied=tied)
    table = params["Embed_0"]["embedding"]
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode=mode,
                  groups="layer-wise", front_end="program")
    booked_lookup = mode == "fused" and strategy == "explicit"
    for rules, named in ((make_rules(sum_chunk_bytes=table.size), True), (make_rules(), False), (None, False)):
        rows = {r["path"]: r for r in dz.explain_plan(loss_fn, dp, params, batch, rules=rules,
                                                      strategy=strategy).rows}
        why = rows["Embed_0/embedding"]["why"]
        assert ("pieces" in why) == (named and mode != "ghost" and (mode != "fused" or booked_lookup)), why
        assert ("split by the ZeRO-3 layout" in why) == (named and booked_lookup), why
        assert not any("pieces" in r["why"] for p, r in rows.items() if p != "Embed_0/embedding")


def test_the_plan_names_a_bad_strategy():
    import dpzero_jax as dz

    _, params, batch, loss_fn = setup(False, tied=False)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, front_end="program")
    with pytest.raises(ValueError, match="strategy must be 'gspmd' or 'explicit'"):
        dz.explain_plan(loss_fn, dp, params, batch, rules=make_rules(), strategy="shard_map")


def test_a_table_summed_in_pieces_holds_less_than_a_whole_one():
    """Compiled (XLA:CPU, 8 devices): an untied 1 MiB table's clipped sum in 8 pieces (fused mode, layer-wise),
    against the same step forming it whole (clipped at its site, autodiff's scatter): temporaries lower by more
    than half the table."""
    mode = "fused"
    _, params, batch, loss_fn = setup(False, tied=False, vocab=8192)
    table_bytes = params["Embed_0"]["embedding"].size * 4
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode=mode,
                  groups="layer-wise", front_end="program")
    mask = jnp.ones((BATCH,), bool)
    temp = [_explicit_clipped_sum(loss_fn, dp, make_rules(sum_chunk_bytes=chunk), params).lower(params, batch, mask)
            .compile().memory_analysis().temp_size_in_bytes
            for chunk in (sharding.DEFAULT_SUM_CHUNK_BYTES, table_bytes // 8)]
    assert temp[1] < temp[0] - table_bytes // 2, temp


class _TiedTable(nn.Module):
    """Only a tied table, float32 throughout: logits ``E[ids] E^T``."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, 32)
        return embed.attend(embed(ids))


@pytest.mark.parametrize("strategy", ["gspmd", "explicit"])
@pytest.mark.parametrize("mode", ["bk", "fused"])
def test_a_table_summed_in_pieces_is_clipped_by_its_exact_norm(mode, strategy):
    """ZeRO-3 forms a large lookup table's clipped sum in pieces from its uses' factors, in float32; the norm that
    clips it must be that gradient's. With ``instantiated_dtype="bfloat16"`` and the gradient instantiated, the norm
    was taken of a bfloat16 copy kept for a sum never formed from it (norms off by up to 4e-4 relative here, so an
    example could move the sum by more than the threshold); ``vmap(grad)``'s float32 norms are the reference. The
    table ``[64, 32]`` split over 8 devices, pieces of a quarter of its float32 bytes; with the pieces larger than
    the table, the book-kept copy is what is summed, and normed."""
    model = _TiedTable()
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), ids)["params"]

    def loss_fn(p, batch):
        logp = jax.nn.log_softmax(model.apply({"params": p}, batch["ids"]))
        return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][..., None], -1)[..., 0], axis=-1)

    per_example = jax.vmap(jax.grad(lambda p, x: loss_fn(p, {"ids": x[None]})[0]), in_axes=(None, 0))(params, ids)
    expected = np.sqrt(np.sum(np.square(np.asarray(per_example["Embed_0"]["embedding"], np.float64)), axis=(1, 2)))
    rules = make_rules(sum_chunk_bytes=params["Embed_0"]["embedding"].size)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=BATCH, mode=mode,
                  front_end="program", norm_method="instantiate", instantiated_dtype="bfloat16")
    batch, mask = {"ids": ids}, jnp.ones((BATCH,), bool)
    if strategy == "gspmd":
        clipped = clipped_grad_sum(loss_fn, dp)

        def norms(p, b, m):
            with rules.gspmd_hint():
                return clipped(p, b, m)[2].norms
    else:
        clipped = clipped_grad_sum(loss_fn, dp, layout=sharding.ShardLayout(rules, params))

        def local(p, b, m):
            losses, sums, stats = clipped(p, b, m)
            return losses, sums, stats.norms
        summed = sharding.explicit_gradient(local, rules, params, gather_by_layer=True, per_example_outputs=1)

        def norms(p, b, m):
            return summed(p, b, m)[2]
    np.testing.assert_allclose(np.asarray(jax.jit(norms)(params, batch, mask)), expected, rtol=2e-6)
