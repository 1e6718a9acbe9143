"""Graceful shutdown for the worker and the proxy: drain, then end what is left properly.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the requests in
flight. :func:`serve` makes that wait ``drain_s`` plus a margin, never shorter (uvicorn's
own default would cut a stream mid-way, with no finish chunk and a traceback), and marks
the :class:`Drain` it shares with the app: a stream still running when ``drain_s`` has
passed ends with its protocol's error event (``worker_stopping``), a request still waiting
gets a 503 with ``Retry-After``, and new requests on kept-alive connections are refused
the same way. Then the lifespan closes (the scheduler stops, workers are stopped) and the
process exits with status 0 — a stop that was asked for is not a failure.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds uvicorn waits beyond the drain: the ended streams' last events need to be sent.
MARGIN_S = 5.0


class Drain:
    """Whether a shutdown has begun, and when requests still running must end."""

    def __init__(self, drain_s: float = 30.0) -> None:
        self.drain_s = drain_s
        self.since: float | None = None
        self._bounded: set[asyncio.Timeout] = set()  # the waits of :meth:`within`, now
        self._loop: asyncio.AbstractEventLoop | None = None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            loop = self._loop
            if loop is not None and not loop.is_closed():  # may run in a signal handler
                loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        for scope in list(self._bounded):
            scope.reschedule(self.deadline)

    @property
    def deadline(self) -> float | None:
        """When the drain time runs out, on the event loop's clock (``time.monotonic``)."""
        return None if self.since is None else self.since + self.drain_s

    async def within(self, aw: Awaitable[T], default: Any = None) -> T | Any:
        """``aw``'s result, or ``default`` (``aw`` cancelled) once the drain time is up,
        including a drain that begins while ``aw`` waits. It costs no task and no timer
        while no shutdown has begun: the wait is an ``asyncio.timeout`` that
        :meth:`begin` reschedules to the drain's end."""
        self._loop = asyncio.get_running_loop()
        scope = asyncio.timeout_at(self.deadline)
        try:
            async with scope:
                self._bounded.add(scope)
                try:
                    return await aw
                finally:
                    self._bounded.discard(scope)
        except TimeoutError:
            if scope.expired():
                return default
            raise

    @property
    def draining(self) -> bool:
        return self.since is not None

    @property
    def expired(self) -> bool:
        """True once the drain time has run out: what still runs must end now."""
        return self.since is not None and time.monotonic() - self.since >= self.drain_s

    def remaining(self) -> float | None:
        """Seconds left to drain (None while not draining)."""
        if self.since is None:
            return None
        return max(0.0, self.drain_s - (time.monotonic() - self.since))


def serve(app: Any, drain: Drain, *, host: str, port: int, **uvicorn_kwargs: Any) -> None:
    """Run ``app`` under uvicorn until SIGTERM/SIGINT, draining as the module says."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain.begin()
            super().handle_exit(sig, frame)

    options = {**uvicorn_kwargs, "timeout_graceful_shutdown": drain.drain_s + MARGIN_S}
    config = uvicorn.Config(app, host=host, port=port, **options)
    # uvicorn re-raises the signal it caught once it is done, under the handler it found:
    # a no-op one makes the asked-for stop an exit with status 0, not a death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    _Server(config).run()
