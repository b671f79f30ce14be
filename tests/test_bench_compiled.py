"""experiments/bench_compiled.py with its steps (compiled_steps.py) and HLO reader (hlo_text.py): the collective
parser (everywhere, on CPU programs) and the smoke run (only where libtpu is installed: the benchmark compiles for
TPU ahead of time; the default test environment has no libtpu and must not import it, since it changes JAX's
start-up)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

_ROOT = pathlib.Path(__file__).parents[1]
_PATH = _ROOT / "experiments" / "bench_compiled.py"
_SPEC = importlib.util.spec_from_file_location("bench_compiled", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bench_compiled", bench)  # its dataclasses look their module up by name
_SPEC.loader.exec_module(bench)
import compiled_steps as steps  # noqa: E402  (experiments/, on the path bench_compiled put it on)
import hlo_text  # noqa: E402


def test_parser_on_written_hlo_lines():
    text = "\n".join([
        "  %ar = f32[128]{0:T(128)} all-reduce(%fusion), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add",
        "  ROOT %ars = (f32[4,8]{1,0}, bf16[16]{0}) all-reduce-start(%a, %b), replica_groups={{0,1}}",
        "  %ard = (f32[4,8]{1,0}, bf16[16]{0}) all-reduce-done(%ars)",
        "  %ags = (f32[2,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%x), dimensions={0}",
        "  %agd = f32[8,64]{1,0} all-gather-done(%ags)",
        "  %cps = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(%y), source_target_pairs={{0,1}}",
        "  %rs = f32[32]{0} reduce-scatter(%z), dimensions={0}, to_apply=%add",
        "  %not = f32[999]{0} add(%all-reduce.1, %p)",
    ])
    found = hlo_text.parse_collectives(text)
    assert found["all-reduce"] == {"count": 2, "bytes": 128 * 4 + 4 * 8 * 4 + 16 * 2}
    assert found["all-gather"] == {"count": 1, "bytes": 8 * 64 * 4}
    assert found["collective-permute"] == {"count": 1, "bytes": 40}
    assert found["reduce-scatter"] == {"count": 1, "bytes": 128}
    assert set(found) == {"all-reduce", "all-gather", "collective-permute", "reduce-scatter"}


def test_parser_counts_an_async_collective_split_over_three_fusions_once():
    """The TPU compiler's form of an all-gather overlapped with a matmul: the same instruction (one channel) copied
    into the computations of ``async-collective-start``, the overlapped ``async_collective_fusion`` and
    ``async-collective-done``. It is one gather of bf16[1, 64, 128]; a plain gather elsewhere is counted too."""
    gather = ("  ROOT %all-gather.{n} = bf16[1,64,128]{{1,2,0:T(8,128)(2,1)}} all-gather(%param_0.{n}), channel_id=20, "
              "replica_groups={{{{0,1,2,3}}}}, dimensions={{2}}")
    text = "\n".join([
        "HloModule jit_step, is_scheduled=true",
        "",
        "%fused_computation.1 (param_0.1: bf16[1,64,32]) -> bf16[1,64,128] {",
        "  %param_0.1 = bf16[1,64,32]{1,2,0} parameter(0)",
        gather.format(n=1),
        "}",
        "",
        "%async_collective_fusion.2 (param_0.2: bf16[1,64,32]) -> (bf16[64,64], bf16[1,64,128]) {",
        "  %param_0.2 = bf16[1,64,32]{1,2,0} parameter(0)",
        gather.format(n=2),
        "}",
        "",
        "%fused_computation.3 (param_0.3: bf16[1,64,32]) -> bf16[1,64,128] {",
        "  %param_0.3 = bf16[1,64,32]{1,2,0} parameter(0)",
        gather.format(n=3),
        "}",
        "",
        "ENTRY %main.9 (p: bf16[1,64,32], q: f32[8]) -> bf16[1,64,128] {",
        "  %p = bf16[1,64,32]{1,2,0} parameter(0)",
        "  %q = f32[8]{0} parameter(1)",
        "  %async-collective-start.1 = (bf16[1,64,32], bf16[1,64,128]) fusion(%p), kind=kCustom, "
        "calls=%fused_computation.1",
        "  %fusion.2 = (bf16[64,64], bf16[1,64,128]) fusion(%p), kind=kCustom, calls=%async_collective_fusion.2",
        "  %ag = f32[32]{0} all-gather(%q), channel_id=21, replica_groups={{0,1,2,3}}, dimensions={0}",
        "  ROOT %async-collective-done.1 = bf16[1,64,128] fusion(%p), kind=kCustom, calls=%fused_computation.3",
        "}",
    ])
    found = hlo_text.parse_collectives(text)
    assert found == {"all-gather": {"count": 2, "bytes": 64 * 128 * 2 + 32 * 4}}
    assert hlo_text.collective_shapes(text) == ["all-gather bf16[1,64,128]", "all-gather f32[32]"]


def test_parser_on_a_compiled_cpu_program():
    """A program with one known all-reduce (psum of a per-device f32[256]) and one all-gather (4 x f32[2, 64] ->
    f32[8, 64]), compiled for 4 CPU devices: the parser finds both with their output bytes."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py asks for 8 virtual CPU devices)")
    mesh = Mesh(np.array(devices[:4]), ("data",))

    def local(x, y):
        return jax.lax.psum(x * 2.0, "data"), jax.lax.all_gather(y + 1.0, "data", tiled=True)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P()),
                                check_vma=False))
    x = jax.ShapeDtypeStruct((4 * 256,), jnp.float32)   # f32[256] per device
    y = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    found = hlo_text.parse_collectives(f.lower(x, y).compile().as_text())
    assert found["all-reduce"]["count"] == 1 and found["all-reduce"]["bytes"] == 256 * 4
    assert found["all-gather"]["count"] == 1 and found["all-gather"]["bytes"] == 8 * 64 * 4


def test_missing_libtpu_message(monkeypatch):
    monkeypatch.setattr(steps.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"tpu-aot"):
        steps.require_libtpu()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]' in a separate environment)")
def test_smoke_run(tmp_path):
    """The benchmark's smallest shape, compiled for a v5e 2x2 slice in a fresh process (JAX with libtpu)."""
    out = tmp_path / "smoke.json"
    # this test process's JAX may have loaded libtpu (it probes for TPUs) and holds its machine-wide lock
    env = {**os.environ, "PYTHONPATH": str(_ROOT), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    run = subprocess.run([sys.executable, str(_PATH), "--smoke", "--out", str(out)], env=env, cwd=_ROOT,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    points = json.loads(out.read_text())["points"]["v5e:2x2"]
    (entry,) = points.values()
    base = entry["nonprivate"]
    assert base["flops"] > 0 and base["bytes_accessed"] > 0 and "all-reduce" in base["collectives"]
    for candidate in ("auto", "bk", "ghost", "vmap"):
        assert entry[candidate]["flops"] >= base["flops"], candidate
    assert entry["auto_resolves_to"]["host"] in ("bk", "ghost")
    if "failed" not in entry["bk_pallas"]:
        assert entry["bk_pallas"]["pallas_calls"] > 0 and entry["bk_pallas"]["pallas_flops"] > 0
    assert "| nonprivate |" in run.stdout


def test_large_buffers_skips_fusions_and_aliases():
    text = "\n".join([
        "%fused_computation.1 (param_0: f32[8,1024,512]) -> f32[8,1024,512] {",
        "  %param_0 = f32[8,1024,512]{2,1,0} parameter(0)",
        "  ROOT %exp = f32[8,1024,512]{2,1,0} exponential(%param_0)",
        "}",
        "ENTRY %main.2 (p: f32[8,1024,512]) -> f32[8,1024,512] {",
        "  %p = f32[8,1024,512]{2,1,0} parameter(0)",
        "  %fusion = f32[8,1024,512]{2,1,0} fusion(%p), kind=kLoop, calls=%fused_computation.1",
        "  %small = f32[8,1024]{1,0} reduce(%fusion, %c), dimensions={2}",
        "  %b = f32[8,1024,512]{2,1,0} bitcast(%fusion)",
        "  ROOT %dot = f32[8,1024,512]{2,1,0} convolution(%fusion, %w), dim_labels=b01f_01io->b01f",
        "}",
    ])
    assert hlo_text.large_buffers(text, 8 * 1024 * 512 * 4 // 2) == {"fusion": 1, "convolution": 1}


def test_fit_criteria():
    """The compiler's verdict (a compiled point fits) and memory_analysis()'s sum (also at most 16 GiB)."""
    gib = 2**30
    compiled = {"total_bytes": 17 * gib}
    assert bench.fits(compiled, "compiler") and not bench.fits(compiled, "total")
    assert bench.fits({"total_bytes": 15 * gib}, "total")
    assert not bench.fits({"failed": "oom", "message": "RESOURCE_EXHAUSTED"}, "compiler")


def test_buffer_dump_reader(tmp_path):
    """experiments/tpu_buffers.py reads the HBM (colour 0) preallocated temporary buffer, not another memory
    space's, and the default memory space's total from the memory-usage report."""
    spec = importlib.util.spec_from_file_location("tpu_buffers", _ROOT / "experiments" / "tpu_buffers.py")
    buffers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(buffers)
    stem = tmp_path / "module_0005.jit_step.cl_1.after_optimizations"
    pathlib.Path(f"{stem}-buffer-assignment.txt").write_text(
        "allocation 0: size 512, thread-local:\n"
        "allocation 7: size 14020543488, preallocated-temp:\n value: <1 fusion @0>\n"
        "allocation 8: size 160, color 2, preallocated-temp:\n"
        "allocation 9: size 20000000000, color 1, preallocated-temp:\n")   # larger: must not be read
    pathlib.Path(f"{stem}-memory-usage-report.txt").write_text(
        "Memory Space: default (color=0)\nTotal bytes: 16862090752 (15.70GiB)\n  cumulative_size; size\n"
        "Memory Space: vmem (color=1)\nTotal bytes: 117440512 (112.00MiB)\n")
    assert buffers.read_dump(str(tmp_path)) == {"preallocated_temp_bytes": 14020543488,
                                                "default_space_bytes": 16862090752}
    with pytest.raises(RuntimeError, match="no buffer assignment"):
        buffers.read_dump(str(tmp_path / "missing"))


def test_llama_style_shape_builds_and_runs_on_the_program_front_end():
    """The table's Llama-style shape (Flax layers, unrolled): built abstractly, ``auto`` resolves on the traced-program
    front end, and a reduced copy's non-private and private steps trace with one gradient per parameter and the
    same tree as the non-private one."""
    import dataclasses

    shape = steps.llama(1024, 4)
    assert shape.key().startswith("llama-unrolled-kv4-mlp2048-L12-d768-V32000-T1024-B4") and shape in bench.FULL_EXTRA
    tiny = dataclasses.replace(shape, n_layer=2, d=64, heads=4, kv_heads=2, mlp=128, vocab=256, T=16, B=2)
    assert steps.resolved_auto(tiny) == {"host": "bk", "v5e_chip": "bk"}
    graphdef, params, rest, trainable = steps.build(tiny)
    batch = {"input_ids": jax.ShapeDtypeStruct((tiny.B, tiny.T), jnp.int32)}
    trees = {}
    for candidate in ("nonprivate", "auto_bf16"):
        losses, grads = jax.eval_shape(steps.make_step(candidate, graphdef, trainable, tiny.B), params, rest, batch, 0)
        assert losses.shape == (tiny.B,)
        trees[candidate] = jax.tree.map(lambda g: (g.shape, g.dtype), grads)
    assert trees["auto_bf16"] == trees["nonprivate"] == jax.tree.map(lambda p: (p.shape, p.dtype), params)
