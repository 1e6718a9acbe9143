"""The proxy's event log: what happened to which worker, when (bounded, in memory).

Every transition that matters for the no-overlap guarantee is recorded with a wall
clock time (comparable with a process's start time) and a monotonic one (for
ordering and durations): ``spawn``, ``ready``, ``spawn-failed``, ``refused``,
``drain``, ``evict``, ``exit``, ``release-verified``, ``release-unverified``,
``idle-unload``, ``crash``, ``unload``, ``mode-change``, ``mode-refused``; and the
memory-pressure tripwire's ``pressure-warn``, ``pressure-critical`` (rising),
``pressure-easing`` (critical → warn), ``pressure-clear`` (admission reopens),
``pressure-cancel`` (a request waiting for a load), ``pressure-unload`` and
``pressure-probe-failed``.
Tests read it at ``GET /running`` (``events``) and ``GET /admin/events``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("plimsoll.proxy")


@dataclass(frozen=True)
class Event:
    seq: int
    kind: str
    model: str | None
    t: float  # time.time()
    mono: float  # time.monotonic()
    detail: dict[str, Any] = field(default_factory=dict)


class EventLog:
    """Append-only, capped at ``cap`` events (older ones are dropped, never the process)."""

    def __init__(self, cap: int = 2000) -> None:
        self._events: deque[Event] = deque(maxlen=cap)
        self._seq = itertools.count(1)

    def record(self, kind: str, model: str | None = None, **detail: Any) -> Event:
        ev = Event(next(self._seq), kind, model, time.time(), time.monotonic(), detail)
        self._events.append(ev)
        log.info("event %s %s %s", kind, model or "-", detail or "")
        return ev

    def as_json(self, limit: int | None = None) -> list[dict[str, Any]]:
        events = list(self._events)[-limit:] if limit else list(self._events)
        return [asdict(e) for e in events]

    def kinds(self, model: str | None = None) -> list[str]:
        return [e.kind for e in self._events if model is None or e.model == model]
