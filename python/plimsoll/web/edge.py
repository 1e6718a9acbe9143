"""What every HTTP answer of the worker and the proxy gets on its way out (ASGI middleware).

- :class:`Edge` wraps the app once and does three things for each request:

  1. **a bounded number in flight**: past ``limit`` concurrent requests the answer is a 503
     in the route's protocol (code ``too_many_requests``) with ``Retry-After`` — instead of
     uvicorn's own plain-text 503, which carries no hint and no code;
  2. **``Retry-After`` on every 429 and 503**, whoever made it (the scheduler, the
     supervisor, a health check): an answer a client may retry always says when;
  3. **one access-log line** (:mod:`.access_log`) when the answer's last byte is
     sent: route, model, prompt / cached / completion tokens, output reservation, status
     or refusal code, time to first token and total time. Handlers fill in what they know
     through :func:`access` (the record rides in the ASGI scope).
"""

from __future__ import annotations

import json
import time
from typing import Any

from .access_log import Access, emit
from .errors import OLLAMA_PREFIX, error_body_for

DEFAULT_RETRY_AFTER_S = 1
_SCOPE_KEY = "plimsoll.access"
_MAX_ERROR_BODY = 65536


def access(request: Any) -> Access:
    """The access record of this request (a fresh one outside :class:`Edge`, e.g. in tests)."""
    scope = request.scope
    rec = scope.get(_SCOPE_KEY)
    if rec is None:
        rec = scope[_SCOPE_KEY] = Access(route=scope.get("path", ""))
    return rec


def _code_of(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return err.get("code") or err.get("type")
    if isinstance(err, str):  # Ollama's shape: the code beside the message
        code = obj.get("code")
        return code if isinstance(code, str) else None
    return None


class Edge:
    """The ASGI middleware of the module docstring; ``limit`` None means no bound."""

    def __init__(self, app: Any, *, limit: int | None = None,
                 retry_after_s: int = DEFAULT_RETRY_AFTER_S, log_paths: tuple[str, ...] = (
                     "/v1/", OLLAMA_PREFIX)) -> None:
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.log_paths = log_paths
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        rec = scope[_SCOPE_KEY] = Access(route=f"{scope.get('method', '')} {path}")
        if self.limit is not None and self.in_flight >= self.limit:
            await self._refuse(scope, send, rec)
            return
        self.in_flight += 1
        error_chunks: list[bytes] = []
        json_error = False

        async def wrapped_send(message: dict) -> None:
            nonlocal json_error
            if message["type"] == "http.response.start":
                status = message["status"]
                rec.status = status
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _v in headers}
                if status in (429, 503) and b"retry-after" not in names:
                    headers.append((b"retry-after", str(self.retry_after_s).encode()))
                    message = {**message, "headers": headers}
                ctype = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
                json_error = status >= 400 and ctype.startswith(b"application/json")
            elif message["type"] == "http.response.body":
                if json_error and sum(map(len, error_chunks)) < _MAX_ERROR_BODY:
                    error_chunks.append(message.get("body", b""))
                if not message.get("more_body", False) and rec.code is None and error_chunks:
                    rec.code = _code_of(b"".join(error_chunks))
            await send(message)

        try:
            await self.app(scope, receive, wrapped_send)
        finally:
            self.in_flight -= 1
            if path.startswith(self.log_paths) and scope.get("method") == "POST":
                emit(rec, time.monotonic())

    async def _refuse(self, scope: dict, send: Any, rec: Access) -> None:
        path = scope.get("path", "")
        body = json.dumps(error_body_for(
            path, 503, f"{self.in_flight} requests are in flight, the most this server takes "
            f"at once ({self.limit}): retry after {self.retry_after_s} s",
            "too_many_requests")).encode()
        rec.status, rec.code = 503, "too_many_requests"
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.retry_after_s).encode())]})
        await send({"type": "http.response.body", "body": body})
        if path.startswith(self.log_paths):
            emit(rec, time.monotonic())
