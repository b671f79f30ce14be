"""Temporaries of a compiled ZeRO-3 training step with ``remat='block'``: a peak model of named buffers.

What a partitioned (GSPMD) step of a scanned decoder holds on one device besides its arguments, read from the TPU
compiler's buffer assignment of the steps of ``experiments/tpu_aot.py`` (``--xla_dump_to``: the memory-usage
report's largest allocations) and written as one formula per buffer.
The step's buffers live in *phases*; the compiled step needs the buffers live throughout plus the largest phase:

``temporaries = always + max(block backward, LM head, table gradient)``

With ``b`` sequences per device of ``T`` tokens, ``L`` blocks of width ``d``, ``h`` heads, vocabulary ``V``, ``c``
bytes per activation (2 in bf16 / fp16, 4 in fp32), ``p_l`` parameters per block and ``F`` devices sharing the
ZeRO partition (the mesh's ``fsdp`` axis):

* **always**: the scan's saved block inputs, ``L b T d c`` (``remat='block'`` keeps each block's input; the
  backward of one block at a time rebuilds the rest); the backward scan's stacked gradient of the blocks, sharded,
  at the compute precision, ``c ceil(L p_l / F)``, before its cast to the fp32 gradient of the update (the fp32
  gradient shard is the planner's ``gradients`` row: with 16-bit ``parameters`` and the fp32 master, moments in
  ``optimizer state``, the rows add up to the step's fp32 parameters, moments and gradient, ``16 Psi / F``).
* **block backward** (one block, rebuilt): its weights all-gathered at the compute precision, ``c p_l``; its
  unsharded weight gradient at the compute precision before the reduce-scatter, ``c p_l``; the attention
  probabilities and their gradients, ``b h T^2`` numbers of :func:`attention_bytes` each (GPT-2: ``3 c``; Llama:
  ``4 + 4 + c``); the block's other activations, ``b T c x`` with ``x`` the per-token count of
  :func:`~dpzero_jax.decoder_shapes.activation_bytes_per_token` (GPT-2 ``8 d + 2 d_ff``).
* **LM head**: what the head gathers (:func:`head_gather`: the embedding table and the head at the compute
  precision, ``2 c V d``, or the devices' activations for a large vocabulary-sharded table); the logits,
  ``b T V x`` with ``x`` of :func:`logits_bytes` (GPT-2: the head's output and the loss's shifted slice at the compute
  precision, ``2 c``; Llama: ``4 + 2 c``).
* **table gradient** (only when the table is sharded along ``d``, i.e. ``V`` is not a multiple of ``F``, as for
  GPT-2's 50257, and the batch also spans a data axis, ``N > F``): the partitioner forms the lookup's scatter-add
  gradient and the tied head's gradient as whole ``[V, d]`` tables at the compute precision (``nnx.Embed`` casts the
  table at each use, so its gradient reaches that cast in bf16) and all-reduces them whole, ``2 c V d`` (GPT-2 XL:
  two ``all-reduce bf16[50257, 1600]``). A vocabulary-sharded table gets a sharded scatter-add: no such phase.

The DP step (``private_value_and_grad``, ghost clipping in two passes under remat, ``norm_method`` the TPU's time
rule) adds, measured the same way:

* its clipped sums in float32 (:func:`dp_float32_sums`; the privatized sum is never rounded to half precision,
  ``docs/privacy.md``): **always** the stacked per-block sums ``4 ceil(L p_l / F)``; in the **block backward** a
  block's sum unsharded, ``4 p_l`` where the non-private step holds ``c p_l``, and the LM head's sum held to the
  update, ``4 V d`` (``/ F`` for a vocabulary-sharded table); in the **LM head**, an untied head's sum formed whole,
  ``4 V d``;
* in the **LM head**, for a tied table (a lookup and the head: two sites of one leaf) that ghost book-keeps (where
  :func:`tied_table_weighted` says summing it by the second pullback's weight path would hold more): its
  per-example gradients, instantiated in fp32 (``btr,btc->brc``) with the lookup's rows scattered in, and its
  clipped sum, formed and all-reduced whole in fp32: ``4 (b + 1) V d`` for a ``d``-sharded table (GPT-2 XL when it
  was book-kept: two ``f32[50257, 1600]`` at the peak, 0.60 GiB over the non-private step at 12, 24 and 48 layers),
  ``/ F`` for a vocabulary-sharded one. A weighted table adds nothing there: GPT-2 XL's DP step (one sequence per
  chip, 2026-11-28) holds two logits-sized bf16 buffers in its LM head like the non-private step, no fp32 table,
  and allocates 0.97x the non-private step's HBM.

The ghost norms' ``T x T`` Grams of one weight at a time are small next to these (``2 b T^2`` fp32).

With LoRA (``lora_rank``; the base frozen, the adapters of :func:`~dpzero_jax.decoder_shapes.lora_weights`
trained) the same buffers, but a block's backward forms only its adapters' gradient, ``p_a`` a block (the stacked
and unsharded gradients, the DP step's float32 sums), its gathered weights are the base
block's and the adapters, ``c (p_l + p_a)``, and the frozen table has no gradient phase and no DP buffer.

The multiplicities (two gathered copies, two logits copies, ...) are the buffers counted in the compiled programs
of ``experiments/tpu_aot.py`` (GPT-2 XL on the standard-Flax-layer model, GPT-J-6B and Llama-2-7B on 256 v5e
chips); ``docs/planner.md`` lists how far the model is from the compiled bytes, on the shapes it was written from
and on others (the phases overlap in the compiled heap where this model takes their maximum, and the compiler
gathers some weights ahead of their block).

Not modelled: the TPU's tiled layouts (a sharded dimension smaller than a tile is padded: GPT-2 XL's 64-way shards
of ``d = 1600`` are 25 wide), the allocator's packing, what the compiler puts in on-chip memory (about 0.11 GiB on
v5e, outside ``memory_analysis()``'s temporaries), ``remat='dots'``, the DP options that
change the tied table's buffers (``instantiated_dtype='bfloat16'`` halves its per-example part; ``norm_method=
'mixed'`` takes its ghost norm instead: ``docs/benchmarks/tpu_aot.md``).
"""

from __future__ import annotations

import dataclasses

from dpzero_jax.decoder_shapes import DecoderConfig, lora_weights, weights
from dpzero_jax.norm_rules import INSTANTIATION_MEMORY_BOUND, shape_rule
from dpzero_jax.shard_layout import shard_axis

PHASES = ("always", "block backward", "LM head", "table gradient")


@dataclasses.dataclass(frozen=True)
class Term:
    """One named buffer (or group) of the compiled step: ``phase`` (one of :data:`PHASES`), bytes per device and
    the formula it was computed by."""

    name: str
    phase: str
    bytes: int
    formula: str


def block_parameters(config: DecoderConfig, lora_rank: int = 0) -> int:
    """``p_l``: parameters of one block (the first; every block has the same shapes); with ``lora_rank``, of its
    LoRA adapters."""
    first = "h/0" if config.family == "gpt2" else "layers/0"
    arrays = lora_weights(config, lora_rank) if lora_rank else weights(config)
    return sum(w.size for w in arrays if w.layer.startswith(first + "/") or w.layer == first)


def per_token_block_numbers(config: DecoderConfig) -> int:
    """Per-token activations of one block other than the attention probabilities (numbers at the compute precision,
    the count of :func:`~dpzero_jax.decoder_shapes.activation_bytes_per_token`)."""
    d = config.d_model
    if config.family == "gpt2":
        return 8 * d + 2 * config.mlp_width
    heads = 2 * config.n_head * config.head_size + 2 * config.kv_heads * config.head_size
    return (4 + 2 * config.sandwich_norms) * d + heads + 3 * config.mlp_width


def attention_bytes(config: DecoderConfig, compute_bytes: int) -> int:
    """Bytes per attention probability (``b h T^2`` of them) held in a block's backward. GPT-2 (the project's
    attention: scores, fp32 softmax and the cast back fuse into one kernel): the probabilities, their gradient and
    the scores' gradient at the compute precision, ``3 c``. Llama family (``jax.nn.dot_product_attention``'s XLA
    path): the fp32 probabilities and fp32 gradient, and the probabilities cast for the ``P V`` matmul,
    ``4 + 4 + c``."""
    return 3 * compute_bytes if config.family == "gpt2" else 8 + compute_bytes


def head_gather(config: DecoderConfig, b: int, t: int, c: int, shards: int, replicas: int) -> Term:
    """What the LM head gathers under ZeRO-3. A ``d``-sharded table is gathered whole: ``2 c V d`` (the lookup's
    copy and the head's, one table twice when tied). A vocabulary-sharded table is gathered only when it is smaller
    than the devices' activations (``V d <= N b T d``); otherwise the partitioner gathers the activations, ``c N b T
    d``, and each device computes the logits of all ``N b`` sequences for its ``V / F`` rows (the same bytes)."""
    v, d, n = config.vocab, config.d_model, shards * replicas
    if table_sharded_along_d(config, shards) or v * d <= n * b * t * d:
        return Term("embedding table + LM head, gathered", "LM head", 2 * c * v * d, "2 c V d (ZeRO-3)")
    return Term("activations gathered for the vocabulary-sharded head", "LM head", c * n * b * t * d,
                "c N b T d (V d > N b T d)")


def logits_bytes(config: DecoderConfig, compute_bytes: int) -> int:
    """Bytes per logit (``b T V`` of them) held in the LM head's phase. GPT-2 family: two compute-precision copies
    (the head's ``[b, T, V]`` output and the loss's shifted ``[b, T - 1, V]`` slice or its gradient; the loss's fp32
    cast fuses into its consumers), ``2 c``. Llama family: the fp32 cast for the loss and the logits and their
    gradient at the compute precision, ``4 + 2 c``."""
    return 2 * compute_bytes if config.family == "gpt2" else 4 + 2 * compute_bytes


def table_sharded_along_d(config: DecoderConfig, shards: int) -> bool:
    """Whether ``sharding.weight_spec`` shards the ``[V, d]`` embedding table along ``d`` on ``shards`` devices."""
    return shard_axis((config.vocab, config.d_model), shards) == 1


def block_remat_terms(config: DecoderConfig, batch_per_device: int, seq: int, shards: int, compute_bytes: int,
                      n_params: int, zero: int, replicas: int = 1, lora_rank: int = 0) -> tuple[Term, ...]:
    """The named buffers of a compiled DP step with ``remat='block'`` (see the module docstring): the non-private
    step's, then the DP step's extra ones (names starting with ``DP:``; :func:`non_private` leaves them out).
    ``n_params``: the trainable parameters. ``lora_rank``: LoRA on the default targets, the base frozen (gathered
    like trained weights, no gradient; only the adapters' gradients, ``p_a`` a block, are formed)."""
    b, t, c = batch_per_device, seq, compute_bytes
    d, v, h, layers = config.d_model, config.vocab, config.n_head, config.n_layer
    p_l, p_a = block_parameters(config), block_parameters(config, lora_rank) if lora_rank else 0
    p_g, g = (p_a, "p_a") if lora_rank else (p_l, "p_l")   # what a block's backward forms a gradient of
    gathered = zero == 3 and shards > 1
    terms = [
        Term("block inputs (scan carries)", "always", layers * b * t * d * c, "L b T d c"),
        Term("stacked block gradients, compute precision", "always", c * -(-layers * p_g // shards),
             f"c ceil(L {g} / F)"),
        Term("block weights, gathered", "block backward", c * (p_l + p_a) if gathered else 0,
             "c (p_l + p_a) (ZeRO-3)" if lora_rank else "c p_l (ZeRO-3)"),
        Term("block weight gradient, unsharded", "block backward", c * p_g, f"c {g}"),
        Term("attention probabilities and gradients", "block backward", b * h * t * t * attention_bytes(config, c),
             "b h T^2 x (GPT-2: 3 c; Llama: 4 + 4 + c)"),
        Term("block activations", "block backward", b * t * c * per_token_block_numbers(config), "b T c x"),
        head_gather(config, b, t, c, shards, replicas) if gathered else
        Term("embedding table + LM head, gathered", "LM head", 0, "2 c V d (ZeRO-3)"),
        Term("logits", "LM head",
             b * t * v * logits_bytes(config, c), "b T V x (GPT-2: 2 c; Llama: 4 + 2 c)"),
    ]
    d_sharded = zero == 3 and table_sharded_along_d(config, shards)
    # a d-sharded (or unsharded) table's gradients are formed whole (the partitioner's scatter-add and the head's
    # product), a vocabulary-sharded one's in shards
    table_share = -(-v * d // shards) if gathered and not d_sharded else v * d
    terms.append(Term("lookup + head table gradients, whole, compute precision", "table gradient",
                      2 * c * v * d if d_sharded and replicas > 1 and not lora_rank else 0,
                      "2 c V d (d-sharded trained table, data axis > 1)"))
    terms += dp_float32_sums(config, shards, c, p_g, g, trained_head=not lora_rank)
    booked = config.tied and not lora_rank and not tied_table_weighted(config, b, t, c)
    terms.append(Term("DP: tied table's per-example gradients (book-kept) + clipped sum, fp32", "LM head",
                      4 * (b + 1) * table_share if booked else 0,
                      "4 (b + 1) V d (tied and book-kept; / F when the table is vocabulary-sharded)"))
    return tuple(terms)


def dp_float32_sums(config: DecoderConfig, shards: int, c: int, p_g: int, g: str,
                    trained_head: bool) -> list[Term]:
    """The DP step's clipped sums, float32 on every device and across devices (never rounded before the noise,
    ``docs/privacy.md``), where the non-private step's gradients are at the compute precision ``c``:

    * the scan's stacked per-block sums, sharded, ``4 ceil(L p_g / F)``, throughout (beside the compute-precision
      stack the model keeps);
    * in a block's backward, its sum unsharded before the reduction: ``4 p_g`` where the non-private step holds
      ``c p_g``, so ``(4 - c) p_g`` more;
    * a trained LM head's sum, formed when the backward starts and held until the update, through every block's
      backward: whole, ``4 V d``, for a table sharded along ``d``, else ``4 ceil(V d / F)``; and, for an untied
      head, formed whole in the LM head's phase, ``4 V d`` (a tied table summed by its weight path adds nothing
      there; a book-kept one has its own term).

    Read from the TPU compiler's live ranges at the DP step's peak (``--xla_dump_to``, ``*live-range.txt``: GPT-J-6B's
    shape, 14 layers on 64 v5e chips: the head's ``f32[4096, 50400]``, one block's fp32 gradients at their all-reduce
    and the stacked ``f32[14, ...]`` shards) and from the large-vocabulary presets' DP - non-DP differences (Qwen2-7B
    +2.07 GiB, ``4 V d`` = 2.03)."""
    v, d, layers = config.vocab, config.d_model, config.n_layer
    held = 4 * v * d if table_sharded_along_d(config, shards) else 4 * -(-v * d // shards)
    formed = trained_head and not config.tied
    return [
        Term("DP: stacked block clipped sums, fp32", "always", 4 * -(-layers * p_g // shards),
             f"4 ceil(L {g} / F)"),
        Term("DP: block clipped sum, unsharded, fp32 (over its c bytes)", "block backward", (4 - c) * p_g,
             f"(4 - c) {g}"),
        Term("DP: LM head's clipped sum, fp32, held to the update", "block backward", held if trained_head else 0,
             "4 V d (d-sharded; else 4 ceil(V d / F))"),
        Term("DP: LM head's clipped sum, fp32, formed (untied head)", "LM head", 4 * v * d if formed else 0,
             "4 V d"),
    ]


def tied_table_weighted(config: DecoderConfig, b: int, t: int, c: int) -> bool:
    """Whether the DP step (ghost, ``norm_method`` the TPU's time rule) sums a tied ``[V, d]`` table by its weight
    path rather than book-keeping it: :func:`dpzero_jax.program.ghost.weighted`'s memory rule on the table's two
    uses (``T`` lookups, ``T`` head positions) with ``b`` sequences per device. Book-kept: ``4 V d`` (the fp32
    clipped sum) ``+ 4 b V d`` where the time rule with reuse instantiates (and its bound in bytes lets it: the fp32
    gradient within 2x the operands, the head's ``[T, V]`` and ``[T, d]`` and the lookup's ``[T, d]`` at ``c`` bytes,
    its ids at 4; ``pergrad.kept_outweighs_operands``); weighted: the scaled output gradients ``b T (V + d) c``
    ``+ 4 b V d`` where the rule without reuse instantiates."""
    v, d = config.vocab, config.d_model

    def instantiated(reuse: bool) -> bool:
        if shape_rule("fastest", 2 * t, t, v, d, reuse):
            return False
        operand_bytes = c * t * (v + 2 * d) + 4 * t
        return not (reuse and 4 * v * d > INSTANTIATION_MEMORY_BOUND * operand_bytes
                    and shape_rule("fastest", 2 * t, t, v, d, reuse=False))
    kept = 4 * v * d + (4 * b * v * d if instantiated(True) else 0)
    return b * t * (v + d) * c + (4 * b * v * d if instantiated(False) else 0) < kept


def non_private(terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """The non-private step's buffers among ``terms`` (those not named ``DP: ...``)."""
    return tuple(t for t in terms if not t.name.startswith("DP:"))


def phase_totals(terms: tuple[Term, ...]) -> dict[str, int]:
    """Bytes per phase."""
    out = {phase: 0 for phase in PHASES}
    for term in terms:
        out[term.phase] += term.bytes
    return out


def peak_bytes(terms: tuple[Term, ...]) -> int:
    """``always + max(other phases)``: the temporaries of the compiled step."""
    totals = phase_totals(terms)
    return totals["always"] + max(totals[p] for p in PHASES if p != "always")


def largest_phase(terms: tuple[Term, ...]) -> str:
    totals = phase_totals(terms)
    return max((p for p in PHASES if p != "always"), key=lambda p: totals[p])
