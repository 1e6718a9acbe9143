"""Verified release: a stopped worker's memory must come back before anything loads over it.

:class:`Releases` owns the checks still to verify (``pending``) and the crash releases being
verified; the figure compared is :func:`unaccounted_bytes` (read by the supervisor) and the
arithmetic is :class:`plimsoll.core.sizing.ReleaseCheck`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from plimsoll.core.sizing import ReleaseCheck

from ..probes.held import anon_bytes_except, read_content_bytes
from ..probes.snapshot import MemorySnapshot
from .errors import ProxyError
from .events import EventLog
from .settings import Settings

RELEASE_POLL_S = 0.05


def unaccounted_bytes(snapshot: MemorySnapshot, pid: int = 0, others: int | None = None) -> int:
    """The in-use figure the release check compares (blocking: a few ms on Linux).

    Where in-use is host-wide (Linux with no binding cgroup), the figure is the memory
    the kernel holds with content (:func:`plimsoll.probes.held.content_bytes`: not
    ``MemTotal − MemAvailable``, which a VM's free page reporting holds up for seconds
    after an exit) less every other process's anonymous memory, so other tenants
    growing or shrinking do not move it, while memory a dead worker left behind
    (shared memory, kernel objects) still does. A binding cgroup's usage, or macOS's
    wired figure, is taken as it is. ``others``: :func:`anon_bytes_except` of ``pid``
    where the caller has read it already.
    """
    if snapshot.platform == "linux" and snapshot.ceiling_source.startswith("MemTotal"):
        return read_content_bytes() - (anon_bytes_except(pid) if others is None else others)
    return snapshot.in_use_bytes


class Releases:
    def __init__(self, events: EventLog, unaccounted: Callable[[], int],
                 settings: Settings) -> None:
        self.events, self.unaccounted, self.settings = events, unaccounted, settings
        self.pending: list[ReleaseCheck] = []
        self._verifying: set[asyncio.Task] = set()

    async def unverified(self, check: ReleaseCheck) -> ProxyError:
        """The 503 for a release that did not verify, with the figures read now."""
        now = await asyncio.to_thread(self.unaccounted)
        return ProxyError(503, check.describe(now) + ": refusing to load over it",
                          "release_unverified", retry_after=self.settings.retry_after_s,
                          extra={"release": check.figures(now)})

    async def verify(self, check: ReleaseCheck, timeout_s: float | None = None) -> bool:
        """Poll the in-use figure until the check holds; an unverified check stays pending."""
        start = time.monotonic()
        deadline = start + (self.settings.release_timeout_s if timeout_s is None else timeout_s)
        while True:
            now = await asyncio.to_thread(self.unaccounted)
            if check.released(now):
                self.events.record("release-verified", check.model,
                                   waited_s=round(time.monotonic() - start, 3),
                                   **check.figures(now))
                return True
            if time.monotonic() >= deadline:
                self.events.record("release-unverified", check.model, **check.figures(now))
                if check not in self.pending:
                    self.pending.append(check)
                return False
            await asyncio.sleep(RELEASE_POLL_S)

    async def settle(self) -> None:
        """Before any spawn: crash releases finish verifying; pending ones are re-checked."""
        if self._verifying:
            await asyncio.gather(*self._verifying, return_exceptions=True)
        for check in list(self.pending):
            self.pending.remove(check)
            if not await self.verify(check):
                raise await self.unverified(check)

    async def crashed(self, w: Any, check: ReleaseCheck) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._verifying.add(task)
        try:
            await self.verify(check)
        finally:
            if task is not None:
                self._verifying.discard(task)
