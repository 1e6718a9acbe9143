"""Error answers in the route's own protocol, shared by the worker and the proxy (HTTP edge).

An error on an Anthropic route (``/v1/messages…``) is Anthropic-shaped
(``{"type": "error", "error": {"type", "message"}}``), on an Ollama route (``/api/…``)
Ollama-shaped (``{"error": "...", "code"}``), anywhere else OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``); ``code`` rides inside ``error`` in
the first and the last, beside it in Ollama's, so metrics and clients can tell refusals
apart. Unknown paths and wrong methods get
the same JSON, naming what exists, never Starlette's plain-text "Not Found".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plimsoll import protocol
from plimsoll.protocol import ollama
from plimsoll.protocol.anthropic import error_body as anthropic_error_body

OLLAMA_PREFIX = "/api/"


def is_anthropic(request: Request) -> bool:
    """True on the Anthropic routes (``/v1/messages``, ``/v1/messages/count_tokens``)."""
    return request.scope["path"].startswith("/v1/messages")  # no URL object built per request


def is_ollama_path(path: str) -> bool:
    """True on Ollama's routes (``/api/chat``, ``/api/tags``, ...)."""
    return path.startswith(OLLAMA_PREFIX)


def error_body_for(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    """:func:`error_body` in the protocol of the route at ``path``."""
    if is_ollama_path(path):
        return ollama.error_body(message, code)
    return error_body(status, message, code, anthropic=path.startswith("/v1/messages"))


def error_body(status: int, message: str, code: str, *, anthropic: bool = False,
               param: str | None = None, extra: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """The error object in the route's protocol; ``code`` and ``extra`` ride inside
    ``error`` in both (Anthropic's clients ignore fields they do not know)."""
    if anthropic:
        body = anthropic_error_body(status, message)
        body["error"]["code"] = code
    else:
        body = protocol.error_body(status, message, param=param, code=code)
    body["error"].update(extra or {})
    return body


def no_route_handler(served: str) -> Callable[[Request, Exception], Awaitable[Response]]:
    """The 404/405 handler of a server whose routes ``served`` describes."""

    async def no_route(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        path = request.url.path
        headers = None
        if status == 405:
            headers = getattr(exc, "headers", None)
            allowed = (headers or {}).get("allow", "")
            message = (f"{request.method} is not allowed on {path}; use "
                       f"{allowed or 'another method'}")
            code = "method_not_allowed"
        else:
            message = f"no route {path}: {served}"
            code = "unknown_route"
        return JSONResponse(error_body_for(path, status, message, code), status,
                            headers=headers)

    return no_route
