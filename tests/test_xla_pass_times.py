"""experiments/xla_pass_times.py: XLA's logged pass times summed per section of a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

EXPERIMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments")
sys.path.insert(0, EXPERIMENTS)

import xla_pass_times  # noqa: E402

_LOG = """\
I1130 00:08:22.1 hlo_pass_pipeline.cc:176] HLO pass: dce time: 500 us (500 us) (cumulative: 1 ms)
  compiling non-DP    (jax.value_and_grad(mean loss))
I1130 00:08:23.1 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 1.5 s (1.5 s) (cumulative: 2 s)
I1130 00:08:23.2 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 250 ms (250 ms) (cumulative: 2 s)
I1130 00:08:23.3 hlo_pass_pipeline.cc:176] HLO pass: dce time: 40 ns (40 ns) (cumulative: 2 s)
I1130 00:08:23.3 hlo_pass_pipeline.cc:181]   HLO pass dce
  compiling auto      (mode=auto)
I1130 00:08:24.1 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 27.25 s (27 s) (cumulative: 30 s)
  compiling auto      (again)
I1130 00:08:25.1 hlo_pass_pipeline.cc:176] HLO pass: copy-insertion time: 2 ms (2 ms) (cumulative: 30 s)
"""


def test_times_are_summed_per_pass_and_section_in_seconds():
    sections = xla_pass_times.pass_times(_LOG.splitlines())
    assert list(sections) == ["start", "non-DP", "auto", "auto'"]
    assert sections["start"] == {"dce": {"seconds": 500e-6, "calls": 1}}
    assert abs(sections["non-DP"]["priority-fusion"]["seconds"] - 1.75) < 1e-12
    assert sections["non-DP"]["priority-fusion"]["calls"] == 2
    assert sections["non-DP"]["dce"] == {"seconds": 40e-9, "calls": 1}
    assert sections["auto"] == {"priority-fusion": {"seconds": 27.25, "calls": 1}}
    assert sections["auto'"] == {"copy-insertion": {"seconds": 2e-3, "calls": 1}}
    text = xla_pass_times.table(sections, top=5)
    assert text.splitlines()[2].startswith("priority-fusion")      # the largest time in any section first


def test_a_real_xla_log_splits_at_the_markers(tmp_path):
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        print("compiling small", flush=True)
        jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile()
        print("compiling larger", flush=True)
        jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0) * 3).lower(jnp.ones((8, 8))).compile()
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)     # one stream: the markers and XLA's lines in the order written
    assert done.returncode == 0, done.stdout[-2000:]
    log = tmp_path / "run.log"
    log.write_text(done.stdout)
    out = tmp_path / "passes.json"
    assert xla_pass_times.main([str(log), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert {"small", "larger"} <= set(written["sections"])
    for name in ("small", "larger"):
        assert written["totals"][name]["calls"] > 0 and written["totals"][name]["seconds"] > 0
    assert xla_pass_times.main([str(tmp_path / "passes.json")]) == 1   # no pass lines: said, not an empty table
