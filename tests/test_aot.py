"""dpzero_jax.aot and ``dpzero plan --compile``: the trainer's ZeRO step compiled ahead of time, memory from the
compiler.

Here the target is ``local`` (this process's 8 virtual CPU devices, ``conftest.py``); the TPU topologies are
compiled by ``tests/test_planner_tpu.py`` where libtpu is installed. The per-device arguments of a compiled step are
checked against what ZeRO-3 should hand each device, counted without the compiler: every float32 parameter and both
Adam moments in the shard the sharding rules give it, the batch's share of the token ids and of the mask, the key;
for LoRA the adapters so and the frozen base stored as the trainer stores it (a Llama's matrices in bfloat16). The
model's parameter count is checked against the planner's architecture count (``decoder_shapes``, itself checked
against ``transformers``' models).
"""

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dpzero_jax import aot, planner, sharding
from dpzero_jax.decoder_shapes import config_from_dict

DEVICES, BATCH, SEQ = 4, 8, 32
TINY = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab": 128, "n_ctx": 32, "family": "llama", "n_kv_head": 2,
        "d_ff": 64, "tied": False}


def _shard_bytes(tree, shardings) -> int:
    leaves = jax.tree.leaves(tree)
    places = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert len(leaves) == len(places)
    return sum(math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize for x, s in zip(leaves, places))


def _expected_arguments(lora_rank: int) -> int:
    """Bytes of one device's arguments: parameters and Adam's two moments (float32, ZeRO-3 shards), Adam's step
    count, the batch's share of the ids and the mask, the key; the frozen base (LoRA) in its stored dtypes."""
    from dpzero_jax import peft
    from dpzero_jax.models.llama import Llama

    config = aot.model_config(config_from_dict(TINY), SEQ, "block")
    holder = {"filter": nnx.Param}

    def make():
        model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        if lora_rank:
            model, holder["filter"] = peft.apply(model, "lora", rank=lora_rank, key=jax.random.key(1))
        return model

    _, params, frozen = nnx.split(nnx.eval_shape(make), holder["filter"], ...)
    if not lora_rank:
        assert sum(x.size for x in jax.tree.leaves(params)) == config_from_dict(TINY).n_params
    frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.ndim >= 2 else x.dtype), frozen)
    rules = sharding.ShardingRules(sharding.make_mesh(sharding.MeshShape(data=1, fsdp=DEVICES),
                                                      devices=jax.devices()[:DEVICES]), 3)
    states = 3 * _shard_bytes(params, rules.params(params))          # parameters, first and second moments
    base = _shard_bytes(frozen, rules.params(frozen)) if lora_rank else 0
    return states + base + 4 + (BATCH // DEVICES) * (SEQ * 4 + 1) + 8   # count int32, ids int32, mask bool, key


@pytest.mark.parametrize("lora_rank,strategy", [(0, "gspmd"), (4, "gspmd"), (4, "explicit")])
def test_compiled_arguments_are_the_zero3_shards_of_the_model_states(lora_rank, strategy):
    result = aot.compiled_memory(TINY, "local", devices=DEVICES, batch=BATCH, seq=SEQ, remat="block",
                                 lora_rank=lora_rank, private=True, strategy=strategy)
    assert result.refused is None and result.target == "local:cpu" and result.mesh == "data=1,fsdp=4"
    assert result.argument_bytes == _expected_arguments(lora_rank)
    assert result.temp_bytes > 0
    assert result.total_bytes == result.argument_bytes + result.temp_bytes + result.output_bytes - result.alias_bytes
    assert result.peak_bytes is None or result.peak_bytes >= result.argument_bytes   # the arguments are live at once


def test_plan_compile_prints_the_compiled_steps_beside_the_plan(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    argv = ["--model", str(path), "--devices", str(DEVICES), "--batch", str(BATCH), "--seq", str(SEQ),
            "--remat", "block", "--compile", "local"]
    assert planner.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    compiled = out["compiled"]
    assert [c["private"] for c in compiled] == [False, True]
    for c in compiled:   # the non-private step reads no key (jax.jit drops an unused argument)
        assert c["argument_bytes"] == _expected_arguments(0) - (0 if c["private"] else 8) and c["temp_bytes"] > 0
    # the private step holds more (per-example norms, the noise) and the same model states
    assert compiled[1]["temp_bytes"] > compiled[0]["temp_bytes"]
    assert planner.main(argv) == 0
    text = capsys.readouterr().out
    assert "compiled for local:cpu (4 devices, mesh data=1,fsdp=4; the device's memory unknown here)" in text
    assert "non-DP" in text and "DP (auto)" in text


def test_compile_targets_are_checked_before_anything_is_built(capsys):
    assert planner.main(["--model", "gpt2", "--batch", "8", "--strategy", "explicit"]) == 2
    assert "--strategy chooses how --compile builds the step" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected 'local' or a TPU topology name"):
        aot.target_devices("tpu-v5e")
    with pytest.raises(ValueError, match="fewer than the 4096 planned"):
        aot.target_devices("local", 4096)
    with pytest.raises(ValueError, match="must divide the 4 devices"):
        aot.compiled_memory(TINY, "local", devices=DEVICES, batch=BATCH, seq=SEQ, shards=3)
    with pytest.raises(ValueError, match="batch=6 must be a multiple of the 4 devices"):
        aot.compiled_memory(TINY, "local", devices=DEVICES, batch=6, seq=SEQ)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None,
                    reason="libtpu is installed here: the TPU path is tested by test_planner_tpu.py")
def test_a_tpu_topology_without_libtpu_names_the_extra():
    with pytest.raises(RuntimeError, match=r"needs libtpu.*tpu-aot"):
        aot.target_devices("v5e:2x2")


def test_refusal_reads_both_phrasings_of_the_tpu_compilers_out_of_memory():
    assert aot.refusal("RESOURCE_EXHAUSTED: ... Used 29.3G of 15.75G hbm. Exceeded by 13.5G") == {
        "used_bytes": int(29.3 * 2**30), "hbm_bytes": int(15.75 * 2**30)}
    assert aot.refusal("the total memory required for HLO temporaries (16.16G) exceeds available HBM (15.75G)") == {
        "used_bytes": int(16.16 * 2**30), "hbm_bytes": int(15.75 * 2**30)}
    assert aot.refusal("INVALID_ARGUMENT: something else") == {}
    assert aot.is_oom(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory")) and not aot.is_oom(ValueError("shape"))


def test_fits_is_the_tpu_compilers_verdict_and_a_local_devices_memory():
    made = dict(private=True, devices=256, mesh="data=4,fsdp=64", argument_bytes=3 * 2**28, output_bytes=3 * 2**28,
                alias_bytes=3 * 2**28)
    assert aot.device_memory("v5e:16x16", None) == 16 * 2**30 and aot.device_memory("v5p:4x4x8", None) == 95 * 10**9
    # a TPU topology: the compiler refuses a step whose buffers exceed the chip's usable HBM, so a returned step fits
    # even where memory_analysis()'s total (which counts on-chip scratch too) is above the chip's HBM
    tpu = dict(made, target="v5e:16x16", hbm_bytes=aot.device_memory("v5e:16x16", None))
    returned = aot.CompiledMemory(**tpu, temp_bytes=16 * 2**30, peak_bytes=15 * 2**30)
    assert returned.total_bytes > returned.hbm_bytes and returned.fits is True
    refused = aot.CompiledMemory("v5e:16x16", True, 256, "data=4,fsdp=64", refused="RESOURCE_EXHAUSTED: ...")
    assert refused.fits is False and refused.total_bytes is None
    # a local device (a GPU's bytes_limit): the total against its memory
    gpu = dict(made, target="local:gpu", hbm_bytes=16 * 2**30)
    assert aot.CompiledMemory(**gpu, temp_bytes=15 * 2**30).fits is True
    assert aot.CompiledMemory(**gpu, temp_bytes=16 * 2**30).fits is False
    assert aot.CompiledMemory("local:cpu", True, 4, "data=1,fsdp=4", 1, 1, 1, 1).fits is None
    assert aot.device_memory("local", jax.devices()[0]) is None   # a CPU reports no bytes_limit


def test_presets_script_writes_the_plan_and_the_compiled_steps(tmp_path, capsys):
    """``experiments/planner_presets_tpu.py`` end to end on this host's devices (a TPU topology needs libtpu)."""
    from helpers import experiment_module

    script = experiment_module("planner_presets_tpu")
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    out = tmp_path / "presets.json"
    result = script.main(["--models", str(model), "--topology", "local", "--chips", str(DEVICES), "--seq", str(SEQ),
                          "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(result["rows"])) and [r["private"] for r in rows] == [False, True]
    planned = planner.plan_memory(str(model), DEVICES, DEVICES, SEQ, "bf16", 3, remat="block")
    assert [r["planned_bytes"] for r in rows] == [planned.total_non_dp, planned.total]
    for r in rows:
        assert r["planned_over_compiled"] == pytest.approx(r["planned_bytes"] / r["total_bytes"])
    printed = capsys.readouterr().out
    assert f"| {model} | nonprivate |" in printed and f"| {model} | dp |" in printed
