"""Reading a request body at the HTTP edge, bounded (shared by the worker and the proxy)."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from plimsoll import protocol
from plimsoll.protocol import ProtocolError


async def read_body(request: Request) -> bytes | ProtocolError:
    """The body, refused past MAX_BODY_BYTES without reading it all into memory.

    A client that leaves before its whole body arrived is a refusal too (400, which nobody
    will read), not an exception: the edge must never turn a client's broken request into
    a server error or a traceback in the log.
    """
    too_big = protocol.check_body_size(request.headers.get("content-length"))
    if too_big:
        return too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > protocol.MAX_BODY_BYTES:
                return protocol.check_body_size(size)
            chunks.append(chunk)
    except ClientDisconnect:
        return ProtocolError(400, f"The client closed the connection after {size} bytes of "
                             "the body; send the whole body.", code="client_disconnected")
    return b"".join(chunks)
