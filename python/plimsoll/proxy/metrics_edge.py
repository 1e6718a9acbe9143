"""The metrics' HTTP edge: ``GET /metrics`` and :func:`observed`, which counts and times
every request the proxy's generate endpoints answer (relayed SSE streams are scanned for
the first token, the token count and mid-stream refusals as they pass).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .metrics import MIDSTREAM_REFUSALS, Observer, error_code


def allowed(request: Request) -> bool:
    from .admin import bearer_ok

    key = request.app.state.api_key
    return key is None or bearer_ok(request, key)


async def get_metrics(request: Request) -> Response:
    if not allowed(request):
        from .admin import unauthorized

        return unauthorized("API key")
    obs: Observer = request.app.state.observer
    await obs.poll()
    return Response(obs.exposition(), media_type=CONTENT_TYPE_LATEST)


class _Watched:
    """A relayed SSE stream, scanned for first token, token count and errors as it passes."""

    def __init__(self, inner: Any, obs: Observer, model: str, start: float, status: int):
        self.inner, self.obs, self.model = inner, obs, model
        self.start, self.status = start, status
        self.buf = b""
        self.first: float | None = None
        self.last: float | None = None
        self.deltas = 0
        self.usage: int | None = None
        self.error: dict[str, Any] | None = None
        self.done = False
        self.saw_end = False  # the stream's own end marker passed: a later close is not a cancel

    def __aiter__(self) -> _Watched:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self.inner.__anext__()
        except StopAsyncIteration:
            self._end(complete=True)
            raise
        self._scan(chunk)
        return chunk

    async def aclose(self) -> None:
        self._end(complete=self.saw_end)
        await self.inner.aclose()

    def _scan(self, chunk: bytes) -> None:
        self.buf += chunk
        *events, self.buf = self.buf.split(b"\n\n")
        for raw in events:
            for line in raw.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
                    self.saw_end = True
                elif line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if obj.get("type") == "message_stop":  # Anthropic's end of stream
            self.saw_end = True
        if "error" in obj:
            self.error = obj
            return
        usage = obj.get("usage") or {}
        for key in ("completion_tokens", "output_tokens"):
            if isinstance(usage.get(key), int):
                self.usage = usage[key]
        if self._has_token(obj):
            now = time.monotonic()
            self.first = self.first or now
            self.last = now
            self.deltas += 1

    @staticmethod
    def _has_token(obj: dict[str, Any]) -> bool:
        if obj.get("type") == "content_block_delta":  # Anthropic
            return True
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or choice.get("text"):
                return True
        return False

    def _end(self, complete: bool) -> None:
        if self.done:
            return
        self.done = True
        ttft = self.first - self.start if self.first is not None else None
        tokens = self.usage if self.usage is not None else self.deltas
        rate = None
        if self.first is not None and self.last is not None and self.last > self.first:
            rate = max(tokens - 1, 0) / (self.last - self.first)
        if self.error is not None:  # an SSE error event: the status is not in it
            code, _msg = error_code(self.error)
            status = 503 if code in MIDSTREAM_REFUSALS else 502
            self.obs.finished(self.model, status, self.error, ttft_s=ttft)
        elif not complete:
            self.obs.finished(self.model, 499, None, ttft_s=ttft)
        else:
            self.obs.finished(self.model, self.status, None, ttft_s=ttft, rate=rate)


def observed(endpoint: Callable[[Request], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
    """Count and time every request ``endpoint`` answers (it sets ``request.state.model``)."""

    async def wrapper(request: Request) -> Response:
        start = time.monotonic()
        response = await endpoint(request)
        obs: Observer | None = getattr(request.app.state, "observer", None)
        model = getattr(request.state, "model", None)
        if obs is None:
            return response
        if model is None:  # refused before a served model was named: no per-model label
            model = "-"
        if isinstance(response, StreamingResponse) and response.status_code < 400:
            response.body_iterator = _Watched(response.body_iterator, obs, model, start,
                                              response.status_code)
            return response
        body: Any = None
        with contextlib.suppress(ValueError, AttributeError):
            body = json.loads(response.body)
        tokens, rate = None, None
        usage = body.get("usage") if isinstance(body, dict) else None
        if response.status_code < 400 and isinstance(usage, dict):
            tokens = usage.get("completion_tokens", usage.get("output_tokens"))
            elapsed = time.monotonic() - start
            if isinstance(tokens, int) and tokens > 0 and elapsed > 0:
                rate = tokens / elapsed
        obs.finished(model, response.status_code, body, tokens=tokens, rate=rate)
        return response

    return wrapper

