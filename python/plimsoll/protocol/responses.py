"""OpenAI response objects, stream chunks and Server-Sent Events, as plain dicts.

Shapes follow what the official ``openai`` client parses (its tests validate these
dicts with the client's own pydantic types). A stream is, in order:
:func:`first_chunks` (chat: the assistant role), :func:`delta_chunks` for each batch of
assembler deltas, then :func:`final_chunks` (the finish reason and, when the request set
``stream_options.include_usage``, a usage chunk with ``choices: []``), then
:data:`SSE_DONE`. Kinds are ``"chat"`` (``/v1/chat/completions``) and ``"completion"``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .assembler import Assembled, Delta, ReasoningDelta, TextDelta, ToolCallDelta

Kind = Literal["chat", "completion"]
SSE_DONE = b"data: [DONE]\n\n"
OWNED_BY = "plimsoll"


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares: its id, creation time and model name."""

    kind: Kind
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: Kind, model: str, created: int | None = None) -> ResponseMeta:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, f"{prefix}-{uuid.uuid4().hex}", model,
                   int(time.time()) if created is None else created)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` are prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# --- chat ---------------------------------------------------------------------------------

def chat_completion(meta: ResponseMeta, result: Assembled, usage: dict[str, Any]
                    ) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = result.tool_calls
    return {**meta._head("chat.completion"),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": result.finish_reason}],
            "usage": usage}


def chat_chunk(meta: ResponseMeta, delta: dict[str, Any], finish_reason: str | None = None
               ) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with one choice."""
    return {**meta._head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def chat_delta(delta: Delta) -> dict[str, Any]:
    """An assembler delta as a chat ``delta`` (content text, reasoning text as
    ``reasoning_content``, or one indexed tool call)."""
    if isinstance(delta, ToolCallDelta):
        return {"tool_calls": [{"index": delta.index, **delta.call}]}
    if isinstance(delta, ReasoningDelta):
        return {"reasoning_content": delta.text}
    return {"content": delta.text}


# --- completions --------------------------------------------------------------------------

def completion(meta: ResponseMeta, result: Assembled, usage: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed ``text_completion`` object."""
    return {**meta._head("text_completion"),
            "choices": [{"index": 0, "text": result.text, "logprobs": None,
                         "finish_reason": result.finish_reason}],
            "usage": usage}


def completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None
                     ) -> dict[str, Any]:
    """One streamed ``text_completion`` (finish_reason null until the last)."""
    return {**meta._head("text_completion"),
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


# --- streams, whichever the kind ----------------------------------------------------------

def response(meta: ResponseMeta, result: Assembled, usage: dict[str, Any]) -> dict[str, Any]:
    """The whole non-streamed response for ``meta.kind``."""
    build = chat_completion if meta.kind == "chat" else completion
    return build(meta, result, usage)


def first_chunks(meta: ResponseMeta) -> list[dict[str, Any]]:
    """What a stream opens with: the assistant role for chat, nothing for completions."""
    if meta.kind == "chat":
        return [chat_chunk(meta, {"role": "assistant", "content": ""})]
    return []


def delta_chunks(meta: ResponseMeta, deltas: Iterable[Delta]) -> list[dict[str, Any]]:
    """One chunk per delta (completions carry text only: they are never given tools)."""
    if meta.kind == "chat":
        return [chat_chunk(meta, chat_delta(d)) for d in deltas]
    return [completion_chunk(meta, d.text) for d in deltas if isinstance(d, TextDelta)]


def usage_chunk(meta: ResponseMeta, usage: dict[str, Any]) -> dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if meta.kind == "chat" else "text_completion"
    return {**meta._head(obj), "choices": [], "usage": usage}


def final_chunks(meta: ResponseMeta, result: Assembled, usage: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """The chunk with the finish reason, then the usage chunk if ``usage`` is given."""
    if meta.kind == "chat":
        last = chat_chunk(meta, {}, result.finish_reason)
    else:
        last = completion_chunk(meta, "", result.finish_reason)
    return [last] + ([usage_chunk(meta, usage)] if usage is not None else [])


_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # made once, not per call


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event: ``data: {json}`` and a blank line."""
    return b"data: " + _COMPACT.encode(obj).encode() + b"\n\n"


# --- models -------------------------------------------------------------------------------

def model_card(model_id: str, created: int, owned_by: str = OWNED_BY) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def models_list(model_ids: Iterable[str], created: int | None = None,
                owned_by: str = OWNED_BY) -> dict[str, Any]:
    """The ``GET /v1/models`` body for the served model(s)."""
    when = int(time.time()) if created is None else created
    return {"object": "list", "data": [model_card(m, when, owned_by) for m in model_ids]}
