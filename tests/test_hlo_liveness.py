"""``experiments/hlo_liveness.py``: the dumped program's buffer liveness replayed with while-loop bodies included.

XLA:CPU writes the same dump files as XLA:TPU (``--xla_dump_to``, per compile through ``compiler_options``). A
scanned, rematerialised backward runs inside a ``while`` loop; the replay must see its buffers (the compiler's own
``*live-range.txt`` holds the loop as one instruction). References: ``memory_analysis()`` of the same compile --
its argument bytes exactly, and its peak between the compiler's ``peak_memory_in_bytes`` and arguments + outputs +
temporaries (XLA:CPU preallocates one buffer for all temporaries). The TPU check, the replay equal to the compiler's
peak, is in ``tests/test_planner_tpu.py`` (needs libtpu).
"""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp

_ROOT = pathlib.Path(__file__).parents[1]
_SPEC = importlib.util.spec_from_file_location("hlo_liveness", _ROOT / "experiments" / "hlo_liveness.py")
hlo_liveness = sys.modules.setdefault("hlo_liveness", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(hlo_liveness)


def step(weights, x):
    """Gradient of a 4-layer tanh MLP scanned over its ``[4, 256, 256]`` weights, each layer rematerialised."""
    def layer(carry, w):
        return jnp.tanh(carry @ w), None

    def loss(weights):
        y, _ = jax.lax.scan(jax.checkpoint(layer), x, weights)
        return (y ** 2).sum()
    return jax.grad(loss)(weights)


def test_replay_sees_the_scanned_backward(tmp_path):
    weights, x = jnp.ones((4, 256, 256)), jnp.ones((64, 256))
    compiled = jax.jit(step).lower(weights, x).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    memory = compiled.memory_analysis()
    result = hlo_liveness.replay(str(tmp_path))
    assert result.arguments == memory.argument_size_in_bytes == 4 * (4 * 256 * 256 + 64 * 256)
    total = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert memory.peak_memory_in_bytes <= result.peak_bytes <= total
    body = result.computation
    assert body != result.computation_of[result.schedule[-1]], "the peak lies inside the scan's loop body"
    report = hlo_liveness.summary(result, top=4)
    # the backward's stacked gradient of the weights, [4, 256, 256] fp32, is built in the loop and live at the peak
    assert ["f32[4,256,256]", 4 * 4 * 256 * 256] in [row[1:3] for row in report["largest"]]
    assert result.peak_within(r"region") == result.peak_at


def test_compiler_peak_lists_the_compilers_own_peak(tmp_path):
    """The compiler's own list at its peak (``*live-range.txt``): its values add up to the total it states, the
    weights argument (``f32[4, 256, 256]``, 1 MiB) is among them, and each first-level share is named by the JAX
    operation that made it (the scanned forward's ``while``)."""
    weights, x = jnp.ones((4, 256, 256)), jnp.ones((64, 256))
    jax.jit(step).lower(weights, x).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    peak = hlo_liveness.compiler_peak(str(tmp_path), module="", top=1000)
    assert sum(nbytes for _, nbytes in peak["values"]) == peak["bytes"]
    assert sum(nbytes for _, nbytes in peak["sources"]) == peak["bytes"]
    assert 4 * 4 * 256 * 256 in [nbytes for _, nbytes in peak["values"]]
    assert any(name.endswith("/while") for name, _ in peak["sources"])
