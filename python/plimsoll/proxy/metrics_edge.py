"""The metrics' HTTP edge: ``GET /metrics`` and :func:`observed`, which counts and times
every request the proxy's generate endpoints answer (relayed SSE and NDJSON streams are
scanned for the first token, the token count and mid-stream refusals as they pass).
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

from plimsoll.web.access_log import Access
from plimsoll.web.edge import access

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

    def __init__(self, inner: Any, obs: Observer, model: str, start: float, status: int,
                 rec: Access | None = None, ndjson: bool = False):
        self.inner, self.obs, self.model = inner, obs, model
        self.rec = rec
        self.ndjson = ndjson  # Ollama's streams: one JSON object a line
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
        if self.ndjson:
            *objects, self.buf = self.buf.split(b"\n")
            for line in objects:
                self._data(line)
            return
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
        if obj.get("type") == "message_stop" or obj.get("done") is True:  # Anthropic, Ollama
            self.saw_end = True
        if "error" in obj:
            self.error = obj
            if self.rec is not None:
                self.rec.code = error_code(obj)[0]
            return
        usage = usage_of(obj)
        for key in ("completion_tokens", "output_tokens"):
            if isinstance(usage.get(key), int):
                self.usage = usage[key]
        if self.rec is not None and usage:
            note_usage(self.rec, usage)
        if self._has_token(obj):
            now = time.monotonic()
            if self.rec is not None:
                self.rec.first_token()
            self.first = self.first or now
            self.last = now
            self.deltas += 1

    @staticmethod
    def _has_token(obj: dict[str, Any]) -> bool:
        if obj.get("type") == "content_block_delta":  # Anthropic
            return True
        if obj.get("done") is False:  # Ollama: a piece of the answer (or a keep-alive)
            message = obj.get("message") or {}
            return bool(obj.get("response") or obj.get("thinking") or message.get("content")
                        or message.get("thinking") or message.get("tool_calls"))
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


def usage_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``usage`` of an OpenAI or Anthropic object, or an Ollama final object's counts
    in OpenAI's keys ({} when it has none)."""
    usage = obj.get("usage") or (obj.get("message") or {}).get("usage")
    if isinstance(usage, dict):
        return usage
    if isinstance(obj.get("eval_count"), int):
        return {"prompt_tokens": obj.get("prompt_eval_count"),
                "completion_tokens": obj["eval_count"]}
    return {}


def note_usage(rec: Access, usage: dict[str, Any]) -> None:
    """Token figures of an OpenAI or Anthropic ``usage`` object into the access record."""
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(usage.get("input_tokens"), int):  # Anthropic: input excludes cache reads
        cached = usage.get("cache_read_input_tokens") or 0
        prompt = usage["input_tokens"] + cached
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    for key, value in (("prompt", prompt), ("cached", cached), ("completion", completion)):
        if isinstance(value, int):
            setattr(rec, key, value)


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
        rec = access(request)
        if isinstance(response, StreamingResponse) and response.status_code < 400:
            ndjson = (response.media_type or "").startswith("application/x-ndjson")
            response.body_iterator = _Watched(response.body_iterator, obs, model, start,
                                              response.status_code, rec, ndjson)
            return response
        body: Any = None
        with contextlib.suppress(ValueError, AttributeError):
            body = json.loads(response.body)
        tokens, rate = None, None
        usage = usage_of(body) if isinstance(body, dict) else None
        if usage:
            note_usage(rec, usage)
        if response.status_code < 400 and usage:
            tokens = usage.get("completion_tokens", usage.get("output_tokens"))
            elapsed = time.monotonic() - start
            if isinstance(tokens, int) and tokens > 0 and elapsed > 0:
                rate = tokens / elapsed
        obs.finished(model, response.status_code, body, tokens=tokens, rate=rate)
        return response

    return wrapper

