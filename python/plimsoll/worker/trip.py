"""The worker's memory lines: when the scheduler probes memory, whether it is over a line, and
the emergency clear (docs/DESIGN.md, "The invariants": the trip).

:class:`MemoryLine` is held by the scheduler and runs on its thread. Over a line, the clear
comes first (cached blocks and state snapshots dropped, MLX's buffer cache emptied, the C
heap trimmed); still over after it, the scheduler sheds work: every waiting request, then the
newest running one, one per iteration (:func:`shed` picks them; the scheduler refuses and
ends them).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("plimsoll.worker")

#: Decode-only steps probe memory at most this often (see :meth:`MemoryLine.due`).
PROBE_INTERVAL_S = 0.05


class MemoryLine:
    """The trip line and the guard's soft line, read through ``memory_probe``
    (``{"mlx_active": …, "rss": …}`` and, under a guard, ``guard_usage`` / ``guard_soft``)."""

    def __init__(self, memory_probe: Callable[[], dict[str, int]]):
        self.memory_probe = memory_probe
        self.tripped = ""  # why the worker is over a memory line; "" when it is not
        self.probed_at = 0.0  # monotonic time of the last probe
        self.spiked = True  # the last step ran a prefill: probe memory at once

    def due(self, running: bool) -> bool:
        """Whether this iteration probes memory (the trip check): always after a step that
        ran a prefill, while nothing runs, and at least every
        :data:`PROBE_INTERVAL_S` otherwise.

        Why the bound still holds between probes: a step of decodes only adds what
        admission already counted — one token per row written into blocks of the row's
        reservation (the pool's own accounting is the hard bound: ``held + outstanding ≤
        total``, pool arrays grow only up to ``max_blocks``) and a decode transient that
        :func:`plimsoll.worker.waiting.decode_fits` kept under ``transient_bytes`` when the
        row joined. The probe is the line for what accounting cannot see (allocator
        fragmentation, a guard's limit lowered from outside); the spikes it exists for —
        prefills — are probed before every admission
        (:func:`plimsoll.worker.waiting.admit_waiting`) and in the iteration right after
        every prefill step, and a cgroup's hard line or the footprint guard's thread act on
        their own. So a decode-only stretch is re-checked within :data:`PROBE_INTERVAL_S`, a
        few steps.
        """
        return (self.spiked or not running
                or time.monotonic() - self.probed_at >= PROBE_INTERVAL_S)

    def over(self, trip_bytes: int) -> str:
        """Why memory is over a line ("" when it is not): the trip, or the guard's soft line.

        ``guard_usage``/``guard_soft`` come from the per-process guard (:mod:`plimsoll.guard`:
        the worker's cgroup, or its own footprint): its whole footprint, not only MLX's.
        """
        mem = self.memory_probe()
        for name in ("mlx_active", "rss"):
            if mem.get(name, 0) > trip_bytes:
                return f"{name}={mem[name]} B is over the trip at {trip_bytes} B"
        soft = mem.get("guard_soft")
        if soft and mem.get("guard_usage", 0) > soft:
            return (f"memory usage {mem['guard_usage']} B is over the guard's soft line "
                    f"at {soft} B")
        return ""

    def check(self, trip_bytes: int, pool: Any, engine: Any, counters: Counter[str]) -> bool:
        """Probe; over a line, the emergency clear, then probe again.
        Sets :attr:`tripped` to why memory is still over ("" when it is not) and returns
        whether that changed or is still set (a reader of the status must see it).

        The clear is cached blocks and snapshots dropped (a trip, counted and logged, when
        there were any) and, every time memory is over, the engine's freed memory handed
        back (MLX's buffer cache, the C heap): a step in flight at the first clear frees its
        buffers after it, and without a clear at each probe they kept the worker over its
        line with nothing left to drop."""
        self.probed_at = time.monotonic()
        was = self.tripped
        over = self.over(trip_bytes)
        if over:
            if pool.cached:
                pool.drop_cached()
                for key in pool.take_dropped_snapshots():
                    engine.drop_snapshot(key)
                counters["trips"] += 1
                log.warning("trip: %s; dropped cached blocks", over)
            engine.clear_cache()
            over = self.over(trip_bytes)
        if over and not self.tripped:
            log.error("trip: %s after the emergency clear; refusing new work", over)
        self.tripped = over
        return bool(over or was)


def shed(why: str, waiting: deque, running: dict[int, Any]) -> tuple[str, list, Any]:
    """What a trip still over after the clear sheds, with the refusal's message: every
    waiting request (taken from ``waiting``), and the newest running one or None (one per
    iteration, so the oldest work finishes if that is enough)."""
    message = f"memory trip: {why}; request aborted to keep the worker under its line"
    waiters = list(waiting)
    waiting.clear()
    return message, waiters, running[max(running)] if running else None
