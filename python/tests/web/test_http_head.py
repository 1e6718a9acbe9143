"""The servers' HTTP protocol (``web.http_head``: uvicorn on httptools with h11's bound on a
request head), on a real uvicorn server with plimsoll's options on 127.0.0.1: heads under the
bound are served, over it a 400 and a close before the app sees them, an endless header is cut
off, a large body in the same read as its head is not counted as head, kept-alive and
pipelined requests are served."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from plimsoll.web.http_head import MAX_HEAD_BYTES
from plimsoll.web.serve import free_port, uvicorn_options

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def server():
    seen: list[int] = []

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(len(body))
        return JSONResponse({"body": len(body), "headers": len(request.headers)})

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                       **uvicorn_options(limit_concurrency=64, graceful_s=0)))
    srv.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield port, seen
    srv.should_exit = True
    thread.join(10)


def request(extra_head: bytes = b"", body: bytes = b"{}") -> bytes:
    return (b"POST /echo HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + extra_head + b"content-length: %d\r\n\r\n" % len(body) + body)


def answers(port: int, raw: bytes, want: int = 1) -> bytes:
    """Everything the server sends back until ``want`` answers are in or it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(raw)
        got = b""
        while got.count(b"HTTP/1.1 ") < want or not got.endswith(b"}"):
            part = s.recv(65536)
            if not part:
                break
            got += part
        return got


def test_a_head_under_the_bound_is_served(server):
    port, _seen = server
    got = answers(port, request(b"x-big: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n"))
    assert got.startswith(b"HTTP/1.1 200"), got[:200]


@pytest.mark.parametrize("extra", [
    b"x-big: " + b"a" * (MAX_HEAD_BYTES + 4096) + b"\r\n",  # one header, one read
    b"".join(b"x-h%d: vvvvvvvvvvvvvvvv\r\n" % i for i in range(2000)),  # many small ones
], ids=["one-large", "many-small"])
def test_a_head_over_the_bound_is_a_400_and_a_close_before_the_app(server, extra):
    port, seen = server
    before = len(seen)
    got = answers(port, request(extra))
    assert got.startswith(b"HTTP/1.1 400"), got[:200]
    assert b"connection: close" in got.lower()
    assert b"Request head too large" in got
    assert len(seen) == before


def kernel_buffer_bytes() -> int:
    """The most a TCP connection's two kernel buffers may hold here (the receiver's, which
    autotunes, and the sender's): bytes a client can send that no server ever read."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except (OSError, IndexError, ValueError):
            total += 8 << 20
    return total


def test_an_endless_header_is_cut_off(server):
    port, seen = server
    before = len(seen)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: ")
        with pytest.raises(OSError):  # reset (or broken pipe) once the server closed
            for _ in range(4096):  # 256 MiB at most: the loop ends by itself
                s.sendall(b"a" * 65536)
                sent += 65536
    # what the server read is about its bound; the rest sat in the kernel's buffers (on a
    # loaded box the close comes later and loopback's receive buffer grows meanwhile: CI
    # once sent 2.6 MiB against a 1 MiB bound that left the kernel out)
    assert sent < 64 * MAX_HEAD_BYTES + kernel_buffer_bytes() < 4096 * 65536
    assert len(seen) == before


def test_a_large_body_read_with_its_head_is_not_counted_as_head(server):
    port, _seen = server
    body = b'"' + b"b" * (2 << 20) + b'"'
    got = answers(port, request(body=body))
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert b'"body":%d' % len(body) in got


def test_kept_alive_and_pipelined_requests_are_served(server):
    port, _seen = server
    near = b"x-big: " + b"a" * (MAX_HEAD_BYTES // 2) + b"\r\n"
    raw = request(near) + request(near) + request(body=b"[1]")
    got = answers(port, raw, want=3)
    assert got.count(b"HTTP/1.1 200") == 3, got[:300]
