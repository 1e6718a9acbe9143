"""The worker's Ollama API: ``POST /api/chat`` and ``/api/generate``, NDJSON streams or one
object.

The same request path as the OpenAI routes of :mod:`plimsoll.worker.submit` — body limit,
model check, chat template, the output-reservation and context checks, one ``GenRequest``
to the scheduler, admission or a refusal — with Ollama's shapes at both ends
(:mod:`plimsoll.protocol.ollama`): the body is translated onto the OpenAI request model,
rendered, constrained where ``format`` asks, and assembled (tool calls parsed) exactly as
on ``/v1/chat/completions`` (or ``/v1/completions`` for ``raw`` generation). Running out is
a 503 with ``Retry-After`` and bad input a 400 that says what to change, both as
``{"error": "..."}``; ``options.num_ctx`` over the served context is a 400 with the
figures, and under it bounds this request's context. A model named ``name:latest`` is
``name``. A request with nothing to generate (no messages, no prompt) answers
``done_reason: "load"`` at once: reaching the worker loaded the model.

The shared request path is :mod:`.submit` (imported as ``W``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import protocol as P
from plimsoll.core.aliases import untagged
from plimsoll.protocol import ollama as O
from plimsoll.web.body import read_body
from plimsoll.web.edge import access
from plimsoll.worker import submit as W

from .scheduler import Refused, Started


def error(status: int, message: str, code: str | None = None,
          retry_after: int | None = None) -> JSONResponse:
    """An error response in Ollama's shape (``Retry-After`` when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(O.error_body(message, code), status, headers=headers)


def protocol_error(err: P.ProtocolError) -> JSONResponse:
    return error(err.status, err.message, err.code)


def refused(r: Refused) -> JSONResponse:
    return error(r.status, r.message, r.code, r.retry_after)


def _prepare(state: Any, req: O.ChatRequest | O.GenerateRequest
             ) -> tuple[P.Request, list[int], Any]:
    """On a thread: the OpenAI request, its prompt ids and its constraint (or raise the 400)."""
    if isinstance(req, O.GenerateRequest) and req.raw:
        target: P.Request = O.to_completion(req)
        prompt = P.render_completion(state.tokenizer, target)
    else:
        target = O.to_chat(req)
        prompt = P.render_chat(state.tokenizer, target, **req.template_kwargs)
    return target, prompt, W.make_constraint(state, O.format_spec(req))


async def _answer(request: Request, kind: O.Kind) -> Response:
    state = request.app.state
    cfg = state.cfg
    rec = access(request)
    raw = await read_body(request)
    if isinstance(raw, P.ProtocolError):
        return protocol_error(raw)
    req = O.parse_chat(raw) if kind == "chat" else O.parse_generate(raw)
    if isinstance(req, P.ProtocolError):
        return protocol_error(req)
    rec.model = req.model
    if err := P.check_model(untagged(req.model), cfg.model_name):
        return protocol_error(err)
    num_ctx = req.options.num_ctx
    if err := O.check_num_ctx(num_ctx, cfg.context, state.native_max_context):
        return protocol_error(err)
    meta = O.Meta.new(cfg.model_name, kind)
    if O.loads_only(req):
        return JSONResponse(O.loaded(meta))
    try:
        target, prompt, constraint = await run_in_threadpool(_prepare, state, req)
    except P.ProtocolError as err:
        return protocol_error(err)
    rec.prompt = len(prompt)
    asked = O.output_within_num_ctx(num_ctx, len(prompt), target.max_output_tokens,
                                    cfg.default_max_tokens)
    if isinstance(asked, P.ProtocolError):
        return protocol_error(asked)
    res = W.reservation(state, len(prompt), asked,
                        "prompt" if isinstance(target, P.CompletionRequest) else "messages")
    if isinstance(res, P.ProtocolError):
        return protocol_error(res)
    rec.reservation = res.max_tokens
    if stop := W.stopping(request):
        return refused(stop)
    first, queue, gen = await W.submit(request, prompt, res.max_tokens,
                                       temperature=target.temperature, top_p=target.top_p,
                                       seed=target.seed, constraint=constraint,
                                       wait_s=W.EARLY_HEADERS_S if req.stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return refused(first)
    assembler = P.TextAssembler.for_request(state.tokenizer, target, res.max_tokens,
                                            P.markers_for(state.tokenizer, prompt))
    if req.stream:
        return StreamingResponse(_stream(meta, (first, queue, request, gen), assembler),
                                 media_type=O.NDJSON,
                                 headers=W.reserved_headers(res, {"Cache-Control": "no-cache"}))
    async for item in W.events(queue, request, gen, assembler):
        if isinstance(item, Refused):
            return refused(item)
    if not assembler.done:  # the client left
        return Response(status_code=499)
    rec.cached = first.cached_tokens
    return JSONResponse(O.final(meta, assembler.result(), _counts(request, first, assembler),
                                whole=True), headers=W.reserved_headers(res))


def _counts(request: Request, first: Started, assembler: P.TextAssembler) -> O.Counts:
    rec = access(request)
    return O.Counts(first.prompt_tokens, assembler.completion_tokens, rec.started,
                    rec.first_token_at, time.monotonic())


def _stream(meta: O.Meta, waiting: tuple, assembler: P.TextAssembler) -> AsyncIterator[bytes]:
    """The NDJSON lines; while the request waits for admission or its prefill, an empty
    chunk every few seconds keeps the connection alive (NDJSON has no comment line)."""
    request = waiting[2]

    def closing(first: Started) -> list[bytes]:
        counts = _counts(request, first, assembler)
        return [O.ndjson(O.final(meta, assembler.result(), counts, whole=False))]

    return W.sse_stream(
        waiting, assembler, opening=(), keepalive=O.ndjson(O.chunk(meta)),
        refusal=lambda r: [O.ndjson(O.error_body(r.message, r.code))],
        deltas=lambda item: [O.lines(meta, item)], closing=closing)


async def chat(request: Request) -> Response:
    return await _answer(request, "chat")


async def generate(request: Request) -> Response:
    return await _answer(request, "generate")


ROUTES = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
]
"""Append to the worker's routes: ``routes=[..., *ollama_routes.ROUTES]``."""
