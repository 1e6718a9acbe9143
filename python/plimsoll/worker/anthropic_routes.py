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

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import protocol as P
from plimsoll.protocol import anthropic as A
from plimsoll.protocol import structured
from plimsoll.web.body import read_body
from plimsoll.web.edge import access
from plimsoll.worker import submit as W

from .scheduler import Refused, Started


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """An error response in Anthropic's shape (``Retry-After`` when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(A.error_body(status, message), status, headers=headers)


def protocol_error(err: P.ProtocolError) -> JSONResponse:
    return error(err.status, err.message)


async def _prompt(request: Request, parse: Any) -> tuple[Any, list[int]] | JSONResponse:
    """Body → validated request → prompt ids, or the error response (400/404/413)."""
    state = request.app.state
    raw = await read_body(request)
    if isinstance(raw, P.ProtocolError):
        return protocol_error(raw)
    req = parse(raw)
    if isinstance(req, P.ProtocolError):
        return protocol_error(req)
    rec = access(request)
    rec.model = req.model
    if err := P.check_model(req.model, state.cfg.model_name):
        return protocol_error(err)
    try:
        prompt = await run_in_threadpool(A.render_messages, state.tokenizer, req)
    except P.ProtocolError as err:
        return protocol_error(err)
    rec.prompt = len(prompt)
    return req, prompt


def _constraint(state: Any, req: Any) -> Any:
    return W.make_constraint(state, structured.anthropic_spec(req))


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens through the chat template."""
    got = await _prompt(request, A.parse_count_tokens)
    if isinstance(got, Response):
        return got
    return JSONResponse(A.count_tokens_body(len(got[1])))


async def messages(request: Request) -> Response:
    """``POST /v1/messages``, streamed (Anthropic's SSE events) or not."""
    got = await _prompt(request, A.parse_messages)
    if isinstance(got, Response):
        return got
    req, prompt = got
    state = request.app.state
    cfg = state.cfg
    rec = access(request)
    res = W.reservation(state, len(prompt), req.max_tokens, "messages")
    if isinstance(res, P.ProtocolError):
        return protocol_error(res)
    rec.reservation = res.max_tokens
    if refused := W.stopping(request):
        return error(refused.status, refused.message, refused.retry_after)
    try:
        constraint = await run_in_threadpool(_constraint, state, req)
    except P.ProtocolError as err:
        return protocol_error(err)
    first, queue, gen = await W.submit(request, prompt, res.max_tokens,
                                       temperature=req.temperature, top_p=req.top_p,
                                       top_k=req.top_k, constraint=constraint,
                                       wait_s=W.EARLY_HEADERS_S if req.stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return error(first.status, first.message, first.retry_after)
    assembler = A.AnthropicAssembler.for_messages(state.tokenizer, req, res.max_tokens,
                                                  P.markers_for(state.tokenizer, prompt))
    meta = A.MessageMeta.new(cfg.model_name)
    blocks = A.BlockStream()
    if req.stream:
        return StreamingResponse(_sse(meta, (first, queue, request, gen), len(prompt),
                                      assembler, blocks),
                                 media_type="text/event-stream",
                                 headers=W.reserved_headers(res, {"Cache-Control": "no-cache"}))
    failure = None
    async for item in W.events(queue, request, gen, assembler):
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
    return JSONResponse(A.message(meta, blocks.blocks, A.stop_reason(result, stop), stop,
                                  _usage(first, assembler)), headers=W.reserved_headers(res))


def _usage(first: Started, assembler: P.TextAssembler) -> dict[str, Any]:
    return A.usage(first.prompt_tokens, assembler.completion_tokens, first.cached_tokens)


def _sse(meta: A.MessageMeta, waiting: tuple, prompt_tokens: int,
         assembler: A.AnthropicAssembler, blocks: A.BlockStream) -> AsyncIterator[bytes]:
    """The events; a stream not started yet opens at once (``message_start`` with the
    prompt's tokens, then a ``ping`` every few seconds until the first token), and the
    final ``message_delta`` carries the real usage, cache reads included."""
    first = waiting[0]
    cached = 0 if first is W.PENDING else first.cached_tokens

    def closing(first: Started) -> Any:
        result, stop = assembler.result(), assembler.stop_sequence
        return map(A.sse_event, A.message_end(blocks, A.stop_reason(result, stop), stop,
                                              _usage(first, assembler)))

    return W.sse_stream(
        waiting, assembler,
        opening=map(A.sse_event, A.message_start(meta, A.usage(prompt_tokens, 0, cached))),
        keepalive=A.sse_event({"type": "ping"}),
        refusal=lambda refused: [A.sse_event(A.error_body(refused.status, refused.message))],
        deltas=lambda item: map(A.sse_event, blocks.feed(item)), closing=closing)


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
"""Append to the worker's routes: ``routes=[..., *anthropic_routes.ROUTES]``."""
