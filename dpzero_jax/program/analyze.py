"""Where the trainable leaves meet per-example data in a traced program: the *sites* of the program front-end.

The front-end traces the single-example loss ``loss_i(params, example) -> []`` (the user's batched loss on a batch
of one) and classifies every value of the jaxpr:

* ``DATA``  -- depends on the example;
* ``CONST`` -- depends on neither the example nor a trainable leaf (literals, iota, frozen weights);
* :class:`View` -- a linear function of one trainable leaf through *structural* operations (dtype casts, reshapes,
  transposes, broadcasts, slices, ...) whose other operands are literals; ``bijective`` when only norm-preserving
  ones were applied (casts, reshapes, transposes);
* :class:`Mixed` -- depends on trainable leaves (and maybe constants) in any other way (e.g. ``A @ B`` of two
  leaves, a LoRA-merged weight).

An equation that combines a :class:`View` with ``DATA`` is a :class:`Site`, one of

* ``"dot"``    -- ``dot_general`` with a bijective view on one side (dense, einsum, per-head projections, the tied
  head ``x @ table.T``): the per-example gradient is a sum of outer products (``pergrad.Outer``), blockwise over the
  dot's batch dimensions;
* ``"conv"``   -- ``conv_general_dilated`` with a bijective view as the kernel (any strides, padding, dilations,
  dimension numbers, feature groups; ``batch_group_count == 1``): ``Outer`` of the unfolded input patches and the
  output gradient, blockwise over the feature groups (:mod:`dpzero_jax.program.conv`);
* ``"gather"`` -- a row lookup ``table[ids]`` of a bijective view (``jnp.take(table, ids, axis=0)``, ``nnx.Embed``):
  ``Outer`` with integer ids;
* ``"local"``  -- any other primitive (scale and shift with broadcasting, other convolutions, concatenation of a
  class token, ...): the per-example gradient of the view is the local VJP of that one equation at the example's
  operands, instantiated (``B x`` the view's size) and mapped back to the leaf through the view's VJP.

A row lookup ``table[idx]`` (``gather`` / ``dynamic_slice``) of a view at *constant* indices -- a position table
``wpe[jnp.arange(T)]`` -- is a site too (``gather`` or ``local``), although no data enters it: its output is then
treated as data, so its uses downstream are tracked by the probe's cotangent.

A leaf that reaches the data through a :class:`Mixed` value, a loop carry, a ``while``/``cond``, a custom-VJP
function or a scan slice of a non-elementwise view is a *fallback* leaf: its per-example gradient is computed by
autodiff of the single-example loss with respect to that leaf (exact; ``B x`` its size). No parameter is refused.

Sub-programs: ``jit`` / ``closed_call`` / ``remat`` are entered (a site inside keeps its
place, keyed by the path of equation indices); ``scan`` is entered with its body's inputs classified (a leaf
passed as a scanned input is sliced per iteration: *stacked*, ``level "xs"``; passed as a constant it is the same
at every iteration: ``level "const"``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.extend import core as jcore

from dpzero_jax.program import conv

DATA = "data"
CONST = "const"

# Linear single-leaf operations whose other operands must be literals. Bijective ones preserve norms.
BIJECTIVE = frozenset({"convert_element_type", "reshape", "transpose", "copy", "copy_p", "squeeze", "expand_dims"})
STRUCTURAL = BIJECTIVE | frozenset({"broadcast_in_dim", "slice", "rev", "pad", "neg", "reduce_precision"})
ELEMENTWISE = frozenset({"convert_element_type", "copy", "copy_p"})  # commute with slicing a stacked leaf
# Entered. A ``custom_jvp_call`` / ``custom_vjp_call`` is not: its custom derivative (a straight-through estimator,
# a stable softmax) must be kept, so it is one opaque operation -- a local site, or a fallback.
REMAT = frozenset({"remat2", "checkpoint"})
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"}) | REMAT


@dataclasses.dataclass(frozen=True)
class View:
    """A linear view of trainable leaf ``leaf`` (flatten index): ``chain`` of equations applied to it (to the
    per-iteration slice for stacked leaves); ``levels``: for each enclosing scan (outermost first) ``"xs"`` if the
    leaf was sliced by it, ``"const"`` if passed whole."""

    leaf: int
    chain: tuple = ()
    bijective: bool = True
    levels: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Mixed:
    leaves: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Site:
    """One use of a trainable leaf: equation ``eqn`` at ``path`` combines ``view`` (operand ``param_operand``) with
    data. ``recorded``: the operand indices whose values the engine keeps (data and non-literal constants);
    ``lengths``: the lengths of the enclosing scans (outermost first)."""

    path: tuple
    kind: str            # "dot" | "conv" | "gather" | "local"
    eqn: Any
    param_operand: int
    view: View
    recorded: tuple[int, ...]
    lengths: tuple[int, ...]
    constant: bool = False   # no data enters it (a lookup at constant indices): its output is the same per example
    squeeze: bool = False    # its equation computed without the leading unit axes (program.unit_axis; a CPU target)

    @property
    def out_aval(self):
        return self.eqn.outvars[0].aval


@dataclasses.dataclass
class Analysis:
    """The sites (by path), the fallback leaves and the paths of sub-programs that contain sites."""

    sites: dict = dataclasses.field(default_factory=dict)
    fallback: set = dataclasses.field(default_factory=set)
    containers: set = dataclasses.field(default_factory=set)
    reasons: dict = dataclasses.field(default_factory=dict)   # fallback leaf -> first reason
    primitives: dict = dataclasses.field(default_factory=dict)  # path of an entered sub-program -> its primitive
    # site -> an earlier site of the same sub-program whose recorded operands are the same values (the query, key and
    # value projections of one input), or whose output gradient is the same value (see :func:`_shared`)
    shared_records: dict = dataclasses.field(default_factory=dict)
    shared_gradient: dict = dataclasses.field(default_factory=dict)
    # evaluate with per-example values' leading unit axis removed where program.unit_axis can (a CPU target)
    squeeze_unit_axis: bool = False

    def mark_fallback(self, leaves, reason: str) -> None:
        for leaf in leaves:
            self.fallback.add(leaf)
            self.reasons.setdefault(leaf, reason)

    def finish(self) -> Analysis:
        """Drop the sites of fallback leaves (their gradient comes from autodiff) and recompute the containers."""
        self.sites = {p: s for p, s in self.sites.items() if s.view.leaf not in self.fallback}
        self.containers = {p[:k] for p in self.sites for k in range(1, len(p))}
        for shared in (self.shared_records, self.shared_gradient):
            kept = {p: q for p, q in shared.items() if p in self.sites and q in self.sites}
            shared.clear()
            shared.update(kept)
        return self

    @property
    def rematerialised(self) -> bool:
        """Whether some site lies inside a ``jax.checkpoint`` (remat) region."""
        return any(self.primitives.get(p) in REMAT for p in self.containers)

    def in_remat(self, path: tuple) -> bool:
        """Whether the equation at ``path`` lies inside a ``jax.checkpoint`` (remat) region."""
        return any(self.primitives.get(path[:k]) in REMAT for k in range(1, len(path)))


def _leaves(kind) -> frozenset[int]:
    if isinstance(kind, View):
        return frozenset({kind.leaf})
    if isinstance(kind, Mixed):
        return kind.leaves
    return frozenset()


def _is_param(kind) -> bool:
    return isinstance(kind, (View, Mixed))


def _join(kinds) -> Any:
    """The kind of a value computed from ``kinds`` by an unrecognised operation."""
    if any(k == DATA for k in kinds):
        return DATA
    leaves = frozenset().union(*(_leaves(k) for k in kinds))
    return Mixed(leaves) if leaves else CONST


def _is_row_gather(eqn, operand_shape) -> bool:
    """``table[ids]`` along axis 0 (how ``jnp.take(table, ids, axis=0)`` lowers), ids in bounds or dropped."""
    dims = eqn.params["dimension_numbers"]
    mode = str(eqn.params.get("mode", ""))
    rank = len(operand_shape)
    out_rank = len(eqn.outvars[0].aval.shape)
    return (tuple(dims.collapsed_slice_dims) == (0,) and tuple(dims.start_index_map) == (0,)
            and not tuple(getattr(dims, "operand_batching_dims", ())) and rank >= 1
            and tuple(eqn.params["slice_sizes"]) == (1,) + tuple(operand_shape[1:])
            and tuple(dims.offset_dims) == tuple(range(out_rank - rank + 1, out_rank))
            and ("FILL_OR_DROP" in mode or "PROMISE_IN_BOUNDS" in mode))


def _sub_jaxpr(eqn):
    """``(jaxpr, consts)`` of a call-like equation."""
    params = eqn.params
    for name in ("jaxpr", "call_jaxpr"):
        if name in params:
            sub = params[name]
            if isinstance(sub, jcore.ClosedJaxpr):
                return sub.jaxpr, sub.consts
            return sub, ()
    raise KeyError(eqn.primitive.name)


def analyze(jaxpr, in_kinds, analysis: Analysis, path: tuple = (), lengths: tuple = ()) -> list:
    """Classify the values of ``jaxpr`` given its inputs' kinds; record sites and fallback leaves in ``analysis``.
    Returns the kinds of its outputs."""
    env: dict = {}

    def read(v):
        if isinstance(v, jcore.Literal):
            return CONST
        return env.get(v, CONST)

    for var in jaxpr.constvars:
        env[var] = CONST
    for var, kind in zip(jaxpr.invars, in_kinds):
        env[var] = kind
    for index, eqn in enumerate(jaxpr.eqns):
        here = path + (index,)
        kinds = [read(v) for v in eqn.invars]
        outs = _classify(eqn, kinds, analysis, here, lengths)
        for var, kind in zip(eqn.outvars, outs):
            env[var] = kind
    _shared(jaxpr, analysis, path)
    return [read(v) for v in jaxpr.outvars]


def _shared(jaxpr, analysis: Analysis, path: tuple) -> None:
    """Record the sites of this (sub-)program that repeat an earlier site's values, so that book-keeping keeps
    each value once (inside a scan every kept value is a stacked output of its own):

    * ``shared_records``: the same recorded operands (one input to the query, key and value projections);
    * ``shared_gradient``: a shift ``x + b`` (a bias, a norm's offset) whose data operand ``x`` is the output of
      another site used by nothing else and of the shift's shape: the shift passes its output gradient to ``x``
      unchanged, so both sites' output gradients are one value.
    """
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            uses[v] = uses.get(v, 0) + 1
    recorded_by: dict = {}
    produced_by: dict = {}
    for index, eqn in enumerate(jaxpr.eqns):
        here = path + (index,)
        site = analysis.sites.get(here)
        if site is None:
            continue
        operands = tuple(eqn.invars[i] for i in site.recorded)
        if operands and operands in recorded_by:
            analysis.shared_records[here] = recorded_by[operands]
        elif operands:
            recorded_by[operands] = here
        if site.kind == "local" and eqn.primitive.name in ("add", "add_any") and len(eqn.invars) == 2:
            data = eqn.invars[1 - site.param_operand]
            if (not isinstance(data, jcore.Literal) and data in produced_by and uses.get(data) == 1
                    and tuple(data.aval.shape) == tuple(eqn.outvars[0].aval.shape)):
                analysis.shared_gradient[here] = produced_by[data]
        produced_by[eqn.outvars[0]] = here


def _classify(eqn, kinds, analysis: Analysis, here: tuple, lengths: tuple) -> list:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    params_in = [k for k in kinds if _is_param(k)]
    if not params_in:
        return [_join(kinds)] * n_out
    if name == "stop_gradient":  # no gradient flows back through it: parameters become constants
        return [DATA if kinds[0] == DATA else CONST]
    if name == "scan":
        analysis.primitives[here] = name
        return _classify_scan(eqn, kinds, analysis, here, lengths)
    if name in CALLS:
        analysis.primitives[here] = name
        sub, _ = _sub_jaxpr(eqn)
        return analyze(sub, kinds, analysis, here, lengths)
    has_data = any(k == DATA for k in kinds)
    if not has_data and _constant_lookup(name, kinds, n_out):
        # ``table[jnp.arange(T)]`` (a position table): a site with constant indices. Its output is treated as the
        # example's from here on; the probe's cotangent is each example's gradient with respect to it.
        view = kinds[0]
        kind = "gather" if (name == "gather" and view.bijective
                            and _is_row_gather(eqn, eqn.invars[0].aval.shape)) else "local"
        recorded = tuple(i for i, v in enumerate(eqn.invars) if i != 0 and not isinstance(v, jcore.Literal))
        analysis.sites[here] = Site(here, kind, eqn, 0, view, recorded, lengths, constant=True)
        return [DATA]
    if not has_data:
        return [_param_only(eqn, kinds)] * n_out
    # Data meets trainable leaves: a site when exactly one operand is a view and the others are data or constants.
    views = [i for i, k in enumerate(kinds) if isinstance(k, View)]
    if len(params_in) == 1 and len(views) == 1 and n_out == 1 and name not in ("while", "cond"):
        p = views[0]
        view = kinds[p]
        kind = "local"
        if name == "dot_general" and view.bijective:
            kind = "dot"
        elif view.bijective and conv.supported(eqn, p):
            kind = "conv"
        elif name == "gather" and p == 0 and view.bijective and _is_row_gather(eqn, eqn.invars[0].aval.shape):
            kind = "gather"
        recorded = tuple(i for i, v in enumerate(eqn.invars) if i != p and not isinstance(v, jcore.Literal))
        analysis.sites[here] = Site(here, kind, eqn, p, view, recorded, lengths)
        return [DATA]
    if len(params_in) > 1:
        reason = f"'{name}' combines it with other parameters and the example's data"
    elif isinstance(params_in[0], Mixed):
        reason = (f"reaches the example's data ('{name}') through a non-structural function of parameters "
                  "(e.g. a product of two parameters)")
    else:
        reason = f"used by '{name}', which has no per-example rule"
    analysis.mark_fallback(frozenset().union(*(_leaves(k) for k in params_in)), reason)
    return [DATA] * n_out


def _constant_lookup(name: str, kinds, n_out: int) -> bool:
    """A ``gather`` / ``dynamic_slice`` of a view at constant indices (literals, or values computed from them)."""
    return (name in ("gather", "dynamic_slice") and n_out == 1 and isinstance(kinds[0], View)
            and all(k == CONST for k in kinds[1:]))


def _param_only(eqn, kinds):
    """The kind of an equation on trainable leaves and constants only."""
    views = [i for i, k in enumerate(kinds) if isinstance(k, View)]
    others_literal = all(isinstance(v, jcore.Literal) for i, v in enumerate(eqn.invars) if i not in views)
    name = eqn.primitive.name
    if len(views) == 1 and len(kinds) >= 1 and others_literal and name in STRUCTURAL and len(eqn.outvars) == 1:
        view = kinds[views[0]]
        if views[0] == 0:
            return dataclasses.replace(view, chain=view.chain + (eqn,), bijective=view.bijective and name in BIJECTIVE)
    return Mixed(frozenset().union(*(_leaves(k) for k in kinds)))


def _classify_scan(eqn, kinds, analysis: Analysis, here: tuple, lengths: tuple) -> list:
    params = eqn.params
    body = params["jaxpr"].jaxpr
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, carry, xs = kinds[:n_consts], kinds[n_consts:n_consts + n_carry], kinds[n_consts + n_carry:]
    body_consts = [dataclasses.replace(k, levels=k.levels + ("const",)) if isinstance(k, View) else k
                   for k in consts]
    body_xs = []
    for k in xs:
        if isinstance(k, View):
            if all(e.primitive.name in ELEMENTWISE for e in k.chain):
                body_xs.append(dataclasses.replace(k, levels=k.levels + ("xs",)))
            else:
                analysis.mark_fallback({k.leaf}, "scanned over after a non-elementwise reshaping")
                body_xs.append(Mixed(frozenset({k.leaf})))
        else:
            body_xs.append(k)
    # A trainable leaf in the loop carry changes from one iteration to the next: fallback. Carries become data
    # when their initial value or the body's output is data (two passes reach the fixed point: kinds only rise).
    carry_kinds = []
    for k in carry:
        if _is_param(k):
            analysis.mark_fallback(_leaves(k), "carried through a loop")
        carry_kinds.append(DATA if _is_param(k) or k == DATA else CONST)
    inner_lengths = lengths + (int(params["length"]),)
    for _ in range(2):
        scratch = Analysis(fallback=set(analysis.fallback))
        outs = analyze(body, body_consts + carry_kinds + body_xs, scratch, here, inner_lengths)
        new = [DATA if (c == DATA or o == DATA or _is_param(o)) else CONST for c, o in zip(carry_kinds, outs)]
        for o in outs[:n_carry]:
            if _is_param(o):
                analysis.mark_fallback(_leaves(o), "carried through a loop")
        if new == carry_kinds:
            break
        carry_kinds = new
    outs = analyze(body, body_consts + carry_kinds + body_xs, analysis, here, inner_lengths)
    ys = [DATA if k == DATA else _join([k]) if not _is_param(k) else k for k in outs[n_carry:]]
    for k in ys:  # a stacked output of parameter values: treat as mixed (rare)
        if _is_param(k):
            analysis.mark_fallback(_leaves(k), "returned stacked from a loop")
    ys = [Mixed(_leaves(k)) if _is_param(k) else k for k in ys]
    return carry_kinds + ys


def view_size(site: Site) -> int:
    return math.prod(site.eqn.invars[site.param_operand].aval.shape)
