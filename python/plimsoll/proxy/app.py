"""The proxy's HTTP edge: one OpenAI-compatible endpoint in front of every model.

``make_app(policy, …)`` is an app factory; its lifespan creates the
:class:`~.supervisor.Supervisor`, the pool of kept-alive connections that relayed requests
take to the workers (:mod:`.upstream`), an ``httpx.AsyncClient`` for status polls and the
idle reaper,
and on exit stops every worker. Requests are routed by their ``model``; bodies are
relayed as bytes (the worker parses them) and streams pass through chunk by chunk as
they arrive — nothing is buffered but a non-streamed answer. A worker that dies under a
request is reported to its client with the reason (an SSE ``error`` event mid-stream, a 502
otherwise). The proxy's own errors speak the route's protocol: Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``) on ``/v1/messages*``, OpenAI's
elsewhere; both carry the machine-readable ``code`` the metrics count.

A ``model`` the policy does not serve by that name is looked up in its aliases (and the
default rule for names coding clients send, :mod:`plimsoll.core.aliases`); the body is
relayed with the served name. Every answer passes :class:`plimsoll.web.edge.Edge`
(``Retry-After`` on each 429/503, one access-log line); on SIGTERM, streams still relaying
when the drain time is up end with their protocol's error event
(:mod:`plimsoll.web.graceful`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll.core.policy import Mode, Policy
from plimsoll.web.body import read_body
from plimsoll.web.edge import access
from plimsoll.web.errors import error_body, is_anthropic, no_route_handler
from plimsoll.web.graceful import Drain

from .. import protocol
from ..protocol import ProtocolError, responses_events
from ..protocol import anthropic as anthropic_protocol
from ..protocol import ollama as ollama_protocol
from ..protocol.reservation import HEADER as MAX_TOKENS_HEADER
from . import admin, catalog, dashboard, metrics_edge, ollama
from . import upstream as upstream_mod
from .errors import ProxyError
from .metrics import Observer  # the request/event observer
from .routing import route_model
from .settings import Settings
from .state import Incarnation, Lease, State, describe_exit
from .supervisor import Supervisor

EXIT_WAIT_S = 0.5
DRAIN_POLL_S = 0.25
NO_ROUTE = no_route_handler("this proxy serves POST /v1/chat/completions, /v1/completions, "
                            "/v1/responses, /v1/messages, /v1/messages/count_tokens and GET "
                            "/v1/models")
STATUS_TIMEOUT_S = 2.0


def error(status: int, message: str, code: str, *, param: str | None = None,
          retry_after: int | None = None, extra: dict[str, Any] | None = None,
          anthropic: bool = False) -> JSONResponse:
    body = error_body(status, message, code, anthropic=anthropic, param=param, extra=extra)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status, headers=headers)


def proxy_error(err: ProxyError, *, anthropic: bool = False) -> JSONResponse:
    return error(err.status, err.message, err.code, retry_after=err.retry_after,
                 extra=err.extra, anthropic=anthropic)


def request_error(err: ProtocolError, *, anthropic: bool) -> JSONResponse:
    """A body the proxy cannot route (too large, not a JSON object, a bad ``model``)."""
    return error(err.status, err.message, err.code or "invalid_request", param=err.param,
                 anthropic=anthropic)


class PassThrough(StreamingResponse):
    """A stream whose iterator is always closed, even when the client leaves mid-way."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def api_key_ok(request: Request) -> bool:
    """``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic's)."""
    key = request.app.state.api_key
    if key is None or admin.bearer_ok(request, key):
        return True
    given = request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())


async def lost_reason(lease: Lease, err: Exception) -> str:
    """Why the worker under this request went away, once its exit is visible."""
    inc, name = lease.inc, lease.worker.name
    deadline = time.monotonic() + EXIT_WAIT_S
    while inc.proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    rc = inc.proc.poll()
    if rc is None:
        return (f"the connection to the worker for model {name!r} (pid {inc.pid}) was lost: "
                f"{type(err).__name__}: {err}")
    why = f" ({inc.stop_reason})" if inc.stop_reason else ""
    return (f"the worker for model {name!r} (pid {inc.pid}) exited with {describe_exit(rc)} "
            f"during this request{why}; retry: the next request starts it again")


_DRAINED = object()


async def until_drained(aw: Awaitable[Any], drain: Drain | None) -> Any:
    """``aw``'s result, or :data:`_DRAINED` (``aw`` cancelled) once a shutdown's drain time
    is up. Awaited in place: no task and no timer per call while no shutdown has begun."""
    if drain is None:
        return await aw
    return await drain.within(aw, _DRAINED)


def _stream_lost(message: str, code: str, anthropic: bool, status: int = 502,
                 responses: bool = False, ndjson: bool = False) -> list[bytes]:
    if ndjson:  # Ollama's streams: one {"error"} line
        return [ollama_protocol.ndjson(ollama_protocol.error_body(message, code))]
    body = error_body(status, message, code, anthropic=anthropic)
    if responses:  # the Responses API's typed error event; no [DONE]
        return [responses_events.sse_event({"type": "error", "sequence_number": 0, "code": code,
                                            "message": body["error"]["message"], "param": None})]
    if anthropic:  # Anthropic's streams end at the error event; no [DONE]
        return [anthropic_protocol.sse_event(body)]
    return [protocol.sse(body), protocol.SSE_DONE]


async def relay(upstream: upstream_mod.Answer, lease: Lease, *, anthropic: bool = False,
                responses: bool = False, drain: Drain | None = None,
                ndjson: bool = False) -> AsyncIterator[bytes]:
    """The worker's stream, chunk by chunk; a worker lost mid-way, or a shutdown whose
    drain time runs out, ends it with the protocol's error event."""
    chunks = upstream.aiter_raw()
    try:
        while True:
            # Read in place: a client that leaves cancels this read (the half-read answer then
            # closes its upstream connection below), a shutdown's drain time running out too.
            try:
                chunk = await until_drained(anext(chunks), drain)
            except StopAsyncIteration:
                return
            if chunk is _DRAINED:
                for part in _stream_lost(
                        f"the proxy is shutting down and its drain time ({drain.drain_s:g} s) "
                        "ran out before this stream finished", "proxy_stopping", anthropic,
                        503, responses, ndjson):
                    yield part
                return
            yield chunk
    except upstream_mod.ERRORS as err:
        for part in _stream_lost(await lost_reason(lease, err), "worker_lost", anthropic,
                                 responses=responses, ndjson=ndjson):
            yield part
    finally:
        try:
            await upstream.aclose()
        finally:  # even when a cancelled client's scope interrupts the close
            lease.release()


async def generate(request: Request) -> Response:
    anthropic = is_anthropic(request)
    if not api_key_ok(request):
        if anthropic:
            return error(401, "missing or wrong API key: send 'x-api-key: <key>' or "
                         "'Authorization: Bearer <key>'", "unauthorized", anthropic=True)
        return admin.unauthorized("API key")
    sup: Supervisor = request.app.state.supervisor
    raw = await read_body(request)
    if isinstance(raw, ProtocolError):
        return request_error(raw, anthropic=anthropic)
    routed = route_model(raw, sorted(sup.workers), sup.policy)
    if isinstance(routed, ProtocolError):
        return request_error(routed, anthropic=anthropic)
    model, raw = routed
    request.state.model = model  # metrics: the label of this request
    rec = access(request)
    rec.model = model
    drain: Drain = request.app.state.drain
    if drain.draining:
        return error(503, "the proxy is shutting down: retry once it is back", "proxy_stopping",
                     retry_after=1, anthropic=anthropic)
    try:
        lease = await sup.acquire(model)
    except ProxyError as err:
        return proxy_error(err, anthropic=anthropic)
    try:
        cfg = lease.inc.cfg
        upstream = await until_drained(request.app.state.upstream.post(
            cfg.host, cfg.port, request.scope["path"], lease.inc.headers, raw), drain)
    except upstream_mod.ERRORS as err:
        lease.release()
        return error(502, await lost_reason(lease, err), "worker_lost", anthropic=anthropic)
    if upstream is _DRAINED:  # shutting down, and the worker had not answered within the drain
        lease.release()
        return error(503, f"the proxy is shutting down and its drain time ({drain.drain_s:g} s)"
                     " ran out before the worker answered", "proxy_stopping", retry_after=1,
                     anthropic=anthropic)
    ctype = upstream.headers.get("content-type", "application/json")
    headers = {k: v for k, v in upstream.headers.items()
               if k.lower() in ("retry-after", MAX_TOKENS_HEADER)}
    if (reserved := upstream.headers.get(MAX_TOKENS_HEADER, "")).isdigit():
        rec.reservation = int(reserved)
    if ctype.startswith(("text/event-stream", ollama_protocol.NDJSON)):
        return PassThrough(relay(upstream, lease, anthropic=anthropic, drain=drain,
                                 responses=request.scope["path"] == "/v1/responses",
                                 ndjson=ctype.startswith(ollama_protocol.NDJSON)),
                           upstream.status_code, media_type=ctype,
                           headers={"Cache-Control": "no-cache", **headers})
    try:
        content = await upstream.aread()
    except upstream_mod.ERRORS as err:
        return error(502, await lost_reason(lease, err), "worker_lost", anthropic=anthropic)
    finally:
        try:
            await upstream.aclose()
        finally:
            lease.release()
    return Response(content, upstream.status_code, media_type=ctype, headers=headers)


async def models(request: Request) -> Response:
    """Every model of the policy, loaded or not, with the context admission grants it."""
    if not api_key_ok(request):
        return admin.unauthorized("API key")
    sup: Supervisor = request.app.state.supervisor
    figures = sup.figures()
    created = int(request.app.state.started)
    data = []
    for name, w in sorted(sup.workers.items()):
        card = protocol.model_card(name, created)
        if (inc := w.current) is not None:
            dec = inc.decision
        else:
            try:
                _facts, dec = sup.admit(w, figures)
            except ProxyError as err:
                card.update(state=str(w.state), loaded=False, admission="refuse",
                            reasons=[err.message])
                data.append(card)
                continue
        card.update(state=str(w.state), loaded=w.state is State.READY, admission=dec.decision,
                    context=dec.context if dec.admitted else None,
                    configured_context=w.entry.context, max_tokens=dec.output_reservation,
                    concurrency=dec.concurrency)
        if not dec.admitted:
            card["reasons"] = dec.reasons
        data.append(card)
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    sup: Supervisor = request.app.state.supervisor
    ready = [n for n, w in sup.workers.items() if w.state is State.READY]
    return JSONResponse({"status": "ok", "mode": sup.mode, "ready": ready,
                         "pressure": sup.pressure.state.level})


async def worker_status(client: httpx.AsyncClient, inc: Incarnation) -> dict[str, Any] | None:
    try:
        r = await client.get(inc.url + "/v1/plimsoll/status", headers=inc.headers,
                             timeout=STATUS_TIMEOUT_S)
        return r.json()
    except (httpx.HTTPError, ValueError):
        return None


async def running(request: Request) -> Response:
    if not api_key_ok(request):
        return admin.unauthorized("API key")
    sup: Supervisor = request.app.state.supervisor
    client: httpx.AsyncClient = request.app.state.client
    figures = sup.figures()
    workers = [w.snapshot() for w in sup.workers.values()]
    live = [(snap, w.current) for snap, w in zip(workers, sup.workers.values(), strict=True)
            if w.current is not None]
    statuses = await asyncio.gather(*(worker_status(client, inc) for _s, inc in live))
    for (snap, inc), st in zip(live, statuses, strict=True):
        snap["observed_bytes"] = sup.observed_bytes(inc.pid)
        if st is not None:
            snap["memory"] = {"rss_bytes": st.get("rss_bytes"), "mlx": st.get("mlx"),
                              "pool": st.get("pool"), "kv_bytes_held": st.get("kv_bytes_held")}
    for snap in workers:
        snap["waiting"] = sup.waiting[snap["model"]]
    pending = []
    if sup.pending:
        now = await asyncio.to_thread(sup.unaccounted)
        pending = [{"model": c.model, **c.figures(now)} for c in sup.pending]
    return JSONResponse({
        "mode": sup.mode, "envelope_bytes": sup.envelope(figures),
        "budget_bytes": figures.budget_bytes, "host_in_use_bytes": sup.in_use(),
        "workers": workers, "pending_releases": pending,
        "pressure": sup.pressure.snapshot(),  # the tripwire: level, reasons, last reading
        "events": sup.events.as_json(),
    })


async def unload(request: Request) -> Response:
    if not api_key_ok(request):
        return admin.unauthorized("API key")
    sup: Supervisor = request.app.state.supervisor
    name = request.path_params.get("model")
    if name is not None and name not in sup.workers:
        return error(404, f"the model {name!r} is not served here; known models: "
                     f"{', '.join(sorted(sup.workers))}", "model_not_found")
    return JSONResponse(await sup.unload([name] if name else list(sup.workers)))


def make_app(policy: Policy, *, mode: Mode = "standalone", settings: Settings | None = None,
             api_key: str | None = None, admin_token: str, read_snapshot=None,
             drain: Drain | None = None) -> Starlette:
    """The proxy app for ``policy``. Workers are spawned only when a request needs them.

    ``drain`` is the shutdown state :func:`plimsoll.web.graceful.serve` marks on SIGTERM
    (default: one of ``settings.drain_s`` that nothing marks)."""
    drain = drain or Drain(settings.drain_s if settings else Settings().drain_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        obs = Observer(policy)  # metrics + dashboard: sees every event and request
        sup = Supervisor(policy, mode, settings, read_snapshot, events=obs.events)
        app.state.supervisor = sup
        app.state.observer = obs
        app.state.api_key = api_key
        app.state.admin_token = admin_token
        app.state.started = time.time()
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        upstream = app.state.upstream = upstream_mod.Upstream()
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                     limits=limits) as client:
            app.state.client = client
            sup.start_background()
            obs.start(sup, client)
            try:
                yield
            finally:
                await obs.stop()
                await sup.shutdown()
                await upstream.aclose()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", metrics_edge.observed(generate), methods=["POST"]),
            Route("/v1/completions", metrics_edge.observed(generate), methods=["POST"]),
            Route("/v1/responses", metrics_edge.observed(generate), methods=["POST"]),  # Responses
            Route("/v1/messages", metrics_edge.observed(generate), methods=["POST"]),  # Anthropic
            Route("/v1/messages/count_tokens", generate, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", catalog.retrieve(models), methods=["GET"]),
            *ollama.routes(policy, settings, metrics_edge.observed(generate)),  # /api/*
            Route("/health", health, methods=["GET"]),
            Route("/running", running, methods=["GET"]),
            Route("/unload", unload, methods=["POST"]),
            Route("/unload/{model}", unload, methods=["POST"]),
            Route("/admin/mode", admin.post_mode, methods=["POST"]),
            Route("/admin/mode", admin.get_mode, methods=["GET"]),
            Route("/admin/events", admin.get_events, methods=["GET"]),
            Route("/metrics", metrics_edge.get_metrics, methods=["GET"]),
            Route("/", dashboard.page, methods=["GET"]),
            Route("/dashboard.json", dashboard.data, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={404: NO_ROUTE, 405: NO_ROUTE},
    )
    app.state.drain = drain
    return app
