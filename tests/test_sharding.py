"""ZeRO sharding on 8 virtual CPU devices (GSPMD and explicit strategies): layouts, the sharded step equals the
one-device step, and the private step communicates exactly what the non-private step does."""

import collections
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpzero_jax import sharding
from dpzero_jax.train import TrainConfig, Trainer

# SGD: Adam's m / sqrt(v) would amplify the float reordering of cross-device sums on near-zero gradients
BASE = dict(steps=4, batch_size=64, log_every=2, progress=False, plot=False, checkpoint_every=0, optimizer="sgd",
            lr=0.1, epsilon=3.0)


@pytest.mark.parametrize("shape, fsdp, expected", [
    ((64, 128), 4, P("fsdp", None)),       # shards [16, 128] fill TPU lanes, [64, 32] would not
    ((128, 64), 4, P(None, "fsdp")),       # [128, 16] fill them, [32, 64] would not
    ((256, 128), 4, P("fsdp", None)),      # both fill them: the largest
    ((64, 32), 4, P("fsdp", None)),        # neither does (a toy table): the largest
    ((128, 128), 4, P("fsdp", None)),      # ties: the first
    # GPT-2 XL's stacked kernels on 64 devices (measured on v5e, docs/benchmarks/tpu_aot.md)
    ((48, 1600, 6400), 64, P(None, "fsdp", None)),     # [48, 25, 6400], not [48, 1600, 100]
    ((48, 6400, 1600), 64, P(None, None, "fsdp")),     # [48, 6400, 25], not [48, 100, 1600]
    ((48, 1600, 4800), 64, P(None, None, "fsdp")),     # neither fills them: the largest
    ((32000, 4096), 256, P("fsdp", None)),             # Llama's table: the vocabulary, as before
    ((128, 10), 8, P("fsdp", None)),
    ((30, 70), 4, P()),                    # nothing divisible
    ((128,), 8, P()),                      # below min_shard_elements
    ((4096,), 8, P("fsdp")),
    ((64, 128), 1, P()),                   # no fsdp axis to shard over
])
def test_weight_spec(shape, fsdp, expected):
    assert sharding.weight_spec(shape, fsdp) == expected


def test_parse_mesh_and_errors():
    assert sharding.parse_mesh("data=2,fsdp=4") == sharding.MeshShape(2, 4)
    assert sharding.parse_mesh("fsdp=8").size == 8
    for bad in ("data=2,model=4", "data=x", "fsdp=0", "data=2,data=2", "8"):
        with pytest.raises(ValueError, match="mesh"):
            sharding.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(sharding.MeshShape(2, 8))
    with pytest.raises(ValueError, match="zero stage"):
        sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(1, 2)), zero=4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stage_layouts(zero):
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(2, 4)), zero)
    params = {"w": np.zeros((64, 128), np.float32), "b": np.zeros((128,), np.float32)}
    opt_state = ({"mu": params}, np.zeros((), np.int32))
    spec = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731
    sharded = {"w": P("fsdp", None), "b": P()}      # shards [16, 128] fill the TPU lanes (weight_spec)
    replicated = {"w": P(), "b": P()}
    assert spec(rules.params(params)) == (sharded if zero == 3 else replicated)
    assert spec(rules.grads(params)) == (sharded if zero >= 2 else replicated)
    assert spec(rules.opt_state(opt_state)) == ({"mu": sharded}, P())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return Trainer(TrainConfig(out=str(tmp_path_factory.mktemp("single")), **BASE)).run()


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["gspmd", "explicit"])
@pytest.mark.parametrize("mesh, zero", [("fsdp=8", 3), ("data=2,fsdp=4", 2), ("data=2,fsdp=4", 1)])
def test_sharded_step_equals_single_device(single, tmp_path, mesh, zero, strategy):
    trainer = Trainer(TrainConfig(out=str(tmp_path), mesh=mesh, zero=zero, strategy=strategy, **BASE))
    result = trainer.run()
    _assert_close(result.params, single.params)       # same key -> same noise and update on 1 and 8 devices
    assert result.epsilon == pytest.approx(single.epsilon, rel=1e-3)
    fsdp = trainer.mesh.shape["fsdp"]
    for leaf in jax.tree.leaves(result.params):       # parameters stay in their stage's layout
        expected = sharding.weight_spec(leaf.shape, fsdp) if zero == 3 else P()
        assert leaf.sharding.spec == expected
    for leaf in jax.tree.leaves(result.opt_state):    # optimizer state is sharded at every stage
        assert leaf.sharding.spec == sharding.weight_spec(leaf.shape, fsdp)
    assert any(leaf.sharding.spec != P() for leaf in jax.tree.leaves(result.opt_state))


@pytest.mark.parametrize("precision, strategy", [("bf16", "gspmd"), ("fp16", "explicit")])
def test_half_precision_sharded_equals_single_device(tmp_path, precision, strategy):
    bf16 = dict(BASE, precision=precision)
    one = Trainer(TrainConfig(out=str(tmp_path / "1"), **bf16)).run()
    eight = Trainer(TrainConfig(out=str(tmp_path / "8"), mesh="data=2,fsdp=4", strategy=strategy, **bf16)).run()
    for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-2, atol=2e-3)  # bf16 sums reorder
        assert x.dtype == np.float32                   # fp32 master weights


def test_restore_onto_another_device_count(single, tmp_path):
    cfg = TrainConfig(out=str(tmp_path), mesh="fsdp=8", **{**BASE, "checkpoint_every": 2})
    Trainer(cfg).run(stop_at=2)
    resumed = Trainer(cfg.replace(mesh="data=2,fsdp=2")).run(resume=True)   # 8 devices -> 4
    _assert_close(resumed.params, single.params)
    assert resumed.steps == 4


def test_fp16_without_loss_scaling_tracks_fp32(tmp_path):
    cfg = dict(BASE, steps=40, log_every=10, optimizer="adam", lr=1e-2)
    fp32 = Trainer(TrainConfig(out=str(tmp_path / "32"), **cfg)).run()
    fp16 = Trainer(TrainConfig(out=str(tmp_path / "16"), precision="fp16", **cfg)).run()
    losses32 = np.array([r["loss"] for r in fp32.history])
    losses16 = np.array([r["loss"] for r in fp16.history])
    assert np.all(np.isfinite(losses16))
    np.testing.assert_allclose(losses16, losses32, rtol=0.05, atol=0.02)
    assert abs(fp16.test_accuracy - fp32.test_accuracy) < 0.03


def test_mesh_must_match_devices():
    with pytest.raises(ValueError, match="does not match mesh"):
        TrainConfig(devices=4, mesh="data=2,fsdp=4")
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


@pytest.mark.parametrize("mode, groups", [("bk", "layer-wise"), ("ghost", "all-layer"), ("fused", "param-wise"),
                                          ("vmap", ("uniform", 2))])
def test_explicit_strategy_in_every_engine_mode_and_grouping(tmp_path, mode, groups):
    """The explicit strategy (shard_map, ZeRO-3 over 8 devices) gives the one-device update in each engine mode and
    group-wise clipping (per-group thresholds enter the noise scale outside shard_map)."""
    cfg = dict(BASE, steps=2, mode=mode, groups=groups)
    one = Trainer(TrainConfig(out=str(tmp_path / "1"), **cfg)).run()
    eight = Trainer(TrainConfig(out=str(tmp_path / "8"), mesh="fsdp=8", strategy="explicit", **cfg)).run()
    _assert_close(eight.params, one.params)


def test_explicit_strategy_bf16_and_no_dp(tmp_path):
    bf16 = dict(BASE, steps=2, precision="bf16")
    one = Trainer(TrainConfig(out=str(tmp_path / "1"), **bf16)).run()
    eight = Trainer(TrainConfig(out=str(tmp_path / "8"), mesh="data=2,fsdp=4", strategy="explicit", **bf16)).run()
    for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-2, atol=2e-3)
    plain = dict(BASE, steps=2, no_dp=True)
    one = Trainer(TrainConfig(out=str(tmp_path / "1n"), **plain)).run()
    eight = Trainer(TrainConfig(out=str(tmp_path / "8n"), mesh="fsdp=8", strategy="explicit", **plain)).run()
    _assert_close(eight.params, one.params)


COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                        r"(?:-start)?\(")
ARRAY = re.compile(r"(pred|[subf]\d+|bf16)\[([\d,]*)\]")


def _collectives(hlo_text: str):
    """From compiled HLO: the multiset of ``(op, dtype, shape)`` of every non-scalar collective result (tuples --
    combined collectives -- split into their parts), and the number of scalar ones."""
    arrays, scalars = collections.Counter(), 0
    for match in COLLECTIVE.finditer(hlo_text):
        for dtype, dims in ARRAY.findall(match.group(1)):
            if dims:
                arrays[(match.group(2), dtype, dims)] += 1
            else:
                scalars += 1
    return arrays, scalars


@pytest.mark.parametrize("mesh, zero", [("fsdp=8", 3), ("data=2,fsdp=4", 2), ("data=2,fsdp=4", 1)])
def test_private_step_has_the_collectives_of_the_non_private_step(tmp_path, mesh, zero):
    """Explicit strategy: the same collectives, count and shapes (hence bytes), in the compiled DP and non-DP
    steps. Scalars aside: the non-private mean divides by the realised batch size (one more scalar all-reduce); DP
    divides by the expected one. (The GSPMD strategy gives no such guarantee: XLA's partitioner decides, and on
    this tiny model it all-reduces partial per-example products in the DP step -- the reason the explicit strategy
    exists.)"""
    strategy = "explicit"
    found = {}
    for no_dp in (False, True):
        trainer = Trainer(TrainConfig(out=str(tmp_path), mesh=mesh, zero=zero, strategy=strategy, no_dp=no_dp,
                                      noise_multiplier=None if no_dp else 1.0, **{**BASE, "optimizer": "adam"}))
        found[no_dp] = _collectives(trainer.lower_step().compile().as_text())
    (dp_arrays, dp_scalars), (plain_arrays, plain_scalars) = found[False], found[True]
    assert dp_arrays == plain_arrays
    assert dp_scalars <= plain_scalars
    if zero >= 2:   # gradients reach their owners by reduce-scatter
        assert any(op == "reduce-scatter" for op, _, _ in dp_arrays)


def test_zero_memory_experiment_explicit_stage3_is_fully_partitioned():
    """experiments/zero_memory.py at N=8, stage 3, explicit: the compiled step's per-device model-state arguments
    x 8 are within 5% of the unsharded total (small replicated tensors), and match 12 Psi / N and the planner to 5%."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "experiments" / "zero_memory.py"
    spec = importlib.util.spec_from_file_location("zero_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = module.measure("explicit", 3, 8)
    assert 1.0 <= row["partition_ratio"] <= 1.05
    assert row["vs_formula"] == pytest.approx(1.0, abs=0.05)
    assert row["vs_planner"] == pytest.approx(1.0, abs=0.10)
    assert row["argument_bytes"] >= row["model_state_bytes"]


def test_explicit_stage3_gathers_each_layer_just_before_use():
    """Explicit ZeRO-3 gathers layer by layer (paper 003): in the compiled DP step of a 4-layer GPT-2 on 8 devices
    the weights are gathered again in the backward pass (more all-gathers than sharded weights, where gathering
    everything first has one each), and the whole parameters are never live at once: the step's temporary memory
    is below that of the same step gathering every weight first by more than half the parameters' bytes."""
    import jax.numpy as jnp
    from flax import nnx

    from dpzero_jax import DPConfig, models

    config = models.GPT2Config(vocab_size=512, n_positions=32, n_embd=128, n_layer=4, n_head=4)
    params, loss_fn = models.lm_objective(models.GPT2(config, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(1, 8)), 3)
    batch = {"input_ids": jax.ShapeDtypeStruct((16, 32), jnp.int32)}
    mask = jax.ShapeDtypeStruct((16,), jnp.bool_)
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=16, noise_rng="partitionable",
                  mode="bk")
    sharded = [x for x in jax.tree.leaves(params) if sharding.weight_spec(x.shape, 8) != P()]
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))

    def compiled(by_layer):
        gradient = sharding.explicit_private_gradient(loss_fn, dp, rules, params, gather_by_layer=by_layer)
        step = jax.jit(lambda p, b, k, m: gradient(p, b, k, m)[1],
                       in_shardings=(rules.params(params), rules.batch(batch), rules.replicated, rules.batch(0)),
                       out_shardings=rules.grads(params))
        executable = step.lower(params, batch, jax.random.key(0), mask).compile()
        gathers = sum(n for (op, _, _), n in _collectives(executable.as_text())[0].items() if op == "all-gather")
        return gathers, executable.memory_analysis().temp_size_in_bytes

    (by_layer_gathers, by_layer_temp), (upfront_gathers, upfront_temp) = compiled(True), compiled(False)
    assert upfront_gathers == len(sharded)
    assert by_layer_gathers > len(sharded) + 4 * config.n_layer   # every layer's kernels gathered in the backward
    assert upfront_temp - by_layer_temp > 0.5 * param_bytes


def test_explicit_stage3_gathers_linear_weights_in_the_compute_precision(tmp_path):
    """With bf16 compute on fp32 master weights, a linear layer's sharded kernel is cast to bf16 before its gather
    (the layer casts it anyway: same result, half the bytes), in the DP and the non-DP step alike. Read from the
    lowered program: XLA:CPU itself widens bf16 collectives to f32 when it compiles."""
    found = {}
    for no_dp in (False, True):
        trainer = Trainer(TrainConfig(out=str(tmp_path), mesh="fsdp=8", strategy="explicit", no_dp=no_dp,
                                      precision="bf16", noise_multiplier=None if no_dp else 1.0, **BASE))
        text = trainer.lower_step().as_text()
        found[no_dp] = collections.Counter(re.findall(r"all_gather.*?-> tensor<[\dx]*x(\w+)>", text))
    assert found[False] == found[True]
    assert set(found[False]) == {"bf16"} and found[False]["bf16"] >= 2
