"""Convolutions as factored sites: a kernel's per-example gradient as a sum of outer products of unfolded patches.

For ``out = conv_general_dilated(lhs, kernel)`` (any strides, padding, lhs / rhs dilation, dimension numbers,
``feature_group_count = G``) the kernel gradient of one example is, per feature group ``g``,

    grad[g] = patches[g]^T @ cotangent[g]      patches [g]: [T, Cin_g * prod(k)],  cotangent [g]: [T, Cout_g]

with ``T`` the output positions (times the lhs's own batch axis, when the single-example program has one) and the
patches unfolded by :func:`jax.lax.conv_general_dilated_patches` with the same window parameters. The feature
groups are the blocks of :class:`~dpzero_jax.program.sites.Factored` (like a dot's batch dimensions), so the ghost
norm (Grams ``[G, T, T]``) and clipped sums of the dot sites apply unchanged. The rule decides from the unfolded
sizes ``T``, ``rows = Cin_g * prod(k)``, ``cols = Cout_g`` (:func:`~dpzero_jax.program.sites.conv_factored`); where
it picks instantiation the kernel gradient comes from the convolution's own VJP, as for a local site, so the
``[T, rows]`` patches (``prod(k)`` times the input) are only formed for the ghost norm.

Canonical layout of the kernel view: ``[G, Cin_g, *k, Cout_g]`` with the window axes ``k`` in the kernel's memory
order (the order in which the patches flatten them, channel first); :func:`canonical_to_view` maps it back to the
view's own layout (``O`` split as ``[G, Cout_g]``: output feature ``o`` belongs to group ``o // Cout_g``).

Handled when the kernel is the right operand, its view is bijective and ``batch_group_count == 1``; other
convolutions stay ``local`` sites (exact, instantiated).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dpzero_jax import pergrad


def supported(eqn, param_operand: int) -> bool:
    """Whether a ``conv_general_dilated`` equation with the parameter view at ``param_operand`` is a conv site."""
    return (eqn.primitive.name == "conv_general_dilated" and param_operand == 1
            and int(eqn.params.get("batch_group_count", 1)) == 1)


def _specs(eqn):
    lhs_spec, rhs_spec, out_spec = eqn.params["dimension_numbers"]
    return tuple(lhs_spec), tuple(rhs_spec), tuple(out_spec)


def _window_axes(eqn) -> list[int]:
    """The kernel's spatial axes in memory order (the order the patches flatten them in)."""
    return sorted(_specs(eqn)[1][2:])


def sizes(eqn) -> tuple[int, int, int, int]:
    """``(G, T, rows, cols)`` of one instance: feature groups, output positions, ``Cin_g * prod(k)``, ``Cout_g``."""
    _, rhs_spec, out_spec = _specs(eqn)
    kernel = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    groups = int(eqn.params["feature_group_count"])
    positions = out[out_spec[0]] * math.prod(out[d] for d in out_spec[2:])
    rows = kernel[rhs_spec[1]] * math.prod(kernel[d] for d in rhs_spec[2:])
    return groups, positions, rows, kernel[rhs_spec[0]] // groups


def canonical_shape(eqn) -> tuple[int, ...]:
    """``[G, Cin_g, *k, Cout_g]`` (window axes in the kernel's memory order)."""
    _, rhs_spec, _ = _specs(eqn)
    kernel = eqn.invars[1].aval.shape
    groups = int(eqn.params["feature_group_count"])
    return ((groups, kernel[rhs_spec[1]]) + tuple(kernel[d] for d in _window_axes(eqn))
            + (kernel[rhs_spec[0]] // groups,))


def canonical_to_view(eqn, block):
    """``[G * Cin_g * prod(k) * Cout_g]`` (any shape of that size, canonical order) -> the kernel view's shape."""
    _, rhs_spec, _ = _specs(eqn)
    canonical = canonical_shape(eqn)
    n = len(canonical) - 3                                    # window axes
    kernel = eqn.invars[1].aval.shape
    a = block.reshape(canonical)
    a = jnp.moveaxis(a, 0, n + 1).reshape(canonical[1:n + 2] + (kernel[rhs_spec[0]],))   # [Cin_g, *k, O]
    window = _window_axes(eqn)
    source = [0] * len(kernel)
    source[rhs_spec[1]] = 0
    source[rhs_spec[0]] = n + 1
    for j, axis in enumerate(window):
        source[axis] = 1 + j
    return jnp.transpose(a, source)


def factors(eqn, lhs, g):
    """One instance: ``(left [G, T, rows], right [G, T, cols])`` from the recorded input ``lhs`` and the output
    gradient ``g`` (the convolution's operand and output layouts)."""
    _, _, out_spec = _specs(eqn)
    params = eqn.params
    groups, positions, rows, cols = sizes(eqn)
    kernel = eqn.invars[1].aval.shape
    # The identity kernel of the unfolding is exact in any dtype; HIGHEST keeps float32 inputs unrounded on
    # backends whose default convolution precision is lower (TPU).
    patches = lax.conv_general_dilated_patches(
        lhs, tuple(kernel[d] for d in _window_axes(eqn)), params["window_strides"], params["padding"],
        lhs_dilation=params["lhs_dilation"], rhs_dilation=params["rhs_dilation"],
        dimension_numbers=params["dimension_numbers"], precision=lax.Precision.HIGHEST)
    # Patches come in the output's layout with the features [C * prod(k)] (channel first) on the feature axis.
    order = [out_spec[0]] + list(out_spec[2:]) + [out_spec[1]]
    left = jnp.transpose(patches, order).reshape(positions, groups, rows)
    right = jnp.transpose(g, order).reshape(positions, groups, cols)
    return jnp.swapaxes(left, 0, 1), jnp.swapaxes(right, 0, 1)


def use_ghost(method: str, positions: int, rows: int, cols: int, reuse: bool = True) -> bool:
    """Ghost norm or instantiation for one block of ``positions`` positions (unfolded, for a convolution), ``rows x
    cols``: the rule of :func:`dpzero_jax.pergrad.use_ghost` for one dense use (``"mixed"``: space, ``"fastest"``:
    FLOPs; ``reuse``: whether an instantiated gradient would be reused for the clipped sum). Also the ghost mode's
    rule for a dot site, without reuse (its sums come from the second pullback)."""
    use = pergrad.Outer(jax.ShapeDtypeStruct((1, positions, rows), jnp.float32),
                        jax.ShapeDtypeStruct((1, positions, cols), jnp.float32), rows, (rows, cols))
    return pergrad.use_ghost([use], method, reuse=reuse)


def positions(eqn) -> int:
    """``T``: the output positions of one instance (the lhs's batch axis times the output's spatial axes)."""
    return sizes(eqn)[1]
