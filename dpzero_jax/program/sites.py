"""Per-example gradients of one site from its recorded operands and its output gradient.

Arrays arriving here carry leading axes ``[B, *lengths]`` (the example, then the enclosing scans' iterations), or
the example after the iterations (``example_axis``: book-keeping's pass leaves them so).
For a leaf sliced by a scan (level ``"xs"``) each iteration's gradient belongs to its own slice -- a *block*; for a
leaf passed whole (level ``"const"``) the iterations' gradients add up -- more *positions*.

* ``dot``, ``conv`` and ``gather`` sites give :class:`Factored`: ``left [K, B, T, rows]`` (or int ids ``[K, B, T]``)
  and ``right [K, B, T, cols]`` with ``K`` blocks (scan slices x the dot's batch dimensions or the conv's feature
  groups), the weight viewed in a canonical layout ``[*batch, *contracting, *free]`` (a transpose of the view; a
  conv's ``[G, Cin_g, *window, Cout_g]``, see :mod:`dpzero_jax.program.conv`; norms unchanged);
* ``local`` sites give the per-example gradient of the whole leaf, ``[B, *leaf.shape]``.

:func:`to_leaf` maps a ``[K, rows, cols]`` sum (or one example's blocks) back to the leaf: inverse transpose, then
the VJP of the view's chain, slice by slice.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax.program import conv
from dpzero_jax.program.analyze import Site
from dpzero_jax.program.interpret import bind, bind_squeezing


@dataclasses.dataclass(frozen=True)
class Factored:
    left: jax.Array       # [K, B, T, rows] floats, or [K, B, T] ids: blocks first (see factored)
    right: jax.Array      # [K, B, T, cols]
    rows: int
    left_is_ids: bool
    canonical_shape: tuple  # the view in canonical layout (per scan slice): [*dot batch, *contracting, *free]
    perm: tuple             # view axes -> canonical axes (() for a conv: see conv.canonical_to_view)
    swapped: bool = False   # left and right exchanged so that the factors follow the leaf's own axis order
    layout: tuple = ()      # what two uses must share to add their factors: the leaf axes of [rows | cols]

    @property
    def structure(self):
        return (self.left.shape[0], self.rows, self.right.shape[-1], self.layout)


def _leaf_axes(site: Site):
    """The leaf (slice) axis behind each axis of the view, when the chain only casts and transposes; else None."""
    ndim = len(site.view.chain[0].invars[0].aval.shape) if site.view.chain else \
        len(site.eqn.invars[site.param_operand].aval.shape)
    axes = list(range(ndim))
    for eqn in site.view.chain:
        name = eqn.primitive.name
        if name == "transpose":
            axes = [axes[p] for p in eqn.params["permutation"]]
        elif name not in ("convert_element_type", "copy", "copy_p"):
            return None
    return axes


def _vmap_n(fn, n: int, in_axes):
    for _ in range(n):
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


def replay_chain(site: Site, base, skip_casts: bool = False, upto: int | None = None):
    """The view (the site's parameter operand) from the leaf, or from its per-iteration slice. ``skip_casts``:
    leave dtype conversions out (mapping a float32 gradient back without rounding it to a half-precision view);
    ``upto``: replay only the chain's first ``upto`` equations."""
    value = base
    for eqn in site.view.chain[:upto]:
        if skip_casts and eqn.primitive.name == "convert_element_type":
            continue
        (value,) = bind(eqn, [value] + [v.val for v in eqn.invars[1:]])
    return value


def scale_grad(site: Site, ops, g):
    """``(gradient, upto)`` when the site multiplies data by the view: one example's float32 gradient of the
    chain's value after its first ``upto`` equations (the view, or the operand of a ``broadcast_in_dim`` that ends
    the chain), for the scale of a norm layer, a layer scale, a gate; else None.

    The product's axes where the view (or what is broadcast) has size one while the output does not are summed.
    Written as one ``dot_general`` of ``g`` and the data: the VJP gives the same values as a product reduced over
    those axes, which XLA:CPU fuses into one kernel that runs 10-40x slower than the contraction when the arrays
    have a unit axis -- as every per-example array here does (the example's batch axis of one): 56 ms against
    1.8 ms for the scale of a LayerNorm on ``[16, 1, 512, 512]`` (``B, 1, T, d``)."""
    if site.eqn.primitive.name != "mul" or len(site.recorded) != 1:
        return None
    other = ops[0]
    out, view = tuple(g.shape), tuple(site.eqn.invars[site.param_operand].aval.shape)
    chain, upto, target = site.view.chain, None, view
    if not view:   # a scalar times the data
        view = (1,) * len(out)
    if not jnp.issubdtype(other.dtype, jnp.inexact) or other.ndim != len(out) or len(view) != len(out):
        return None
    if chain and chain[-1].primitive.name == "broadcast_in_dim":   # what is broadcast, in the output's rank
        cast = chain[-1]
        target, upto = tuple(cast.invars[0].aval.shape), -1
        view = [1] * len(out)
        for j, d in enumerate(cast.params["broadcast_dimensions"]):
            if target[j] == out[d]:
                view[d] = out[d]
    if any(v not in (1, n) for v, n in zip(view, out)) or any(o not in (1, n) for o, n in zip(other.shape, out)):
        return None
    summed = [i for i, n in enumerate(out) if n > 1 and view[i] == 1]
    if not summed:
        return None
    g_alone = tuple(i for i in summed if other.shape[i] == 1)    # summed where the data is broadcast too
    if g_alone:
        g = jnp.sum(g, axis=g_alone, keepdims=True)
    axes = [i for i, n in enumerate(out) if n > 1 and i not in g_alone]
    g_axes, o_axes = axes, [i for i in axes if other.shape[i] > 1]
    g = g.reshape([out[i] for i in g_axes])
    other = other.astype(g.dtype).reshape([out[i] for i in o_axes])
    batch = [i for i in axes if view[i] > 1 and i in o_axes]
    contract = [i for i in axes if view[i] == 1]
    free = [i for i in axes if view[i] > 1 and i not in o_axes]
    grad = jax.lax.dot_general(g, other, (([g_axes.index(i) for i in contract], [o_axes.index(i) for i in contract]),
                                          ([g_axes.index(i) for i in batch], [o_axes.index(i) for i in batch])),
                               preferred_element_type=jnp.float32)
    order = batch + free                  # dot_general's output axes
    kept = sorted(order)
    grad = jnp.transpose(grad, [order.index(i) for i in kept]) if order != kept else grad
    return grad.reshape(target), upto


def base_shape(site: Site) -> tuple:
    """The shape of the chain's base: the leaf, or its per-iteration slice inside a scan."""
    return tuple((site.view.chain[0].invars[0] if site.view.chain else site.eqn.invars[site.param_operand]).aval.shape)


# Primitives whose VJP with respect to the parameter's view does not read the view's value (linear in it, or the
# product with data), and those whose VJP reads neither the view nor the other operands (a shift, a concatenated
# token): a local tap keeps for its backward only what it reads (program.local_tap).
VIEW_FREE_VJP = frozenset({"add", "add_any", "sub", "mul", "neg", "concatenate", "pad", "select_n", "reshape",
                           "broadcast_in_dim", "transpose", "convert_element_type", "dynamic_update_slice"})
OPERAND_FREE_VJP = frozenset({"add", "add_any", "sub", "neg", "concatenate", "pad", "reshape", "broadcast_in_dim",
                              "transpose", "convert_element_type"})


def base_grad(site: Site, w, ops, g, base_shape):
    """One example's float32 gradient of the chain's base (the leaf or its per-iteration slice, ``base_shape``)
    through the site with output gradient ``g``, casts left out (the view ``w`` as evaluated)."""
    def to_base(view_grad, upto=None):
        _, pullback = jax.vjp(lambda b: replay_chain(site, b, skip_casts=True, upto=upto).astype(jnp.float32),
                              jnp.zeros(base_shape, jnp.float32))
        return pullback(view_grad.astype(jnp.float32))[0]

    scaled = scale_grad(site, ops, g)
    if scaled is not None:
        return to_base(*scaled)
    _, pullback = jax.vjp(lambda w_: apply_site(site, w_, ops), w)
    return to_base(pullback(g)[0])


def _dot_factors(site: Site, data, g):
    """One instance: ``(left [Kd, T, rows], right [Kd, T, cols], canonical shape, perm)`` of a dot site."""
    eqn = site.eqn
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    p = site.param_operand
    w_shape = tuple(eqn.invars[p].aval.shape)
    c_d, c_w = (lc, rc) if p == 1 else (rc, lc)
    b_d, b_w = (lb, rb) if p == 1 else (rb, lb)
    f_d = [i for i in range(data.ndim) if i not in c_d and i not in b_d]
    f_w = [i for i in range(len(w_shape)) if i not in c_w and i not in b_w]
    nb = len(b_d)
    # Output axes: batch, then the left operand's free axes, then the right's.
    out_fd = list(range(nb, nb + len(f_d))) if p == 1 else list(range(nb + len(f_w), nb + len(f_w) + len(f_d)))
    out_fw = list(range(nb + len(f_d), nb + len(f_d) + len(f_w))) if p == 1 else list(range(nb, nb + len(f_w)))
    kd = math.prod(data.shape[i] for i in b_d)
    positions = math.prod(data.shape[i] for i in f_d)
    rows = math.prod(data.shape[i] for i in c_d)
    cols = math.prod(w_shape[i] for i in f_w)
    left = jnp.transpose(data, list(b_d) + f_d + list(c_d)).reshape(kd, positions, rows)
    right = jnp.transpose(g, list(range(nb)) + out_fd + out_fw).reshape(kd, positions, cols)
    perm = tuple(b_w) + tuple(c_w) + tuple(f_w)
    return left, right, tuple(w_shape[i] for i in perm), perm


def factored(site: Site, operands, g, example_axis: int = 0) -> Factored:
    """A dot, conv or gather site's factors with ``[K, B, T, ...]`` layout, blocks first. ``operands`` and ``g``
    have the examples and the enclosing scans' iterations in front, the examples on ``example_axis`` of those.
    Blocks first because book-keeping's pass leaves a scan's operands ``[*lengths, B, ...]`` in memory: its uses
    then merge blocks and examples into one batch axis with no copy (examples first made XLA transpose every
    operand of a deep scanned model: ~5% of its step)."""
    lead = 1 + len(site.lengths)
    if site.kind == "dot":
        def one(data, g_):
            left, right, _, _ = _dot_factors(site, data, g_)
            return left, right

        left, right = _vmap_n(one, lead, 0)(operands[0], g)
        canonical, perm = _canonical(site)
        ids = False
    elif site.kind == "conv":
        left, right = _vmap_n(lambda lhs, g_: conv.factors(site.eqn, lhs, g_), lead, 0)(operands[0], g)
        left, right = _blocks(site, left, right, False, example_axis)
        view_axes = _leaf_axes(site)
        # Two uses of one kernel share cross terms when their canonical layouts name the same leaf axes.
        layout = (("conv", tuple(view_axes), tuple(site.eqn.params["dimension_numbers"][1]),
                   int(site.eqn.params["feature_group_count"])) if view_axes is not None else ("view", site.path))
        return Factored(left, right, left.shape[-1], False, conv.canonical_shape(site.eqn), (), False, layout)
    else:  # gather: operands[0] are the start indices [..., 1]
        table = tuple(site.eqn.invars[0].aval.shape)
        cols = math.prod(table[1:])
        left = operands[0].reshape(operands[0].shape[:lead] + (1, -1))
        right = g.reshape(g.shape[:lead] + (1, left.shape[-1], cols))
        canonical, perm, ids = table, tuple(range(len(table))), True
    rows = left.shape[-1] if not ids else site.eqn.invars[0].aval.shape[0]
    left, right = _blocks(site, left, right, ids, example_axis)
    view_axes = _leaf_axes(site)
    layout: tuple = ("view", site.path)
    swapped = False
    if view_axes is not None and len(canonical) >= 1:
        leaf_order = [view_axes[i] for i in perm]
        n_rows = _n_row_axes(site)
        if len(leaf_order) == n_rows + (len(canonical) - n_rows) and leaf_order == sorted(leaf_order):
            layout = (tuple(leaf_order[:n_rows]), tuple(leaf_order[n_rows:]))
        elif (not ids and leaf_order[n_rows:] + leaf_order[:n_rows] == sorted(leaf_order)
              and _n_batch_axes(site) == 0):
            left, right, rows, swapped = right, left, right.shape[-1], True
            layout = (tuple(leaf_order[n_rows:]), tuple(leaf_order[:n_rows]))
    return Factored(left, right, rows, ids, tuple(canonical), perm, swapped, layout)


def conv_factored(leaf_sites, method: str, reuse: bool = True) -> bool:
    """Whether the conv sites of one leaf are factored (unfolded into patches): all of the leaf's sites are conv
    sites sharing one canonical layout and the rule of ``method`` picks the ghost norm on the unfolded sizes (all
    positions ``T``, ``rows = Cin_g * prod(k)``, ``cols = Cout_g``). Otherwise they are instantiated through the
    convolution's own VJP, like local sites: ``rows x cols`` per example and no ``[T, rows]`` patches. ``reuse``: as
    :func:`~dpzero_jax.program.conv.use_ghost` (ghost mode: False)."""
    if any(s.kind != "conv" for s in leaf_sites):
        return False
    keys = {(tuple(s.eqn.params["dimension_numbers"][1]), conv.sizes(s.eqn)[::2], xs_lengths(s),
             None if _leaf_axes(s) is None else tuple(_leaf_axes(s))) for s in leaf_sites}
    if len(keys) > 1 or (len(leaf_sites) > 1 and any(_leaf_axes(s) is None for s in leaf_sites)):
        return False
    _, _, rows, cols = conv.sizes(leaf_sites[0].eqn)
    return conv.use_ghost(method, sum(conv_positions(s) for s in leaf_sites), rows, cols, reuse)


def conv_positions(site: Site) -> int:
    """Positions of one conv site per example and block (times the iterations of a scan that passes it whole)."""
    levels = site.view.levels[-len(site.lengths):] if site.lengths else ()
    return conv.positions(site.eqn) * math.prod(n for n, lv in zip(site.lengths, levels) if lv == "const")


def _n_batch_axes(site: Site) -> int:
    if site.kind == "gather":
        return 0
    (_, _), (lb, rb) = site.eqn.params["dimension_numbers"]
    return len(lb)


def _n_row_axes(site: Site) -> int:
    """Axes of the canonical layout before the columns: the dot's batch and contracting axes (a table's row)."""
    if site.kind == "gather":
        return 1
    (lc, _), (lb, _) = site.eqn.params["dimension_numbers"]
    return len(lb) + len(lc)


def _blocks(site: Site, left, right, ids: bool, example_axis: int = 0):
    """``[B, *lengths, Kd, T, ...]`` (the example on ``example_axis`` of the leading ``1 + len(lengths)`` axes) ->
    ``[K, B, T', ...]``: xs levels (and the dot's batch) are blocks, const levels are positions. One transpose."""
    levels = site.view.levels[-len(site.lengths):] if site.lengths else ()
    n = len(levels)
    iteration_axes = [a for a in range(n + 1) if a != example_axis]
    xs_axes = [iteration_axes[i] for i, lv in enumerate(levels) if lv == "xs"]
    const_axes = [iteration_axes[i] for i, lv in enumerate(levels) if lv == "const"]
    tail_l = 2 if not ids else 1
    order_l = xs_axes + [1 + n, example_axis] + const_axes + list(range(2 + n, left.ndim))
    order_r = xs_axes + [1 + n, example_axis] + const_axes + list(range(2 + n, right.ndim))
    left = jnp.transpose(left, order_l)
    right = jnp.transpose(right, order_r)
    k = math.prod(left.shape[:1 + len(xs_axes)])
    batch = left.shape[1 + len(xs_axes)]
    left = left.reshape((k, batch, -1) + left.shape[left.ndim - tail_l + 1:]) if not ids else left.reshape(k, batch, -1)
    right = right.reshape(k, batch, -1, right.shape[-1])
    return left, right


def xs_lengths(site: Site) -> tuple[int, ...]:
    levels = site.view.levels[-len(site.lengths):] if site.lengths else ()
    return tuple(n for n, lv in zip(site.lengths, levels) if lv == "xs")


def to_leaf(site: Site, blocks, leaf, factored: Factored | None = None):
    """``[K, rows, cols]`` (canonical blocks of the view; ``[K, cols, rows]`` for ``factored.swapped``) -> the
    leaf's shape (float32)."""
    canonical, perm = _canonical(site)
    xs = xs_lengths(site)
    inverse = np.argsort(perm) if perm is not None else None
    slice_shape = leaf.shape[len(xs):]

    if getattr(factored, "swapped", False):
        blocks = jnp.swapaxes(blocks, -1, -2)

    def one(block, leaf_slice):
        if site.kind == "conv":
            view_grad = conv.canonical_to_view(site.eqn, block)
        else:
            view_grad = jnp.transpose(block.reshape(canonical), inverse)
        _, pullback = jax.vjp(lambda base: replay_chain(site, base, skip_casts=True).astype(jnp.float32),
                              leaf_slice.astype(jnp.float32))
        return pullback(view_grad.astype(jnp.float32))[0]

    # The dot's own batch dimensions are leading axes of the canonical layout: they fold back in.
    stacked = blocks.reshape(xs + canonical)
    out = _vmap_n(lambda b, lf: one(b, lf), len(xs), 0)(stacked, jnp.zeros(leaf.shape, jnp.float32))
    return out.reshape(leaf.shape) if not xs else out.reshape(xs + slice_shape)


def _canonical(site: Site):
    """``(canonical shape, view axes -> canonical axes)``; a conv's canonical layout is no transpose of the view
    (its output features split into groups): ``perm`` None, :func:`conv.canonical_to_view` maps it."""
    if site.kind == "conv":
        return conv.canonical_shape(site.eqn), None
    if site.kind == "gather":
        shape = tuple(site.eqn.invars[0].aval.shape)
        return shape, tuple(range(len(shape)))
    eqn = site.eqn
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    p = site.param_operand
    w_shape = tuple(eqn.invars[p].aval.shape)
    c_w, b_w = (rc, rb) if p == 1 else (lc, lb)
    f_w = [i for i in range(len(w_shape)) if i not in c_w and i not in b_w]
    perm = tuple(b_w) + tuple(c_w) + tuple(f_w)
    return tuple(w_shape[i] for i in perm), perm


def finite_operands(ops):
    """``(ok, ops')``: whether every float operand is finite (a scalar) and the operands with their non-finite
    entries zeroed (integer operands unchanged): a weight path's operands, where an example with a non-finite
    entry gets the coefficient 0 and 0 * NaN would not be 0 in the weight's contraction."""
    floats = [o for o in ops if jnp.issubdtype(o.dtype, jnp.inexact)]
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(o)) for o in floats])) if floats else jnp.asarray(True)
    return ok, [jnp.where(jnp.isfinite(o), o, jnp.zeros((), o.dtype)) if jnp.issubdtype(o.dtype, jnp.inexact)
                else o for o in ops]


def data_and_weight_paths(site: Site, w, ops, view32=None):
    """``(y_data, ok, held, y_weight)``: the site's *data path* ``f(stop_gradient(w), ops)`` (its output), and its
    *weight path* ``f(w, held)`` on the operands under ``stop_gradient`` with non-finite entries zeroed
    (:func:`finite_operands`, whose ``ok`` it passes on): what ghost and fused taps join. ``view32``: the view
    replayed in float32 from a float32 leaf whose chain narrows it (:func:`float32_view`); the weight path is then
    :func:`apply_site_float32` on it, so that the clipped sum it forms is accumulated, and added over the examples
    and devices, in float32 (see :func:`float32_view`)."""
    y_data = apply_site(site, jax.lax.stop_gradient(w), ops)
    ok, held = finite_operands([jax.lax.stop_gradient(o) for o in ops])
    if view32 is not None:
        return y_data, ok, held, apply_site_float32(site, view32, held)
    return y_data, ok, held, apply_site(site, w, held)


def scaled(g, coef, dtype=None):
    """One example's ``g`` times its clip coefficient; exactly zero where the coefficient is 0 (never NaN * 0).
    ``dtype``: the result's (default ``g``'s); float32 for a float32 weight path: the product of a half-precision
    ``g`` and the float32 coefficient is then not rounded to half precision."""
    dtype = g.dtype if dtype is None else dtype
    return jnp.where(coef != 0, g.astype(dtype) * coef.astype(dtype), jnp.zeros((), dtype))


def float32_view(site: Site, w, base):
    """The site's parameter view replayed in float32 from ``base`` (the float32 leaf, or its per-iteration slice,
    that the view's chain starts from) with the chain's casts left out -- where the chain narrows it (a float32
    master weight cast to bfloat16 at its use); else None.

    A weight path on the narrow view would form its parameter's clipped sum ``sum_i C_i g_i`` as that view's
    cotangent, in the narrow dtype: each device's sum rounded to half precision, and the devices' sums added in it,
    before the noise. The rounding error of a sum grows with the sum (``~2^-8 |sum|`` per coordinate in bfloat16),
    so adding or removing one example would move the released sum by more than its clipped contribution: the
    sensitivity the noise is calibrated to would not hold (a bfloat16 MLP, 128 near-identical examples: 1.06x the
    threshold). On the float32 view the weight path's contraction writes float32 and the sum reaches the float32
    leaf without a cast: the per-example rounding that remains is the matmul unit's (``docs/privacy.md``)."""
    if (not site.view.chain or base.dtype != jnp.float32 or w.dtype == jnp.float32
            or not jnp.issubdtype(w.dtype, jnp.floating)):
        return None
    return replay_chain(site, base, skip_casts=True)


def apply_site_float32(site: Site, w32, ops):
    """:func:`apply_site` on a float32 view ``w32``, written in float32: a ``dot_general`` takes its half-precision
    operands as they are (a mixed-precision contraction, preferred element type float32: its transpose keeps them,
    not float32 copies, and writes the parameter's cotangent in float32); any other site computes on float32
    copies of its floating operands."""
    eqn = site.eqn
    values = _site_operands(site, w32, ops)
    params = dict(eqn.params)
    if eqn.primitive.name != "dot_general":
        values = [v.astype(jnp.float32) if i != site.param_operand and hasattr(v, "dtype")
                  and jnp.issubdtype(v.dtype, jnp.floating) else v for i, v in enumerate(values)]
    if "preferred_element_type" in params:
        params["preferred_element_type"] = jnp.float32
    return bind_squeezing(eqn.replace(params=params), values, site.squeeze)[0]


def _site_operands(site: Site, w, ops) -> list:
    """The site equation's operands: the view ``w``, the recorded operands ``ops``, literals as traced."""
    values, k = [], 0
    for i, var in enumerate(site.eqn.invars):
        if i == site.param_operand:
            values.append(w)
        elif i in site.recorded:
            values.append(ops[k])
            k += 1
        else:
            values.append(var.val)
    return values


def apply_site(site: Site, w, ops):
    """The site's equation on the view ``w`` and its recorded operands ``ops`` (literals as traced)."""
    return bind_squeezing(site.eqn, _site_operands(site, w, ops), site.squeeze)[0]


def from_tap(site: Site, grads, example_axis: int = 0):
    """``[B, *leaf.shape]`` per-example gradient of the leaf through one local site, from per-example gradients of
    its base (formed in the backward by book-keeping's tap, :mod:`dpzero_jax.program.local_tap`, or after it by
    :func:`local_grad`): ``grads [*lengths, base]`` with the examples on ``example_axis`` of the leading ``[B,
    *lengths]`` axes; the iterations of a scan that passes the leaf whole (``"const"`` level) add up, a stacked
    leaf's (``"xs"``) are its slices."""
    levels = site.view.levels[-len(site.lengths):] if site.lengths else ()
    out = jnp.moveaxis(grads, example_axis, 0)
    axes = [1 + i for i, lv in enumerate(levels) if lv == "const"]
    return jnp.sum(out, axis=tuple(axes)) if axes else out


def local_grad(site: Site, operands, g, leaf, example_axis: int = 0):
    """``[B, *leaf.shape]`` per-example gradient of the leaf through one local site; ``operands`` and ``g`` hold
    the examples on ``example_axis`` of their leading ``[B, *lengths]`` axes (as :func:`factored`)."""
    levels = site.view.levels[-len(site.lengths):] if site.lengths else ()

    def one(ops, g_, leaf_slice):
        g_ = g_.astype(site.out_aval.dtype)
        scaled = scale_grad(site, ops, g_)
        if scaled is not None:
            grad, upto = scaled
            value, pullback = jax.vjp(lambda base: replay_chain(site, base, upto=upto), leaf_slice)
            return pullback(grad.astype(value.dtype))[0].astype(jnp.float32)

        def through(base):
            return apply_site(site, replay_chain(site, base), ops)

        _, pullback = jax.vjp(through, leaf_slice)
        return pullback(g_)[0].astype(jnp.float32)

    if example_axis not in (0, len(levels)):
        raise ValueError(f"example_axis {example_axis}: the examples are first or after the {len(levels)} iterations")
    # The examples mapped where they are: mapped outermost over [L, B, ...], the contraction's batching would put
    # them first and XLA transpose the activation-sized operands; the gradient [L, B, *slice] moves instead.
    fn = one if not example_axis else jax.vmap(one, in_axes=(0, 0, None))
    for level in reversed(levels):
        fn = jax.vmap(fn, in_axes=(0, 0, 0 if level == "xs" else None))
    if not example_axis:
        fn = jax.vmap(fn, in_axes=(0, 0, None))
    # const levels were vmapped with an unbatched leaf: their axes are iterations to sum (as for a tap's gradients)
    return from_tap(site, fn(list(operands), g, leaf), example_axis)


def instantiate(site: Site, f: Factored, leaf):
    """``[B, *leaf.shape]`` per-example gradient of a dot/conv/gather site (for leaves that mix site kinds)."""
    if f.left_is_ids:
        k, batch = f.right.shape[:2]
        dense = jnp.zeros((batch, k, f.rows, f.right.shape[-1]), jnp.float32)
        b_idx = jnp.arange(batch)[None, :, None]
        k_idx = jnp.arange(k)[:, None, None]
        dense = dense.at[b_idx, k_idx, f.left].add(f.right.astype(jnp.float32))
    else:
        dense = jnp.einsum("kbtr,kbtc->bkrc", f.left, f.right, preferred_element_type=jnp.float32)
    return jax.vmap(lambda blocks: to_leaf(site, blocks, leaf, f))(dense)
