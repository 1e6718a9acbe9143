"""Request submission, shared by the OpenAI and the Anthropic routes: the output
reservation (clamped or refused, :mod:`plimsoll.protocol.reservation`), one ``GenRequest``
handed to the scheduler, waiting for its start (with keep-alives for a slow one), the drain
of a shutdown, and its events as assembler deltas.

Its own module so that :mod:`.app` (the OpenAI routes and the app factory) and
:mod:`.anthropic_routes` both import it, and neither imports the other's routes back.

Events come in bursts (a decode step emits one token for every running stream at once).
From the engine process (the worker's own backend) a burst is one message, read on the
event loop, whose events go straight into the requests' queues; from a scheduler thread in
this process (a clustered rank 0's ring) a :class:`Mailbox` per event loop wakes the loop
once per burst (one ``call_soon_threadsafe``, one self-pipe write), not once per token.
Either way :func:`events` feeds every event already queued for a request before it yields,
so a step's tokens for one connection are detokenized together and sent as one write.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from plimsoll import protocol
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.protocol import ProtocolError
from plimsoll.protocol.reservation import HEADER as MAX_TOKENS_HEADER
from plimsoll.protocol.reservation import Reservation, reserve
from plimsoll.web.edge import access
from plimsoll.web.graceful import Drain

from .events import Finished, GenRequest, Refused, Started, Token

DISCONNECT_POLL_S = 0.25
#: A stream not started (admitted and prefilled) within this many seconds gets its headers
#: and opening events now, then a keep-alive every KEEPALIVE_S: clients that give up on a
#: silent connection (Claude Code retries after minutes without a byte) keep waiting for a
#: long prefill. A refusal after that point is the stream's error event, not an HTTP 503.
EARLY_HEADERS_S = float(os.environ.get("PLIMSOLL_EARLY_HEADERS_S", "10"))
KEEPALIVE_S = float(os.environ.get("PLIMSOLL_KEEPALIVE_S", "5"))


class _Pending:
    """What :func:`next_event` returns when its ``wait_s`` passed with no event."""


class Mailbox:
    """Events for one event loop's request queues, posted from the scheduler thread: the
    first post of a burst schedules one :meth:`_flush` on the loop, the rest only append."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []

    def sink(self, queue: asyncio.Queue):
        """A request's sink (``Sink``): its events land in ``queue`` on the loop."""
        return lambda ev: self.post(queue, ev)

    def post(self, queue: asyncio.Queue, ev: Any) -> None:
        with self._lock:
            self._items.append((queue, ev))
            if len(self._items) > 1:  # a flush is scheduled already and will take it
                return
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, ev in items:
            queue.put_nowait(ev)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
    weakref.WeakKeyDictionary())


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's mailbox (made on first use; only the loop's own thread calls this)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        box = _MAILBOXES[loop] = Mailbox(loop)
    return box


PENDING = _Pending()


async def rendered(request: Request, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (a prompt's rendering and tokenizing) on a worker thread, off the event
    loop; the access line's ``parse_s`` / ``render_s`` say when it began and how long it
    took. Its ProtocolError propagates to the caller."""
    rec = access(request)
    rec.parsed_at = time.monotonic()
    try:
        return await run_in_threadpool(fn, *args)
    finally:
        rec.rendered_at = time.monotonic()


def reservation(state: Any, prompt_tokens: int, asked: int | None,
                prompt_param: str) -> Reservation | ProtocolError:
    """The output reservation for this prompt (clamped, or refused by the worker's policy),
    or the 400 for a prompt that alone fills the context."""
    cfg: WorkerConfig = state.cfg
    return reserve(asked, default=cfg.default_max_tokens, limit=cfg.max_tokens,
                   context=cfg.context, prompt_tokens=prompt_tokens,
                   native_max=state.native_max_context,
                   over_limit=cfg.max_tokens_over_limit, prompt_param=prompt_param)


def reserved_headers(res: Reservation, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The applied reservation as a response header (and any ``extra``)."""
    return {MAX_TOKENS_HEADER: str(res.max_tokens), **(extra or {})}


def stopping(request: Request) -> Refused | None:
    """The 503 for a request that arrives while the worker drains for shutdown."""
    if request.app.state.drain.draining:
        return Refused(503, "the worker is shutting down: retry (the next request starts "
                       "it again where a proxy manages it)", "worker_stopping", 1)
    return None


def error(status: int, message: str, *, code: str | None = None, param: str | None = None,
          retry_after: int | None = None) -> JSONResponse:
    """An OpenAI-shaped error response (``Retry-After`` when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(protocol.error_body(status, message, param=param, code=code), status,
                        headers=headers)


def protocol_error(err: ProtocolError) -> JSONResponse:
    return JSONResponse(err.body(), err.status)


def constraint_spec(state: Any, spec: Any) -> Any:
    """``spec`` as it goes to the engine (None for none): the engine process builds its
    matcher (a grammar the matcher refuses comes back as a 400 ``invalid_schema``). A
    backend without constrained decoding (``constrained_decoding`` unset: the clustered
    ring) refuses with a 400 here rather than answering unconstrained."""
    if spec is None:
        return None
    if not getattr(state, "constrained_decoding", False):
        raise ProtocolError(400, "Structured output and forced tool choices need constrained "
                            "decoding, which this (clustered) worker does not run; drop "
                            "response_format / the forced tool_choice.",
                            code="constraint_unsupported")
    return spec


async def submit(request: Request, prompt: list[int], max_tokens: int, *, temperature: float,
                 top_p: float, seed: int | None = None, top_k: int = 0, min_p: float = 0.0,
                 spec: Any = None,
                 wait_s: float | None = None, ignore_eos: bool = False
                 ) -> tuple[Started | Refused | _Pending | None, asyncio.Queue, GenRequest]:
    """Hand a request to the scheduler; wait for admission (Started) or a Refused.

    ``None`` means the client left while waiting (the request is then cancelled);
    :data:`PENDING` that ``wait_s`` passed first (the caller waits on with :func:`started`).
    A scheduler in another process (:class:`~.engine_client.EngineClient`) is started first
    if it is not running, and calls each sink on this loop; one on a thread of this process
    posts through the loop's :class:`Mailbox`.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    sched = request.app.state.scheduler
    on_loop = getattr(sched, "sinks_on_loop", False)
    gen = GenRequest(prompt=prompt, max_tokens=max_tokens,
                     sink=queue.put_nowait if on_loop else mailbox(loop).sink(queue),
                     temperature=temperature, top_p=top_p, seed=seed, top_k=top_k,
                     min_p=min_p, spec=spec,
                     ignore_eos=ignore_eos)
    if on_loop and (refused := await sched.ensure_running()) is not None:
        return refused, queue, gen
    rec = access(request)
    rec.submitted_at = time.monotonic()
    sched.submit(gen)
    first = await next_event(queue, request, gen, wait_s)
    if isinstance(first, Started):
        rec.admitted_at = time.monotonic()
    return first, queue, gen


async def started(first: Any, queue: asyncio.Queue, request: Request, gen: GenRequest,
                  keepalive: bytes) -> AsyncIterator[Any]:
    """While ``first`` is :data:`PENDING`: ``keepalive`` every :data:`KEEPALIVE_S`; then the
    first event itself (Started, Refused, or None for a client that left) as the last item."""
    while first is PENDING:
        first = await next_event(queue, request, gen, KEEPALIVE_S)
        if first is PENDING:
            yield keepalive
    if isinstance(first, Started) and access(request).admitted_at is None:
        access(request).admitted_at = time.monotonic()
    yield first


async def next_event(queue: asyncio.Queue, request: Request, gen: GenRequest,
                     wait_s: float | None = None):
    """Wait for the scheduler's next event; a client that left cancels its request, and one
    still running when a shutdown's drain time is up gets a ``worker_stopping`` refusal.
    With ``wait_s``, :data:`PENDING` once that passed with no event."""
    drain: Drain = request.app.state.drain
    until = None if wait_s is None else time.monotonic() + wait_s
    while True:
        if until is not None and time.monotonic() >= until:
            return PENDING
        if drain.expired:
            request.app.state.scheduler.cancel(gen)
            return Refused(503, f"the worker is shutting down and its drain time "
                           f"({drain.drain_s:g} s) ran out before this request finished",
                           "worker_stopping", 1)
        if not queue.empty():  # the common case mid-stream: no timer, no task
            return queue.get_nowait()
        poll = DISCONNECT_POLL_S if until is None else min(DISCONNECT_POLL_S,
                                                            max(0.0, until - time.monotonic()))
        try:
            async with asyncio.timeout(poll):  # wait_for would make a task
                return await queue.get()
        except TimeoutError:
            if await request.is_disconnected():
                request.app.state.scheduler.cancel(gen)
                return None


async def events(queue: asyncio.Queue, request: Request, gen: GenRequest,
                 assembler: protocol.TextAssembler, idle_s: float | None = None
                 ) -> AsyncIterator[list[protocol.Delta] | Refused | _Pending]:
    """Deltas until the assembler is done (then the sequence is cancelled), or a Refused;
    with ``idle_s``, :data:`PENDING` each time that passed before the first token (a long
    prefill: the stream's keep-alive).

    Every event already queued is fed before the deltas are yielded (one list for all of
    them). The access record learns the first token's time and the completion count."""
    rec = access(request)
    waited = idle_s  # None once the first token came
    try:
        while not assembler.done:
            ev = await next_event(queue, request, gen, waited)
            if ev is None:
                return
            if ev is PENDING:
                yield ev
                continue
            deltas: list[protocol.Delta] = []
            while True:
                if isinstance(ev, Token):
                    waited = None
                    rec.first_token()
                    deltas += assembler.feed(ev.token_id)
                elif isinstance(ev, Finished):
                    deltas += assembler.close("length" if ev.reason == "length" else "stop")
                    gen.drafted, gen.accepted = ev.drafted, ev.accepted  # from the engine
                elif isinstance(ev, Refused):
                    if deltas:
                        yield deltas
                    yield ev
                    return
                if assembler.done or queue.empty():
                    break
                ev = queue.get_nowait()
            yield deltas
    finally:
        rec.completion = assembler.completion_tokens
        while not queue.empty():  # an engine process's Finished (its speculation figures)
            if isinstance(ev := queue.get_nowait(), Finished):  # comes with the last token
                gen.drafted, gen.accepted = ev.drafted, ev.accepted
        if gen.drafted:
            rec.drafted, rec.accepted = gen.drafted, gen.accepted
        if not gen.cancelled.is_set():  # stop string, tool call, or client gone
            request.app.state.scheduler.cancel(gen)


async def sse_stream(waiting: tuple, assembler: protocol.TextAssembler, *, opening: Iterable[bytes],
                     keepalive: bytes, refusal: Callable[[Refused], Iterable[bytes]],
                     deltas: Callable[[list[protocol.Delta]], Iterable[bytes]],
                     closing: Callable[[Started], Iterable[bytes]]) -> AsyncIterator[bytes]:
    """A streamed answer in any protocol: ``opening`` at once, then ``keepalive`` every
    :data:`KEEPALIVE_S` until the first token — while the request waits for admission
    (``waiting`` is :func:`submit`'s result, its first item maybe :data:`PENDING`) and while
    its prompt is prefilled (clients drop a connection silent for minutes: Node's default
    body timeout is 300 s) — then each token's ``deltas``, and ``closing`` once the answer
    is complete. A refusal at any point is the protocol's ``refusal`` events (the headers
    are sent: no HTTP 503 now); a client that left ends the stream silently."""
    first, queue, request, gen = waiting
    rec = access(request)
    for chunk in opening:
        yield chunk
    async for item in started(first, queue, request, gen, keepalive=keepalive):
        if isinstance(item, bytes):
            yield item
        else:
            first = item
    if first is None:  # the client left
        return
    if isinstance(first, Refused):
        rec.code = first.code
        for chunk in refusal(first):
            yield chunk
        return
    rec.cached = first.cached_tokens
    async for item in events(queue, request, gen, assembler, idle_s=KEEPALIVE_S):
        if item is PENDING:
            yield keepalive
        elif isinstance(item, Refused):
            rec.code = item.code
            for chunk in refusal(item):
                yield chunk
            return
        elif item and (data := b"".join(deltas(item))):  # one write per wake-up
            yield data
    if assembler.done:
        for chunk in closing(first):
            yield chunk
