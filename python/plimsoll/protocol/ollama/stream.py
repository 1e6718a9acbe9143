"""Generated ids to Ollama's output: NDJSON chunks, the final object, durations in ns.

An answer is a sequence of JSON objects, one a line (``application/x-ndjson``), each
``{"model", "created_at", ..., "done": false}`` with a piece of the answer — in
``message`` (``content``, ``thinking``, ``tool_calls``) on ``/api/chat``, in ``response``
(and ``thinking``) on ``/api/generate`` — then one ``"done": true`` object with
``done_reason`` (``stop`` or ``length``), the token counts (``prompt_eval_count``: the
whole prompt, cache reads included; ``eval_count``: the output) and the durations in
nanoseconds (``total_duration`` from the request's arrival; ``prompt_eval_duration`` to the
first token, the wait for admission included; ``eval_duration`` after it;
``load_duration`` 0: a worker answers only once its model is loaded). ``stream: false`` is
the same final object holding the whole answer. A tool call's ``arguments`` is an object,
as Ollama's clients expect it. An error after the stream started is one
``{"error": ...}`` line, which Ollama's clients raise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from ..assembler import Assembled, Delta, ReasoningDelta, TextDelta, ToolCallDelta

NDJSON = "application/x-ndjson"
Kind = Literal["chat", "generate"]
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def ndjson(obj: dict[str, Any]) -> bytes:
    """One object as one NDJSON line."""
    return _COMPACT.encode(obj).encode() + b"\n"


def timestamp(at: datetime | None = None) -> str:
    """RFC 3339 in UTC with a ``Z``, as Ollama writes ``created_at`` and ``modified_at``."""
    return (at or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Meta:
    """What every object of one answer repeats."""

    model: str
    kind: Kind
    created_at: str

    @classmethod
    def new(cls, model: str, kind: Kind) -> Meta:
        return cls(model, kind, timestamp())

    def head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": self.created_at}


@dataclass(frozen=True)
class Counts:
    """The figures of the final object: tokens, and the monotonic times they are taken from
    (the request's arrival, its first token or None, its end)."""

    prompt_tokens: int
    output_tokens: int
    started: float
    first_token_at: float | None
    ended: float

    def fields(self) -> dict[str, int]:
        first = self.first_token_at if self.first_token_at is not None else self.ended
        return {"total_duration": _ns(self.ended - self.started), "load_duration": 0,
                "prompt_eval_count": self.prompt_tokens,
                "prompt_eval_duration": _ns(first - self.started),
                "eval_count": self.output_tokens, "eval_duration": _ns(self.ended - first)}


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assembler call ``{id, function: {name, arguments: "<json>"}}`` in Ollama's shape:
    ``arguments`` an object (arguments that are not a JSON object are kept, as a string,
    under ``"arguments"``)."""
    raw = call["function"]["arguments"]
    try:
        args = json.loads(raw)
    except ValueError:
        args = None
    return {"id": call["id"], "function": {
        "name": call["function"]["name"],
        "arguments": args if isinstance(args, dict) else {"arguments": raw}}}


def _piece(meta: Meta, text: str = "", thinking: str = "",
           calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The answer's fields in the route's place: ``message`` (chat) or ``response``."""
    if meta.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def chunk(meta: Meta, text: str = "", thinking: str = "",
          calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One ``"done": false`` object (all empty: the keep-alive of a stream not started)."""
    return {**meta.head(), **_piece(meta, text, thinking, calls), "done": False}


def lines(meta: Meta, deltas: Iterable[Delta]) -> bytes:
    """The NDJSON lines of a burst of deltas: consecutive text (or reasoning) joined into
    one object, each tool call an object of its own."""
    out: list[bytes] = []
    run: list[str] = []
    reasoning = False

    def flush() -> None:
        if run:
            text = "".join(run)
            out.append(ndjson(chunk(meta, thinking=text) if reasoning else chunk(meta, text)))
            run.clear()

    for d in deltas:
        if isinstance(d, ToolCallDelta):
            flush()
            out.append(ndjson(chunk(meta, calls=[tool_call(d.call)])))
        elif isinstance(d, TextDelta | ReasoningDelta):
            if run and reasoning != isinstance(d, ReasoningDelta):
                flush()
            reasoning = isinstance(d, ReasoningDelta)
            run.append(d.text)
    flush()
    return b"".join(out)


def done_reason(result: Assembled) -> str:
    """``length`` when the output reservation ended the answer, else ``stop`` (Ollama says
    ``stop`` for an answer that is tool calls too)."""
    return "length" if result.finish_reason == "length" else "stop"


def final(meta: Meta, result: Assembled, counts: Counts, whole: bool) -> dict[str, Any]:
    """The ``"done": true`` object; ``whole`` (``stream: false``) puts the answer in it."""
    piece = _piece(meta, result.text, result.reasoning,
                   [tool_call(c) for c in result.tool_calls]) if whole else _piece(meta)
    return {**meta.head(), **piece, "done": True, "done_reason": done_reason(result),
            **counts.fields()}


def loaded(meta: Meta) -> dict[str, Any]:
    """The answer to a request with nothing to generate: the model is loaded."""
    return {**meta.head(), **_piece(meta), "done": True, "done_reason": "load"}
