"""The model entry ``plimsoll serve`` sizes for coding clients (``--model`` or the demo).

The largest context up to the model's native maximum that this machine's budget admits at
``concurrency`` sequences (found by bisection over admission itself:
:func:`~plimsoll.core.sizing.largest_fitting`, the one search admission's context clamps
share), an output limit of a quarter of it (:func:`~plimsoll.core.sizing.output_limit`, at
most :data:`~plimsoll.core.sizing.CLIENT_OUTPUT_CAP`; a larger request is clamped), unless
``--context`` / ``--concurrency`` / ``--max-tokens`` say otherwise.
"""

from __future__ import annotations

from pathlib import Path

from plimsoll.core.policy import parse_policy
from plimsoll.core.sizing import CLIENT_OUTPUT_CAP, largest_fitting, output_limit
from plimsoll.probes.snapshot import MemorySnapshot

from .defaults import DEFAULT_CONCURRENCY, FALLBACK_CONTEXT, budgets


def model_entry(model_dir: Path, *, context: int | None = None, concurrency: int | None = None,
                max_tokens: int | None = None, snapshot: MemorySnapshot | None = None,
                draft_model: str | None = None, mtp: bool = True) -> dict:
    """A policy model entry for ``model_dir``: what is given, the rest sized (see module),
    a draft model (or the checkpoint's MTP head, unless ``mtp`` is off) counted in the
    sizing and named in the entry."""
    from plimsoll.core.model_facts import inspect_model

    concurrency = concurrency or DEFAULT_CONCURRENCY
    if context is None:
        native = inspect_model(model_dir).native_max_context or FALLBACK_CONTEXT
        context = native if snapshot is None else largest_context(
            model_dir, native, concurrency, snapshot, draft_model, mtp)
    limit = max_tokens or output_limit(context, CLIENT_OUTPUT_CAP)
    limit = min(limit, context - 1)
    return {"path": str(model_dir), "context": context, "concurrency": concurrency,
            "maxTokens": limit, "defaultMaxTokens": limit,
            **({"draftModel": draft_model} if draft_model else {}),
            **({} if mtp else {"mtp": False})}


def largest_context(model_dir: Path, native: int, concurrency: int,
                    snapshot: MemorySnapshot, draft_model: str | None = None,
                    mtp: bool = True) -> int:
    """The largest context ≤ ``native`` that admission grants ``concurrency`` sequences of
    on this machine's budget (found by bisection; the policy minimum if none is)."""
    from .live_admission import MemoryFigures, Wanted, plan

    pol = parse_policy(budgets(snapshot), "default policy")
    figures = MemoryFigures(ceiling_bytes=snapshot.ceiling_bytes,
                            total_ram_bytes=snapshot.total_ram_bytes,
                            budget_bytes=pol.budget_bytes("standalone"), source="live probe")

    def fits(ctx: int) -> bool:
        wanted = Wanted(concurrency, ctx, output_limit(ctx), draft_model=draft_model, mtp=mtp)
        _f, _r, dec = plan(model_dir, None, pol, figures, wanted)
        return dec.admitted and dec.concurrency >= concurrency and dec.context >= ctx

    low, high = pol.min_context, max(native, pol.min_context)
    if fits(high):
        return high
    best = largest_fitting(low, high, fits, step=pol.block_tokens)
    return best if best is not None else low
