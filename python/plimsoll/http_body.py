"""Reading a request body at the HTTP edge, bounded (shared by the worker and the proxy)."""

from __future__ import annotations

from starlette.requests import Request

from . import protocol as P


async def read_body(request: Request) -> bytes | P.ProtocolError:
    """The body, refused past MAX_BODY_BYTES without reading it all into memory."""
    too_big = P.check_body_size(request.headers.get("content-length"))
    if too_big:
        return too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > P.MAX_BODY_BYTES:
            return P.check_body_size(size)
        chunks.append(chunk)
    return b"".join(chunks)
