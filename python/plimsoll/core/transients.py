"""Every compute transient the engine holds beside the pool, and the prefill-chunk rule, pure.

Admission counts these in its transient reserve (:func:`transient_floor`), launch derives the
worker's ``--transient-bytes`` from that reserve, and the worker sizes each prefill chunk
(:func:`prefill_chunk`) and each decode batch (:func:`decode_transient_bytes`) to stay under
it. All of them call this module, so they agree to the byte. No mlx: the figures come from a
model's :class:`~plimsoll.core.model_facts.ModelFacts`. Units: bytes and tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plimsoll.core.sizing import reserve_for_compute

if TYPE_CHECKING:  # pragma: no cover
    from plimsoll.core.model_facts import ModelFacts

# Activations and attention scores are counted at 4 bytes (float32) whatever the model's
# dtype: mlx's CPU attention and softmax run in float32, and it is the upper bound.
_ACT_BYTES = 4

#: The per-step prompt budget (``--prefill-chunk``) by default. On a CPU a chunk's compute
#: is what the running streams wait for, so it stays small. On a GPU every chunk at a prefix
#: costs a fixed ~40-55 ms of attention-plan build on MLX's CUDA backend (a new key length
#: each chunk; bench/results/cuda-attention-h200.md), so bigger chunks, as mlx_lm.server's
#: 2048-token prefill steps, pay it for more tokens; a 2048 chunk delays streams ~0.1 s.
PREFILL_CHUNK = 512
PREFILL_CHUNK_FUSED = 2048

#: Layers of a heavy step's forward the engine lets the device hold at once
#: (:class:`plimsoll.engine.attention.Pacer`): at each layer it submits that layer and waits
#: for the one this many layers back. Unpaced, MLX's CUDA backend encodes most of a forward
#: ahead and keeps every op's inputs until its graph completes, so a chunk held many layers'
#: gathers and activations (measured on an H200, bench/results/agentic-memory-h200-2026-12-03.md:
#: up to 7.4 GiB above the pool for a 2048-token chunk at 16k, 1.0-1.25 GiB paced at 2).
PREFILL_LAYER_WINDOW = 2
#: what one paced step holds: the window queued on the device and the layer being built
LAYERS_IN_FLIGHT = PREFILL_LAYER_WINDOW + 1
#: A step is paced when one of its layers touches this many tokens (chunk tokens plus the
#: context slots its attention gathers): below it a whole forward in flight is small, and a
#: decode step is not slowed by waits.
PACE_FROM_TOKENS = 1024


def paced(chunk_tokens: int, gathered_tokens: int) -> bool:
    """Is a step whose layers each compute ``chunk_tokens`` prompt tokens and gather
    ``gathered_tokens`` context slots paced (:data:`PREFILL_LAYER_WINDOW`)?"""
    return chunk_tokens + gathered_tokens >= PACE_FROM_TOKENS


def decode_fits_unpaced(step_bytes: int, layers: int, budget: int | None) -> bool:
    """May a decode step that :func:`paced` names heavy run unpaced after all? Yes where
    every one of its ``layers`` in flight at once — ``step_bytes`` (its
    :func:`decode_transient_bytes`, which counts :data:`LAYERS_IN_FLIGHT` layers) per
    in-flight layer times ``layers`` — stays within ``budget``, the transient admission
    reserved for the worker (None: not known, so pace). Pacing waits for the device at every
    layer: a single stream at a few thousand tokens would pay that on every step although
    the reserve, sized for the widest batch at the longest context, holds its whole forward."""
    if budget is None:
        return False
    return -(-step_bytes // LAYERS_IN_FLIGHT) * layers <= budget


def gather_transient_bytes(facts: ModelFacts, batch_tokens: int) -> int:
    """Bytes of the gather one attention call reads through: K and V of ``batch_tokens``
    slots of one layer, twice (the gather plus its cast to the queries' dtype when the pool
    dtype differs; otherwise headroom for the next layer's gather in flight).

    The engine gathers whole blocks: a decode batch reads ``rows × longest`` slots with
    ``longest`` rounded up to a whole block, a prefill chunk its table's blocks up to
    ``start + chunk``. A single table of consecutive blocks is read as a view and needs
    none of this: the figure is an upper bound.
    """
    if facts.kv_layers == 0 or batch_tokens <= 0:
        return 0
    per_layer_token = facts.kv_bytes_per_token // facts.kv_layers  # K and V of one layer
    return 2 * per_layer_token * batch_tokens


def dequant_transient_bytes(facts: ModelFacts, tokens: int) -> int:
    """Quantized KV only: the float copy of K and V of ``tokens`` slots of one layer that a
    prefill chunk attends through (engine/quantized.py dequantizes its gathered context;
    a decode on CUDA too, so a decode batch counts it on every backend); 0 for float pools."""
    if not facts.kv_bits or tokens <= 0:
        return 0
    return 2 * facts.num_key_value_heads * facts.head_dim * facts.kv_dtype_bytes * tokens


def _per_chunk_token_bytes(facts: ModelFacts, context: int, fused: bool = False) -> int:
    """Transient bytes one more query token adds: its attention scores against
    ``context`` keys and their softmax (mlx's unfused attention holds both; a fused kernel,
    ``fused``, holds only tiles of them), and its activations in one layer."""
    heads = facts.num_attention_heads or facts.num_key_value_heads
    hidden = facts.hidden_size or heads * facts.head_dim
    inter = facts.intermediate_size or 4 * hidden
    # scores and softmax (none in a fused attention); MLA also holds its positional scores
    # and their masked copy, the additive mask it hands the attention, fused or not
    arrays = (0 if fused else 2) + (2 if facts.prefill_expand_per_token else 0)
    scores = arrays * heads * context * _ACT_BYTES
    acts = (4 * hidden + 3 * inter + 2 * heads * facts.head_dim) * _ACT_BYTES
    return scores + acts


#: the fewest tokens of one split of the paged decode kernel (engine/paged_cuda.py): each split
#: of a row's context leaves one partial result per query head (counted here at the most
#: splits, one per this many tokens; the kernel takes fewer where rows × KV heads fill the GPU)
DECODE_KERNEL_SPLIT = 256
#: a compiled decode step (engine/compiled.py) reads every row's table to a width that is a
#: multiple of this many blocks (its padding masked), so one traced shape serves that many
#: blocks of growth: the decode's transient is counted at that width
DECODE_BUCKET_BLOCKS = 8


def decode_transient_bytes(facts: ModelFacts, rows: int, longest: int,
                           block_tokens: int = 16, gathered: bool = True) -> int:
    """Transient bytes of one batched decode step: the gather of ``rows × longest`` slots
    (whole blocks; for quantized KV also their float copy, see
    :func:`dequant_transient_bytes`) plus every row's scores and activations (one query
    token each), at the width a compiled step reads (:data:`DECODE_BUCKET_BLOCKS`).
    ``gathered`` False: the decode reads the pools in place (a paged decode
    kernel that passed its check, engine/kernels.py): no gather and no score matrix, only
    the kernel's partial results (:func:`decode_kernel_partials_bytes`)."""
    if rows <= 0:
        return 0
    longest = _whole(longest, block_tokens * DECODE_BUCKET_BLOCKS)
    if not gathered:
        return (decode_kernel_partials_bytes(facts, rows, longest)
                + rows * _per_chunk_token_bytes(facts, longest, fused=True))
    slots = rows * _whole(longest, block_tokens)
    return LAYERS_IN_FLIGHT * (
        gather_transient_bytes(facts, slots) + dequant_transient_bytes(facts, slots)
        + rows * _per_chunk_token_bytes(facts, longest))


def decode_kernel_partials_bytes(facts: ModelFacts, rows: int, longest: int) -> int:
    """The paged decode kernel's partial results: per row, query head and split of
    :data:`DECODE_KERNEL_SPLIT` tokens, an accumulator of ``head_dim`` plus its max and sum,
    in float32."""
    if rows <= 0 or longest <= 0:
        return 0
    heads = facts.num_attention_heads or facts.num_key_value_heads
    splits = -(-longest // DECODE_KERNEL_SPLIT)
    return rows * heads * splits * (facts.head_dim + 2) * _ACT_BYTES


def _whole(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens) * block_tokens


def prefill_transient_bytes(facts: ModelFacts, chunk: int, context: int,
                            block_tokens: int = 16, fused: bool = False) -> int:
    """Transient bytes of one prefill chunk of ``chunk`` tokens ending at ``context``
    (``fused``: the backend's prefill attention is a fused kernel, see
    :func:`_per_chunk_token_bytes`): :data:`LAYERS_IN_FLIGHT` layers of it."""
    if chunk <= 0:
        return 0
    context = max(context, chunk)
    return LAYERS_IN_FLIGHT * (_context_transient_bytes(facts, _whole(context, block_tokens))
                               + chunk * _per_chunk_token_bytes(facts, context, fused))


def _context_transient_bytes(facts: ModelFacts, tokens: int) -> int:
    """A prefill chunk's transient that follows the context, not the chunk: the gather,
    the float copy of a quantized context (:func:`dequant_transient_bytes`), and (MLA) the
    per-head keys and values one layer expands the latent of every
    context token into."""
    return (gather_transient_bytes(facts, tokens) + dequant_transient_bytes(facts, tokens)
            + tokens * facts.prefill_expand_per_token * _ACT_BYTES)


def prefill_chunk_tokens(facts: ModelFacts, context: int, transient_bytes: int, *,
                         multiple: int = 16, most: int = 2048, block_tokens: int = 16,
                         fused: bool = False) -> int:
    """The largest prefill chunk (a multiple of ``multiple``, at most ``most``; below
    ``multiple`` any size) whose transient at ``context`` stays within ``transient_bytes``.

    0 when not even one token fits (what follows the context alone passes the bound):
    the caller refuses that context rather than exceed it.
    """
    if context <= 0:
        raise ValueError("context must be positive")
    room = (transient_bytes // LAYERS_IN_FLIGHT
            - _context_transient_bytes(facts, _whole(context, block_tokens)))
    if room <= 0:
        return 0
    chunk = min(most, context, room // _per_chunk_token_bytes(facts, context, fused))
    if chunk >= multiple:
        chunk -= chunk % multiple
    return int(chunk)


def growth_transient_bytes(block_bytes: int, max_blocks: int, kv_layers: int) -> int:
    """Bytes held twice while the pool grows by a slab: one array (one layer's K or V) at
    its old size, at most the pool's final size over ``2 × kv_layers`` arrays (the engine
    grows one array at a time and evaluates it before the next)."""
    if kv_layers <= 0 or max_blocks <= 0:
        return 0
    return -(-block_bytes * max_blocks // (2 * kv_layers))


def default_prefill_chunk(fused: bool) -> int:
    """``--prefill-chunk`` when none is given: bigger where the prefill attention is fused."""
    return PREFILL_CHUNK_FUSED if fused else PREFILL_CHUNK


def prefill_chunk(facts: ModelFacts, context: int, transient_bytes: int | None, *,
                  block_tokens: int, most: int, fused: bool = False) -> int:
    """The prefill chunk at ``context`` whose transient (scores, activations and the gather
    of its table) stays within ``transient_bytes``: a multiple of the block, at most
    ``most``; 0 when not even one token fits. Admission and the worker both call this, so
    they agree on it. (The pool's growth transient comes before a step's compute, not
    during it, and is not counted here.)"""
    if transient_bytes is None:
        return most
    return prefill_chunk_tokens(facts, context, transient_bytes, multiple=block_tokens,
                                most=most, block_tokens=block_tokens, fused=fused)


def transient_floor(facts: ModelFacts, context: int, block_tokens: int) -> int:
    """The least transient reserve a worker of ``context`` needs: its compute share holds
    a prefill chunk of one block at the full context (the gather of the context, and one
    block of queries' scores and activations); at shorter prompts the chunk grows back
    under the same bound (:func:`prefill_chunk`)."""
    return reserve_for_compute(prefill_transient_bytes(facts, block_tokens, context,
                                                       block_tokens))
