"""Load-time admission: from live memory figures and a model's architecture to a worker's caps.

This is the arithmetic of docs/DESIGN.md ("The arithmetic") as one pure function. It does
no I/O: callers pass the ceiling and total RAM (from a probe or overrides), the mode budget
and the model facts. :func:`admit_counting_transient` wraps it with the engine's least
transient at the context counted in the reserve (the clamp launch and the proxy call).

The two knobs and their two denominators:
    allocation_limit = u × ceiling                     (``--gpu-memory-utilization u``)
    trip             = min(u + trip_offset, 0.99) × total_ram   (the emergency clear)
The invariant ``footprint < trip < ceiling`` gives the band
    footprint / ceiling  <  u  <  ceiling / total_ram − trip_offset
and ``u = band_high − margin``. The pool fills what the envelope leaves:
    pool_blocks = floor((min((u − margin) × ceiling, budget) − resident − weights − reserve)
                        / block_bytes)
with ``reserve = max(transient_reserve × budget, transient_floor)`` (the floor: the
engine's least transient at the context, see ``transient_floor_bytes``),
so the footprint stays ≤ ``(u − margin) × ceiling`` and ≤ the mode budget. Then
``concurrency × blocks_per_seq ≤ pool_blocks`` is restored by clamping concurrency
first, then context; a model that cannot hold one sequence of the minimum context is
refused, never paged. Running out is a decision (``refuse``) with reasons that name
what to change, not an exception.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from plimsoll.core.sizing import (
    blocks_for,
    compute_transient_bytes,
    context_for,
    fixed_blocks,
    largest_fitting,
    pool_problem,
)
from plimsoll.core.transients import PREFILL_CHUNK, prefill_chunk, transient_floor
from plimsoll.core.units import fmt_bytes

if TYPE_CHECKING:  # pragma: no cover
    from plimsoll.core.model_facts import ModelFacts

__all__ = ["AdmissionDecision", "AdmissionRequest", "admit", "admit_counting_transient",
           "blocks_for", "fixed_blocks", "trip_fraction"]

Decision = Literal["admit", "clamp", "refuse"]
TRIP_CAP = 0.99


class AdmissionRequest(BaseModel):
    """Every input of the arithmetic, already in bytes and tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ceiling_bytes: int = Field(gt=0)
    total_ram_bytes: int = Field(gt=0)
    budget_bytes: int = Field(gt=0, description="The mode's maxLocalLlmGb in bytes.")
    resident_bytes: int = Field(
        default=0, ge=0, description="Footprints of co-resident workers sharing the envelope."
    )
    weights_bytes: int = Field(ge=0)
    kv_bytes_per_token: int = Field(gt=0)
    draft_weights_bytes: int = Field(default=0, ge=0, description=(
        "The draft model's weights (--draft-model), held beside the model's."))
    draft_kv_bytes_per_token: int = Field(default=0, ge=0, description=(
        "The draft model's KV per token: its pool has a block for every block of the "
        "model's, so each block costs both."))
    per_sequence_fixed_bytes: int = Field(default=0, ge=0)
    native_max_context: int | None = None
    transient_reserve: float = Field(ge=0, le=1, description="Fraction of the budget.")
    transient_floor_bytes: int = Field(default=0, ge=0, description=(
        "The least transient reserve the engine needs at this context (one prefill chunk's "
        "gather, scores and activations, with MLX's buffer cache): the reserve is the larger "
        "of this and the fraction, so a long context takes its transient from the pool "
        "instead of passing the bound."))
    trip_offset: float = Field(default=0.05, gt=0, lt=1)
    u_margin: float = Field(default=0.02, gt=0, lt=1)
    block_tokens: int = Field(gt=0)
    concurrency: int = Field(gt=0)
    context: int = Field(gt=0, description="Requested configured total context per sequence.")
    max_tokens: int = Field(gt=0, description="Output reservation per sequence.")
    min_context: int = Field(default=2048, gt=0)


class AdmissionDecision(BaseModel):
    """Every figure of the arithmetic, so a refusal or clamp can be explained line by line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision: Decision
    reasons: list[str]
    kv_bytes_per_token: int
    block_tokens: int
    block_bytes: int
    fixed_blocks_per_seq: int
    blocks_per_seq: int
    weights_bytes: int
    budget_bytes: int
    resident_bytes: int
    transient_reserve_bytes: int
    pool_blocks: int
    pool_bytes: int
    footprint_bytes: int
    #: the draft model (0 without one): its weights, its bytes per block, its pool's bytes
    draft_weights_bytes: int = 0
    draft_block_bytes: int = 0
    draft_pool_bytes: int = 0
    concurrency: int
    requested_concurrency: int
    context: int
    requested_context: int
    native_max_context: int | None
    output_reservation: int
    gpu_memory_utilization: float
    band_low: float
    band_high: float
    allocation_limit_bytes: int
    trip_bytes: int
    ceiling_bytes: int
    total_ram_bytes: int

    @property
    def admitted(self) -> bool:
        return self.decision != "refuse"

    def footprint_at(self, pool_blocks: int) -> int:
        """Weights (and the draft's), the reserve and ``pool_blocks`` blocks of both pools."""
        return (self.weights_bytes + self.draft_weights_bytes + self.transient_reserve_bytes
                + pool_blocks * (self.block_bytes + self.draft_block_bytes))


def trip_fraction(u: float, trip_offset: float) -> float:
    return min(u + trip_offset, TRIP_CAP)


def admit(req: AdmissionRequest) -> AdmissionDecision:
    """Decide a worker's caps. Pure: the same request always gives the same decision.

    ``notes`` explain a binding limit without changing what was asked for; ``changes``
    are clamps of what was asked for (decision ``clamp``); a refusal ends the search.
    """
    notes: list[str] = []
    changes: list[str] = []
    ceiling, total = req.ceiling_bytes, req.total_ram_bytes
    if ceiling > total:
        notes.append(
            f"ceiling {fmt_bytes(ceiling)} is above total RAM {fmt_bytes(total)}: "
            "clamped to total RAM"
        )
        ceiling = total
    block_bytes = req.kv_bytes_per_token * req.block_tokens
    draft_block = req.draft_kv_bytes_per_token * req.block_tokens
    weights = req.weights_bytes + req.draft_weights_bytes
    fixed = fixed_blocks(req.per_sequence_fixed_bytes, block_bytes)
    reserve = math.floor(req.transient_reserve * req.budget_bytes)
    if req.transient_floor_bytes > reserve:
        notes.append(
            f"transient reserve raised from {fmt_bytes(reserve)} ({req.transient_reserve:g} of "
            f"the budget) to {fmt_bytes(req.transient_floor_bytes)}: the engine's least "
            f"transient at context {min(req.context, req.native_max_context or req.context)}"
        )
        reserve = req.transient_floor_bytes

    band_high = ceiling / total - req.trip_offset
    u = max(band_high - req.u_margin, 0.0)
    envelope_by_ceiling = math.floor(max(u - req.u_margin, 0.0) * ceiling)
    envelope = min(envelope_by_ceiling, req.budget_bytes)
    if req.budget_bytes < envelope_by_ceiling:
        notes.append(
            f"the {fmt_bytes(req.budget_bytes)} mode budget binds below "
            f"(u − margin) × ceiling = {fmt_bytes(envelope_by_ceiling)}"
        )
    pool = max(0, (envelope - req.resident_bytes - weights - reserve)
               // (block_bytes + draft_block))

    context, concurrency = req.context, req.concurrency
    if req.native_max_context and context > req.native_max_context:
        changes.append(
            f"context {context} exceeds the model-native maximum {req.native_max_context}: "
            f"clamped to {req.native_max_context}"
        )
        context = req.native_max_context
    floor_context = max(min(req.min_context, context), req.max_tokens + 1)
    floor_blocks = blocks_for(floor_context, req.block_tokens, fixed)

    refused: list[str] = []
    if context <= req.max_tokens:
        refused.append(
            f"context {context} leaves no room for a prompt beside the output reservation "
            f"of {req.max_tokens} tokens: raise the context or lower max tokens"
        )
    elif floor_blocks > pool:
        refused.extend(_refusal_remedies(req, ceiling, u, band_high, envelope, reserve, pool,
                                         floor_blocks, floor_context))
    else:
        per_seq = blocks_for(context, req.block_tokens, fixed)
        if pool_problem(pool, context, req.block_tokens, fixed, concurrency):
            fit = pool // per_seq
            if fit >= 1:
                changes.append(
                    f"concurrency clamped from {concurrency} to {fit}: {concurrency} × "
                    f"{per_seq} blocks/seq > pool of {pool} blocks"
                )
                concurrency = fit
            else:
                new_context = context_for(pool, req.block_tokens, fixed)
                changes.append(
                    f"concurrency clamped from {concurrency} to 1 and context from {context} "
                    f"to {new_context}: one sequence of {context} tokens needs {per_seq} "
                    f"blocks > pool of {pool} blocks"
                )
                concurrency, context = 1, new_context

    decision: Decision = "refuse" if refused else ("clamp" if changes else "admit")
    pool_bytes = pool * block_bytes
    footprint = weights + reserve + pool * (block_bytes + draft_block)
    return AdmissionDecision(
        decision=decision,
        reasons=notes + changes + refused,
        kv_bytes_per_token=req.kv_bytes_per_token,
        block_tokens=req.block_tokens,
        block_bytes=block_bytes,
        fixed_blocks_per_seq=fixed,
        blocks_per_seq=blocks_for(context, req.block_tokens, fixed),
        weights_bytes=req.weights_bytes,
        budget_bytes=req.budget_bytes,
        resident_bytes=req.resident_bytes,
        transient_reserve_bytes=reserve,
        pool_blocks=pool,
        pool_bytes=pool_bytes,
        footprint_bytes=footprint,
        draft_weights_bytes=req.draft_weights_bytes,
        draft_block_bytes=draft_block,
        draft_pool_bytes=pool * draft_block,
        concurrency=concurrency,
        requested_concurrency=req.concurrency,
        context=context,
        requested_context=req.context,
        native_max_context=req.native_max_context,
        output_reservation=req.max_tokens,
        gpu_memory_utilization=u,
        band_low=(footprint + req.resident_bytes) / ceiling,
        band_high=band_high,
        allocation_limit_bytes=math.floor(u * ceiling),
        trip_bytes=math.floor(trip_fraction(u, req.trip_offset) * total),
        ceiling_bytes=ceiling,
        total_ram_bytes=total,
    )


def _refusal_remedies(
    req: AdmissionRequest,
    ceiling: int,
    u: float,
    band_high: float,
    envelope: int,
    reserve: int,
    pool: int,
    needed_blocks: int,
    floor_context: int,
) -> list[str]:
    """Why one minimal sequence doesn't fit, and what to change. The u band is named when empty."""
    if band_high - 2 * req.u_margin <= 0:
        return [
            f"empty u band: ceiling / total RAM − trip offset = {band_high:.3f} leaves no room "
            f"for the {req.u_margin} margin on both sides: raise the ceiling "
            f"(now {fmt_bytes(ceiling)} of {fmt_bytes(req.total_ram_bytes)} RAM)"
        ]
    need = req.resident_bytes + req.weights_bytes + req.draft_weights_bytes + reserve \
        + needed_blocks * (req.kv_bytes_per_token + req.draft_kv_bytes_per_token) * req.block_tokens
    draft = (f" + the draft model's weights {fmt_bytes(req.draft_weights_bytes)} (and its KV "
             f"{req.draft_kv_bytes_per_token} B/token)" if req.draft_weights_bytes
             or req.draft_kv_bytes_per_token else "")
    return [
        f"refused: one sequence of the minimum context ({floor_context} tokens = "
        f"{needed_blocks} blocks) does not fit: weights {fmt_bytes(req.weights_bytes)}{draft} + "
        f"reserve {fmt_bytes(reserve)} + co-resident {fmt_bytes(req.resident_bytes)} + KV "
        f"needs {fmt_bytes(need)}, the envelope is {fmt_bytes(envelope)} "
        f"(u = {u:.3f}, pool would be {pool} blocks)",
        "to admit it: raise the ceiling or the mode budget, unload co-resident models, "
        "lower the transient reserve, lower max tokens or the minimum context, "
        "or use a smaller (or more quantized) model"
        + (", or a smaller draft model (or none)" if draft else ""),
    ]


# ------------------------------------------------ the transient at the context, counted


def _chunk(facts: ModelFacts, d: AdmissionDecision, context: int) -> int:
    return prefill_chunk(facts, context, compute_transient_bytes(d.transient_reserve_bytes),
                         block_tokens=d.block_tokens,
                         most=PREFILL_CHUNK)


def _floor(facts: ModelFacts, draft: ModelFacts | None, context: int, block_tokens: int) -> int:
    """The least transient at ``context``: the model's, or the draft model's where larger
    (the draft's steps run before the model's, never beside them)."""
    return max(transient_floor(facts, context, block_tokens),
               transient_floor(draft, context, block_tokens) if draft is not None else 0)


def _at(facts: ModelFacts, req: AdmissionRequest, context: int,
        draft: ModelFacts | None = None) -> AdmissionRequest:
    """``req`` at ``context``, its transient floor counted at that context."""
    ctx = min(context, req.native_max_context or context)
    return req.model_copy(update={
        "context": context,
        "transient_floor_bytes": _floor(facts, draft, ctx, req.block_tokens)})


def admit_counting_transient(facts: ModelFacts, req: AdmissionRequest,
                             draft: ModelFacts | None = None) -> AdmissionDecision:
    """Admission with the prefill transient at the context counted in the reserve (the
    model's, or ``draft``'s, the draft model's, where larger).

    The reserve grows to hold the engine's least transient at the context (taken from the
    pool, which admission then fits as usual), so the chunk shrinks as the context grows
    and the context is not cut to fit a fixed fraction. Only when the envelope cannot hold
    that transient beside one sequence is the context clamped: to the longest whose own
    transient fits (one search), else the refusal stands.
    """
    target = min(req.context, req.native_max_context or req.context)
    d = admit(_at(facts, req, req.context, draft))
    if d.admitted and d.context == target and _chunk(facts, d, d.context) > 0:
        return d
    if not admit(req.model_copy(update={"transient_floor_bytes": 0})).admitted:
        return d  # refused whatever the transient: admission's own reasons say why
    floor = max(min(req.min_context, target), req.max_tokens + 1)

    def fits(ctx: int) -> bool:  # admitted at ctx, its own transient counted, not cut further
        got = admit(_at(facts, req, ctx, draft))
        return got.admitted and got.context == ctx

    best = largest_fitting(floor, target - 1, fits, step=req.block_tokens)
    need = _floor(facts, draft, target, req.block_tokens)
    why = (f"the prefill transient at context {target} (a reserve of {fmt_bytes(need)}: "
           "the gather of the context and one block of queries) and one sequence of it do not "
           "fit the envelope together")
    if best is None and d.admitted:
        return d  # admission's own clamp, its transient counted at the longer context
    if best is not None:
        again = admit(_at(facts, req, best, draft))
        return again.model_copy(update={"decision": "clamp", "requested_context": req.context,
                                        "reasons": [*again.reasons, f"context clamped to "
                                                    f"{again.context}: {why}"]})
    return d.model_copy(update={"decision": "refuse", "reasons": [
        *d.reasons, f"refused: {why}, nor at the minimum context {floor}: raise the budget, "
        "or lower the context or the concurrency"]})
