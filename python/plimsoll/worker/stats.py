"""The figures the scheduler publishes for ``GET /v1/plimsoll/status`` (pure).

``kv_bytes_held`` counts distinct blocks held (live + cached, a shared block once) × the
engine's real ``block_bytes``, beside the engine's own ``kv_bytes_allocated``. The scheduler
publishes a fresh snapshot at once when anything a reader acts on changes (admissions, ends,
refusals, the trip, going idle) and otherwise at most every :data:`PUBLISH_INTERVAL_S`: on a
GPU a batched step computes in ~10 ms, and every millisecond of Python per step is decode
time lost.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

from .events import SchedulerLimits

#: The status snapshot of decode-only steps is refreshed at most this often.
PUBLISH_INTERVAL_S = 0.05


def status_figures(pool: Any, engine: Any, running: Collection[Any], waiting: int,
                   limits: SchedulerLimits, counters: Counter[str], steps: int, tripped: str,
                   disk: Any, kv_bytes_allocated: int, kv_bytes_peak: int,
                   attention_plans: dict | None = None,
                   host: dict | None = None) -> dict[str, Any]:
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
        # the engine thread's time in steady decode, by part (HostClock.figures)
        "host": host,
    }


class HostClock:
    """Where the scheduler thread's time goes in steady decode: wall and thread-CPU seconds,
    summed since start, over the loop's passes that submit a step of decode rows only.

    Parts: ``iterate`` (the whole pass), ``build`` (``engine.run_async``: the step's graph
    built and queued), ``wait`` (the previous step's tokens awaited), ``probe`` (the memory
    lines checked, on their cadence), ``publish`` (the status snapshot, on its cadence; this
    figure is in the snapshot after the one it is taken in), ``flush`` (the pass's events
    sent). The scheduler's own Python a step is ``iterate − build − wait``, probe and publish
    included; on a GPU, where the step is host-bound, that and ``flush`` are what the served
    step adds to the engine's own. Each reading costs ~0.3 µs; a pass takes four to six.
    """

    PARTS = ("iterate", "build", "wait", "probe", "publish", "flush")

    def __init__(self) -> None:
        self.steps = 0
        self.wall = dict.fromkeys(self.PARTS, 0.0)
        self.cpu = dict.fromkeys(self.PARTS, 0.0)
        self.pass_parts: dict[str, tuple[float, float]] = {}  # this pass's, until it is known

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def begin_pass(self) -> None:
        self.pass_parts = {}

    def part(self, name: str, since: tuple[float, float]) -> None:
        """Note ``name`` of this pass: from ``since`` (:meth:`now`) to now."""
        wall, cpu = self.now()
        w, c = self.pass_parts.get(name, (0.0, 0.0))
        self.pass_parts[name] = (w + wall - since[0], c + cpu - since[1])

    def timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, noted as ``name`` of this pass."""
        since = self.now()
        try:
            return fn(*args)
        finally:
            self.part(name, since)

    def end_pass(self, decode_only: bool) -> None:
        """Count this pass's parts if it submitted a step of decode rows only."""
        if decode_only:
            self.steps += 1
            for name, (w, c) in self.pass_parts.items():
                self.wall[name] += w
                self.cpu[name] += c

    def figures(self) -> dict[str, float | int]:
        """Totals in ms (``<part>_ms``, ``<part>_cpu_ms``) and the passes counted (``steps``):
        a reader takes two and divides their differences by the steps between them."""
        return {"steps": self.steps,
                **{f"{p}_ms": round(1000 * self.wall[p], 3) for p in self.PARTS},
                **{f"{p}_cpu_ms": round(1000 * self.cpu[p], 3) for p in self.PARTS}}
