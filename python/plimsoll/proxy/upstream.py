"""The proxy's connections to its workers: one pool of kept-alive HTTP/1.1 connections.

A worker is a loopback peer the proxy started itself, so a relayed request needs none of an
HTTP client's per-request layers (URL parsing and merging, header and cookie objects, auth,
redirects, hooks): :meth:`Upstream.post` is one ``httpcore`` request on a connection of the
pool, and its answer's body is read as it arrives (:class:`Answer`). Enough connections stay
open for every stream of a busy proxy, so a burst opens none per request.

Before an idle connection is reused, the pool checks that the worker has not closed it (a
zero-timeout poll of its socket). :class:`_Stream` answers that from the socket it keeps;
the default stream rebuilds its attribute table, asking the kernel for the peer's address,
on every check — paid for each idle connection on every request and every answer's end, so
it grew with the streams in flight.
"""

from __future__ import annotations

import select
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpcore

#: What a lost or broken connection to a worker raises (the names say what happened).
ERRORS: tuple[type[Exception], ...] = (
    httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException,
    httpcore.UnsupportedProtocol, httpcore.ProxyError)
CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024
KEEPALIVE_CONNECTIONS = 256
# Under the worker's own keep-alive (uvicorn's 5 s): the pool drops an idle connection before
# the worker may close it, so no request is sent on a connection the worker is closing.
KEEPALIVE_S = 4.0
_TIMEOUTS = {"connect": CONNECT_TIMEOUT_S, "read": None, "write": None, "pool": None}


def _readable(sock: socket.socket | None) -> bool:
    """Whether a read would not block (data, or the peer's close): a connection not to reuse."""
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class _Stream(httpcore.AsyncNetworkStream):
    """An anyio stream whose readability check uses the socket it keeps."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._sock = inner.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return await self._inner.start_tls(*args, **kwargs)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return _readable(self._sock)
        return self._inner.get_extra_info(info)


class _Backend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any
                                  ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class Answer:
    """A worker's answer: status and headers now, the body as it arrives; close it once."""

    def __init__(self, response: httpcore.Response) -> None:
        self._response = response
        self.status_code = response.status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in response.headers}

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._response.aiter_stream()

    async def aread(self) -> bytes:
        return await self._response.aread()

    async def aclose(self) -> None:
        await self._response.aclose()


class Upstream:
    """The pool; ``post`` sends a relayed body to one worker."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS,
                 keepalive_connections: int = KEEPALIVE_CONNECTIONS) -> None:
        self.pool = httpcore.AsyncConnectionPool(
            max_connections=max_connections, max_keepalive_connections=keepalive_connections,
            keepalive_expiry=KEEPALIVE_S, network_backend=_Backend())

    async def post(self, host: str, port: int, path: str, headers: dict[str, str],
                   body: bytes) -> Answer:
        """POST ``body`` (JSON) to ``http://host:port/path``; raises one of :data:`ERRORS`."""
        url = httpcore.URL(scheme=b"http", host=host.encode("ascii"), port=port,
                           target=path.encode("ascii"))
        request = httpcore.Request(
            b"POST", url, headers={"host": f"{host}:{port}", "content-type": "application/json",
                                   **headers, "content-length": str(len(body))},
            content=body, extensions={"timeout": _TIMEOUTS})
        return Answer(await self.pool.handle_async_request(request))

    async def aclose(self) -> None:
        await self.pool.aclose()
