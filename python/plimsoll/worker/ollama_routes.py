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

The shared request path is :mod:`.submit`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import protocol
from plimsoll.core.aliases import untagged
from plimsoll.protocol import ollama
from plimsoll.web.body import read_body
from plimsoll.web.edge import access
from plimsoll.worker import submit

from .scheduler import Refused, Started


def error(status: int, message: str, code: str | None = None,
          retry_after: int | None = None) -> JSONResponse:
    """An error response in Ollama's shape (``Retry-After`` when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(ollama.error_body(message, code), status, headers=headers)


def protocol_error(err: protocol.ProtocolError) -> JSONResponse:
    return error(err.status, err.message, err.code)


def refused(r: Refused) -> JSONResponse:
    return error(r.status, r.message, r.code, r.retry_after)


def _prepare(state: Any, req: ollama.ChatRequest | ollama.GenerateRequest
             ) -> tuple[protocol.Request, list[int], Any]:
    """On a thread: the OpenAI request, its prompt ids and its constraint's spec (or raise the
    400)."""
    if isinstance(req, ollama.GenerateRequest) and req.raw:
        target: protocol.Request = ollama.to_completion(req)
        prompt = protocol.render_completion(state.tokenizer, target)
    else:
        target = ollama.to_chat(req)
        prompt = protocol.render_chat(state.tokenizer, target, **req.template_kwargs)
    return target, prompt, submit.constraint_spec(state, ollama.format_spec(req))


async def _answer(request: Request, kind: ollama.Kind) -> Response:
    state = request.app.state
    cfg = state.cfg
    rec = access(request)
    raw = await read_body(request)
    if isinstance(raw, protocol.ProtocolError):
        return protocol_error(raw)
    req = ollama.parse_chat(raw) if kind == "chat" else ollama.parse_generate(raw)
    if isinstance(req, protocol.ProtocolError):
        return protocol_error(req)
    rec.model = req.model
    if err := protocol.check_model(untagged(req.model), cfg.model_name):
        return protocol_error(err)
    num_ctx = req.options.num_ctx
    if err := ollama.check_num_ctx(num_ctx, cfg.context, state.native_max_context):
        return protocol_error(err)
    meta = ollama.Meta.new(cfg.model_name, kind)
    if ollama.loads_only(req):
        return JSONResponse(ollama.loaded(meta))
    try:
        target, prompt, spec = await submit.rendered(request, _prepare, state, req)
    except protocol.ProtocolError as err:
        return protocol_error(err)
    rec.prompt = len(prompt)
    asked = ollama.output_within_num_ctx(num_ctx, len(prompt), target.max_output_tokens,
                                    cfg.default_max_tokens)
    if isinstance(asked, protocol.ProtocolError):
        return protocol_error(asked)
    res = submit.reservation(state, len(prompt), asked,
                        "prompt" if isinstance(target, protocol.CompletionRequest) else "messages")
    if isinstance(res, protocol.ProtocolError):
        return protocol_error(res)
    rec.reservation = res.max_tokens
    if stop := submit.stopping(request):
        return refused(stop)
    first, queue, gen = await submit.submit(request, prompt, res.max_tokens,
                                       temperature=target.temperature, top_p=target.top_p,
                                       top_k=target.top_k, min_p=target.min_p,
                                       seed=target.seed, spec=spec,
                                       wait_s=submit.EARLY_HEADERS_S if req.stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return refused(first)
    assembler = protocol.TextAssembler.for_request(state.tokenizer, target, res.max_tokens,
                                            protocol.markers_for(state.tokenizer, prompt))
    if req.stream:
        return StreamingResponse(_stream(meta, (first, queue, request, gen), assembler),
                                 media_type=ollama.NDJSON,
                                 headers=submit.reserved_headers(
                                     res, {"Cache-Control": "no-cache"}))
    async for item in submit.events(queue, request, gen, assembler):
        if isinstance(item, Refused):
            return refused(item)
    if not assembler.done:  # the client left
        return Response(status_code=499)
    rec.cached = first.cached_tokens
    return JSONResponse(ollama.final(meta, assembler.result(), _counts(request, first, assembler),
                                whole=True), headers=submit.reserved_headers(res))


def _counts(request: Request, first: Started, assembler: protocol.TextAssembler) -> ollama.Counts:
    rec = access(request)
    return ollama.Counts(first.prompt_tokens, assembler.completion_tokens, rec.started,
                    rec.first_token_at, time.monotonic())


def _stream(meta: ollama.Meta, waiting: tuple, assembler: protocol.TextAssembler
            ) -> AsyncIterator[bytes]:
    """The NDJSON lines; while the request waits for admission or its prefill, an empty
    chunk every few seconds keeps the connection alive (NDJSON has no comment line)."""
    request = waiting[2]

    def closing(first: Started) -> list[bytes]:
        counts = _counts(request, first, assembler)
        return [ollama.ndjson(ollama.final(meta, assembler.result(), counts, whole=False))]

    return submit.sse_stream(
        waiting, assembler, opening=(), keepalive=ollama.ndjson(ollama.chunk(meta)),
        refusal=lambda r: [ollama.ndjson(ollama.error_body(r.message, r.code))],
        deltas=lambda item: [ollama.lines(meta, item)], closing=closing)


async def chat(request: Request) -> Response:
    return await _answer(request, "chat")


async def generate(request: Request) -> Response:
    return await _answer(request, "generate")


ROUTES = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
]
"""Append to the worker's routes: ``routes=[..., *ollama_routes.ROUTES]``."""
