"""The worker's HTTP edge: a Starlette app over one scheduler (OpenAI-compatible).

``make_app(cfg)`` is an app factory with a lifespan, as Starlette recommends: the lifespan
opens a *backend* — by default :func:`~.engine_client.process_backend` (the engine, the
process limits, the pool and the scheduler in an engine process of their own; this process
parses, renders templates, detokenizes and streams); in clustered mode rank 0 passes its
ring scheduler instead (:mod:`plimsoll.cluster.serve`) and every route below is the same
code.
Routes read ``request.app.state`` — no globals. Running out arrives from the scheduler as a
``Refused`` event and leaves here as a 503 (with ``Retry-After``) in the OpenAI error
shape; bad input is a 400 that says what to change. This module holds the OpenAI routes,
their streaming (:class:`TextSSE`, the per-token template) and the status report; the
Anthropic and Responses routes are :mod:`.anthropic_routes` and :mod:`.responses_routes`.

A ``max_tokens`` over what the worker reserves is clamped (or refused: the
``max_tokens_over_limit`` setting; :mod:`plimsoll.protocol.reservation`), the applied
reservation sent back in ``x-plimsoll-max-tokens``. Every answer passes
:class:`plimsoll.web.edge.Edge` (``Retry-After`` on each 429/503, a bound on requests in
flight, one access-log line), and a SIGTERM drains as :mod:`plimsoll.web.graceful` says.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import protocol
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard.process import SelfGuard
from plimsoll.protocol import structured
from plimsoll.web.access_log import set_quiet
from plimsoll.web.body import read_body
from plimsoll.web.edge import Edge, access
from plimsoll.web.errors import no_route_handler
from plimsoll.web.graceful import Drain
from plimsoll.web.worker_secret import SECRET_ENV, RequireSecret

from . import anthropic_routes, ollama_routes, responses_routes
from .backend import Backend
from .engine_client import process_backend
from .events import Refused, Started
from .submit import (
    EARLY_HEADERS_S,
    constraint_spec,
    error,
    events,
    protocol_error,
    rendered,
    reservation,
    reserved_headers,
    sse_stream,
    stopping,
    submit,
)

log = logging.getLogger("plimsoll.worker")
NO_ROUTE = no_route_handler("this worker serves POST /v1/chat/completions, /v1/completions, "
                            "/v1/responses, /v1/messages, /v1/messages/count_tokens and GET "
                            "/v1/models, "
                            "/health, /v1/plimsoll/status")


async def generate(request: Request, kind: protocol.Kind) -> Response:
    state = request.app.state
    cfg: WorkerConfig = state.cfg
    rec = access(request)
    raw = await read_body(request)
    if isinstance(raw, protocol.ProtocolError):
        return protocol_error(raw)
    req = protocol.parse_request(kind, raw)
    if isinstance(req, protocol.ProtocolError):
        return protocol_error(req)
    rec.model = req.model or cfg.model_name
    if err := protocol.check_model(req.model, cfg.model_name):
        return protocol_error(err)
    render = protocol.render_chat if kind == "chat" else protocol.render_completion
    try:
        prompt = await rendered(request, render, state.tokenizer, req)
        spec = constraint_spec(state, structured.chat_spec(req) if kind == "chat" else None)
    except protocol.ProtocolError as err:
        return protocol_error(err)
    rec.prompt = len(prompt)
    res = reservation(state, len(prompt), req.max_output_tokens,
                      "messages" if kind == "chat" else "prompt")
    if isinstance(res, protocol.ProtocolError):
        return protocol_error(res)
    rec.reservation = res.max_tokens
    if refused := stopping(request):
        return error(refused.status, refused.message, code=refused.code,
                     retry_after=refused.retry_after)
    first, queue, gen = await submit(request, prompt, res.max_tokens,
                                     temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                     top_k=req.top_k, min_p=req.min_p, spec=spec,
                                     ignore_eos=req.ignore_eos,
                                     wait_s=EARLY_HEADERS_S if req.stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return error(first.status, first.message, code=first.code, retry_after=first.retry_after)
    assembler = protocol.TextAssembler.for_request(state.tokenizer, req, res.max_tokens,
                                                   protocol.markers_for(state.tokenizer, prompt))
    meta = protocol.ResponseMeta.new(kind, cfg.model_name)
    if req.stream:
        return StreamingResponse(_sse(meta, req, (first, queue, request, gen), assembler),
                                 media_type="text/event-stream",
                                 headers=reserved_headers(res, {"Cache-Control": "no-cache"}))
    failure = None
    async for item in events(queue, request, gen, assembler):
        if isinstance(item, Refused):
            failure = item
    if failure is not None:
        return error(failure.status, failure.message, code=failure.code,
                     retry_after=failure.retry_after)
    if not assembler.done:  # the client left
        return Response(status_code=499)
    rec.cached = first.cached_tokens
    return JSONResponse(protocol.response(meta, assembler.result(), _usage(first, assembler)),
                        headers=reserved_headers(res))


_JSON_STR = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps builds one per call


class TextSSE:
    """``P.sse`` of the chunk of one text delta, byte for byte, without building and encoding
    the whole chunk per token: its bytes around the text are rendered once per response."""

    def __init__(self, meta: protocol.ResponseMeta) -> None:
        chat = meta.kind == "chat"
        raw = protocol.sse(protocol.chat_chunk(meta, {"content": ""}) if chat
                           else protocol.completion_chunk(meta, ""))
        marker = b'"content":""' if chat else b'"text":""'
        head, found, self._tail = raw.rpartition(marker)
        if not found:  # pragma: no cover - the chunk builders changed shape
            raise RuntimeError("a text chunk without its text field")
        self._head = head + marker[:-2]

    def __call__(self, text: str) -> bytes:
        return self._head + _JSON_STR(text).encode() + self._tail

    def deltas(self, meta: protocol.ResponseMeta, deltas: list[protocol.Delta]) -> bytes:
        """Every delta's event, joined: text through the template, the rest as built."""
        out = []
        for d in deltas:
            if type(d) is protocol.TextDelta:
                out.append(self(d.text))
            else:
                out.extend(protocol.sse(c) for c in protocol.delta_chunks(meta, [d]))
        return b"".join(out)


def _usage(first: Started, assembler: protocol.TextAssembler) -> dict[str, Any]:
    return protocol.usage(first.prompt_tokens, assembler.completion_tokens, first.cached_tokens)


def _sse(meta: protocol.ResponseMeta, req: protocol.Request, waiting: tuple,
         assembler: protocol.TextAssembler) -> AsyncIterator[bytes]:
    def refusal(refused: Refused) -> list[bytes]:
        body = protocol.error_body(refused.status, refused.message, code=refused.code)
        return [protocol.sse(body), protocol.SSE_DONE]

    def closing(first: Started) -> list[bytes]:
        usage = _usage(first, assembler) if req.include_usage else None
        return [*map(protocol.sse, protocol.final_chunks(meta, assembler.result(), usage)),
                protocol.SSE_DONE]

    text_sse = TextSSE(meta)
    return sse_stream(waiting, assembler, opening=map(protocol.sse, protocol.first_chunks(meta)),
                      keepalive=b": keep-alive\n\n", refusal=refusal,
                      deltas=lambda item: [text_sse.deltas(meta, item)], closing=closing)


# --- the other routes -------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    return await generate(request, "chat")


async def completions(request: Request) -> Response:
    return await generate(request, "completion")


async def models(request: Request) -> Response:
    return JSONResponse(protocol.models_list([request.app.state.cfg.model_name]))


async def health(request: Request) -> Response:
    live = await live_figures(request.app.state)
    status = "stopped" if live.get("down") else "tripped" if live.get("tripped") else "ok"
    return JSONResponse({"status": status}, 200 if status == "ok" else 503)


async def status(request: Request) -> Response:
    state = request.app.state
    return JSONResponse(status_report(state, await live_figures(state)))


async def live_figures(state: Any) -> dict[str, Any]:
    """What the status report reads from wherever the engine runs: the scheduler's published
    ``stats``, whether it is ``tripped``, MLX's ``memory``, the worker's ``rss`` (every
    process of it), the ``guard`` and its ``cgroup``, the ``engine_pid``, and ``down`` (why
    no engine runs now; None while one does). A backend that has them elsewhere (the engine
    process: :meth:`.engine_client.EngineClient.live`) gives ``live``; a scheduler in this
    process is read here."""
    if (live := getattr(state, "live", None)) is not None:
        return await live()
    guard = state.guard
    guard_status = guard.status() if guard else None
    return {"stats": dict(state.scheduler.stats), "tripped": state.scheduler.tripped,
            "memory": state.engine_memory(), "rss": state.rss(), "guard": guard_status,
            "cgroup": guard_status if isinstance(guard, SelfGuard) else None,
            "engine_pid": os.getpid(), "down": None}


def status_report(state: Any, live: dict[str, Any]) -> dict[str, Any]:
    cfg: WorkerConfig = state.cfg
    mem = live.get("memory") or {}
    down = {"engine_down": live["down"]} if live.get("down") else {}
    return {
        "ready": not down,
        "model": cfg.model_name,
        "pid": os.getpid(),
        "engine_pid": live.get("engine_pid"),
        **down,
        "block_tokens": cfg.block_tokens,
        "block_bytes": state.block_bytes,
        "kv_bytes_per_token": state.kv_bytes_per_token,
        "kv_bytes_bound": cfg.max_cache_blocks * state.block_bytes,
        "kv_dtype": getattr(state, "kv_dtype", None),
        "transient_bytes": cfg.transient_bytes,
        "max_num_seqs": cfg.max_num_seqs,
        **live.get("stats", {}),
        "mlx": {"active_bytes": mem.get("active"), "peak_bytes": mem.get("peak"),
                "cache_bytes": mem.get("cache")},
        "rss_bytes": live.get("rss"),
        "cgroup": live.get("cgroup"),
        "guard": live.get("guard"),
        "context": {"native_max": state.native_max_context, "configured": cfg.context,
                    "max_tokens": cfg.max_tokens, "default_max_tokens": cfg.default_max_tokens},
        "limits": {
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "allocation_limit_bytes": cfg.allocation_limit_bytes,
            **state.applied_limits,
            "trip_bytes": cfg.trip_bytes,
            "ceiling_bytes": cfg.ceiling_bytes,
            "total_ram_bytes": cfg.total_ram_bytes,
        },
        "uptime_s": round(time.monotonic() - state.started, 3),
        **live.get("extra", {}),  # the engine's kernels, its step, speculation
        **(extra() if (extra := getattr(state, "status_extra", None)) else {}),
    }


def make_app(cfg: WorkerConfig, backend: Backend | None = None) -> Starlette:
    """The worker's routes over ``backend`` (default: the worker's engine process).

    A clustered load passes its own backend (rank 0's ring scheduler): the routes,
    protocol parsing, streaming, chat templates and error shapes are this same code.
    """
    open_backend = backend or process_backend
    drain = Drain(cfg.drain_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with open_backend(cfg) as parts:
            app.state.cfg = cfg
            for name, value in parts.items():
                setattr(app.state, name, value)
            app.state.started = time.monotonic()
            report = status_report(app.state, await live_figures(app.state))
            log.info("PLIMSOLL_READY %s", json.dumps(report))
            yield

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/plimsoll/status", status, methods=["GET"]),
            *anthropic_routes.ROUTES,  # POST /v1/messages, /v1/messages/count_tokens
            *responses_routes.ROUTES,  # POST /v1/responses
            *ollama_routes.ROUTES,  # POST /api/chat, /api/generate (Ollama's API)
        ],
        exception_handlers={404: NO_ROUTE, 405: NO_ROUTE},
        lifespan=lifespan,
    )
    app.state.drain = drain
    app.add_middleware(RequireSecret, secret=os.environ.get(SECRET_ENV))  # its launcher's only
    return app


def in_flight_limit(cfg: WorkerConfig) -> int:
    """Requests the worker holds at once (running, waiting for blocks, being parsed)."""
    return cfg.max_queue + cfg.batch_bound + 16


def serve_worker(cfg: WorkerConfig) -> None:
    """Run the worker under uvicorn until SIGTERM/SIGINT (drained, exit 0); limits are
    restored on exit."""
    from plimsoll.web.graceful import serve
    from plimsoll.web.serve import basic_logging, uvicorn_options

    basic_logging()
    set_quiet(cfg.quiet)
    app = make_app(cfg)
    limit = in_flight_limit(cfg)
    # h11 whatever else is installed: its cap on a request head bounds enormous headers.
    # uvicorn's own concurrency bound (a plain 503 with no Retry-After) stays far behind
    # the Edge's, which answers in the route's protocol with Retry-After.
    serve(Edge(app, limit=limit), app.state.drain, host=cfg.host, port=cfg.port,
          **uvicorn_options(limit_concurrency=limit + 1024, graceful_s=0))
