"""Ghost norm or instantiation, decided from shapes alone (no JAX: the planner imports this module).

:func:`dpzero_jax.pergrad.use_ghost` applies these rules to a parameter's factored uses; ``dpzero plan`` applies
them to a model's shapes (:mod:`dpzero_jax.step_memory`).
"""

from __future__ import annotations

# Multiply-add equivalents per gradient element of instantiating a per-example gradient and reusing it for the
# clipped sum (write it, read it for the norm, read it for the sum); used by the "fastest" rule.
INSTANTIATION_COST = 60

# The time rule's memory bound: a per-example gradient that book-keeping would instantiate and keep for the clipped
# sum may hold at most this many times the per-example operands its ghost norm keeps instead (the ``[T, rows]`` and
# ``[T, cols]`` factors of every use; an embedding's ids count one per position). Without it ViT-B/16 at T 197,
# compiled for a v5e chip with 32 images each, instantiated every weight (the MLP's ``[768, 3072]``, 3.1x its
# operands) and held 3.7x the non-private step's temporaries. The bound keeps every weight the CPU benchmarks
# instantiate, where the time rule is what makes book-keeping faster than the non-private step: at most 1.94x
# (``experiments/bench_overhead.py``'s W3 at T 128: its untied head ``[256, 8192]``; its blocks' weights 1.6x).
# Here, on shapes, it counts elements; the program front-end also counts bytes (``pergrad.kept_outweighs_operands``).
INSTANTIATION_MEMORY_BOUND = 2


def space_rule(method: str, positions: int, size: int) -> bool:
    """Ghost (``True``) or instantiation for ``positions`` positions of a parameter of ``size`` elements when only
    the method and the shapes are known: ``"ghost"`` / ``"instantiate"`` as asked, otherwise paper 000's space rule,
    ghost iff ``2 T^2 < size``."""
    if method in ("ghost", "instantiate"):
        return method == "ghost"
    return 2 * positions ** 2 < size


def operand_elements(positions: int, dense_positions: int, rows: int, cols: int) -> int:
    """Per-example elements of a ``[rows, cols]`` parameter's factored operands: ``T (rows + cols)`` for its dense
    uses, ``T (1 + cols)`` for its embedding uses (ids and the output gradient)."""
    return dense_positions * (rows + cols) + (positions - dense_positions) * (1 + cols)


def bound_note(method: str, positions: int, dense_positions: int, rows: int, cols: int, reuse: bool = True) -> str:
    """Where the time rule's memory bound (alone) makes ``shape_rule`` pick the ghost norm, why, in words; else
    ``""``."""
    shape = (positions, dense_positions, rows, cols)
    if not shape_rule(method, *shape, reuse) or shape_rule(method, *shape, reuse, bound=False):
        return ""   # instantiated, or the ghost norm without the bound
    return (f"ghost by the time rule's memory bound: kept instantiated it would hold "
            f"{rows * cols / operand_elements(*shape):.1f}x its operands (more than {INSTANTIATION_MEMORY_BOUND}x)")


def shape_rule(method: str, positions: int, dense_positions: int, rows: int, cols: int, reuse: bool = True,
               bound: bool = True) -> bool:
    """Ghost (``True``) or instantiation by ``"mixed"`` / ``"fastest"`` (``pergrad.use_ghost``, XLA kernels) for a
    ``[rows, cols]`` parameter used at ``positions`` positions per example, ``dense_positions`` of them by dense
    (not embedding) uses; ``reuse``: whether an instantiated gradient is reused for the clipped sum, and so kept
    through the step (``"fastest"`` then instantiates only within ``INSTANTIATION_MEMORY_BOUND`` times the
    operands, :func:`operand_elements`; ``bound=False`` leaves the bound out)."""
    if method in ("ghost", "instantiate"):
        return method == "ghost"
    if method == "fastest" and dense_positions:
        operands = operand_elements(positions, dense_positions, rows, cols)
        if bound and reuse and rows * cols > INSTANTIATION_MEMORY_BOUND * operands:
            return True
        # right Grams for every pair of uses, left Grams as contractions only between dense uses (an embedding's
        # left Gram is an equality test or a gather)
        ghost_cost = positions**2 * cols + dense_positions**2 * rows
        instantiation_cost = (INSTANTIATION_COST + (0 if reuse else dense_positions)) * rows * cols
        return ghost_cost < instantiation_cost
    return 2 * positions**2 < rows * cols    # the space rule (also "fastest" for embeddings only)
