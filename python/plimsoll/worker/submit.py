"""Request submission, shared by the OpenAI and the Anthropic routes: the output-reservation
check, one ``GenRequest`` handed to the scheduler, and its events as assembler deltas.

Its own module so that :mod:`.app` (the OpenAI routes and the app factory) and
:mod:`.anthropic_routes` both import it, and neither imports the other's routes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from plimsoll import protocol as P
from plimsoll.engine.work import TokenConstraint
from plimsoll.worker.config import WorkerConfig

from .scheduler import Finished, GenRequest, Refused, Started, Token

DISCONNECT_POLL_S = 0.25


def check_reservation(state: Any, prompt_tokens: int, max_tokens: int,
                      prompt_param: str) -> P.ProtocolError | None:
    """400 when the output reservation or prompt + reservation is over what was admitted."""
    cfg: WorkerConfig = state.cfg
    if max_tokens > cfg.max_tokens:
        return P.ProtocolError(400, f"max_tokens {max_tokens} exceeds this worker's output "
                               f"reservation limit of {cfg.max_tokens}: lower max_tokens",
                               param="max_tokens", code="max_tokens_too_large")
    return P.context_overflow(state.native_max_context, cfg.context, prompt_tokens, max_tokens,
                              prompt_param=prompt_param)


def error(status: int, message: str, *, code: str | None = None, param: str | None = None,
          retry_after: int | None = None) -> JSONResponse:
    """An OpenAI-shaped error response (``Retry-After`` when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(P.error_body(status, message, param=param, code=code), status,
                        headers=headers)


def protocol_error(err: P.ProtocolError) -> JSONResponse:
    return JSONResponse(err.body(), err.status)


def make_constraint(state: Any, spec: Any) -> Any:
    """The engine constraint for ``spec`` (None for none), built with this worker's
    :class:`~plimsoll.constrain.Constrainer` (made on first use: a token trie of the
    vocabulary). A backend without the hook (``constrained_decoding`` unset: the clustered
    ring) refuses with a 400 rather than answering unconstrained."""
    if spec is None:
        return None
    if not getattr(state, "constrained_decoding", False):
        raise P.ProtocolError(400, "Structured output and forced tool choices need constrained "
                              "decoding, which this (clustered) worker does not run; drop "
                              "response_format / the forced tool_choice.",
                              code="constraint_unsupported")
    from plimsoll import constrain

    if getattr(state, "constrainer", None) is None:
        state.constrainer = constrain.Constrainer(state.tokenizer)
    if spec.kind == "tool_call" and state.constrainer.markup is None:
        return None  # a format we cannot force: rendered, parsed, not enforced (logged once)
    try:
        return state.constrainer.constraint(spec)
    except constrain.SpecError as e:
        raise P.ProtocolError(400, f"{e}; simplify the schema.", code="invalid_schema") from e


async def submit(request: Request, prompt: list[int], max_tokens: int, *, temperature: float,
                 top_p: float, seed: int | None = None,
                 constraint: TokenConstraint | None = None
                 ) -> tuple[Started | Refused | None, asyncio.Queue, GenRequest]:
    """Hand a request to the scheduler; wait for admission (Started) or a Refused.

    ``None`` means the client left while waiting (the request is then cancelled).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    gen = GenRequest(prompt=prompt, max_tokens=max_tokens,
                     sink=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
                     temperature=temperature, top_p=top_p, seed=seed, constraint=constraint)
    request.app.state.scheduler.submit(gen)
    return await next_event(queue, request, gen), queue, gen


async def next_event(queue: asyncio.Queue, request: Request, gen: GenRequest):
    """Wait for the scheduler's next event; a client that left cancels its request."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                gen.cancelled.set()
                request.app.state.scheduler.wake()
                return None


async def events(queue: asyncio.Queue, request: Request, gen: GenRequest,
                  assembler: P.TextAssembler) -> AsyncIterator[list[P.Delta] | Refused]:
    """Deltas until the assembler is done (then the sequence is cancelled), or a Refused."""
    try:
        while not assembler.done:
            ev = await next_event(queue, request, gen)
            if ev is None:
                return
            if isinstance(ev, Token):
                yield assembler.feed(ev.token_id)
            elif isinstance(ev, Finished):
                yield assembler.close("length" if ev.reason == "length" else "stop")
            elif isinstance(ev, Refused):
                yield ev
                return
    finally:
        if not gen.cancelled.is_set():  # stop string, tool call, or client gone
            gen.cancelled.set()
            request.app.state.scheduler.wake()
