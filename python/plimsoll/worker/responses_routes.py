"""The worker's OpenAI Responses API: ``POST /v1/responses``, streamed (typed SSE events)
or not.

The chat request path under another shape: the body is validated
(:mod:`plimsoll.protocol.responses_request`), turned into the equivalent chat request
(after the stored conversation of ``previous_response_id``), rendered by the model's chat
template, checked against the reservation and the context, constrained where
``text.format`` or a forced ``tool_choice`` asks, and generated through the same
scheduler and :class:`~plimsoll.protocol.TextAssembler` (tool calls parsed) as
``/v1/chat/completions``; the builder of :mod:`plimsoll.protocol.responses_events` turns the
deltas into output items. Refusals are OpenAI-shaped errors; a missing
``previous_response_id`` is a 404 ``previous_response_not_found``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import protocol
from plimsoll.protocol import ProtocolError, responses_events, responses_request, structured
from plimsoll.web.body import read_body
from plimsoll.web.edge import access

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

STORE_CAP = 256
"""Responses kept for ``previous_response_id`` (their conversations; LRU beyond this)."""
STORE_BYTES = 64 << 20
"""…and their conversations' JSON bytes in all (a worker's store never holds more)."""


def store(state: Any) -> responses_events.ResponseStore:
    if getattr(state, "response_store", None) is None:
        state.response_store = responses_events.ResponseStore(STORE_CAP, STORE_BYTES)
    return state.response_store


def _echo(req: responses_request.ResponsesRequest, model: str, max_tokens: int) -> dict[str, Any]:
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
        if req.text and req.text.format else {"type": "text"}
    return {"model": model, "instructions": req.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": req.tool_choice.responses_shape() if req.tool_choice else "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "max_output_tokens": max_tokens, "previous_response_id": req.previous_response_id,
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt}, "truncation": "disabled", "metadata": req.metadata or {},
            "reasoning": {"effort": None, "summary": None}, "user": None}


def _prepare(state: Any, req: responses_request.ResponsesRequest
             ) -> tuple[Any, list[int], Any, list[dict[str, Any]]]:
    """On a thread: the chat request, its prompt ids, its constraint's spec and the conversation to
    store (or raise the 400/404)."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = store(state).get(req.previous_response_id)
        if found is None:
            raise ProtocolError(404, f"Previous response with id {req.previous_response_id!r} "
                                f"not found (this worker keeps the last {STORE_CAP} stored "
                                f"responses, up to {STORE_BYTES >> 20} MiB, in memory, until "
                                "it restarts): send the whole conversation in input instead.",
                                param="previous_response_id",
                                code="previous_response_not_found",
                                type="invalid_request_error")
        history = found
    chat = responses_request.to_chat(req, history)
    prompt = protocol.render_chat(state.tokenizer, chat)
    try:
        spec = structured.chat_spec(chat)
    except ProtocolError as err:
        if err.param and err.param.startswith("response_format"):
            err.param = "text.format.schema"
            err.message = err.message.replace("response_format.json_schema.schema",
                                              "text.format.schema")
        raise
    return chat, prompt, constraint_spec(state, spec), responses_request.conversation(req, history)


async def responses(request: Request) -> Response:
    state = request.app.state
    cfg = state.cfg
    raw = await read_body(request)
    if isinstance(raw, ProtocolError):
        return protocol_error(raw)
    req = responses_request.parse_responses(raw)
    if isinstance(req, ProtocolError):
        return protocol_error(req)
    rec = access(request)
    rec.model = req.model or cfg.model_name
    if err := protocol.check_model(req.model, cfg.model_name):
        return protocol_error(err)
    try:
        chat, prompt, spec, convo = await rendered(request, _prepare, state, req)
    except ProtocolError as err:
        return protocol_error(err)
    rec.prompt = len(prompt)
    res = reservation(state, len(prompt), req.max_output_tokens, "input")
    if isinstance(res, ProtocolError):
        return protocol_error(res)
    max_tokens = rec.reservation = res.max_tokens
    if refused := stopping(request):
        return error(refused.status, refused.message, code=refused.code,
                     retry_after=refused.retry_after)
    first, queue, gen = await submit(request, prompt, max_tokens, temperature=req.temperature,
                                     top_p=req.top_p, seed=req.seed, spec=spec,
                                     wait_s=EARLY_HEADERS_S if req.stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Refused):
        return error(first.status, first.message, code=first.code,
                     retry_after=first.retry_after)
    assembler = protocol.TextAssembler.for_request(state.tokenizer, chat, max_tokens)
    builder = responses_events.ResponseBuilder(_echo(req, cfg.model_name, max_tokens))
    if req.stream:
        return StreamingResponse(_sse(state, req, convo, (first, queue, request, gen),
                                      assembler, builder),
                                 media_type="text/event-stream",
                                 headers=reserved_headers(res, {"Cache-Control": "no-cache"}))
    async for item in events(queue, request, gen, assembler):
        if isinstance(item, Refused):
            return error(item.status, item.message, code=item.code)
        builder.feed(item)
    if not assembler.done:  # the client left
        return Response(status_code=499)
    result = assembler.result()
    _remember(state, req, convo, builder, result)
    return JSONResponse(builder.final(result, _usage(first, assembler)),
                        headers=reserved_headers(res))


def _usage(first: Started, assembler: protocol.TextAssembler) -> dict[str, Any]:
    return responses_events.usage(first.prompt_tokens, assembler.completion_tokens,
                                  first.cached_tokens)


def _remember(state: Any, req: responses_request.ResponsesRequest, convo: list[dict[str, Any]],
              builder: responses_events.ResponseBuilder, result: protocol.Assembled) -> None:
    if req.store:
        store(state).put(builder.id, [*convo, responses_events.assistant_message(result)])


def _sse(state: Any, req: responses_request.ResponsesRequest, convo: list[dict[str, Any]],
         waiting: tuple, assembler: protocol.TextAssembler,
         builder: responses_events.ResponseBuilder) -> AsyncIterator[bytes]:
    def closing(first: Started) -> Any:
        result = assembler.result()
        _remember(state, req, convo, builder, result)
        return map(responses_events.sse_event, builder.finish(result, _usage(first, assembler)))

    return sse_stream(
        waiting, assembler, opening=map(responses_events.sse_event, builder.start()),
        keepalive=b": keep-alive\n\n",
        refusal=lambda refused: [
            responses_events.sse_event(builder.fail(refused.code, refused.message))],
        deltas=lambda item: map(responses_events.sse_event, builder.feed(item)), closing=closing)


ROUTES = [Route("/v1/responses", responses, methods=["POST"])]
"""Append to the worker's routes: ``routes=[..., *responses_routes.ROUTES]``."""
