"""Reference private gradients, computed independently of the engine.

Per-example gradients come from ``jax.vmap(jax.grad(single_example_loss), in_axes=(None, 0))``; everything after
that (group norms, clip factors, clipped sum, normalisation) is plain float64 numpy written out here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

# XLA:CPU compile options that keep the suite fast on a small CPU machine (LLVM optimisation off, no fusion
# emitters): compile time drops several-fold for these tiny models; the arithmetic is the same fp32 arithmetic.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def jit(fn, **kwargs):
    """``jax.jit`` with the fast-compile options of the test suite."""
    return jax.jit(fn, compiler_options=COMPILER_OPTIONS, **kwargs)


def _name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def paths(tree) -> list[str]:
    """``"a/0/kernel"`` paths of the leaves of ``tree`` in flatten order (a trailing ``value`` attribute dropped)."""
    out = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_name(k) for k in keypath]
        if len(names) > 1 and names[-1] == "value":
            names = names[:-1]
        out.append("/".join(names))
    return out


def flat(tree) -> dict[str, np.ndarray]:
    """``{path: float64 array}`` of a pytree."""
    return {p: np.asarray(leaf, np.float64) for p, leaf in zip(paths(tree), jax.tree.leaves(tree))}


def parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else path


def per_example_grads(loss_fn: Callable, params, batch) -> dict[str, np.ndarray]:
    """``{path: [B, *shape]}`` per-example gradients by ``vmap(grad)`` of the one-example loss (float64 copies)."""

    def single_example_loss(params, example):
        return loss_fn(params, jax.tree.map(lambda x: x[None], example))[0]

    grads = jit(jax.vmap(jax.grad(single_example_loss), in_axes=(None, 0)))(params, batch)
    return flat(grads)


def per_example_losses(loss_fn: Callable, params, batch) -> np.ndarray:
    return np.asarray(jit(loss_fn)(params, batch), np.float64)


def group_assignment(groups, param_paths: Sequence[str], layer_order: Sequence[str] | None = None):
    """``(group name of each path, group names in order of first appearance in flatten order)``.

    groups: ``"all-layer"``, ``"layer-wise"``, ``"param-wise"``, ``("uniform", k)`` (needs the forward
    ``layer_order``), a mapping or a callable.
    """
    if groups == "all-layer":
        name = {p: "all" for p in param_paths}
    elif groups == "layer-wise":
        name = {p: parent(p) for p in param_paths}
    elif groups == "param-wise":
        name = {p: p for p in param_paths}
    elif isinstance(groups, tuple):
        _, k = groups
        assert layer_order is not None and sorted(layer_order) == sorted({parent(p) for p in param_paths})
        n = len(layer_order)
        # k contiguous chunks of sizes differing by at most one, the larger ones first.
        sizes = [n // k + (1 if c < n % k else 0) for c in range(k)]
        chunk, start = {}, 0
        for c, size in enumerate(sizes):
            for layer in layer_order[start:start + size]:
                chunk[layer] = f"uniform-{c}"
            start += size
        name = {p: chunk[parent(p)] for p in param_paths}
    elif isinstance(groups, Mapping):
        name = {p: str(groups[p]) for p in param_paths}
    else:
        name = {p: str(groups(p)) for p in param_paths}
    return name, list(dict.fromkeys(name[p] for p in param_paths))


def group_norms(grads: Mapping[str, np.ndarray], group_of: Mapping[str, str], names: Sequence[str]) -> np.ndarray:
    """``[B, M]`` L2 norms of the per-example gradient restricted to each group."""
    batch = next(iter(grads.values())).shape[0]
    sq = np.zeros((batch, len(names)))
    for p, g in grads.items():
        sq[:, names.index(group_of[p])] += np.sum(np.square(g).reshape(batch, -1), axis=1)
    return np.sqrt(sq)


def clip_factors(norms: np.ndarray, thresholds, clip_fn: str, gamma: float = 0.01) -> np.ndarray:
    """The clip functions of the paper, written out: abadi ``min(1, R/n)``, automatic ``R/(n+gamma)``,
    global ``1{n < R}``."""
    r = np.asarray(thresholds, np.float64)
    if clip_fn == "abadi":
        return np.minimum(1.0, r / norms)
    if clip_fn == "automatic":
        return r / (norms + gamma)
    if clip_fn == "global":
        return (norms < r).astype(np.float64)
    raise ValueError(clip_fn)


def clipped_sum(grads: Mapping[str, np.ndarray], coef: np.ndarray, group_of: Mapping[str, str],
                names: Sequence[str]) -> dict[str, np.ndarray]:
    """``{path: sum_i coef[i, m(path)] * g_i}``."""
    return {p: np.tensordot(coef[:, names.index(group_of[p])], g, axes=1) for p, g in grads.items()}


def private_grads(grads: Mapping[str, np.ndarray], groups, clip_fn: str, *, max_grad_norm: float | None = None,
                  thresholds=None, include=None, divisor: float | None = None, gamma: float = 0.01,
                  layer_order=None):
    """Noiseless reference of ``private_value_and_grad``: ``(grads {path: array}, norms [B, M], coef [B, M])``.

    include: ``[B]`` bools (default all); excluded examples get coefficient 0. divisor: default B.
    """
    param_paths = list(grads)
    group_of, names = group_assignment(groups, param_paths, layer_order)
    norms = group_norms(grads, group_of, names)
    if thresholds is None:
        thresholds = np.full(len(names), max_grad_norm / np.sqrt(len(names)))
    batch = norms.shape[0]
    include = np.ones(batch, bool) if include is None else np.asarray(include, bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        coef = np.where(include[:, None], clip_factors(norms, thresholds, clip_fn, gamma), 0.0)
    safe = {p: np.where(include.reshape((-1,) + (1,) * (g.ndim - 1)), g, 0.0) for p, g in grads.items()}
    total = clipped_sum(safe, coef, group_of, names)
    divisor = batch if divisor is None else divisor
    return {p: v / divisor for p, v in total.items()}, norms, coef


def split_threshold(values) -> float:
    """A threshold strictly inside the range of ``values`` with a wide relative margin to every value (so that
    some are clipped and some not, and the decision is robust to rounding)."""
    v = np.sort(np.asarray(values, np.float64).ravel())
    v = v[np.isfinite(v) & (v > 0)]
    lo, hi = len(v) // 4, max(len(v) * 3 // 4, len(v) // 4 + 1)
    best = max(range(lo, min(hi, len(v) - 1)), key=lambda i: v[i + 1] / v[i])
    return float(np.sqrt(v[best] * v[best + 1]))
