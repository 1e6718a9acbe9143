"""Ollama's API on the proxy's port: generation relayed to the model's worker, the listings
over every model of the policy, and model management refused.

- ``POST /api/chat`` and ``/api/generate`` take the proxy's request path of every generate
  route (API key, routing by ``model`` with its aliases and ``name:latest``, load and
  admission, the relay of NDJSON streams chunk by chunk, metrics, the access log); the
  worker answers them (:mod:`plimsoll.worker.ollama_routes`). The proxy's own refusals on
  them (401, 404, 429, 503 with ``Retry-After``) are re-shaped here into Ollama's
  ``{"error": "..."}``.
- ``GET /api/tags`` (every model of the policy), ``GET /api/ps`` (the loaded ones),
  ``POST /api/show`` (one, with its served context as ``model_info``'s context_length) and
  ``GET /api/version`` are answered by the proxy without loading anything.
- ``pull``, ``push``, ``create``, ``copy``, ``delete`` and blob uploads are a 400 that says
  the models come from the policy — never a pretended success; so are embeddings (the
  policy's models are served for generation). A 4xx, not 501: asking is the client's
  mistake here, and a 5xx would count as a server fault and invite retries.

On by default; the policy's ``ollamaApi: false`` or ``plimsoll serve --no-ollama-api`` leave
every ``/api/*`` path unrouted (404). Every route but ``/api/version`` asks for the API key
when the proxy has one (``Authorization: Bearer``, as Ollama's clients send it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll.core.aliases import resolve
from plimsoll.core.policy import Policy
from plimsoll.web.body import read_body

from .. import protocol
from ..protocol import ollama as ollama_protocol
from ..protocol.ollama import catalog as ollama_catalog
from . import admin, catalog
from .errors import ProxyError
from .settings import Settings
from .state import State
from .supervisor import Supervisor

Endpoint = Callable[[Request], Awaitable[Response]]
NOT_HERE = ("not supported here: models come from the policy ({what} is not done through "
            "this API); add, change or remove a model in the policy file (or serve one with "
            "`plimsoll serve --model DIR`) and restart the server")
MANAGEMENT = {
    "/api/pull": (["POST"], "pulling from a registry"),
    "/api/push": (["POST"], "pushing to a registry"),
    "/api/create": (["POST"], "creating a model from a Modelfile"),
    "/api/copy": (["POST"], "copying a model"),
    "/api/delete": (["DELETE"], "deleting a model"),
    "/api/blobs/{digest:path}": (["HEAD", "POST"], "uploading blobs"),
}
EMBEDDINGS = ("/api/embed", "/api/embeddings")
NEVER = datetime(9999, 12, 31, tzinfo=UTC)  # expires_at of a model with no idle TTL


def enabled(policy: Policy, settings: Settings | None) -> bool:
    """On unless the policy or the command line turned it off."""
    return policy.ollama_api and (settings or Settings()).ollama_api


def error(status: int, message: str, code: str, headers: dict[str, str] | None = None
          ) -> JSONResponse:
    return JSONResponse(ollama_protocol.error_body(message, code), status, headers=headers)


def shaped(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with the proxy's own OpenAI-shaped errors answered in Ollama's shape
    (status, ``Retry-After`` and the other headers kept); the worker's answers, already
    Ollama's, pass as they are."""

    async def wrapper(request: Request) -> Response:
        response = await endpoint(request)
        if response.status_code < 400 or isinstance(response, StreamingResponse):
            return response
        try:
            err = json.loads(bytes(response.body)).get("error")
        except (ValueError, AttributeError):
            return response
        if not isinstance(err, dict):
            return response
        kept = {k: v for k, v in response.headers.items()
                if k.lower() not in ("content-length", "content-type")}
        return error(response.status_code, str(err.get("message")),
                     str(err.get("code") or err.get("type") or "error"), kept)

    return wrapper


def _refused_key(request: Request) -> Response | None:
    """The 401 for a missing or wrong API key (None when it is right or none is set)."""
    key = request.app.state.api_key
    if key is None or admin.bearer_ok(request, key):
        return None
    return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (an "
                 "Ollama client sends OLLAMA_API_KEY so)", "unauthorized",
                 {"WWW-Authenticate": "Bearer"})


async def tags(request: Request) -> Response:
    """``GET /api/tags``: every model of the policy, loaded or not."""
    if refused := _refused_key(request):
        return refused
    sup: Supervisor = request.app.state.supervisor
    entries = [(name, w.entry.path) for name, w in sorted(sup.workers.items())]
    views = await asyncio.to_thread(
        lambda: [catalog.model_view(name, path, None) for name, path in entries])
    return JSONResponse(ollama_catalog.tags(views))


def _expires_at(sup: Supervisor, name: str) -> datetime:
    w = sup.workers[name]
    ttl = sup.settings.idle_ttl(w.name, w.entry)
    if ttl <= 0 or w.current is None:
        return NEVER
    idle = 0.0 if w.current.inflight else time.monotonic() - w.current.last_used
    return datetime.now(UTC) + timedelta(seconds=max(0.0, ttl - idle))


async def ps(request: Request) -> Response:
    """``GET /api/ps``: the loaded models, each with its admitted footprint and context."""
    if refused := _refused_key(request):
        return refused
    sup: Supervisor = request.app.state.supervisor
    loaded = [(name, w.entry.path, w.current.decision) for name, w in sorted(sup.workers.items())
              if w.state is State.READY and w.current is not None]
    views = await asyncio.to_thread(
        lambda: [catalog.model_view(name, path, dec.context) for name, path, dec in loaded])
    return JSONResponse({"models": [
        ollama_catalog.running_entry(view, dec.footprint_bytes,
                                     ollama_protocol.timestamp(_expires_at(sup, name)))
        for view, (name, _path, dec) in zip(views, loaded, strict=True)]})


async def show(request: Request) -> Response:
    """``POST /api/show``: one model in detail (a name of the policy, an alias, or
    ``name:latest``)."""
    if refused := _refused_key(request):
        return refused
    raw = await read_body(request)
    req = ollama_protocol.parse_show(raw) if isinstance(raw, bytes) else raw
    if isinstance(req, protocol.ProtocolError):
        return error(req.status, req.message, req.code or "invalid_request")
    sup: Supervisor = request.app.state.supervisor
    name = resolve(req.target, sup.policy)
    if name is None or name not in sup.workers:
        return error(404, f"model {req.target!r} not found: this server serves "
                     f"{', '.join(sorted(sup.workers)) or '(none)'} (from the policy, or an "
                     "alias of its 'aliases')", "model_not_found")
    try:
        context = catalog.served_context(sup, name)
    except ProxyError as err:
        headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
        return error(err.status, err.message, err.code, headers)
    view = await asyncio.to_thread(catalog.model_view, name, sup.workers[name].entry.path,
                                   context)
    return JSONResponse(ollama_catalog.show(view))


async def version(request: Request) -> Response:
    """``GET /api/version``: the Ollama API version these routes follow (no key needed)."""
    return JSONResponse(ollama_catalog.version())


def _not_here(what: str) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        if refused := _refused_key(request):
            return refused
        return error(400, NOT_HERE.format(what=what), "not_supported")

    return endpoint


async def _no_embeddings(request: Request) -> Response:
    if refused := _refused_key(request):
        return refused
    return error(400, "not supported here: the policy's models are served for generation, not "
                 "embeddings; use an embedding server for /api/embed", "not_supported")


def routes(policy: Policy, settings: Settings | None, relay: Endpoint) -> list[Route]:
    """Ollama's routes, ``relay`` (the proxy's generate endpoint) answering the generation
    ones; none when the policy or the command line turned the API off."""
    if not enabled(policy, settings):
        return []
    generation = shaped(relay)
    return [
        Route("/api/chat", generation, methods=["POST"]),
        Route("/api/generate", generation, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/version", version, methods=["GET"]),
        *(Route(path, _not_here(what), methods=methods)
          for path, (methods, what) in MANAGEMENT.items()),
        *(Route(path, _no_embeddings, methods=["POST"]) for path in EMBEDDINGS),
    ]
