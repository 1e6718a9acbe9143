"""The worker's Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The same request path as the OpenAI routes of :mod:`plimsoll.worker.submit` — body limit,
model check, chat template, the output-reservation and context checks, one
``GenRequest`` to the scheduler, admission or a refusal — with Anthropic's shapes at both
ends (:mod:`plimsoll.protocol.anthropic`). Admission is the same: a request reserves
``prompt + max_tokens`` blocks before prefill, and running out is a 503 with
``Retry-After`` whose body is Anthropic's ``overloaded_error``; bad input is a 400
``invalid_request_error`` that says what to change. ``max_tokens`` over the worker's
reservation is clamped as on the OpenAI routes (``x-plimsoll-max-tokens``), and reasoning
comes back as ``thinking`` blocks.

The shared request path is :mod:`.submit` (imported as ``W``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import protocol
from plimsoll.protocol import anthropic, structured
from plimsoll.web.body import read_body
from plimsoll.web.edge import access
from plimsoll.worker.submit import (
    EARLY_HEADERS_S,
    PENDING,
    constraint_spec,
    events,
    rendered,
    reservation,
    reserved_headers,
    sse_stream,
    stopping,
    submit,
)

from .events import Refused, Started


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """An error response in Anthropic's shape (``Retry-After`` when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(anthropic.error_body(status, message), status, headers=headers)


def protocol_error(err: protocol.ProtocolError) -> JSONResponse:
    return error(err.status, err.message)


async def _prompt(request: Request, parse: Any) -> tuple[Any, list[int]] | JSONResponse:
    """Body → validated request → prompt ids, or the error response (400/404/413)."""
    state = request.app.state
    raw = await read_body(request)
    if isinstance(raw, protocol.ProtocolError):
        return protocol_error(raw)
    req = parse(raw)
    if isinstance(req, protocol.ProtocolError):
        return protocol_error(req)
    rec = access(request)
    rec.model = req.model
    if err := protocol.check_model(req.model, state.cfg.model_name):
        return protocol_error(err)
    try:
        prompt = await rendered(request, anthropic.render_messages, state.tokenizer,
                                req)
    except protocol.ProtocolError as err:
        return protocol_error(err)
    rec.prompt = len(prompt)
    return req, prompt


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens through the chat template."""
    got = await _prompt(request, anthropic.parse_count_tokens)
    if isinstance(got, Response):
        return got
    return JSONResponse(anthropic.count_tokens_body(len(got[1])))


async def messages(request: Request) -> Response:
    """``POST /v1/messages``, streamed (Anthropic's SSE events) or not."""
    got = await _prompt(request, anthropic.parse_messages)
    if isinstance(got, Response):
        return got
    req, prompt = got
    state = request.app.state
    cfg = state.cfg
    rec = access(request)
    res = reservation(state, len(prompt), req.max_tokens, "messages")
    if isinstance(res, protocol.ProtocolError):
        return protocol_error(res)
    rec.reservation = res.max_tokens
    if refused := stopping(request):
        return error(refused.status, refused.message, refused.retry_after)
    try:
        spec = constraint_spec(state, structured.anthropic_spec(req))
    except protocol.ProtocolError as err:
        return protocol_error(err)
    first, queue, gen = await submit(request, prompt, res.max_tokens,
                                     temperature=req.temperature, top_p=req.top_p,
                                     top_k=req.top_k, spec=spec,
                                     wait_s=EARLY_HEADERS_S if req.stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return error(first.status, first.message, first.retry_after)
    markers = protocol.markers_for(state.tokenizer, prompt)
    assembler = anthropic.AnthropicAssembler.for_messages(state.tokenizer, req, res.max_tokens,
                                                          markers)
    meta = anthropic.MessageMeta.new(cfg.model_name)
    blocks = anthropic.BlockStream()
    if req.stream:
        return StreamingResponse(_sse(meta, (first, queue, request, gen), len(prompt),
                                      assembler, blocks),
                                 media_type="text/event-stream",
                                 headers=reserved_headers(res, {"Cache-Control": "no-cache"}))
    failure = None
    async for item in events(queue, request, gen, assembler):
        if isinstance(item, Refused):
            failure = item
        else:
            blocks.feed(item)
    if failure is not None:
        return error(failure.status, failure.message, failure.retry_after)
    if not assembler.done:  # the client left
        return Response(status_code=499)
    rec.cached = first.cached_tokens
    result, stop = assembler.result(), assembler.stop_sequence
    body = anthropic.message(meta, blocks.blocks, anthropic.stop_reason(result, stop), stop,
                             _usage(first, assembler))
    return JSONResponse(body, headers=reserved_headers(res))


def _usage(first: Started, assembler: protocol.TextAssembler) -> dict[str, Any]:
    return anthropic.usage(first.prompt_tokens, assembler.completion_tokens, first.cached_tokens)


def _sse(meta: anthropic.MessageMeta, waiting: tuple, prompt_tokens: int,
         assembler: anthropic.AnthropicAssembler,
         blocks: anthropic.BlockStream) -> AsyncIterator[bytes]:
    """The events; a stream not started yet opens at once (``message_start`` with the
    prompt's tokens, then a ``ping`` every few seconds until the first token), and the
    final ``message_delta`` carries the real usage, cache reads included."""
    first = waiting[0]
    cached = 0 if first is PENDING else first.cached_tokens

    def closing(first: Started) -> Any:
        result, stop = assembler.result(), assembler.stop_sequence
        end = anthropic.message_end(blocks, anthropic.stop_reason(result, stop), stop,
                                    _usage(first, assembler))
        return map(anthropic.sse_event, end)

    return sse_stream(
        waiting, assembler,
        opening=map(anthropic.sse_event,
                    anthropic.message_start(meta, anthropic.usage(prompt_tokens, 0, cached))),
        keepalive=anthropic.sse_event({"type": "ping"}),
        refusal=lambda refused: [
            anthropic.sse_event(anthropic.error_body(refused.status, refused.message))],
        deltas=lambda item: map(anthropic.sse_event, blocks.feed(item)), closing=closing)


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
"""Append to the worker's routes: ``routes=[..., *anthropic_routes.ROUTES]``."""
