"""The proxy's connections to its workers: kept-alive HTTP/1.1 connections, answers parsed by
httptools.

A worker is a loopback peer the proxy started itself, and what the proxy sends it is always
the same shape: a ``POST`` of a JSON body it already holds, with a few headers it made. So a
relayed request needs none of an HTTP client's layers (URL parsing, header objects, auth,
redirects, cookies, cancel scopes, an h11 state machine per event): :meth:`Upstream.post`
writes the request in one ``write`` on an asyncio connection of the pool, and the answer is
parsed as it arrives by ``httptools`` (the C parser uvicorn uses; it handles chunked and
sized bodies), its body handed out as it comes (:class:`Answer`). On the 2-core box this cut
the client side of a relayed request from ~370 µs of CPU (httpcore) to ~75 µs.

A connection goes back to the pool only when its answer was read to its end and both sides
keep it alive; an answer left half-read (its client went away) closes its connection. An
idle connection is reused most recent first, and not when it has been idle for
:data:`KEEPALIVE_S` (under the worker's own keep-alive, uvicorn's 5 s, so no request goes out
on a connection the worker is closing) or its socket is readable (the worker closed it and
the event loop has not seen that yet). A body arriving faster than the client takes it stops
the connection's reads past :data:`HIGH_WATER` bytes held (the worker's writes then wait),
as a client's stream would. At most :data:`MAX_CONNECTIONS` answers are open at once; more
wait for one to close.
"""

from __future__ import annotations

import asyncio
import collections
import select
from collections.abc import AsyncIterator
from typing import Any

import httptools


class UpstreamError(Exception):
    """A connection to a worker failed, broke or was closed under an answer."""


class ConnectFailed(UpstreamError):
    """No connection to the worker could be made (refused, unreachable, timed out)."""


class ConnectionLost(UpstreamError):
    """The connection closed or broke before the worker's answer ended."""


class BadAnswer(UpstreamError):
    """The worker's bytes are not an HTTP/1.1 answer."""


#: What a lost or broken connection to a worker raises (the names say what happened).
ERRORS: tuple[type[Exception], ...] = (UpstreamError,)
CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024
KEEPALIVE_S = 4.0
HIGH_WATER = 1 << 18  # bytes of body held before reads pause
LOW_WATER = 1 << 16  # ... and resume


def _readable(sock: Any) -> bool:
    """Whether a read would not block (data, or the peer's close): a connection not to reuse."""
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class _Connection(asyncio.Protocol):
    """One connection to a worker and the answer being read on it (httptools' callbacks)."""

    transport: asyncio.Transport  # set by connection_made, before create_connection returns

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.lost: UpstreamError | None = None
        self.idle_since = 0.0
        self.on_lost: Any = None  # the pool's hook while idle
        self._reset()

    def _reset(self) -> None:
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.held = 0
        self.complete = False
        self.keep_alive = False
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(BadAnswer(f"the worker's answer is not HTTP/1.1 ({err})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the worker"
        self._fail(ConnectionLost(f"the connection to the worker ended ({why}) before its "
                                  "answer did"))
        if self.on_lost is not None:
            self.on_lost(self)

    # httptools
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it at the end
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.held += len(body)
        if self.held > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # ours
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        if self.lost is None:
            self.lost = err
        if not self.head.done():
            self.head.set_exception(err)
            self.head.exception()  # retrieved: a head nobody awaits any more logs nothing
        self._wake()

    def take(self) -> bytes | None:
        """The next piece of body held, or None."""
        if not self.chunks:
            return None
        chunk = self.chunks.popleft()
        self.held -= len(chunk)
        if self.paused and self.held <= LOW_WATER:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def reusable(self, now: float) -> bool:
        return (self.lost is None and not self.transport.is_closing()
                and now - self.idle_since < KEEPALIVE_S
                and not _readable(self.transport.get_extra_info("socket")))

    def close(self) -> None:
        self.transport.close()


class Answer:
    """A worker's answer: status and headers now, the body as it arrives; close it once."""

    def __init__(self, pool: Upstream, key: tuple[str, int], conn: _Connection) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self._closed = False
        self.status_code = conn.parser.get_status_code()
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in conn.headers}

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            chunk = conn.take()
            if chunk is not None:
                yield chunk
            elif conn.complete:
                return
            elif conn.lost is not None:
                raise conn.lost
            else:
                await conn.wait()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.chunks and conn.lost is None:
            self._pool._put_back(self._key, conn)
        else:
            conn.close()
        self._pool._slots.release()


class Upstream:
    """The pool; ``post`` sends a relayed body to one worker."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, host: str, port: int, path: str, headers: dict[str, str],
                   body: bytes) -> Answer:
        """POST ``body`` (JSON) to ``http://host:port/path``; the answer once its head is in.
        Raises one of :data:`ERRORS`."""
        head = [f"POST {path} HTTP/1.1", f"host: {host}:{port}",
                "content-type: application/json", f"content-length: {len(body)}"]
        for name, value in headers.items():
            if any(c in name or c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: a header cannot hold CR, LF or NUL")
            head.append(f"{name}: {value}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        key = (host, port)
        await self._slots.acquire()
        conn: _Connection | None = None
        try:
            conn = await self._connection(key)
            conn.transport.write(request)
            await conn.head
            return Answer(self, key, conn)
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise

    async def _connection(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        now = loop.time()
        while idle:
            conn = idle.pop()
            conn.on_lost = None
            if conn.reusable(now):
                conn._reset()
                return conn
            conn.close()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, *key), CONNECT_TIMEOUT_S)
        except TimeoutError as err:
            raise ConnectFailed(f"no connection to {key[0]}:{key[1]} within "
                                f"{CONNECT_TIMEOUT_S:g} s") from err
        except OSError as err:
            raise ConnectFailed(f"no connection to {key[0]}:{key[1]}: {err}") from err
        return conn  # asyncio sets TCP_NODELAY on its TCP transports

    def _put_back(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        conn.idle_since = asyncio.get_running_loop().time()
        conn.on_lost = lambda c: c in idle and idle.remove(c)
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.on_lost = None
                conn.close()
        self._idle.clear()
