"""experiments/hlo_text.py: collectives per executed step -- loop trip counts read from the compiled program text.

References are the programs' own structure: a scan of length L around one ``psum`` runs it L times; nested scans
multiply. The TPU compiler records no ``known_trip_count`` (XLA:CPU does), so every CPU program is also read with
that annotation removed, as the TPU prints it, and must give the same counts from the loops' conditions alone."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import experiment_module
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

hlo = experiment_module("hlo_text")


def _without_known_trip_counts(text: str) -> str:
    stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    assert "known_trip_count" not in stripped
    return stripped


def _mesh():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py asks for 8 virtual CPU devices)")
    return Mesh(np.array(devices[:4]), ("data",))


def _compiled_text(local, *shapes):
    mesh = _mesh()
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=tuple(P("data") for _ in shapes), out_specs=P(),
                              check_vma=False))
    return f.lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()


@pytest.mark.parametrize("annotated", [True, False], ids=["known-trip-count", "from-the-condition"])
def test_a_psum_in_a_scan_runs_once_per_iteration(annotated):
    length, width = 6, 32

    def local(x, w):             # x: f32[1, width] per device, w: f32[length, width] per device
        def body(h, w_i):
            return jnp.tanh(jax.lax.psum(h * w_i, "data")), None
        return jax.lax.psum(jax.lax.scan(body, x[0], w)[0], "data")

    text = _compiled_text(local, (4, width), (4 * length, width))
    if not annotated:
        text = _without_known_trip_counts(text)
    static = hlo.parse_collectives(text)["all-reduce"]
    executed = hlo.parse_collectives(text, executed=True)["all-reduce"]
    assert hlo.loop_trip_counts(text) == [length]
    assert static == {"count": 2, "bytes": 2 * width * 4}                 # one in the body, one after the loop
    assert executed == {"count": length + 1, "bytes": (length + 1) * width * 4}
    assert hlo.multiplicities(text)[1] == []


@pytest.mark.parametrize("annotated", [True, False], ids=["known-trip-count", "from-the-condition"])
def test_nested_scans_multiply(annotated):
    outer, inner, width = 4, 3, 16

    def local(x, w):             # w: f32[outer, inner, width] per device
        def inner_body(h, w_ij):
            return jax.lax.psum(h * w_ij, "data"), None

        def outer_body(h, w_i):
            h = jax.lax.scan(inner_body, h, w_i)[0]
            return jnp.sin(jax.lax.all_gather(h, "data", tiled=True)[:width]), None
        return jax.lax.scan(outer_body, x[0], w)[0]

    text = _compiled_text(local, (4, width), (4 * outer, inner, width))
    if not annotated:
        text = _without_known_trip_counts(text)
    executed = hlo.parse_collectives(text, executed=True)
    assert sorted(hlo.loop_trip_counts(text)) == [inner, outer]
    assert executed["all-reduce"] == {"count": outer * inner, "bytes": outer * inner * width * 4}
    assert executed["all-gather"] == {"count": outer, "bytes": outer * 4 * width * 4}


def test_a_loop_with_a_data_dependent_bound_is_counted_once_and_reported():
    def local(x, n):
        def cond(carry):
            return carry[0] < carry[2]

        def body(carry):
            i, h, bound = carry
            return i + 1, jax.lax.psum(h, "data") * 0.5, bound
        steps = jnp.minimum(n[0, 0], 5.0).astype(jnp.int32)
        return jax.lax.while_loop(cond, body, (jnp.int32(0), x[0], steps))[1]

    text = _compiled_text(local, (4, 8), (4, 1))
    assert hlo.loop_trip_counts(text) == [None]
    counts, unknown = hlo.multiplicities(text)
    assert len(unknown) == 1
    assert hlo.parse_collectives(text, executed=True)["all-reduce"]["count"] == 1


def test_tpu_style_loop_read_from_its_condition():
    """The shape of a TPU program's layer scan (no ``known_trip_count``; the counter compared with a constant, its
    start a constant in the operand tuple, the body adding 1), its all-gather split over three async fusions."""
    text = "\n".join([
        "HloModule jit_step",
        "",
        "%async_collective_fusion.1 (p: bf16[100]) -> bf16[6400] {",
        "  %p = bf16[100]{0} parameter(0)",
        "  ROOT %all-gather.9 = bf16[6400]{0} all-gather(%p), channel_id=7, dimensions={0}",
        "}",
        "",
        "%start_computation (p.1: bf16[100]) -> bf16[6400] {",
        "  %p.1 = bf16[100]{0} parameter(0)",
        "  ROOT %all-gather.8 = bf16[6400]{0} all-gather(%p.1), channel_id=7, dimensions={0}",
        "}",
        "",
        "%body (param: (s32[], bf16[100])) -> (s32[], bf16[100]) {",
        "  %param = (s32[]{:T(128)}, bf16[100]{0}) parameter(0)",
        "  %gte.0 = s32[]{:T(128)} get-tuple-element(%param), index=0",
        "  %gte.1 = bf16[100]{0} get-tuple-element(%param), index=1",
        "  %async-collective-start.3 = bf16[6400]{0} fusion(%gte.1), kind=kCustom, calls=%start_computation",
        "  %async-collective-done.3 = bf16[6400]{0} fusion(%async-collective-start.3), kind=kCustom, "
        "calls=%async_collective_fusion.1",
        "  %one = s32[]{:T(128)} constant(1)",
        "  %next = s32[]{:T(128)} add(%gte.0, %one)",
        "  %ar = f32[8]{0} all-reduce(%gte.1), channel_id=8, to_apply=%add",
        "  ROOT %tuple.5 = (s32[]{:T(128)}, bf16[100]{0}) tuple(%next, %gte.1)",
        "}",
        "",
        "%cond (param.2: (s32[], bf16[100])) -> pred[] {",
        "  %constant.969 = s32[]{:T(128)} constant(48)",
        "  %param.2 = (s32[]{:T(128)}, bf16[100]{0}) parameter(0)",
        "  %gte.2 = s32[]{:T(128)} get-tuple-element(%param.2), index=0",
        "  ROOT %lt.74 = pred[]{:T(512)} compare(%gte.2, %constant.969), direction=LT",
        "}",
        "",
        "ENTRY %main (x: bf16[100]) -> (s32[], bf16[100]) {",
        "  %x = bf16[100]{0} parameter(0)",
        "  %zero = s32[]{:T(128)} constant(0)",
        "  %tuple.1 = (s32[]{:T(128)}, bf16[100]{0}) tuple(%zero, %x)",
        "  ROOT %while.63 = (s32[]{:T(128)}, bf16[100]{0}) while(%tuple.1), condition=%cond, body=%body",
        "}",
    ])
    assert hlo.loop_trip_counts(text) == [48]
    executed = hlo.parse_collectives(text, executed=True)
    assert executed["all-gather"] == {"count": 48, "bytes": 48 * 6400 * 2}
    assert executed["all-reduce"] == {"count": 48, "bytes": 48 * 8 * 4}
    # a counter starting at 2 (a peeled iteration) runs 46 times; a step of 2 is not read
    assert hlo.loop_trip_counts(text.replace("constant(0)", "constant(2)")) == [46]
    assert hlo.loop_trip_counts(text.replace("%one = s32[]{:T(128)} constant(1)",
                                             "%one = s32[]{:T(128)} constant(2)")) == [None]


@pytest.mark.parametrize("annotated", [True, False], ids=["known-trip-count", "from-the-condition"])
def test_matmul_flops_count_a_scanned_layer_once_per_layer(annotated):
    """The gradient of L scanned ``h @ W_l`` layers (B x d by d x d) does three such products per layer (forward,
    input cotangent, weight gradient): ``3 * 2 B d^2 L`` FLOPs executed; the static text holds each product once. A
    convolution contracts its kernel's window and input features: ``2 * output elements * kh * kw * c_in`` without
    padding; with "SAME" padding only the taps on the image count (a 3-tap window over 8 positions: 8 * 3 - 2 = 22
    real taps per spatial axis)."""
    batch, width, layers = 4, 16, 5

    def loss(x, w):
        return jax.lax.scan(lambda h, w_l: (jnp.tanh(h @ w_l), None), x, w)[0].sum()

    text = jax.jit(jax.grad(loss, argnums=1)).lower(jnp.ones((batch, width)),
                                                     jnp.ones((layers, width, width))).compile().as_text()
    if not annotated:
        text = _without_known_trip_counts(text)
    assert hlo.matmul_flops(text) == 3 * 2 * batch * width * width * layers
    assert hlo.matmul_flops(text, executed=False) == 3 * 2 * batch * width * width

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    text = jax.jit(conv).lower(jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 5))).compile().as_text()
    assert hlo.matmul_flops(text) == 2 * (2 * 6 * 6 * 5) * (3 * 3 * 3)

    def same_conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    text = jax.jit(same_conv).lower(jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 5))).compile().as_text()
    assert hlo.matmul_flops(text) == 2 * 2 * 5 * 3 * (8 * 3 - 2) ** 2
