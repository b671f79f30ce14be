"""Temporaries of a compiled ZeRO-3 training step with ``remat='block'``: a peak model of named buffers.

What a partitioned (GSPMD) step of a scanned decoder holds on one device besides its arguments, read off the TPU
compiler's own schedule: ``experiments/hlo_liveness.py`` replays the dumped program's buffer liveness (while-loop
bodies included, where the scanned blocks' backward runs) and lists what is live at its peak; its peak equals the
compiler's ``peak_memory_in_bytes`` within 1% on the steps this model was written from. Each buffer is one formula.

A step's buffers live at different *moments*, and the compiled step needs the largest:

``temporaries = always + max(carried + LM head, backward + carried + held + block, backward + held + table gradient)``

with ``LM head`` the largest of its three phases (``table``, ``logits``, ``gradient``) and ``block`` the larger of a
block's backward at its attention and at its weight gradients. With ``b`` sequences per device of ``T`` tokens,
``L`` blocks of width ``d``, ``h`` heads, vocabulary ``V``, ``c`` bytes per activation (2 in bf16 / fp16, 4 in fp32),
``p_l`` parameters per block, ``W`` the block's largest weight matrix (the MLP's ``d x d_ff``), ``x`` the block's
per-token activations (:func:`per_token_block_numbers`), ``N`` devices and ``F`` of them sharing the ZeRO partition
(the mesh's ``fsdp`` axis; ``R = N / F`` replicas):

* **backward** (from the blocks' backward to the update): the backward scan's stacked block gradients are fp32
  shards, ``4 ceil(L p_l / F)``, of which the planner's ``gradients`` row holds ``c``: ``(4 - c) ceil(L p_l / F)``
  here (the ``parameters`` row is the blocks' 16-bit shards, live throughout). ``always`` is empty here (the
  steps without remat use it: :func:`dp_float32_sums`).
* **carried** (dead once the blocks' backward is done): the scan's saved block inputs, ``L b T d c``.
* **LM head** -- where the head runs depends on the table's layout (:func:`head_layout`). A table sharded along ``d``
  (``V`` not a multiple of ``F``: GPT-2's 50257), or a vocabulary-sharded one no larger than the devices' activations
  (``V <= N b T``), is gathered whole and the head runs on each device's tokens; a larger vocabulary-sharded table
  stays sharded and the devices' activations are gathered instead (``c N b T d``), each device computing its
  ``V / F`` rows for every sequence. *table*: the lookup's gather and the table, ``2 c V d``; *logits*: the table
  (or the activations) and two logits-sized buffers, ``2 c b T V``; *gradient*: the table (released first with a
  data axis), the logits' gradient ``c b T V`` and the head's gradient formed whole, ``c V d`` (not on at most 32
  devices: reduce-scattered as it is formed; on 65-128, not where each device's vocabulary rows are padded).
* **held** through the blocks' backward to the update: the head's gradient, whole (``c V d``) when the table is whole,
  reduce-scattered (``c V d / F``) by a windowed einsum when the table is split at most 32 ways (the compiler's
  choice, seen at ``F`` = 16 and 32 and not at 64) or at the head on 65-128 devices when larger than 630 MiB (the DP
  step's fp32 sum likewise, by its own bytes), there with ``b > 1`` also the logits' gradient (``c b T V``: the
  einsum runs after the blocks); with the activations gathered, the logits' gradient and the activations, ``c b T V +
  c N b T d`` (a tied table's lookup part, and the GPT-2 family's untied head), a Llama-family untied head nothing.
* **block** (one block's backward, rebuilt): at its *attention*, the probabilities (GPT-2 at one sequence per device:
  the probabilities and their gradient, ``2 c b h T^2``, at ``b > 1`` the fp32 probabilities too, ``(4 + 2 c) b h
  T^2``; Llama's ``jax.nn.dot_product_attention``: fp32 probabilities and their cast, ``(4 + c) b h T^2``), half the
  block's activations ``b T c x / 2`` and the largest matrix twice (gathered, and its gradient), ``2 c W``; at its
  *weights*, Llama's fp32 probabilities still live (``4 b h T^2``), half the activations and the largest matrix four
  times (gathered, its gradient and the reduction's buffers), ``4 c W`` -- twice, ``2 c W``, on at most 32 devices,
  where the compiler gathers and reduce-scatters the block's matrices in windowed einsums.
* **table gradient** (after the blocks): a ``d``-sharded trained table with a data axis (``R > 1``) gets the
  lookup's scatter-add and the head's gradient as whole tables, ``2 c V d``, beside the held one; a whole
  vocabulary-sharded one on more than 32 devices (its head's gradient not reduce-scattered at the head) the lookup's
  scatter-add, whole, and its all-reduce into a second whole table, ``2 c V d`` (:func:`lookup_gradient_all_reduced`).

The DP step (``private_value_and_grad``, ghost clipping in two passes under remat, ``norm_method`` the TPU's time rule)
sums in float32 (never rounded before the noise, ``docs/privacy.md``): on more than 32 devices a block's matrices' sums
are all-reduced whole in fp32 -- the largest's twice at the attention, ``8 W``, and three to four matrices of up to its
size at the weights (GPT-J-6B's three ``[16384, 4096]``, one ``[4096, 12288]`` and one ``[4096, 4096]``; counted ``3.5 x
4 W = 14 W``), ``(8 - 2 c) W`` and ``(14 - 4 c) W`` more than the non-private step's; on at most 32 they are
reduce-scattered and add nothing at the peak. The head's held sum is fp32, ``4 V d`` whole (``/ F`` reduce-scattered),
and on more than 32 devices a vocabulary-sharded table's sum is all-reduced whole at the end beside it (``4 V d``,
in place of the non-private step's lookup gradient and its all-reduce, ``2 c V d``); with
the activations gathered, a Llama-family untied head's second pass keeps the logits' gradient and the activations (``c b
T V + c N b T d``), a GPT-2-family one only the logits' gradient (the non-private step keeps both: ``- c N b T d``), and
a tied table that book-keeps (:func:`tied_table_weighted`) holds its per-example gradients of all ``R b`` sequences and
two per-site sums, ``4 R b V d + 16 V d / F``; a whole tied table that book-keeps forms its fp32 sum in the LM head,
``4 V d``, and, where the rule with reuse instantiates, its per-example gradients, ``4 b V d``, held through the blocks
with the logits' gradient, ``c b T V`` -- with a ghost norm the logits' gradient is held instead, twice at ``b > 1`` (a
relayout); a whole tied table summed by its weight path holds, through the first pass's
blocks, the output gradients it scales in the second (``b T (V + d) c``) and, where the rule without reuse instantiates,
the head's fp32 per-example gradients (``4 b V d``), beyond the second pass's held sums
(:func:`weight_path_first_pass`). The stacked fp32 sums are the same buffers as the non-private step's fp32 stacked
gradients.

With LoRA (``lora_rank``; the base frozen, the adapters of :func:`~dpzero_jax.decoder_shapes.lora_weights`
trained) the same buffers with the adapters' parameters ``p_a`` in the stacked gradients; the frozen base is still
gathered a matrix at a time (``2 c W``, ``4 c W``); no head gradient, no table gradient, and no DP buffer beyond
the non-private step's.

``docs/planner.md`` compares the model with the compiled steps (GPT-2 XL, GPT-J-6B, Llama-2-7B, LoRA on a
Llama-2-70B shape, smaller shapes of them and the Mistral / Llama-3 / Qwen2 / Gemma presets on 4-256 chips at one to
four sequences per chip) and lists the exceptions; shapes compiled after their predictions were written came within
10% far less often than the steps the formulas were fitted on: the compiler's choices change with the shape and the
device count. A book-kept table summed in pieces (:func:`table_sum_in_pieces`) holds neither its per-example
gradients nor a whole fp32 sum through the blocks.

Not modelled: the TPU's tiled layouts beyond the head's rows (a sharded dimension smaller than a tile is padded),
the allocator's packing and what the compiler puts in on-chip memory (``memory_analysis()``'s arguments +
temporaries exceed the peak by up to 2x for these steps: docs/planner.md), ``remat='dots'``, the DP options that
change the tied table's buffers (``instantiated_dtype``, ``norm_method='mixed'``).
"""

from __future__ import annotations

import dataclasses

from dpzero_jax.decoder_shapes import DecoderConfig, lora_weights, weights
from dpzero_jax.norm_rules import shape_rule
from dpzero_jax.shard_layout import shard_axis
from dpzero_jax.table_memory import (  # noqa: F401  (re-exported: the planner's and tests' names)
    kept_logits_gradient,
    table_sum_in_pieces,
    tied_table_instantiated,
    tied_table_weighted,
    weight_path_first_pass,
)

PHASES = ("always", "backward", "carried", "LM head: table", "LM head: logits", "LM head: gradient", "held",
          "block: attention", "block: weights", "table gradient")
HEAD_PHASES = ("LM head: table", "LM head: logits", "LM head: gradient")
BLOCK_PHASES = ("block: attention", "block: weights")
WINDOWED_EINSUM_MAX_SHARDS = 32   # up to here the compiler gathers and reduce-scatters in windowed einsums
SCATTERED_HEAD_SHARDS = (65, 128)   # a large whole vocabulary-sharded head's gradient reduce-scattered (read at 128)
SCATTERED_HEAD_MIN_BYTES = 630 * 2**20   # ... when the gradient (bf16; the DP step's fp32 sum) is larger than this
TILE_ROWS = 8   # a TPU tile's rows: a device's vocabulary rows that are no multiple of it are padded when gathered
LATE_HEAD_GRADIENT_MIN_SHARDS = 17   # from here a vocabulary-sharded head's gradient waits for the blocks


@dataclasses.dataclass(frozen=True)
class Term:
    """One named buffer (or group) of the compiled step: ``phase`` (one of :data:`PHASES`), bytes per device and
    the formula it was computed by."""

    name: str
    phase: str
    bytes: int
    formula: str


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where the LM head runs (module docstring): ``gathered`` (ZeRO-3 over more than one device: the table is
    gathered or the activations are), ``d_sharded`` (the table split along ``d``), ``whole`` (the head runs on each
    device's tokens with the whole table), ``windowed`` (ZeRO-3 over at most 32 devices: the compiler gathers and
    reduce-scatters in windowed einsums -- a whole table's head gradient and the blocks' matrices), ``scattered`` (a
    whole table's head gradient reduce-scattered as it is formed, never held whole: windowed, or a large
    vocabulary-sharded table on 65-128 devices, :func:`head_layout`), ``sum_scattered`` (the same for the DP step's
    fp32 sum), ``formed_whole`` (the non-private step forms the head's gradient whole before reducing it)."""

    gathered: bool
    d_sharded: bool
    whole: bool
    windowed: bool
    scattered: bool
    sum_scattered: bool
    formed_whole: bool


def head_layout(config: DecoderConfig, b: int, t: int, shards: int, replicas: int, zero: int,
                compute_bytes: int = 2) -> HeadLayout:
    """The layout of ``config``'s head with ``b`` sequences of ``t`` tokens per device on ``shards x replicas``
    devices at ZeRO stage ``zero``, ``compute_bytes`` per activation. ``scattered`` beyond the windowed einsum's 32
    devices: read off the TPU compiler at 128 devices (rounds 13-15, v5e 8x16 and 16x8 alike), where a large whole
    head's gradient is reduce-scattered at the head and nothing of it is live in the blocks' backward, and a small one
    is all-reduced whole and held, as every head is on 64 and 256 devices: held at 250-384 MiB in bf16 (vocabularies
    32000-49152) and 500-625 MiB in fp32 (the DP step's sums of the 32000 heads), reduce-scattered from 640 MiB (the
    fp32 sums of vocabularies 40960-49152) up; ``SCATTERED_HEAD_MIN_BYTES`` lies in that gap, and the same bound for
    both precisions is a guess. ``formed_whole`` there only where each device's vocabulary rows fill whole tiles
    (``TILE_ROWS``): else the gathered table is padded and copied, and the gradient is not formed whole (Llama-3-8B's
    1002 rows, vocabulary 98560's 770, against 98304's 768 and 128000's 1000 and Gemma's 2000, formed whole)."""
    gathered = zero == 3 and shards > 1
    d_sharded = table_sharded_along_d(config, shards)
    whole = not gathered or d_sharded or config.vocab <= shards * replicas * b * t
    windowed = gathered and shards <= WINDOWED_EINSUM_MAX_SHARDS
    low, high = SCATTERED_HEAD_SHARDS
    mid = gathered and whole and not d_sharded and low <= shards <= high
    table = config.vocab * config.d_model

    def reduce_scattered(nbytes: int) -> bool:   # a whole head's gradient (or fp32 sum) of nbytes, not held whole
        return whole and windowed or mid and nbytes > SCATTERED_HEAD_MIN_BYTES
    scattered, sum_scattered = reduce_scattered(compute_bytes * table), reduce_scattered(4 * table)
    aligned = (config.vocab // max(shards, 1)) % TILE_ROWS == 0
    formed_whole = whole and not windowed and (not scattered or aligned)
    return HeadLayout(gathered, d_sharded, whole, windowed, scattered, sum_scattered, formed_whole)


def block_parameters(config: DecoderConfig, lora_rank: int = 0) -> int:
    """``p_l``: parameters of one block (the first; every block has the same shapes); with ``lora_rank``, of its
    LoRA adapters."""
    first = "h/0" if config.family == "gpt2" else "layers/0"
    arrays = lora_weights(config, lora_rank) if lora_rank else weights(config)
    return sum(w.size for w in arrays if w.layer.startswith(first + "/") or w.layer == first)


def largest_block_matrix(config: DecoderConfig) -> int:
    """``W``: the largest weight matrix of a block (GPT-2: the MLP's ``d x d_ff``; Llama: a gated-MLP matrix)."""
    first = "h/0/" if config.family == "gpt2" else "layers/0/"
    return max(w.size for w in weights(config) if w.is_matrix and w.path.startswith(first))


def per_token_block_numbers(config: DecoderConfig) -> int:
    """``x``: a block's per-token activations other than the attention probabilities (numbers at the compute
    precision): GPT-2 ``8 d + 2 d_ff``; Llama ``(4 + 2 [sandwich norms]) d + 2 q + 2 kv`` head widths ``+ 3 d_ff``."""
    d = config.d_model
    if config.family == "gpt2":
        return 8 * d + 2 * config.mlp_width
    heads = 2 * config.n_head * config.head_size + 2 * config.kv_heads * config.head_size
    return (4 + 2 * config.sandwich_norms) * d + heads + 3 * config.mlp_width


def attention_bytes(config: DecoderConfig, compute_bytes: int, b: int = 1) -> tuple[int, int]:
    """Bytes per attention probability (``b h T^2`` of them) in a block's backward, ``(at its attention, at its
    weights)``. GPT-2 at one sequence per device (scores, fp32 softmax and the cast back fuse into one kernel): the
    probabilities and their gradient at the compute precision, ``2 c``, then none; at ``b > 1`` the fp32 probabilities
    besides them, ``4 + 2 c`` (GPT-2 XL's compiled steps at two sequences per chip: ``f32[2, 25, 2048, 2048]`` and two
    bf16 copies at T 2048, one bf16 copy at the peak at T 1024). Llama family (``jax.nn.dot_product_attention``'s XLA
    path): the fp32 probabilities and their cast for the ``P V`` matmul, ``4 + c``; the fp32 ones stay, ``4``."""
    if config.family == "gpt2":
        return (2 * compute_bytes if b == 1 else 4 + 2 * compute_bytes), 0
    return 4 + compute_bytes, 4


def table_sharded_along_d(config: DecoderConfig, shards: int) -> bool:
    """Whether ``sharding.weight_spec`` shards the ``[V, d]`` embedding table along ``d`` on ``shards`` devices."""
    return shard_axis((config.vocab, config.d_model), shards) == 1


def head_terms(config: DecoderConfig, b: int, t: int, c: int, n: int, replicas: int, layout: HeadLayout,
               trained: bool) -> list[Term]:
    """The LM head's three phases (module docstring)."""
    v, d = config.vocab, config.d_model
    table = c * v * d if layout.gathered and layout.whole else 0
    return [
        Term("embedding table + LM head, gathered", "LM head: table", 2 * table, "2 c V d (the table gathered)"),
        Term("table or activations gathered for the head", "LM head: logits",
             table if layout.whole else c * n * b * t * d, "c V d (the table gathered), else c N b T d"),
        Term("logits, two copies", "LM head: logits", 2 * c * b * t * v, "2 c b T V"),
        Term("table gathered (as for the logits)", "LM head: gradient",
             0 if layout.d_sharded and replicas > 1 else table,
             "c V d (the table gathered; released first with a data axis, R > 1)"),
        Term("logits gradient", "LM head: gradient", c * b * t * v, "c b T V"),
        Term("LM head gradient, formed whole", "LM head: gradient",
             c * v * d if trained and layout.formed_whole else 0,
             "c V d (the table whole; not where reduce-scattered as formed: F <= 32, or 65-128 with rows padded)"),
    ]


def held_term(config: DecoderConfig, b: int, t: int, c: int, n: int, shards: int, layout: HeadLayout,
              trained: bool) -> Term:
    """What the head's backward leaves for the update, held through every block's backward."""
    v, d = config.vocab, config.d_model
    name = "LM head gradient (or what forms it), held to the update"
    if not trained:
        return Term(name, "held", 0, "0 (frozen)")
    if layout.scattered:
        return Term(name, "held", c * -(-v * d // shards) + waiting_logits_gradient(layout, b, t, v, c),
                    "c V d / F (reduce-scattered: F <= 32, or 65-128) [+ c b T V, the logits' gradient, at b > 1 "
                    "on F <= 32]")
    if layout.whole:
        return Term(name, "held", c * v * d, "c V d (the table whole)")
    if config.tied or config.family == "gpt2" or late_head_gradient(layout, shards):
        return Term(name, "held", c * b * t * v + c * n * b * t * d,
                    "c b T V + c N b T d (GPT-2 family, tied, or on more than 16 devices)")
    return Term(name, "held", 0, "0 (a Llama-family untied head, activations gathered)")


def lookup_gradient_all_reduced(layout: HeadLayout, c: int, v: int, d: int) -> int:
    """The non-private step's lookup gradient after the blocks: a whole vocabulary-sharded table's scatter-add, whole,
    and its all-reduce into a second whole table, ``2 c V d``, beside the held head gradient, on more than 32 devices
    where the head's gradient is not reduce-scattered at the head (the compiler's own list at the peak of an 8-layer
    Llama-2-7B at vocabulary 128000 on 256 chips: ``bf16[128000, 4096]`` three times)."""
    if layout.gathered and layout.whole and not layout.d_sharded and not layout.scattered:
        return 2 * c * v * d
    return 0


def late_head_gradient(layout: HeadLayout, shards: int) -> bool:
    """Whether a vocabulary-sharded head (activations gathered) has the non-private step form its gradient after the
    blocks' backward, holding the logits' gradient and the gathered activations through it: on more than 16 devices
    (``LATE_HEAD_GRADIENT_MIN_SHARDS``), read off Llama-family untied heads at vocabularies 32000-152064 -- on 32
    chips at T 1024 and 2048, Llama-2-7B's and Qwen2-7B's widths, every step held them (``bf16[32, 2047, 4752]`` and
    ``bf16[32, 2048, 3584]`` in Qwen2-7B's), and Qwen2-7B on 64 (round 12); on 16 chips none did."""
    return not layout.whole and shards >= LATE_HEAD_GRADIENT_MIN_SHARDS


def waiting_logits_gradient(layout: HeadLayout, b: int, t: int, v: int, c: int) -> int:
    """The logits' gradient ``c b T V`` a windowed whole head holds through the blocks at ``b > 1``, waiting for the
    windowed einsum after them (GPT-2 XL at two sequences per chip on 32: ``bf16[2, 1024, 50257]`` live in the blocks'
    backward; at one sequence it was not); 0 otherwise."""
    return c * b * t * v if layout.windowed and layout.whole and b > 1 else 0


def block_terms(config: DecoderConfig, b: int, t: int, c: int, w: int, windowed: bool) -> list[Term]:
    """One block's backward, rebuilt, at its attention and at its weight gradients (module docstring);
    ``windowed``: ZeRO-3 over at most 32 devices, where the compiler gathers and reduce-scatters a block's matrices
    in windowed einsums (two copies of the largest, ``w`` elements, at its weights, not four)."""
    h, x = config.n_head, per_token_block_numbers(config)
    copies = 2 if windowed else 4
    at_attention, residue = attention_bytes(config, c, b)
    return [
        Term("attention probabilities (+ gradient)", "block: attention", b * h * t * t * at_attention,
             "b h T^2 x (GPT-2: 2 c at b = 1, 4 + 2 c at b > 1; Llama: 4 + c)"),
        Term("block activations, half", "block: attention", b * t * c * x // 2, "b T c x / 2"),
        Term("largest block matrix, twice (gathered, its gradient)", "block: attention", 2 * c * w, "2 c W"),
        Term("attention probabilities, fp32, through the block", "block: weights", b * h * t * t * residue,
             "b h T^2 x (GPT-2: 0; Llama: 4)"),
        Term("block activations, half", "block: weights", b * t * c * x // 2, "b T c x / 2"),
        Term("largest block matrix, gathered, gradient (and reduction)", "block: weights", copies * c * w,
             "4 c W (2 c W on at most 32 devices)"),
    ]


def block_remat_terms(config: DecoderConfig, batch_per_device: int, seq: int, shards: int, compute_bytes: int,
                      zero: int, replicas: int = 1, lora_rank: int = 0) -> tuple[Term, ...]:
    """The named buffers of a compiled DP step with ``remat='block'`` (see the module docstring): the non-private
    step's, then the DP step's extra ones (names starting with ``DP:``; :func:`non_private` leaves them out).
    ``lora_rank``: LoRA on the default targets, the base frozen (gathered like trained weights, no gradient; only
    the adapters' gradients, ``p_a`` a block, are formed)."""
    b, t, c = batch_per_device, seq, compute_bytes
    d, v, layers, n = config.d_model, config.vocab, config.n_layer, shards * replicas
    p_g, g = (block_parameters(config, lora_rank), "p_a") if lora_rank else (block_parameters(config), "p_l")
    trained, w = not lora_rank, largest_block_matrix(config)
    layout = head_layout(config, b, t, shards, replicas, zero, c)
    held = held_term(config, b, t, c, n, shards, layout, trained)
    table_gradient = 2 * c * v * d if layout.gathered and layout.d_sharded and replicas > 1 and trained else 0
    lookup = lookup_gradient_all_reduced(layout, c, v, d) if trained else 0
    terms = [
        Term("stacked block gradients, fp32, beyond the gradients row", "backward",
             (4 - c) * -(-layers * p_g // shards), f"(4 - c) ceil(L {g} / F)"),
        Term("block inputs (scan carries)", "carried", layers * b * t * d * c, "L b T d c"),
        *head_terms(config, b, t, c, n, replicas, layout, trained),
        held,
        *block_terms(config, b, t, c, w, layout.windowed),
        Term("lookup + head table gradients, whole, compute precision", "table gradient", table_gradient,
             "2 c V d (d-sharded trained table, R > 1)"),
        Term("lookup's gradient, whole, and its all-reduce, compute precision", "table gradient", lookup,
             "2 c V d (a whole vocabulary-sharded table, more than 32 devices; not reduce-scattered at the head)"),
    ]
    if trained:
        terms += dp_block_terms(config, b, t, c, n, shards, replicas, w, layout, held.bytes)
    return tuple(terms)


def dp_block_terms(config: DecoderConfig, b: int, t: int, c: int, n: int, shards: int, replicas: int, w: int,
                   layout: HeadLayout, held: int) -> list[Term]:
    """The DP step's buffers beyond the non-private step's with ``remat='block'`` (module docstring): fp32 sums
    where the non-private step's gradients are at ``c`` bytes, and what its second pass keeps."""
    v, d = config.vocab, config.d_model
    booked = config.tied and not tied_table_weighted(config, b, t, c)
    whole_sums = not layout.windowed        # on at most 32 devices the sums are reduce-scattered as formed
    terms = [
        Term("DP: largest block matrix's sums in fp32, at the attention", "block: attention",
             (8 - 2 * c) * w if whole_sums else 0, "(8 - 2 c) W (more than 32 devices)"),
        Term("DP: the block's matrices' sums in fp32, at the weights", "block: weights",
             (14 - 4 * c) * w if whole_sums else 0, "(14 - 4 c) W (more than 32 devices)"),
        # b > 1 on at most 32 devices: all the block's activations at the attention (GPT-J's bf16[4, 1024, 16384] x 3)
        Term("DP: the block's other half of activations, at the attention (b > 1, at most 32 devices)",
             "block: attention", b * t * c * per_token_block_numbers(config) // 2 if layout.windowed and b > 1 else 0,
             "b T c x / 2 (b > 1, at most 32 devices)"),
    ]
    if layout.whole:
        shard = -(-v * d // shards)
        share = shard if layout.sum_scattered else v * d      # the DP step's fp32 sum as held
        held_share = shard if layout.scattered else v * d     # the non-private step's gradient as held
        # book-kept: the per-example gradients where the rule with reuse instantiates them (else the norm is ghost:
        # the head's output gradient kept, with a relayout of it at b > 1); a table summed in pieces from its uses'
        # factors holds them only for the norm (decided by the rule without reuse), at the head, and no whole fp32
        # sum. A windowed head at b > 1 already holds the logits' gradient in the non-private step (held_term): not
        # counted twice
        # on 65-128 devices (the head's gradient reduce-scattered, not windowed) a tied table summed by its weight
        # path holds the head's fp32 share whole through the second pass's blocks (f32[256000, 2048] in Gemma-2B's
        # step on 128 chips) and only the output gradients through the first's
        at_head = layout.sum_scattered and not layout.windowed   # 65-128 devices: the fp32 sum scattered at the head
        weight_path_whole = at_head and config.tied and not booked
        fp32_held = 4 * (v * d if weight_path_whole else share) - c * held_share
        second_pass = held + fp32_held
        first_pass = weight_path_first_pass(config, b, t, c, per_example_held=not at_head)
        pieces = table_sum_in_pieces(config, shards)
        instantiated = booked and tied_table_instantiated(config, t, c, reuse=not pieces)
        in_pieces = instantiated and pieces
        per_example = 4 * b * v * d if instantiated and not in_pieces else 0
        kept = c * b * t * v if instantiated else kept_logits_gradient(b, t, v, c)
        kept_outputs = kept - waiting_logits_gradient(layout, b, t, v, c)
        terms += [
            Term("DP: tied table's weight path, first pass (output gradients, per-example gradients)", "held",
                 max(0, first_pass - second_pass) if config.tied and not booked else 0,
                 "b T (V + d) c [+ 4 b V d; not on 65-128], less the second pass's held sums (tied, weight path)"),
            Term("DP: LM head's clipped sum, fp32, held", "held", 0 if in_pieces else fp32_held,
                 "4 V d - c V d (each / F where reduce-scattered; none summed in pieces; a tied weight path's fp32 "
                 "share whole on 65-128)"),
            Term("DP: LM head's clipped sum, fp32, all-reduced whole at the end", "table gradient",
                 0 if layout.d_sharded or layout.sum_scattered else 4 * v * d,
                 "4 V d (a vocabulary-sharded table, more than 32 devices; not 65-128)"),
            Term("DP: the lookup's compute-precision gradient and its all-reduce, not formed", "table gradient",
                 -lookup_gradient_all_reduced(layout, c, v, d),
                 "- 2 c V d (the non-private step's, where counted; the fp32 sums above)"),
            # on 65-128 devices the fp32 sum is formed whole at the head beside the logits' gradient, the gathered
            # table released first (f32[4096, 128256] and bf16[1, 2047, 128256] alone at Llama-3-8B's DP peak)
            Term("DP: LM head's clipped sum, fp32, formed whole at the head (the table released)", "LM head: gradient",
                 (4 - c) * v * d - (c * v * d if layout.formed_whole else 0) if at_head and not booked else 0,
                 "4 V d - c V d [- c V d formed whole] (a large vocabulary-sharded table on 65-128 devices; not "
                 "book-kept)"),
            Term("DP: tied table's per-example gradients (book-kept) + clipped sum, fp32", "LM head: logits",
                 (4 * b * v * d if in_pieces else 4 * v * d + per_example) if booked else 0,
                 "4 V d [+ 4 b V d instantiated]; 4 b V d summed in pieces (tied and book-kept)"),
            Term("DP: tied table's per-example gradients (book-kept) + logits gradient, held", "held",
                 per_example + kept_outputs if booked else 0,
                 "4 b V d + c b T V instantiated (c b T V summed in pieces), else c b T V (twice at b > 1), less "
                 "the windowed head's c b T V at b > 1 (tied and book-kept)"),
        ]
    elif config.tied and not booked:
        # a vocabulary-sharded head (activations gathered over the N devices): the weight path's norm after the blocks,
        # read off three compiled steps of Gemma's sizes (round 11-12; fitted on them, 0.95-1.08): the fp32
        # per-example gradient where the rule without reuse instantiates it (the head's rows for all N b examples,
        # f32[64, 4000, 2048] on Gemma-2B's on 64 v5e chips, or the lookup's scattered into a whole f32[256000,
        # 2048]: 4 b V d at the compiler's peak; its replayed liveness holds both); then the logits' gradient's T x T
        # Grams of every gathered sequence in fp32, all-reduced over the vocabulary shards (f32[64, 2048, 2048]), and
        # a relayout of the logits' gradient (a second bf16[64, 2047, 4000]); the norm ghost, the Grams' all-reduce
        # beside its input (two f32[64, 2048, 2048] in the compiler's own list at Gemma-2-2B's sizes' peak on 64
        # chips, round 18; the replay had read the logits' gradient's columns gathered at the ids, c N b T^2)
        instantiated = tied_table_instantiated(config, t, c, reuse=False)
        norm = 4 * b * v * d if instantiated else 4 * n * b * t * t
        terms.append(Term("DP: tied table's weight path, its norm after the blocks (fp32 per-example gradients or "
                          "the Grams' all-reduce, fp32 Grams, a relayout of the logits' gradient)", "table gradient",
                          norm + 4 * n * b * t * t + c * b * t * v,
                          "4 b V d (instantiated; ghost: 4 N b T^2) + 4 N b T^2 + c b T V (tied, weight path, the "
                          "head on the device's vocabulary rows)"))
    elif not config.tied and config.family == "gpt2":
        # the non-private step keeps the gathered activations for the head's gradient; the DP step does not
        terms.append(Term("DP: gathered activations not held (the second pass keeps the logits' gradient only)",
                          "held", -min(held, c * n * b * t * d), "- c N b T d"))
    elif not config.tied and layout.windowed and late_head_gradient(layout, shards):
        # the DP step norms the head where its output gradient is formed (a ghost site) and sums it in the second
        # pass: on 17-32 devices it holds neither through the blocks (on 64 chips Qwen2-7B's held both, as the
        # non-private step: the next branch adds nothing there); at the head, the norm's fp32 buffer for every
        # gathered sequence (the T x T Grams: f32[32, 2048, 2048] on 32 chips) and a relayout of the logits' gradient
        norm = 4 * n * b * t * t if shape_rule("fastest", t, t, d, v, reuse=False) else 4 * b * v * d
        terms += [Term("DP: logits gradient + gathered activations not held (normed at the head, summed in the "
                       "second pass)", "held", -held, "- (c b T V + c N b T d)"),
                  Term("DP: the head's norm for every gathered sequence (fp32) + a relayout of the logits' gradient",
                       "LM head: gradient", norm + c * b * t * v, "4 N b T^2 (ghost; instantiated 4 b V d) + c b T V")]
    elif not config.tied:
        terms.append(Term("DP: logits gradient + gathered activations, held for the second pass", "held",
                          max(0, c * b * t * v + c * n * b * t * d - held),
                          "c b T V + c N b T d, less the non-private step's"))
    elif booked:
        kept = 4 * replicas * b * v * d + 16 * -(-v * d // shards)
        terms.append(Term("DP: tied table's per-example gradients (book-kept) + per-site sums, fp32, held", "held",
                          max(0, kept - held), "4 R b V d + 16 V d / F, less the non-private step's"))
    return terms


def dp_float32_sums(config: DecoderConfig, shards: int, c: int, p_g: int, g: str,
                    trained_head: bool) -> list[Term]:
    """The DP step's clipped sums without remat, float32 on every device and across devices (never rounded before
    the noise, ``docs/privacy.md``), where the non-private step's gradients are at the compute precision ``c``:

    * the scan's stacked per-block sums, sharded, ``4 ceil(L p_g / F)``, throughout (beside the compute-precision
      stack the model keeps);
    * in a block's backward, its sum unsharded before the reduction: ``4 p_g`` where the non-private step holds
      ``c p_g``, so ``(4 - c) p_g`` more;
    * a trained LM head's sum, formed when the backward starts and held until the update, through every block's
      backward: whole, ``4 V d``, for a table sharded along ``d``, else ``4 ceil(V d / F)``; and, for an untied
      head, formed whole in the LM head's phase, ``4 V d``.

    Read from the TPU compiler's live ranges at the DP step's peak (``--xla_dump_to``, ``*live-range.txt``) of
    steps without remat and from the large-vocabulary presets' DP - non-DP differences (Qwen2-7B +2.07 GiB,
    ``4 V d`` = 2.03)."""
    v, d, layers = config.vocab, config.d_model, config.n_layer
    held = 4 * v * d if table_sharded_along_d(config, shards) else 4 * -(-v * d // shards)
    formed = trained_head and not config.tied
    return [
        Term("DP: stacked block clipped sums, fp32", "always", 4 * -(-layers * p_g // shards),
             f"4 ceil(L {g} / F)"),
        Term("DP: block clipped sum, unsharded, fp32 (over its c bytes)", "block: weights", (4 - c) * p_g,
             f"(4 - c) {g}"),
        Term("DP: LM head's clipped sum, fp32, held to the update", "held", held if trained_head else 0,
             "4 V d (d-sharded; else 4 ceil(V d / F))"),
        Term("DP: LM head's clipped sum, fp32, formed (untied head)", "LM head: logits", 4 * v * d if formed else 0,
             "4 V d"),
    ]


def non_private(terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """The non-private step's buffers among ``terms`` (those not named ``DP: ...``)."""
    return tuple(t for t in terms if not t.name.startswith("DP:"))


def phase_totals(terms: tuple[Term, ...]) -> dict[str, int]:
    """Bytes per phase."""
    out = {phase: 0 for phase in PHASES}
    for term in terms:
        out[term.phase] += term.bytes
    return out


def largest_phase(terms: tuple[Term, ...]) -> str:
    """The moment of the peak beyond ``always`` (see :func:`peak_bytes`)."""
    return max(_moments(phase_totals(terms)).items(), key=lambda item: item[1])[0]


def peak_bytes(terms: tuple[Term, ...]) -> int:
    """The temporaries of the compiled step: ``always`` plus the largest moment: ``carried + LM head`` (any of its
    phases; the backward has not started), ``backward + carried + held + block`` (either block phase), ``backward +
    held + table gradient`` (the block inputs dead once the blocks' backward is done)."""
    totals = phase_totals(terms)
    return totals["always"] + max(_moments(totals).values())


def _moments(totals: dict[str, int]) -> dict[str, int]:
    moments = {f"carried + {p}": totals["carried"] + totals[p] for p in HEAD_PHASES}
    moments.update({f"backward + carried + held + {p}": totals["backward"] + totals["carried"] + totals["held"]
                    + totals[p] for p in BLOCK_PHASES})
    moments["backward + held + table gradient"] = totals["backward"] + totals["held"] + totals["table gradient"]
    return moments
