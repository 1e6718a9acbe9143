"""The proxy's relay connections (``proxy.upstream``) against a real loopback HTTP server in
the same event loop: one write a request, keep-alive reuse, bodies as they arrive (sized and
chunked), a broken or refused connection as one of ``ERRORS``, a half-read answer's
connection closed rather than reused, an idle connection the worker closed not reused, and
reads paused while a body is not taken."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from plimsoll.proxy import upstream
from plimsoll.proxy.upstream import ConnectFailed, ConnectionLost, Upstream

pytestmark = pytest.mark.pure


class Server:
    """A loopback server whose answer to each request is ``answer(request_bytes)``: a list
    of byte strings written with a short pause between them (None: close the connection)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.reads: list[bytes] = []  # each read of a request's bytes, as it arrived
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self.writers:
            w.close()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                            if line.startswith(b"content-length:"))
                body = await reader.readexactly(size)
                self.reads.append(head + body)
                for part in self.answer(head + body):
                    if part is None:
                        writer.close()
                        return
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.01)


def sized(body: bytes, extra: bytes = b"") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(body) + body]


def chunked(pieces: list[bytes]) -> list[bytes]:
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n"]
    out += [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
    return [*out, b"0\r\n\r\n"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_requests_go_out_in_one_piece_and_reuse_one_kept_alive_connection():
    async def main():
        async with Server(lambda req: sized(b'{"ok": true}', b"x-plimsoll-max-tokens: 7\r\n")) as s:
            up = Upstream()
            for i in range(5):
                a = await up.post("127.0.0.1", s.port, "/v1/chat/completions",
                                  {"x-secret": "k"}, b'{"n": %d}' % i)
                assert a.status_code == 200
                assert a.headers["content-type"] == "application/json"
                assert a.headers["x-plimsoll-max-tokens"] == "7"
                assert await a.aread() == b'{"ok": true}'
                await a.aclose()
            await up.aclose()
        assert s.connections == 1
        assert len(s.reads) == 5
        head, _, body = s.reads[3].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\nx-secret: k" in head and b"\r\ncontent-length: 8" in head
        assert body == b'{"n": 3}'

    run(main())


def test_a_chunked_stream_is_handed_out_piece_by_piece_as_it_arrives():
    pieces = [b"data: %d\n\n" % i for i in range(4)]

    async def main():
        async with Server(lambda req: chunked(pieces)) as s:
            up = Upstream()
            a = await up.post("127.0.0.1", s.port, "/v1/completions", {}, b"{}")
            got = [chunk async for chunk in a.aiter_raw()]
            await a.aclose()
            assert got == pieces  # the server pauses between them: one piece each
            a = await up.post("127.0.0.1", s.port, "/v1/completions", {}, b"{}")
            assert await a.aread() == b"".join(pieces)
            await a.aclose()
            await up.aclose()
        assert s.connections == 1

    run(main())


def test_a_connection_that_breaks_mid_answer_raises_connection_lost():
    async def main():
        def answer(req):
            head = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            return [head, b"5\r\nhello\r\n", None]

        async with Server(answer) as s:
            up = Upstream()
            a = await up.post("127.0.0.1", s.port, "/v1/completions", {}, b"{}")
            got = []
            with pytest.raises(ConnectionLost, match="before its answer did"):
                async for chunk in a.aiter_raw():
                    got.append(chunk)
            assert got == [b"hello"]
            await a.aclose()
            assert isinstance(ConnectionLost("x"), upstream.ERRORS)
            # a connection closed before any answer: the same error from post itself
            s.answer = lambda req: [None]
            with pytest.raises(ConnectionLost):
                await up.post("127.0.0.1", s.port, "/v1/completions", {}, b"{}")
            await up.aclose()

    run(main())


def test_bytes_that_are_not_http_are_a_bad_answer_and_close_the_connection():
    async def main():
        async with Server(lambda req: [b"SSH-2.0-OpenSSH\r\n\r\n"]) as s:
            up = Upstream()
            with pytest.raises(upstream.BadAnswer, match="not HTTP"):
                await up.post("127.0.0.1", s.port, "/x", {}, b"{}")
            s.answer = lambda req: sized(b"{}")
            a = await up.post("127.0.0.1", s.port, "/x", {}, b"{}")  # a new connection
            assert await a.aread() == b"{}"
            await a.aclose()
            await up.aclose()
        assert s.connections == 2

    run(main())


def test_a_refused_connection_is_connect_failed():
    async def main():
        async with Server(lambda req: []) as s:
            port = s.port
        up = Upstream()
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await up.post("127.0.0.1", port, "/v1/completions", {}, b"{}")
        assert up._slots._value == upstream.MAX_CONNECTIONS  # its slot given back

    run(main())


def test_a_half_read_answer_closes_its_connection_and_the_next_request_opens_another():
    async def main():
        async with Server(lambda req: chunked([b"a" * 10, b"b" * 10])) as s:
            up = Upstream()
            a = await up.post("127.0.0.1", s.port, "/v1/completions", {}, b"{}")
            chunks = a.aiter_raw()
            assert await anext(chunks) == b"a" * 10
            await a.aclose()  # the client went away mid-stream
            a = await up.post("127.0.0.1", s.port, "/v1/completions", {}, b"{}")
            assert await a.aread() == b"a" * 10 + b"b" * 10
            await a.aclose()
            await up.aclose()
        assert s.connections == 2

    run(main())


def test_an_idle_connection_the_worker_closed_is_not_reused():
    async def main():
        async with Server(lambda req: sized(b"{}")) as s:
            up = Upstream()
            a = await up.post("127.0.0.1", s.port, "/x", {}, b"{}")
            await a.aread()
            await a.aclose()
            s.writers[0].close()  # the worker's keep-alive ran out
            await asyncio.sleep(0.05)
            a = await up.post("127.0.0.1", s.port, "/x", {}, b"{}")
            assert await a.aread() == b"{}"
            await a.aclose()
            await up.aclose()
        assert s.connections == 2

    run(main())


def test_an_idle_connection_past_the_keep_alive_is_not_reused(monkeypatch):
    monkeypatch.setattr(upstream, "KEEPALIVE_S", 0.05)

    async def main():
        async with Server(lambda req: sized(b"{}")) as s:
            up = Upstream()
            for _ in range(2):
                a = await up.post("127.0.0.1", s.port, "/x", {}, b"{}")
                await a.aread()
                await a.aclose()
                await asyncio.sleep(0.1)
            await up.aclose()
        assert s.connections == 2

    run(main())


def test_a_body_not_taken_pauses_the_connection_past_the_high_water_mark():
    size = 4 * upstream.HIGH_WATER

    async def main():
        async with Server(lambda req: sized(b"z" * size)) as s:
            up = Upstream()
            a = await up.post("127.0.0.1", s.port, "/x", {}, b"{}")
            await asyncio.sleep(0.3)  # the server writes all it can meanwhile
            conn = a._conn
            assert conn.paused
            assert conn.held <= upstream.HIGH_WATER + (1 << 18)  # one read (256 KiB) past it
            got = await a.aread()
            assert len(got) == size and not conn.paused
            await a.aclose()
            await up.aclose()

    run(main())


def test_a_header_that_would_split_the_request_is_refused():
    async def main():
        up = Upstream()
        with pytest.raises(ValueError, match="CR, LF or NUL"):
            await up.post("127.0.0.1", 1, "/x", {"x-a": "b\r\nx-evil: 1"}, b"{}")

    run(main())
