"""The scheduler's memory lines and its published figures, apart from the step loop.

:class:`TripMixin` is the emergency clear and shedding (DESIGN's trip: cached blocks go
first, then waiting requests, then the newest running one); :class:`StatsMixin` publishes
the snapshot ``/v1/plimsoll/status`` shows: ``kv_bytes_held`` counts distinct blocks held
(live + cached, a shared block once) × the engine's real ``block_bytes`` beside the
engine's own ``kv_bytes_allocated``. Both run on the scheduler thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("plimsoll.worker")

#: Decode-only steps probe memory at most this often (see :meth:`TripMixin._probe_due`).
PROBE_INTERVAL_S = 0.05
#: The status snapshot of decode-only steps is refreshed at most this often; anything a
#: reader acts on (admissions, ends, refusals, the trip, going idle) publishes at once.
PUBLISH_INTERVAL_S = 0.05


class TripMixin:
    """Needs: pool, engine, limits, memory_probe, counters, tripped, _waiting, _running,
    _end, _refuse, _drop_snapshots, _spiked, _probed_at, _dirty."""

    def _probe_due(self) -> bool:
        """Whether this iteration probes memory (the trip check): always after a step that
        ran a prefill, while nothing runs, and at least every
        :data:`PROBE_INTERVAL_S` otherwise.

        Why the bound still holds between probes: a step of decodes only adds what
        admission already counted — one token per row written into blocks of the row's
        reservation (the pool's own accounting is the hard bound: ``held + outstanding ≤
        total``, pool arrays grow only up to ``max_blocks``) and a decode transient that
        ``_decode_fits`` kept under ``transient_bytes`` when the row joined. The probe is
        the line for what accounting cannot see (allocator fragmentation, a guard's limit
        lowered from outside); the spikes it exists for — prefills — are probed before
        every admission (``_plan``) and in the iteration right after every prefill step,
        and a cgroup's hard line or the footprint guard's thread act on their own. So a
        decode-only stretch is re-checked within :data:`PROBE_INTERVAL_S`, a few steps.
        """
        now = time.monotonic()
        return (self._spiked or not self._running
                or now - self._probed_at >= PROBE_INTERVAL_S)

    def _check_trip(self) -> None:
        self._probed_at = time.monotonic()
        was = self.tripped
        over = self._over_trip()
        if over and self.pool.cached:
            self.pool.drop_cached()
            self._drop_snapshots()
            self.engine.clear_cache()
            self.counters["trips"] += 1
            log.warning("trip: %s; dropped cached blocks", over)
            over = self._over_trip()
        if over and not self.tripped:
            log.error("trip: %s after the emergency clear; refusing new work", over)
        self.tripped = over
        if over or was:
            self._dirty = True
        if over:
            self._shed(over)

    def _shed(self, why: str) -> None:
        """Still over after the clear: refuse everyone waiting and abort the newest running
        request (one per iteration, so the oldest work finishes if that is enough)."""
        message = f"memory trip: {why}; request aborted to keep the worker under its line"
        while self._waiting:
            self._refuse(self._waiting.popleft(), 503, message, "memory_trip")
        if self._running:
            run = self._running[max(self._running)]
            self._end(run, None)
            self.engine.clear_cache()
            self._refuse(run.req, 503, message, "memory_trip")

    def _over_trip(self) -> str:
        """Why memory is over a line ("" when it is not): the trip, or the guard's soft line.

        ``guard_usage``/``guard_soft`` come from the per-process guard (:mod:`plimsoll.guard`:
        the worker's cgroup, or its own footprint): its whole footprint, not only MLX's.
        """
        mem = self.memory_probe()
        for name in ("mlx_active", "rss"):
            if mem.get(name, 0) > self.limits.trip_bytes:
                return f"{name}={mem[name]} B is over the trip at {self.limits.trip_bytes} B"
        soft = mem.get("guard_soft")
        if soft and mem.get("guard_usage", 0) > soft:
            return (f"memory usage {mem['guard_usage']} B is over the guard's soft line "
                    f"at {soft} B")
        return ""


class StatsMixin:
    """Needs: pool, engine, limits, counters, tripped, _running, _waiting, _inbox, _steps,
    _dirty, _published_at."""

    stats: dict[str, Any]
    kv_bytes_peak: int
    disk: Any  # worker/disk_restore.DiskTier or None

    def _maybe_publish(self) -> None:
        """Publish if something a reader acts on changed, or the last snapshot is older
        than :data:`PUBLISH_INTERVAL_S` (decode-only steps change counts, not decisions)."""
        if self._dirty or time.monotonic() - self._published_at >= PUBLISH_INTERVAL_S:
            self._publish()

    def _publish(self) -> None:
        """A consistent snapshot for /v1/plimsoll/status (read from other threads)."""
        self._dirty = False
        self._published_at = time.monotonic()
        pool, eng = self.pool, self.engine
        allocated = eng.kv_bytes_allocated()
        self.kv_bytes_peak = max(self.kv_bytes_peak, allocated)
        prefilling = sum(1 for r in self._running.values() if r.prefilling)
        c = pool.counters
        self.stats = {
            "pool": pool.stats(),
            "running": len(self._running),
            "decoding": len(self._running) - prefilling,
            "prefilling": prefilling,
            "waiting": len(self._waiting) + len(self._inbox),
            "max_batch": self.limits.max_batch,
            "prefill_tokens_per_step": self.limits.prefill_tokens,
            # distinct blocks held, live + cached, a shared block once
            "kv_bytes_held": (pool.held + pool.cached) * eng.block_bytes,
            "kv_bytes_live": pool.held * eng.block_bytes,
            "kv_bytes_allocated": allocated,
            "kv_bytes_peak": self.kv_bytes_peak,
            "state_bytes_held": eng.state_bytes_held(),
            "shared_blocks": pool.shared,
            "prefix": {"hit_blocks": c["hit_blocks"], "miss_blocks": c["miss_blocks"],
                       "hit_tokens": c["hit_tokens"], "miss_tokens": c["miss_tokens"],
                       "evicted_blocks": c["evicted_blocks"]},
            "prefill_tokens_computed": self.counters["prefill_tokens"],
            "steps": self._steps,
            "tripped": bool(self.tripped),
            "trip_reason": self.tripped,
            "counters": dict(self.counters),
            "disk": self.disk.stats() if self.disk is not None else None,
        }
