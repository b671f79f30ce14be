"""experiments/profile_step.py: kernels attributed to the Python lines that emitted them, and the benchmarks'
16-bit workloads computing in 16 bits."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))

import overhead_steps  # noqa: E402
import profile_step  # noqa: E402

import dpzero_jax as dz  # noqa: E402


def _tanh_of_product(a, b):
    return jnp.tanh(a @ b).sum()


def test_instructions_map_to_the_line_that_emitted_them():
    compiled = jax.jit(_tanh_of_product).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile()
    sources = profile_step.instruction_sources(compiled.as_text())
    line = inspect.getsourcelines(_tanh_of_product)[1] + 1            # the body's line
    here = os.path.abspath(__file__)
    emitted = {(os.path.abspath(f), n) for f, n, _ in sources.values() if f != profile_step.NO_SOURCE}
    assert (here, line) in emitted
    assert profile_step.short_file(here) == "tests/test_profile_step.py"
    assert profile_step.short_file("/x/site-packages/flax/nnx/nn/linear.py") == "flax/nnx/nn/linear.py"


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(8)(h)), None


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_the_program_front_end_keeps_the_models_source_lines(mode):
    """The traced-program front-end re-emits the model's operations (inside ``nn.scan`` and ``nn.remat`` too) under
    their own source information, so a profile or an HLO dump of the private step names the model's line."""
    model = nn.scan(nn.remat(_Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()
    x = jnp.ones((4, 5, 8))
    params = model.init(jax.random.key(0), x, None)["params"]

    def loss_fn(params, batch):
        return jnp.mean(model.apply({"params": params}, batch["x"], None)[0] ** 2, axis=(1, 2))

    dp = dz.DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, mode=mode)
    step = jax.jit(dz.private_value_and_grad(loss_fn, dp))
    sources = profile_step.instruction_sources(step.lower(params, {"x": x}, jax.random.key(0)).compile().as_text())
    line = inspect.getsourcelines(_Block.__call__)[1] + 2
    tanh = {(os.path.abspath(f), n) for f, n, op in sources.values() if op.endswith("/tanh")}
    assert tanh == {(os.path.abspath(__file__), line)}
    dots = {profile_step.short_file(f) for f, _, op in sources.values() if op.endswith("/dot_general")}
    assert "flax/linen/linear.py" in dots and "dpzero_jax/program/interpret.py" not in dots


def test_profiled_operations_are_all_attributed(tmp_path):
    fn = jax.jit(_tanh_of_product)
    args = (jnp.ones((256, 256)), jnp.ones((256, 256)))
    compiled = fn.lower(*args).compile()
    compiled(*args).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    try:
        for _ in range(2):
            compiled(*args).block_until_ready()
    finally:
        jax.profiler.stop_trace()
    ops, where = profile_step.profiled_ops(str(tmp_path), "jit__tanh_of_product")
    assert where == "host" and ops                                   # the CPU: thunk events
    sources = profile_step.instruction_sources(compiled.as_text())
    assert all(op in sources for op, _ in ops)
    assert all(seconds >= 0 for _, seconds in ops)


def test_a_bfloat16_workload_computes_in_bfloat16():
    """Casting the parameters alone leaves the bundled GPT-2 computing in float32 (Flax's Embed keeps the dtype it
    was built with); the benchmarks' 16-bit workloads pass the compute dtype."""
    workload = dataclasses.replace(overhead_steps.QUICK, dtype="bfloat16")
    params, loss_fn, batch = overhead_steps.make_workload(workload)
    params = overhead_steps.cast(params, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda p: loss_fn(p, batch).mean())(params)
    dots = collections.Counter(tuple(str(v.aval.dtype) for v in e.invars)
                               for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general")
    assert dots and set(dots) == {("bfloat16", "bfloat16")}


@pytest.mark.slow
def test_profile_step_quick_writes_its_table(tmp_path, capsys):
    out = tmp_path / "profile.json"
    profile_step.main(["--quick", "--modes", "auto", "--steps", "2", "--profile-steps", "1", "--out", str(out)])
    rows = {row["candidate"]: row for row in json.loads(out.read_text())["candidates"]}
    assert set(rows) == {"non-DP", "auto"}
    auto = rows["auto"]["profile"]["seconds_per_step_by_file"]
    assert any(name.startswith("dpzero_jax/pergrad.py") for name in auto)      # the norms and clipped sums
    assert not any(name.startswith("dpzero_jax/pergrad.py") for name in rows["non-DP"]["profile"]
                   ["seconds_per_step_by_file"])
    assert "+auto ms" in capsys.readouterr().out
