"""The proxy's transition lock: one load, swap, unload or mode change at a time.

An admin holder (a mode change from the link watcher, a pressure unload) goes ahead of
queued bring-ups: while one waits, a plain holder that gets the lock hands it back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TransitionLock:
    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._admin_pending = 0
        self._admin_idle = asyncio.Event()
        self._admin_idle.set()

    @property
    def busy(self) -> bool:
        """Held, or an admin holder is waiting for it."""
        return self._lock.locked() or bool(self._admin_pending)

    @contextlib.asynccontextmanager
    async def hold(self, admin: bool = False,
                   timeout_s: float | None = None) -> AsyncIterator[None]:
        """The transition lock; an admin holder goes ahead of queued bring-ups.

        ``timeout_s`` bounds only the wait for the lock (TimeoutError), never the body.
        """
        if admin:
            self._admin_pending += 1
            self._admin_idle.clear()
        try:
            while True:
                async with asyncio.timeout(timeout_s):
                    await self._lock.acquire()
                if admin or not self._admin_pending:
                    break
                self._lock.release()
                await self._admin_idle.wait()
            try:
                yield
            finally:
                self._lock.release()
        finally:
            if admin:
                self._admin_pending -= 1
                if not self._admin_pending:
                    self._admin_idle.set()
