"""Evaluate a single-example jaxpr with a zero *probe* added to the output of every site and the site's data
operands recorded (the "custom interpreter" pattern of the JAX documentation).

Run inside ``jax.vmap`` (over examples) and ``jax.vjp`` (with respect to the probes), it gives book-keeping's two
ingredients per site: the operands (``records``) and the output gradient (the probes' cotangent), without any
parameter gradient by autodiff. Every other equation is bound as it is. Sub-programs that contain sites:

* ``jit`` / ``closed_call``: evaluated inline (the interpreter enters them; custom-derivative functions are not
  entered: they are sites or bound as they are);
* ``remat``: re-emitted as ``jax.checkpoint`` with its policy around the interpreted body (probes in, records out);
* ``scan``: re-emitted as ``lax.scan`` over the interpreted body, never unrolled: the sites' probes are extra
  scanned inputs and their records extra stacked outputs (leading axis: the iteration).

Parameters given as ZeRO-3 shards are held as :class:`~dpzero_jax.program.zero3.Deferred` values and gathered at
each use (:mod:`dpzero_jax.program.zero3`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend import source_info_util

from dpzero_jax.program import unit_axis, zero3
from dpzero_jax.program.analyze import CALLS, REMAT, Analysis, _sub_jaxpr

INLINED = CALLS - REMAT   # the call primitives (jit, closed_call) the unit-axis squeeze enters where they hold no site


def bind(eqn, invals, params: dict | None = None) -> list:
    """Apply one equation to values (what ``jax.core.eval_jaxpr`` does for it), under the equation's own source
    information: the user's traceback and name stack (e.g. ``Block_0/Dense_0``), so that the re-emitted operation's
    XLA metadata -- and so profiles, HLO dumps and errors -- name the model's line, not the interpreter's.
    ``params``: other parameters than the equation's (:mod:`~dpzero_jax.program.unit_axis`)."""
    params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _under(probes: dict, path: tuple) -> dict:
    return {p: v for p, v in probes.items() if p[:len(path)] == path and len(p) > len(path)}


def bind_squeezing(eqn, invals, squeeze: bool) -> list:
    """:func:`bind`, with ``squeeze`` computed on the operands without their leading unit axis where
    :func:`~dpzero_jax.program.unit_axis.rule` applies (outputs given it back): a site's equation, whose operands
    and output the handlers read whole, still differentiates as the plain equations around it."""
    how = squeeze and unit_axis.rule(eqn)
    if not how:
        return bind(eqn, invals)
    _, dropped, params = how
    outs = bind(eqn, [unit_axis.drop(x, n) for x, n in zip(invals, dropped)], params)
    return [unit_axis.restore(out, var.aval.shape) for out, var in zip(outs, eqn.outvars)]


def add_probe(site, invals, probe, records: dict) -> list:
    """Book-keeping's handling of a site: its output plus the zero probe; its data operands recorded."""
    (out,) = bind_squeezing(site.eqn, invals, site.squeeze)
    # Behind a barrier, a record is the value the forward computed, kept as it is: without it XLA may fuse the
    # operand's producer (e.g. a GELU) into every consumer of the record -- the transposing copy that feeds the
    # clipped sum's contraction recomputed GPT-2's MLP activation from its input (W1 of the CPU overhead benchmark:
    # the step 1.037x -> 1.024x its non-private step, temporaries 328 -> 310 MiB).
    records[site.path] = list(jax.lax.optimization_barrier([invals[i] for i in site.recorded]))
    return [out + probe.astype(out.dtype)]


def run(jaxpr, consts, args, analysis: Analysis, probes: dict, records: dict, path: tuple = (),
        handler=add_probe) -> list:
    """Evaluate ``jaxpr``. At a site, ``handler(site, operand values, probes[site path], records)`` gives the outputs
    (default :func:`add_probe`: the probe added to the output, ``records[site path]`` the recorded operands).
    ``probes`` holds one input per site (a probe, a sink, a scale: whatever the handler takes), stacked over the
    iterations of the enclosing scans."""
    env = {}
    squeezed = {}   # var -> (value, k): kept without its first k (unit) axes (unit_axis), made whole when read

    def read(v):
        if isinstance(v, jcore.Literal):
            return v.val
        if v not in env:
            env[v] = unit_axis.restore(squeezed[v][0], v.aval.shape)
        return env[v]

    def lookup(v):   # a variable of this (sub-)program, or None (a view's chain may start in an enclosing one)
        return read(v) if v in env or v in squeezed else None

    def read_dropped(v, n: int):
        if n and v in squeezed and squeezed[v][1] == n:
            return squeezed[v][0]
        return unit_axis.drop(read(v), n)

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for index, eqn in enumerate(jaxpr.eqns):
        here = path + (index,)
        squeezing = (analysis.squeeze_unit_axis and here not in analysis.sites and here not in analysis.containers
                     and unit_axis.rule(eqn))
        if squeezing and not zero3.holds_deferred([env.get(v) for v in eqn.invars if not isinstance(v, jcore.Literal)]):
            k, dropped, params = squeezing
            invals = [read_dropped(v, n) for v, n in zip(eqn.invars, dropped)]
            for var, value in zip(eqn.outvars, bind(eqn, invals, params)):
                if not isinstance(var, jcore.DropVar):
                    squeezed[var] = (value, k)
            continue
        invals = [read(v) for v in eqn.invars]
        site = analysis.sites.get(here)
        sharded = zero3.holds_deferred(invals) or (site is not None and zero3.holds_deferred(probes[here]))
        if site is not None:
            if sharded:
                state = getattr(handler, "state", None)
                outs, inner, state_out = zero3.at_use(_handled(handler, site, state), invals, probes[here],
                                                      dict(state or {}), _float32_deferred(handler, site, invals))
                records.update(inner)
                if state is not None:
                    state.clear()
                    state.update(state_out)
            elif getattr(handler, "float32_views", False):
                outs = handler(site, invals, probes[here], records, view32=_float32_view(site, invals, lookup))
            else:
                outs = handler(site, invals, probes[here], records)
        elif here in analysis.containers:
            outs = _enter(eqn, invals, analysis, _under(probes, here), records, here, handler)
        elif analysis.squeeze_unit_axis and _inlinable(eqn) and not sharded:
            # a jit without sites (log_softmax, an attention function): inlined, so its equations are squeezed too
            sub, consts = _sub_jaxpr(eqn)
            outs = run(sub, consts, invals, analysis, {}, records, here, handler)
        elif sharded:
            outs = zero3.defer(eqn, invals, bind) or zero3.at_use(functools.partial(bind, eqn), invals)
        else:
            outs = bind(eqn, invals)
        for var, value in zip(eqn.outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = value
    return [zero3.materialise(read(v)) for v in jaxpr.outvars]


def _float32_view(site, invals, read):
    """For a handler with ``float32_views`` (ghost's and fused mode's weight paths): the site's view replayed in
    float32 from the leaf or slice its chain starts from (:func:`~dpzero_jax.program.sites.float32_view`), or None.
    A view gathered at its use from ZeRO-3 shards takes :func:`_float32_deferred` instead."""
    from dpzero_jax.program import sites as sites_lib  # sites imports this module

    chain = site.view.chain
    if not chain or isinstance(chain[0].invars[0], jcore.Literal):
        return None
    base = read(chain[0].invars[0])
    if base is None or zero3.holds_deferred([base]):
        return None
    return sites_lib.float32_view(site, invals[site.param_operand], base)


def _inlinable(eqn) -> bool:
    """A call without shardings or layouts of its own (a ``jax.jit`` that fixes them is left a jit: inlined, its
    partitioning would be the caller's)."""
    if eqn.primitive.name not in INLINED:
        return False
    params = eqn.params
    shardings = tuple(params.get("in_shardings", ())) + tuple(params.get("out_shardings", ()))
    layouts = tuple(params.get("in_layouts", ())) + tuple(params.get("out_layouts", ()))
    return (all(type(s).__name__ == "UnspecifiedValue" for s in shardings)   # jax's marker for "not given"
            and all(layout is None for layout in layouts))


def _float32_deferred(handler, site, invals):
    """For a handler with ``float32_views``, a site whose view is gathered from ZeRO-3 shards cast to half precision
    before the gather: the same view gathered without the cast (a :class:`~dpzero_jax.program.zero3.Deferred` in
    float32), else None. Only the weight path's transpose reads it: its forward gather is dead code, and its
    cotangent is reduce-scattered to the float32 shard."""
    w = invals[site.param_operand]
    if (not getattr(handler, "float32_views", False) or not isinstance(w, zero3.Deferred)
            or all(c is None for c in w.casts)):
        return None
    return zero3.Deferred(w.shards, w.dims, w.fn)


def _handled(handler, site, state: dict | None):
    """The site's handler as a pure function of its operand values, site input, the handler's ``state`` (arrays
    one site leaves for another, e.g. fused mode's links; None: no state) and the float32 view
    (:func:`_float32_deferred` made whole, or None): ``(outputs, records, state after)``."""
    def use(values, site_input, state_in, view32=None):
        if state is not None:
            state.clear()
            state.update(state_in)
        inner: dict = {}
        w = values[site.param_operand]
        if view32 is not None and (view32.dtype != jnp.float32 or w.dtype == jnp.float32):
            view32 = None
        if getattr(handler, "float32_views", False):
            outs = handler(site, values, site_input, inner, view32=view32)
        else:
            outs = handler(site, values, site_input, inner)
        return outs, inner, dict(state or {})
    return use


def _enter(eqn, invals, analysis: Analysis, probes: dict, records: dict, here: tuple, handler) -> list:
    name = eqn.primitive.name
    if name == "scan":
        return _scan(eqn, invals, analysis, probes, records, here, handler)
    sub, consts = _sub_jaxpr(eqn)
    if name in REMAT:
        def body(args, sub_probes):
            inner: dict = {}
            outs = run(sub, consts, args, analysis, sub_probes, inner, here, handler)
            return outs, inner

        rematerialised = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                                        policy=eqn.params.get("policy"))
        outs, inner = rematerialised(invals, probes)
        records.update(inner)
        return outs
    return run(sub, consts, invals, analysis, probes, records, here, handler)


def _scan(eqn, invals, analysis: Analysis, probes: dict, records: dict, here: tuple, handler) -> list:
    params = eqn.params
    body = params["jaxpr"]
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, carry, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
    carry = [zero3.materialise(v) for v in carry]
    # ZeRO-3 shards of stacked leaves (scanned inputs, or site inputs stacked over the iterations) are sliced by
    # the scan: each iteration gathers its slice; other deferred scanned values are made whole first
    scanned_in, rebuild = zero3.for_scan((list(xs), probes))

    def step(carry, scanned):
        x_slices, probe_slices = rebuild(scanned)
        inner: dict = {}
        outs = run(body.jaxpr, body.consts, list(consts) + list(carry) + list(x_slices), analysis, probe_slices,
                   inner, here, handler)
        return outs[:n_carry], (outs[n_carry:], inner)

    carry_out, (ys, inner) = jax.lax.scan(step, list(carry), scanned_in, length=params["length"],
                                          reverse=params["reverse"], unroll=params["unroll"])
    records.update(inner)
    return list(carry_out) + list(ys)
