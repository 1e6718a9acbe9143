"""The figures the scheduler publishes for ``GET /v1/plimsoll/status`` (pure).

``kv_bytes_held`` counts distinct blocks held (live + cached, a shared block once) × the
engine's real ``block_bytes``, beside the engine's own ``kv_bytes_allocated``. The scheduler
publishes a fresh snapshot at once when anything a reader acts on changes (admissions, ends,
refusals, the trip, going idle) and otherwise at most every :data:`PUBLISH_INTERVAL_S`: on a
GPU a batched step computes in ~10 ms, and every millisecond of Python per step is decode
time lost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

from .events import SchedulerLimits

#: The status snapshot of decode-only steps is refreshed at most this often.
PUBLISH_INTERVAL_S = 0.05


def status_figures(pool: Any, engine: Any, running: Collection[Any], waiting: int,
                   limits: SchedulerLimits, counters: Counter[str], steps: int, tripped: str,
                   disk: Any, kv_bytes_allocated: int, kv_bytes_peak: int,
                   attention_plans: dict | None = None) -> dict[str, Any]:
    """One consistent snapshot of the scheduler's figures (``running``: its running
    sequences; ``waiting``: requests queued or not yet taken in)."""
    prefilling = sum(1 for r in running if r.prefilling)
    c = pool.counters
    return {
        "pool": pool.stats(),
        "running": len(running),
        "decoding": len(running) - prefilling,
        "prefilling": prefilling,
        "waiting": waiting,
        "max_batch": limits.max_batch,
        "prefill_tokens_per_step": limits.prefill_tokens,
        # distinct blocks held, live + cached, a shared block once
        "kv_bytes_held": (pool.held + pool.cached) * engine.block_bytes,
        "kv_bytes_live": pool.held * engine.block_bytes,
        "kv_bytes_allocated": kv_bytes_allocated,
        "kv_bytes_peak": kv_bytes_peak,
        "state_bytes_held": engine.state_bytes_held(),
        "shared_blocks": pool.shared,
        "prefix": {"hit_blocks": c["hit_blocks"], "miss_blocks": c["miss_blocks"],
                   "hit_tokens": c["hit_tokens"], "miss_tokens": c["miss_tokens"],
                   "evicted_blocks": c["evicted_blocks"]},
        "prefill_tokens_computed": counters["prefill_tokens"],
        "steps": steps,
        "tripped": bool(tripped),
        "trip_reason": tripped,
        "counters": dict(counters),
        "disk": disk.stats() if disk is not None else None,
        # cuDNN attention plans built ahead while idle (CUDA; engine/warmup.PlanWarmer)
        "attention_plans": attention_plans,
    }
