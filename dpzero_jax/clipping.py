"""Clipping: the clip functions, the grouping of parameters, and the per-example clip coefficients.

Paper 000, eq. (1): for groups ``m = 1..M`` with thresholds ``R_m``, example ``i`` contributes
``C_{m,i} * g_{m,i}`` where ``C_{m,i} = clip_fn(||g_{m,i}||, R_m)``:

* ``abadi``:     ``min(1, R / ||g||)``            -> ``||C g|| <= R``
* ``automatic``: ``R / (||g|| + gamma)``          -> ``||C g|| <  R``
* ``global``:    ``1{||g|| < R}``                 -> ``||C g|| <  R``

so one example changes the group-``m`` sum by at most ``R_m`` and the whole clipped sum by at most
``||(R_1..R_M)||`` -- the noise scale. An example whose mask is 0, whose loss is non-finite or any of whose group
norms is non-finite gets ``C = 0`` in every group (and contributes exactly nothing; see ``pergrad.weighted_sum``).
The one exception is the ``fused`` engine mode, where each layer clips its own groups without seeing the others:
there an example with a finite loss but a non-finite norm in one group is dropped from that group only (the bound
above still holds group by group).

Groups are formed from parameter paths (``"blocks/0/mlp/fc/kernel"``); a *layer* is a parameter's parent path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

CLIP_FUNCTIONS = ("abadi", "automatic", "global")
GROUP_PRESETS = ("all-layer", "layer-wise", "param-wise")


def clip_factor(norms: jax.Array, thresholds: jax.Array, clip_fn: str, gamma: float = 0.01) -> jax.Array:
    """Clip factors ``C`` for ``norms [..., M]`` and ``thresholds [M]`` (float32)."""
    norms = norms.astype(jnp.float32)
    if clip_fn == "abadi":
        return jnp.minimum(1.0, thresholds / jnp.maximum(norms, 1e-30))
    if clip_fn == "automatic":
        return thresholds / (norms + gamma)
    if clip_fn == "global":
        return (norms < thresholds).astype(jnp.float32)
    raise ValueError(f"unknown clip_fn {clip_fn!r}; expected one of {CLIP_FUNCTIONS}")


def l2_sensitivity(thresholds) -> jax.Array:
    """``||(R_1..R_M)||`` (float32 scalar): the L2 sensitivity of the clipped sum under add/remove adjacency.

    Adding or removing one example changes group ``m`` of ``sum_i C_{m,i} g_{m,i}`` by at most ``R_m`` (every clip
    function above keeps ``||C g|| <= R``), hence the whole sum by at most the norm of the thresholds. (Under
    replace-one adjacency the bound doubles.) ``thresholds``: ``[M]``.
    """
    return jnp.sqrt(jnp.sum(jnp.square(jnp.asarray(thresholds, jnp.float32))))


def coefficients(norms: jax.Array, thresholds: jax.Array, keep: jax.Array, clip_fn: str,
                 gamma: float = 0.01) -> jax.Array:
    """``[B, M]`` coefficients: clip factors, zero for examples not kept or with a non-finite group norm.

    norms: ``[B, M]``; thresholds: ``[M]``; keep: ``[B]`` (bool or 0/1).
    """
    finite = jnp.all(jnp.isfinite(norms), axis=1)
    use = jnp.logical_and(keep.astype(bool), finite)
    factors = clip_factor(norms, thresholds, clip_fn, gamma)
    return jnp.where(use[:, None], factors, 0.0)


def parent(path: str) -> str:
    """The layer a parameter belongs to: its path without the last component."""
    return path.rsplit("/", 1)[0] if "/" in path else path


def assign_groups(groups, paths: Sequence[str], layer_order: Sequence[str]) -> tuple[dict[str, int], tuple[str, ...]]:
    """Map every parameter path to a group index.

    groups: ``"all-layer"``, ``"layer-wise"``, ``"param-wise"``, ``("uniform", k)`` (``k`` contiguous groups of
    layers in forward order), a mapping ``{path: group name}`` covering every parameter, or a callable
    ``path -> group name``. layer_order: layer paths in the order the forward pass first uses them.
    Returns ``({path: group index}, group names)``.
    """
    if groups == "all-layer":
        keys = {p: "all" for p in paths}
    elif groups == "param-wise":
        keys = {p: p for p in paths}
    elif groups == "layer-wise":
        keys = {p: parent(p) for p in paths}
    elif isinstance(groups, tuple) and len(groups) == 2 and groups[0] == "uniform":
        layers = list(dict.fromkeys(list(layer_order) + [parent(p) for p in paths]))
        layers = [layer for layer in layers if any(parent(p) == layer for p in paths)]
        k = groups[1]
        if k > len(layers):
            raise ValueError(f"groups=('uniform', {k}) asks for more groups than the model has layers ({len(layers)})")
        chunk_of = {}
        for chunk, members in enumerate(np.array_split(np.arange(len(layers)), k)):
            for member in members:
                chunk_of[layers[member]] = f"uniform-{chunk}"
        keys = {p: chunk_of[parent(p)] for p in paths}
    elif isinstance(groups, Mapping):
        missing = [p for p in paths if p not in groups]
        unknown = [k for k in groups if k not in set(paths)]
        if missing or unknown:
            raise ValueError("the groups mapping must assign exactly the trainable parameters' paths "
                             f"{list(paths)}; unassigned: {missing}, not parameters: {unknown}")
        keys = {p: groups[p] for p in paths}
    elif callable(groups):
        keys = {p: groups(p) for p in paths}
    else:
        raise ValueError(f"invalid groups {groups!r}")
    names = tuple(dict.fromkeys(str(keys[p]) for p in paths))
    index = {name: i for i, name in enumerate(names)}
    return {p: index[str(keys[p])] for p in paths}, names


def thresholds(max_grad_norm: float, n_groups: int, group_thresholds: Sequence[float] | None) -> np.ndarray:
    """``[M]`` per-group thresholds: given ones, or ``R / sqrt(M)`` each (so that ``||(R_m)|| = R``)."""
    if group_thresholds is not None:
        if len(group_thresholds) != n_groups:
            raise ValueError(f"group_thresholds has {len(group_thresholds)} entries but there are {n_groups} groups")
        return np.asarray(group_thresholds, np.float32)
    return np.full((n_groups,), max_grad_norm / math.sqrt(n_groups), np.float32)


def validate_groups(groups) -> None:
    if isinstance(groups, str):
        if groups not in GROUP_PRESETS:
            raise ValueError(f"groups={groups!r}: expected one of {GROUP_PRESETS}, ('uniform', k), a mapping "
                             "{path: group} or a callable")
    elif isinstance(groups, tuple):
        if not (len(groups) == 2 and groups[0] == "uniform" and isinstance(groups[1], int)
                and not isinstance(groups[1], bool) and groups[1] >= 1):
            raise ValueError(f"groups={groups!r}: the tuple form is ('uniform', k) with an integer k >= 1")
    elif not (isinstance(groups, Mapping) or isinstance(groups, Callable)):
        raise ValueError(f"groups={groups!r}: expected a preset name, ('uniform', k), a mapping or a callable")
