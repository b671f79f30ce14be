"""Which dimension of a weight ZeRO splits over the ``fsdp`` devices, and how a split table's clipped sum is cut into
pieces (:func:`piece_bounds`); no JAX: the planner uses both.

One dimension per weight, divisible by the number of devices: preferably one whose shards keep a dimension that is a
multiple of 128, then the largest, then the first. A TPU lays an array out in tiles of 8 x 128 32-bit elements over
its two minor dimensions (the compiler picks which two for a step's parameters), so a shard with no dimension that
fills the 128 lanes is padded: GPT-2 XL's MLP kernel ``[48, 1600, 6400]`` on 64 devices split along its largest
dimension gives shards ``[48, 1600, 100]``, laid out ``1600`` minor and padded to ``1664``; split along ``1600``,
``[48, 25, 6400]``, nothing pads (``6400`` minor, ``48`` second-minor). Measured on v5e:16x16 (``docs/benchmarks/
tpu_aot.md``): GPT-2 XL's ZeRO-3 model states take 1.028x their parameters' bytes, 1.054x when each weight is split
on its largest dimension. Where every split keeps such a dimension (Llama's ``[32000, 4096]`` table on 256 devices:
``[125, 4096]`` or ``[32000, 16]``) or none does (toy widths), the largest is split, as the rule was before: a
preference for the least padding alone would move a toy model's ``[64, 32]`` embedding table from its vocabulary
split to ``d``, and the partitioner then moves the LM head's activations between devices (``tests/test_spmd.py``).
Elsewhere than on TPU the choice costs nothing: any split dimension moves the same bytes.
"""

from __future__ import annotations

import math

DEFAULT_MIN_SHARD_ELEMENTS = 1024
# a lookup table's float32 clipped sum above this is formed in pieces at ZeRO-3 (``ShardingRules.sum_chunk_bytes``)
DEFAULT_SUM_CHUNK_BYTES = 64 * 2**20
LANES = 128   # a TPU tile's minor dimension (tiles are 8 x 128 32-bit elements)


def fills_lanes(shape: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` has a dimension the TPU can lay out minor without padding (a multiple of
    :data:`LANES`)."""
    return any(int(n) % LANES == 0 for n in shape)


def shard_axis(shape: tuple[int, ...], fsdp: int, min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS
               ) -> int | None:
    """The dimension of a weight of ``shape`` split over ``fsdp`` devices (see the module docstring), or ``None``
    (replicated: one device, a tensor under ``min_shard_elements`` elements, or no dimension ``fsdp`` divides)."""
    if fsdp == 1 or len(shape) == 0 or math.prod(shape) < min_shard_elements:
        return None
    divisible = [axis for axis, size in enumerate(shape) if size % fsdp == 0]
    if not divisible:
        return None

    def waste_then_size(axis):
        shard = tuple(size // fsdp if a == axis else size for a, size in enumerate(shape))
        return not fills_lanes(shard), -shape[axis], axis
    return min(divisible, key=waste_then_size)


def piece_bounds(shape, dim: int | None, chunk_bytes: int):
    """How ZeRO-3 forms a lookup table's clipped sum (``dpzero_jax.program.zero3``; the planner counts it too):
    ``(axis, [(lo, hi), ...])``: a 2-D leaf split on ``dim``, its float32 sum cut along the other axis into pieces
    of at most ``chunk_bytes``; None when the leaf is not 2-D, not split, or its sum fits in one piece."""
    shape = tuple(shape)
    if dim is None or len(shape) != 2:
        return None
    extent = shape[1 - dim]
    pieces = min(extent, -(-4 * math.prod(shape) // chunk_bytes))
    if pieces < 2:
        return None
    return 1 - dim, [(k * extent // pieces, (k + 1) * extent // pieces) for k in range(pieces)]
