"""experiments/tpu_aot.py: its pure parts everywhere (mesh choice, the compiler's refusal message, the largest
collectives of an HLO text, the tables), and the Pallas TPU kernels compiled for a TPU chip ahead of time only where
libtpu is installed (the default test environment has none and must not import it: it changes JAX's start-up)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).parents[1]
_SPEC = importlib.util.spec_from_file_location("tpu_aot", _ROOT / "experiments" / "tpu_aot.py")
aot = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("tpu_aot", aot)  # its dataclasses look their module up by name
_SPEC.loader.exec_module(aot)


def test_largest_fsdp_is_the_largest_divisor_every_weight_admits():
    # GPT-2 XL's widths: d = 1600 = 2^6 * 25, 3d = 4800, 4d = 6400, 48 stacked layers, vocab 50257 (prime-ish)
    xl = [(50257, 1600), (1024, 1600), (48, 1600, 4800), (48, 1600, 6400), (48, 6400, 1600), (48, 1600), (1600,)]
    assert aot.largest_fsdp(xl, 256) == 64
    assert aot.largest_fsdp(xl, 128) == 64
    assert aot.largest_fsdp([(32, 4096, 11008), (32000, 4096)], 256) == 256
    # a weight with no dimension divisible by 2: nothing but 1 shards it
    assert aot.largest_fsdp([(3, 5, 7 * 1000 + 1)], 8) == 1
    # tensors under the threshold (biases, norm scales) do not constrain the choice
    assert aot.largest_fsdp([(4096, 4096), (25,)], 16) == 16


def test_refusal_reads_the_compilers_used_and_available_bytes():
    message = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
               "Used 29.31G of 15.75G hbm. Exceeded hbm capacity by 13.56G.")
    found = aot.refusal(message)
    assert found == {"used_bytes": int(29.31 * 2**30), "hbm_bytes": int(15.75 * 2**30)}
    assert aot.refusal("Used 512.5M of 1G hbm")["used_bytes"] == int(512.5 * 2**20)
    other = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (16.16G) "
             "exceeds available HBM (15.75G).")
    assert aot.refusal(other) == {"used_bytes": int(16.16 * 2**30), "hbm_bytes": int(15.75 * 2**30)}
    assert aot.refusal("some other failure") == {}


def test_largest_collectives_orders_by_output_bytes():
    text = "\n".join([
        "  %ar = f32[128]{0} all-reduce(%fusion), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add",
        "  %ag = bf16[64,1024,512]{2,1,0} all-gather(%x), dimensions={0}",
        "  %rs = f32[32,16]{1,0} reduce-scatter(%z), dimensions={0}, to_apply=%add",
        "  %not = f32[999999]{0} add(%a, %b)",
    ])
    found = aot.largest_collectives(text, count=2)
    assert [item["bytes"] for item in found] == [64 * 1024 * 512 * 2, 32 * 16 * 4]
    assert found[0]["op"].startswith("all-gather bf16[64,1024,512]")


def _point(temp, coll, **extra):
    return {"topology": "v5e:16x16", "mesh": "data=4,fsdp=64", "temp_bytes": temp, "argument_bytes": 2**30,
            "output_bytes": 2**30, "flops": 2e12, "collective_bytes": coll,
            "collectives": {"all-gather": {"count": 3, "bytes": coll}}, **extra}


def test_table_ratios_refusals_and_kernels():
    points = {"m/gspmd/nonprivate": _point(4 * 2**30, 10**9), "m/gspmd/dp": _point(5 * 2**30, 2 * 10**9),
              "big/gspmd/dp": {"failed": "oom", "message": "Ran out of memory", "used_bytes": 3 * 2**30,
                               "hbm_bytes": 2**30, "topology": "v5e:16x16"}}
    text = aot.table(points)
    rows = {line.split("|")[1].strip() + "/" + line.split("|")[5].strip(): line for line in text.splitlines()[2:]}
    assert "| 1.25x | 2.00x |" in rows["m/dp"]
    assert "| 4.00 | 1.00 | 1.00 | 2.0 | all-gather 3, 1000 | - | - |" in rows["m/nonprivate"]
    assert "oom (needs 3.00 of 1.00 GiB)" in rows["big/dp"]
    kernels = aot.kernel_table({"gram/x": {"shapes": "bf16[1, 8, 16]", "mosaic_calls": 1, "temp_bytes": 2**20,
                                           "compile_seconds": 1.5},
                                "bad": {"shapes": "-", "failed": "error", "message": "no"}})
    assert "| gram/x | bf16[1, 8, 16] | 1 | 1.0 | 1.5 |" in kernels and "| bad | - | error: no |" in kernels


def test_buffer_table_lists_only_points_with_a_buffer_assignment():
    buffers = {"preallocated_temp_bytes": 2**30, "default_space_bytes": 2 * 2**30}
    points = {"m/gspmd/nonprivate": _point(2**30, 0, **buffers),
              "m/gspmd/dp": _point(3 * 2**30, 0, preallocated_temp_bytes=int(1.5 * 2**30),
                                   default_space_bytes=int(2.5 * 2**30)),
              "m/explicit/dp": _point(2**30, 0)}
    rows = aot.buffer_table(points).splitlines()[2:]
    assert rows == ["| m | gspmd | dp | 1.50 | 1.50x | 2.50 | 1.25x | 3.00 | 3.00x |",
                    "| m | gspmd | nonprivate | 1.00 | - | 2.00 | - | 1.00 | - |"]
    assert aot.buffer_table({"m/explicit/dp": _point(2**30, 0)}) == ""


def test_targets_table_rates_each_dp_step_against_its_strategys_non_private_step():
    import tpu_aot_tables  # beside tpu_aot.py, on the path it put there

    def point(temp_gib, step_gb):
        return {"temp_bytes": temp_gib * 2**30, "collective_bytes_per_step": step_gb * 10**9}

    points = {"gptj-6b/gspmd/nonprivate": point(2, 40), "gptj-6b/gspmd/dp": point(3, 60),
              "gptj-6b/gspmd/dp-layerwise": point(2.2, 52), "gptj-6b/explicit/nonprivate": point(4, 50),
              "gptj-6b/explicit/dp-layerwise": point(3, 50), "gptj-6b/explicit/dp": {"failed": "oom"},
              "llama2-7b/explicit/nonprivate": {"failed": "oom"}}
    rows = tpu_aot_tables.targets_table(points, {("gptj-6b", "gspmd"): "0.98 / 0.99"}).splitlines()[2:]
    assert rows == ["| GPT-J-6B shape, 256 v5e | gspmd | 2.00, 40.0 | 1.50x, 1.50x | 1.10x, 1.30x | 0.98 / 0.99 |",
                    "| GPT-J-6B shape, 256 v5e | explicit | 4.00, 50.0 | - | 0.75x, 1.00x | - |"]


def test_table_mode_needs_no_libtpu(tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"points": {"m/gspmd/nonprivate": _point(2**30, 0)}}))
    data = aot.main(["--table", "--out", str(out)])
    assert "m/gspmd/nonprivate" in data["points"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]' in a separate environment)")
def test_pallas_kernels_compile_for_a_tpu_chip(tmp_path):
    """The Mosaic TPU kernels at GPT-2 XL widths, compiled for one v5e chip in a fresh process (JAX with libtpu):
    each compiled program holds a ``tpu_custom_call`` (a kernel lowered to plain XLA would have none)."""
    out = tmp_path / "kernels.json"
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(_ROOT))
    subprocess.run([sys.executable, str(_ROOT / "experiments" / "tpu_aot.py"), "--kernels", "--out", str(out)],
                   check=True, env=env, timeout=1200)
    kernels = json.loads(out.read_text())["kernels"]
    assert len(kernels) == 3 * len(aot.KERNEL_SHAPES) + 1
    for name, result in kernels.items():
        assert "failed" not in result, (name, result)
        assert result["mosaic_calls"] >= 1, name


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]' in a separate environment)")
def test_a_table_sum_formed_in_row_chunks_peaks_below_the_whole_one(tmp_path):
    """experiments/tpu_table_sum.py --quick, in a fresh process: the embedding table's float32 sum scatter-added
    and reduce-scattered in row chunks peaks below the whole table's (the compiler keeps a whole table and its
    reduction's output), and every variant reduces with collectives."""
    out = tmp_path / "table.json"
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(_ROOT))
    subprocess.run([sys.executable, str(_ROOT / "experiments" / "tpu_table_sum.py"), "--quick", "--out", str(out)],
                   check=True, env=env, timeout=600)
    data = json.loads(out.read_text())
    peaks = {(r["variant"], r["pieces"]): r["peak_bytes"] for r in data["results"]}
    assert peaks[("chunks", 4)] < peaks[("whole", 1)]
    assert peaks[("whole", 1)] >= data["table_bytes"]
    assert all(r["collectives"] for r in data["results"])


_TABLE_PIECES = """
import json, re, sys
sys.path.insert(0, "experiments")
import planner_vs_tpu, tpu_aot
from dpzero_jax import sharding, spmd

case = planner_vs_tpu.parse_spec(sys.argv[1])
whole_table = re.compile(r"= f32\\[50257,1600\\][^ ]* (all-reduce|reduce-scatter|all-gather)")
out = {}
for name in ("pieces", "whole"):
    if name == "whole":   # the same step with the table's sum left whole (no TableSums in the GSPMD hint)
        sharding.ShardingRules.gspmd_hint = lambda self: spmd.batch_sharded(self.mesh, sharding.BATCH_AXES)
    compiled, _, _ = tpu_aot.compile_point(case, "dp-layerwise", "gspmd", "block")
    memory = compiled.memory_analysis()
    out[name] = {"temp": memory.temp_size_in_bytes, "peak": tpu_aot.peak_bytes(memory),
                 "whole_table_collectives": len(whole_table.findall(compiled.as_text()))}
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]' in a separate environment)")
def test_gspmd_sums_a_large_table_in_pieces():
    """The GSPMD step of a 2-layer GPT-2 XL on 64 v5e chips (layer-wise groups, ``fused``: its tied table
    ``[50257, 1600]`` book-kept, 0.30 GiB in float32, split on ``d``), compiled in a fresh process: with the table's
    clipped sum formed in pieces (the trainer's ``ShardingRules.gspmd_hint``) no collective moves the whole float32
    table, which the step with the sum left whole reduces, and the temporaries are lower by more than half the table.
    (The compiler's peak is not: 0.49 against 0.39 GiB on this 2-layer model, where the pieces keep the head's factors
    to the end; 0.92 against 0.99 on the 48-layer GPT-2 XL, ``docs/benchmarks/tpu_aot.md``.)"""
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
               TPU_SKIP_MDS_QUERY="1")
    run = subprocess.run([sys.executable, "-c", _TABLE_PIECES, "gpt2-xl@v5e:8x8:n_layer=2,T=1024"], check=True,
                         env=env, timeout=900, capture_output=True, text=True, cwd=_ROOT)
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["pieces"]["whole_table_collectives"] == 0 < found["whole"]["whole_table_collectives"], found
    assert found["whole"]["temp"] - found["pieces"]["temp"] > 2 * 50257 * 1600, found
