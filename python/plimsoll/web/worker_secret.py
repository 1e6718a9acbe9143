"""A worker that answers only its launcher: a secret made at spawn, required on every route.

The worker listens on a loopback TCP port, which every local user and process can reach
(and a browser page through DNS rebinding): behind ``plimsoll serve --api-key`` it would
otherwise answer anyone without the key. So the launcher (the proxy) makes a random secret
for each worker it starts and hands it over out of band, in the worker's environment
(``SECRET_ENV``; never the command line, which every user can read in ``ps``). The worker's
:class:`RequireSecret` then answers 401 to any request — ``/health``, the status and
metrics included — that does not carry it in ``HEADER``; the launcher sends it on each
request it makes (:func:`headers`). A worker started with no secret (``plimsoll worker`` by
hand, the tests) answers every request as before.
"""

from __future__ import annotations

import hmac
import json
import secrets
from typing import Any

from .errors import error_body

SECRET_ENV = "PLIMSOLL_WORKER_SECRET"
HEADER = "x-plimsoll-worker-secret"
_HEADER_BYTES = HEADER.encode()


def new_secret() -> str:
    """256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def secret_env(secret: str | None) -> dict[str, str]:
    """The environment entry that hands ``secret`` to a worker (none for no secret)."""
    return {SECRET_ENV: secret} if secret else {}


def headers(secret: str | None) -> dict[str, str]:
    """The request header that a worker started with ``secret`` requires."""
    return {HEADER: secret} if secret else {}


class RequireSecret:
    """ASGI middleware: 401, in the route's protocol, without the worker's secret."""

    def __init__(self, app: Any, secret: str | None) -> None:
        self.app = app
        self.secret = secret.encode() if secret else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.secret is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan, or no secret set
            return
        given = next((v for k, v in scope.get("headers", []) if k.lower() == _HEADER_BYTES),
                     b"")
        if hmac.compare_digest(given, self.secret):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        path = scope.get("path", "")
        body = json.dumps(error_body(
            401, "this worker answers only the plimsoll process that started it (its proxy): "
            "send your request to the proxy instead", "worker_secret_required",
            anthropic=path.startswith("/v1/messages"))).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
