"""The single-example program without its batch-of-one axis, where XLA:CPU runs it faster.

The front-end traces ``loss_fn(params, batch of one)``, so every per-example value carries a leading axis of size
one and, under ``jax.vmap`` over the examples, reaches XLA as ``[B, 1, T, d]``. XLA:CPU (jaxlib 0.10) runs a
fusion that multiplies by a broadcast operand and reduces over the last axis 4-10x slower when its shape has a
unit axis: ``sum(x * scale, -1)`` on ``f32[16, 1, 128, 64]`` takes 0.6-0.9 ms against 0.08-0.14 ms on
``f32[16, 128, 64]`` (``[1, 16, 128, 64]`` and ``[16, 128, 1, 64]`` are as slow). Every LayerNorm's and softmax's
backward has that form; on ``experiments/bench_depth.py``'s 48-layer decoder (B 4, T 64) the non-private
gradient computed as ``vmap`` of the batch-of-one loss took 1.05x the plain gradient's time, 1.00x when the
example had no unit axis.

So, where the step is compiled for a CPU (``Analysis.squeeze_unit_axis``), the interpreter evaluates the
equations listed here on operands with their leading unit axis removed (a reshape, a bitcast for XLA) and keeps
their outputs so; a value is given its unit axis back (another bitcast) where an equation outside this list, a
site, a sub-program or the program's output reads it. Each rule computes exactly the equation's values: it only
drops an axis of size one that none of its parameters touch.
"""

from __future__ import annotations

import jax

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt",
    "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem", "round", "rsqrt",
    "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "argmax", "argmin"})


def leading_units(shape) -> int:
    """How many leading axes of ``shape`` have size one, leaving at least one axis."""
    k = 0
    while k < len(shape) - 1 and shape[k] == 1:
        k += 1
    return k


def rule(eqn):
    """How to evaluate ``eqn`` without its leading unit axes: ``(k, how many leading axes each operand loses, the
    parameters for the squeezed operands)``, ``k >= 1`` the number of axes the output loses, or None where this
    module does not apply (then the equation is bound as it is)."""
    name = eqn.primitive.name
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    outs = [tuple(v.aval.shape) for v in eqn.outvars]
    params = dict(eqn.params)
    if len(outs) != 1 or any(params.get(key) is not None for key in ("sharding", "out_sharding")):
        return None
    out = outs[0]
    if name in ELEMENTWISE:
        # lax broadcasts operands of equal rank over their unit axes (a norm's [1, T, 1] times [1, 1, d]) and
        # rank-0 operands (literals) whole
        if any(len(s) not in (0, len(out)) for s in shapes):
            return None
        k = min([leading_units(out)] + [leading_units(s) for s in shapes if len(s) == len(out)])
        return (k, tuple(k if len(s) == len(out) else 0 for s in shapes), params) if k else None
    if name in REDUCTIONS:
        axes = tuple(int(a) for a in params["axes"])
        if not axes:   # reduces nothing (jnp.sum(x, axis=())): bound as it is
            return None
        k = min([leading_units(shapes[0]), min(axes)] + ([leading_units(out)] if out else [0]))
        if not k:
            return None
        params["axes"] = tuple(a - k for a in axes)
        return (k, (k,) + (0,) * (len(shapes) - 1), params)
    if name == "broadcast_in_dim" and len(shapes) == 1:
        dims = tuple(int(d) for d in params["broadcast_dimensions"])
        k = leading_units(out)
        # the operand's axes placed among the first k must be its own first axes, in order (each of size one)
        j = sum(d < k for d in dims)
        if not k or dims[:j] != tuple(range(j)) or (j and leading_units(shapes[0]) < j):
            return None
        params["shape"] = tuple(params["shape"])[k:]
        params["broadcast_dimensions"] = tuple(d - k for d in dims[j:])
        return (k, (j,), params)
    if name == "reshape" and params.get("dimensions") is None:
        k = min(leading_units(shapes[0]), leading_units(out))
        if not k:
            return None
        params["new_sizes"] = tuple(params["new_sizes"])[k:]
        return (k, (k,), params)
    if name == "transpose":
        perm = tuple(int(p) for p in params["permutation"])
        k = min(leading_units(shapes[0]), leading_units(out))
        while k and perm[:k] != tuple(range(k)):
            k -= 1
        if not k:
            return None
        params["permutation"] = tuple(p - k for p in perm[k:])
        return (k, (k,), params)
    return None


def drop(value, n: int):
    """``value [1, ..., 1, *rest]`` as ``rest`` (its first ``n`` axes, of size one, removed)."""
    return value if n == 0 else jax.lax.reshape(value, tuple(value.shape[n:]))


def restore(value, shape):
    """A squeezed ``value`` with its unit axes given back: ``shape``."""
    return jax.lax.reshape(value, tuple(shape))
