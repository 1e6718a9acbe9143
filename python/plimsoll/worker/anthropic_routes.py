"""The worker's Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The same request path as the OpenAI routes of :mod:`plimsoll.worker.app` — body limit,
model check, chat template, the output-reservation and context checks, one
``GenRequest`` to the scheduler, admission or a refusal — with Anthropic's shapes at both
ends (:mod:`plimsoll.protocol.anthropic`). Admission is the same: a request reserves
``prompt + max_tokens`` blocks before prefill, and running out is a 503 with
``Retry-After`` whose body is Anthropic's ``overloaded_error``; bad input is a 400
``invalid_request_error`` that says what to change.

The shared request path (:mod:`.submit`) is its own module, so :mod:`.app` imports
:data:`ROUTES` from here and nothing here imports :mod:`.app`: no import cycle.
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
    if err := P.check_model(req.model, state.cfg.model_name):
        return protocol_error(err)
    try:
        prompt = await run_in_threadpool(A.render_messages, state.tokenizer, req)
    except P.ProtocolError as err:
        return protocol_error(err)
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
    if err := W.check_reservation(state, len(prompt), req.max_tokens, "messages"):
        return protocol_error(err)
    try:
        constraint = await run_in_threadpool(_constraint, state, req)
    except P.ProtocolError as err:
        return protocol_error(err)
    first, queue, gen = await W.submit(request, prompt, req.max_tokens,
                                       temperature=req.temperature, top_p=req.top_p,
                                       constraint=constraint)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return error(first.status, first.message, first.retry_after)
    assembler = A.AnthropicAssembler.for_messages(state.tokenizer, req, req.max_tokens)
    meta = A.MessageMeta.new(cfg.model_name)
    blocks = A.BlockStream()
    stream = W.events(queue, request, gen, assembler)
    if req.stream:
        return StreamingResponse(_sse(meta, first, stream, assembler, blocks),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    failure = None
    async for item in stream:
        if isinstance(item, Refused):
            failure = item
        else:
            blocks.feed(item)
    if failure is not None:
        return error(failure.status, failure.message)
    if not assembler.done:  # the client left
        return Response(status_code=499)
    result, stop = assembler.result(), assembler.stop_sequence
    return JSONResponse(A.message(meta, blocks.blocks, A.stop_reason(result, stop), stop,
                                  _usage(first, assembler)))


def _usage(first: Started, assembler: P.TextAssembler) -> dict[str, Any]:
    return A.usage(first.prompt_tokens, assembler.completion_tokens, first.cached_tokens)


async def _sse(meta: A.MessageMeta, first: Started, stream: AsyncIterator,
               assembler: A.AnthropicAssembler, blocks: A.BlockStream) -> AsyncIterator[bytes]:
    for event in A.message_start(meta, A.usage(first.prompt_tokens, 0, first.cached_tokens)):
        yield A.sse_event(event)
    async for item in stream:
        if isinstance(item, Refused):
            yield A.sse_event(A.error_body(item.status, item.message))
            return
        for event in blocks.feed(item):
            yield A.sse_event(event)
    if not assembler.done:
        return
    result, stop = assembler.result(), assembler.stop_sequence
    for event in A.message_end(blocks, A.stop_reason(result, stop), stop,
                               _usage(first, assembler)):
        yield A.sse_event(event)


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
"""Append to the worker's routes: ``routes=[..., *anthropic_routes.ROUTES]``."""
