"""A tied or large embedding table's buffers in a compiled DP step, at shape level: which of the engine's rules
applies to a ``[V, d]`` table (book-kept or summed by its weight path, instantiated or ghost-normed, summed in
pieces) and what its weight path holds through the first pass. The engine decides these from the traced program
(:mod:`dpzero_jax.program.ghost`, :mod:`dpzero_jax.program.mode`); :mod:`dpzero_jax.step_memory` counts their
buffers from these shape-level versions of the same rules (``tests/test_ghost_weighted.py`` checks one against the
other)."""

from __future__ import annotations

from dpzero_jax.decoder_shapes import DecoderConfig
from dpzero_jax.norm_rules import INSTANTIATION_MEMORY_BOUND, shape_rule
from dpzero_jax.shard_layout import DEFAULT_SUM_CHUNK_BYTES, piece_bounds, shard_axis


def table_sum_in_pieces(config: DecoderConfig, shards: int) -> bool:
    """Whether the DP step forms the ``[V, d]`` table's clipped sum in pieces from its uses' factors (a book-kept
    table split over ``shards`` whose float32 sum exceeds ``ShardingRules.sum_chunk_bytes``, the default: the
    engine's :func:`~dpzero_jax.shard_layout.piece_bounds`), not from kept per-example gradients."""
    shape = (config.vocab, config.d_model)
    return piece_bounds(shape, shard_axis(shape, shards), DEFAULT_SUM_CHUNK_BYTES) is not None


def tied_table_instantiated(config: DecoderConfig, t: int, c: int, reuse: bool) -> bool:
    """Whether the time rule (``norm_method`` the TPU's) instantiates a tied ``[V, d]`` table's per-example gradient
    (``T`` lookups, ``T`` head positions), with ``reuse`` (book-keeping: kept for the clipped sum, and only where its
    bound in bytes lets it: the fp32 gradient within 2x the operands, the head's ``[T, V]`` and ``[T, d]`` and the
    lookup's ``[T, d]`` at ``c`` bytes, its ids at 4; ``pergrad.kept_outweighs_operands``) or without (the weight
    path: for the norm alone)."""
    v, d = config.vocab, config.d_model
    if shape_rule("fastest", 2 * t, t, v, d, reuse):
        return False
    operand_bytes = c * t * (v + 2 * d) + 4 * t
    return not (reuse and 4 * v * d > INSTANTIATION_MEMORY_BOUND * operand_bytes
                and shape_rule("fastest", 2 * t, t, v, d, reuse=False))


def tied_table_weighted(config: DecoderConfig, b: int, t: int, c: int) -> bool:
    """Whether the DP step (ghost, ``norm_method`` the TPU's time rule) sums a tied ``[V, d]`` table by its weight
    path rather than book-keeping it: :func:`dpzero_jax.program.ghost.weighted`'s memory rule on the table's two
    uses with ``b`` sequences per device. Book-kept: ``4 V d`` (the fp32 clipped sum) ``+ 4 b V d`` where the rule
    with reuse instantiates (:func:`tied_table_instantiated`); weighted: the scaled output gradients ``b T (V + d)
    c`` ``+ 4 b V d`` where the rule without reuse instantiates (the engine's count; what the compiled step holds is
    :func:`weight_path_first_pass`)."""
    v, d = config.vocab, config.d_model
    kept = 4 * v * d + (4 * b * v * d if tied_table_instantiated(config, t, c, reuse=True) else 0)
    weighted = b * t * (v + d) * c + (4 * b * v * d if tied_table_instantiated(config, t, c, reuse=False) else 0)
    return weighted < kept


def kept_logits_gradient(b: int, t: int, v: int, c: int) -> int:
    """The head's output gradient kept for a tied table's norm or second pullback, ``c b T V``, twice at ``b > 1``:
    the compiler keeps a relayout of it beside it (two ``bf16[2, 1023, 50257]`` in GPT-2 XL's step at two sequences
    per chip; at one sequence the relayout is a bitcast)."""
    return c * b * t * v * (1 if b == 1 else 2)


def weight_path_first_pass(config: DecoderConfig, b: int, t: int, c: int, per_example_held: bool = True) -> int:
    """Bytes per device a tied table summed by its weight path holds through the first pass's blocks: the sites' output
    gradients, kept at ``c`` bytes to be scaled in the second pullback, ``b T (V + d) c`` (the head's twice at ``b >
    1``: :func:`kept_logits_gradient`), and, where the rule without reuse instantiates, the head's per-example gradients
    in fp32 until the lookup's are added to them for the norm, ``4 b V d`` (both read off the TPU-compiled step of a
    6-layer GPT-2 of width 1536 at ``T`` 2048 on 16 chips: ``f32[50257, 1536]`` and ``bf16[1, 2047, 50257]`` live in its
    first backward scan). The engine forms the norm after the first pullback; the compiler may schedule the head's
    contraction before the blocks (that step) or after them (GPT-2 XL's width, 8 layers on 32 chips, where only the
    output gradients are held): counted held, the larger. ``per_example_held=False``: the output gradients only (on
    65-128 devices, where the per-example gradients are formed after the blocks)."""
    v, d = config.vocab, config.d_model
    instantiated = per_example_held and tied_table_instantiated(config, t, c, reuse=False)
    per_example = 4 * b * v * d if instantiated else 0
    return kept_logits_gradient(b, t, v, c) + b * t * d * c + per_example
