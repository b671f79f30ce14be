"""Book-keeping's local sites, reduced in the backward: each example's gradient of a norm's scale or offset, a
bias, a layer scale, an added position table or a concatenated class token is formed where the site's output
gradient is produced, not from kept activations after the pullback.

A local site's per-example gradient is as small as its parameter (``B x`` its size), while its operand and output
gradient are activation-sized (``[B, T, d]`` for a LayerNorm's scale, for every layer: inside a scan, stacked
outputs of the forward and of the backward loop). Book-keeping keeps those for its other sites because a matrix's
norm and clipped sum need them; a local site needs only its own reduction, so its handler here is a
``jax.custom_vjp`` *tap* on the site's output: the forward value is the site's, the backward passes the output
gradient on unchanged (the data's cotangents stay autodiff's) and returns, as the cotangent of a zero *probe* of
the parameter's (slice's) shape, the example's gradient of the parameter
(:func:`~dpzero_jax.program.sites.base_grad`, as ghost's taps form a local site's norm). The pass then holds
``[*scan lengths, B, *parameter slice]`` per local site instead of its output gradient (the operand a scale reads
is kept, as the tap's residual; a bias keeps nothing): in a 48-layer scanned decoder of width 64 on a CPU, two
``[48, B, 1, T, 64]`` output gradients fewer a step, each a stacked output of the backward loop with its
zero-filled buffer and copies (``experiments/bench_depth.py``: the private step 1.043x -> 1.032x the non-private
one, its temporaries 166 -> 155 MiB).

Not under a ZeRO-3 ``layout`` (the sharded uses go through :func:`~dpzero_jax.program.zero3.at_use`), nor for a
site no data enters (its output is the same per example; book-keeping's probe makes it per example).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpzero_jax.program import sites as sites_lib
from dpzero_jax.program.interpret import bind_squeezing


def tapped_sites(analysis, layout) -> frozenset:
    """The paths of the sites book-keeping taps: local sites that take the example's data, without a layout."""
    if layout is not None:
        return frozenset()
    return frozenset(path for path, site in analysis.sites.items() if site.kind == "local" and not site.constant)


def probe(site) -> jax.Array:
    """A tapped site's input: a float32 zero of the parameter's (per-iteration slice's) shape, stacked over the
    enclosing scans."""
    return jnp.zeros(tuple(site.lengths) + sites_lib.base_shape(site), jnp.float32)


def tap(site, invals, site_probe) -> list:
    """The site's output through the tap (see the module doc); ``site_probe``: this example's zero of the
    parameter slice's shape, whose cotangent is the example's gradient of that slice (float32)."""
    (out,) = bind_squeezing(site.eqn, invals, site.squeeze)
    ops = [invals[i] for i in site.recorded]
    w = jax.lax.stop_gradient(invals[site.param_operand])
    # kept for the backward only where its VJP reads them: the view for a division by the parameter (not for a
    # scale or a shift), the operands for a scale (not for a bias: its gradient is the output gradient's sum)
    name = site.eqn.primitive.name
    keeps_view, keeps_ops = name not in sites_lib.VIEW_FREE_VJP, name not in sites_lib.OPERAND_FREE_VJP
    shape = tuple(site_probe.shape)

    @jax.custom_vjp
    def tapped(out, site_probe, w, ops):
        return out

    def forward(out, site_probe, w, ops):
        return out, (w if keeps_view else None, ops if keeps_ops else None)

    def backward(saved, g):
        view, kept = saved   # what the VJP does not read enters as zeros (XLA drops them unread)
        view = view if keeps_view else jnp.zeros(w.shape, w.dtype)
        kept = kept if keeps_ops else [jnp.zeros(x.shape, x.dtype) for x in ops]
        return g, sites_lib.base_grad(site, view, kept, g, shape), None, [None] * len(ops)

    tapped.defvjp(forward, backward)
    return [tapped(out, site_probe, w, ops)]


def sharing(shared_records: dict, shared_gradient: dict, tapped: frozenset) -> tuple[dict, dict]:
    """``Analysis.shared_records`` / ``shared_gradient`` for a pass with taps at ``tapped``: a tapped site keeps no
    operands and its probe's cotangent is a parameter gradient, so no site reads either from it; the first site
    that shared a tapped site's operands records them for the others."""
    gradient = {p: q for p, q in shared_gradient.items() if p not in tapped and q not in tapped}
    records, moved = {}, {}
    for path, first in sorted(shared_records.items()):
        if path in tapped:
            continue
        if first in tapped:
            if first in moved:
                records[path] = moved[first]
            else:
                moved[first] = path
        else:
            records[path] = first
    return records, gradient
