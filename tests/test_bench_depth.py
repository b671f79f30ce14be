"""Smoke tests of the depth and front-end benchmarks (slow: each compiles several DP steps)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))


@pytest.mark.slow
def test_bench_depth_quick_writes_its_table(tmp_path, capsys):
    import bench_depth

    out = tmp_path / "depth.json"
    bench_depth.main(["--quick", "--unrolled", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    layouts = {(row["layout"], row["layers"]) for row in result["rows"]}
    assert {("scan", 2), ("scan", 4), ("scan+remat", 2), ("unrolled", 2)} <= layouts
    remat = next(row for row in result["rows"] if row["layout"] == "scan+remat")
    assert remat["temp_ghost_bytes"] < remat["temp_bk_bytes"]      # ghost keeps no operands inside remat blocks
    assert remat["temp_dp_bytes"] == remat["temp_ghost_bytes"]     # auto picks ghost there
    assert all(0 < row["noise_ratio_paired"] < row["step_ratio_paired"] for row in result["rows"])
    assert all(0 < row["compile_noise_ratio"] < row["compile_ratio"] for row in result["rows"])
    assert "compiles in" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_front_ends_quick_writes_its_table(tmp_path):
    import bench_front_ends

    out = tmp_path / "front_ends.json"
    bench_front_ends.main(["--quick", "--rounds", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"non-DP", "program bk", "program ghost", "dz.layers non-DP", "dz.layers layers bk",
                         "dz.layers layers ghost", "dz.layers program bk", "dz.layers program ghost"}
    assert all(row["step_s"] > 0 and row["flops"] > 0 for row in rows.values())
    assert {row["baseline"] for name, row in rows.items() if name.startswith("dz.layers")} == {"dz.layers non-DP"}
    assert {row["baseline"] for name, row in rows.items() if not name.startswith("dz.layers")} == {"non-DP"}


@pytest.mark.slow
def test_bench_front_ends_quick_vit_writes_its_table(tmp_path):
    import bench_front_ends

    out = tmp_path / "front_ends_vit.json"
    bench_front_ends.main(["--model", "vit", "--quick", "--rounds", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {f"{layers} {mode}" for layers in ("flax", "dz.layers")
                         for mode in ("non-DP", "auto", "bk", "ghost", "vmap")} | {"dz.layers program bk"}
    assert all(row["step_s"] > 0 and row["flops"] > 0 for row in rows.values())
    assert rows["flax bk"]["baseline"] == "flax non-DP" and rows["dz.layers bk"]["baseline"] == "dz.layers non-DP"
