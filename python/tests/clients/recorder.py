"""A recording pass-through proxy on 127.0.0.1: every request is relayed unchanged to an
upstream URL and one JSON line per exchange (method, path, status, request body) is appended
to a file. Streams are relayed chunk by chunk. Run as
``python recorder.py UPSTREAM PORT LOG.jsonl``; the end-to-end client test starts it between
each coding client and ``plimsoll serve``."""

from __future__ import annotations

import json
import sys
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def make_app(upstream: str, log_path: str) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=5.0))

    async def relay(request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        started = time.monotonic()
        up = await client.send(client.build_request(request.method, url, content=body,
                                                    headers=headers), stream=True)
        record = {"method": request.method, "path": request.url.path,
                  "query": request.url.query, "status": up.status_code,
                  "request_headers": {k: v for k, v in headers.items()
                                      if k.lower() not in ("authorization", "x-api-key")}}
        try:
            record["body"] = json.loads(body) if body else None
        except ValueError:
            record["body"] = body.decode("utf-8", "replace")[:2000]
        chunks: list[bytes] = []

        async def stream():
            try:
                async for chunk in up.aiter_raw():
                    if up.status_code >= 400 or sum(map(len, chunks)) < 65536:
                        chunks.append(chunk)
                    yield chunk
            finally:
                await up.aclose()
                record["response"] = b"".join(chunks).decode("utf-8", "replace")[:65536]
                record["seconds"] = round(time.monotonic() - started, 3)
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")

        out = {k: v for k, v in up.headers.items() if k.lower() not in HOP
               and k.lower() != "content-encoding"}
        return StreamingResponse(stream(), up.status_code, headers=out)

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", relay, methods=methods)])


if __name__ == "__main__":
    upstream_url, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    uvicorn.run(make_app(upstream_url, log), host="127.0.0.1", port=port, log_level="warning")
