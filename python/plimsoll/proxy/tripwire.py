"""The memory-pressure tripwire's edge: poll the probe, keep the state, act through the supervisor.

The decisions are :mod:`.pressure`'s (pure); this module owns the one mutable
:class:`~.pressure.TripState`, the ``closed`` event that requests waiting for a load race
against, and the background loop (:func:`watch`, started by
``Supervisor.start_background``). It acts only through :class:`Host`, two calls the
supervisor implements — the ready residents, and an unload under the transition lock by
``stop_verified`` (drain, stop, verify the memory came back) — so an unload under pressure
is the same verified release as any other, and this module imports nothing of the supervisor.

Invariants: while the level is not ``normal`` every new request and every new load is
refused with a reason (:meth:`Tripwire.refusal`), and every request waiting for a load is
answered (503 ``memory_pressure``) rather than left to wait; at most one pressure unload
runs at a time, and readings continue while it drains.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from plimsoll.core.policy import Pressure

from ..probes.pressure import PressureReading, read_pressure
from .events import EventLog, log
from .evict import Resident
from .pressure import RANK, Actions, TripState, classify, decide, page_out_rate, step


@dataclass(frozen=True)
class Refusal:
    """Why a request or load is refused now (the supervisor raises it as a 503)."""

    message: str
    retry_after: int
    extra: dict[str, Any] = field(default_factory=dict)


class Tripwire:
    def __init__(self, thresholds: Pressure, events: EventLog,
                 read: Callable[[], PressureReading] = read_pressure,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.thresholds, self.events, self.read, self.clock = thresholds, events, read, clock
        self.state = TripState()
        self.prev: PressureReading | None = None
        self.last: PressureReading | None = None
        self.closed = asyncio.Event()  # set while the level is not normal
        self.unloads = 0
        self.cancelled = 0
        self.unloading: asyncio.Task | None = None
        self._probe_error: str | None = None

    @property
    def enabled(self) -> bool:
        return self.thresholds.enabled

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.thresholds.clear_after_s))

    # --- one reading ------------------------------------------------------------------------
    def observe(self, reading: PressureReading, residents: list[Resident]) -> Actions:
        """Fold one reading into the state; record level changes; return the actions."""
        self.prev, self.last = self.last, reading
        if not reading.has_signal:
            # A backstop that cannot see must not stop serving: no signal reads as normal.
            if reading.error != self._probe_error:
                self.events.record("pressure-probe-failed", None, error=reading.error)
            self._probe_error = reading.error
            raw, reasons = "normal", ()
        else:
            self._probe_error = None
            raw, reasons = classify(reading, self.prev, self.thresholds)
        before = self.state
        self.state = step(before, raw, reasons, reading.mono, self.thresholds.clear_after_s)
        actions = decide(self.state, residents)
        if self.state.level != before.level:
            detail = {"previous": before.level, "reasons": list(self.state.reasons),
                      "reading": reading.describe()}
            if self.state.level == "normal":
                calm = self.state.calm_for(reading.mono)
                detail["calm_for_s"] = round(calm, 3) if calm is not None else None
                detail["clear_after_s"] = self.thresholds.clear_after_s
                self.events.record("pressure-clear", None, **detail)
            elif RANK[self.state.level] < RANK[before.level]:  # critical → warn: no unloads
                self.events.record("pressure-easing", None, level=self.state.level, **detail)
            else:
                self.events.record(f"pressure-{self.state.level}", None, **detail)
        if actions.admit:
            self.closed.clear()
        else:
            self.closed.set()
        return actions

    # --- what the request path asks ---------------------------------------------------------
    def refusal(self, what: str, verb: str = "refused") -> Refusal | None:
        """None while admitting; else why ``what`` (a request, a load) is refused."""
        st = self.state
        if not self.enabled or st.level == "normal":
            return None
        why = "; ".join(st.reasons) or "pressure readings above the policy's lines"
        if st.raw == "normal":
            calm = st.calm_for(self.clock()) or 0.0
            why += (f" (readings calm for {calm:.1f} s; admission reopens after "
                    f"{self.thresholds.clear_after_s:g} s)")
        return Refusal(f"{what} {verb}: the host is under memory pressure ({st.level}): "
                       f"{why}; retry after {self.retry_after} s", self.retry_after,
                       {"pressure": {"level": st.level, "reasons": list(st.reasons)}})

    def note_cancelled(self, model: str) -> None:
        self.cancelled += 1
        self.events.record("pressure-cancel", model, level=self.state.level,
                           reasons=list(self.state.reasons))

    def snapshot(self) -> dict[str, Any]:
        st, now = self.state, self.clock()
        out: dict[str, Any] = {"enabled": self.enabled, "level": st.level, "raw": st.raw,
                               "admitting": st.level == "normal", "reasons": list(st.reasons),
                               "unloads": self.unloads, "cancelled": self.cancelled,
                               "thresholds": self.thresholds.model_dump(by_alias=True)}
        if st.since is not None:
            out["level_for_s"] = round(now - st.since, 3)
        calm = st.calm_for(now)
        if calm is not None:
            out["calm_for_s"] = round(calm, 3)
        if self.last is not None:
            r = asdict(self.last)
            r.pop("mono")
            r["age_s"] = round(now - self.last.mono, 3)
            r["page_outs_per_s"] = page_out_rate(self.prev, self.last)
            out["reading"] = r
        return out


# --- the loop: acts through the narrow Host interface -----------------------------------
class Host(Protocol):
    """What the tripwire needs of the supervisor, and nothing more (it imports none of it)."""

    def ready_residents(self) -> list[Resident]:
        """Ready workers as the decision sees them (sizes do not matter to it)."""

    async def unload_verified(self, name: str,
                              why: Callable[[], tuple[str, dict[str, Any]] | None], *,
                              event: str, lock_timeout_s: float) -> None:
        """Under the transition lock (waiting at most ``lock_timeout_s``), if ``name`` is
        ready and ``why()`` gives a ``(reason, detail)``: record ``event`` with ``detail``,
        then stop it the verified way (drain, stop, memory back)."""


async def tick(tw: Tripwire, host: Host) -> Actions:
    """Read, decide, and start (not await) the one unload the decision names."""
    reading = await asyncio.to_thread(tw.read)
    actions = tw.observe(reading, host.ready_residents())
    busy = tw.unloading is not None and not tw.unloading.done()
    if actions.unload is not None and not busy:
        tw.unloading = asyncio.create_task(unload(tw, host, actions.unload),
                                           name=f"pressure-unload-{actions.unload}")
    return actions


async def unload(tw: Tripwire, host: Host, name: str) -> None:
    """Stop ``name`` the verified way; give up this round if a transition holds the lock."""

    def why() -> tuple[str, dict[str, Any]] | None:
        if tw.state.raw != "critical":
            return None
        tw.unloads += 1
        reasons = list(tw.state.reasons)
        return "unloaded under memory pressure: " + "; ".join(reasons), {"reasons": reasons}

    await host.unload_verified(name, why, event="pressure-unload",
                               lock_timeout_s=tw.thresholds.poll_s)


async def watch(tw: Tripwire, host: Host) -> None:
    """Poll every ``pollS`` for the proxy's life; one bad reading never stops the loop."""
    try:
        while True:
            try:
                await tick(tw, host)
            except Exception:
                log.exception("pressure tripwire: tick failed; retrying")
            await asyncio.sleep(tw.thresholds.poll_s)
    finally:
        if tw.unloading is not None:
            tw.unloading.cancel()
