"""Generated ids to Anthropic's output: the message, its content blocks and stream events.

An :class:`AnthropicAssembler` (a :class:`TextAssembler` that also remembers which stop
sequence ended the output) feeds a :class:`BlockStream`, which turns its deltas into
content blocks in the order the model wrote them — ``thinking`` (reasoning between the
model's think markers), ``text``, ``tool_use`` — and, for streams, into Anthropic's events
(``message_start``, ``ping``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``), each framed by :func:`sse_event`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..assembler import (
    Assembled,
    Delta,
    ReasoningDelta,
    TextAssembler,
    TextDelta,
    ToolCallDelta,
)
from ..reasoning import Markers
from .request import MessagesRequest

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicAssembler(TextAssembler):
    """A :class:`TextAssembler` that also reports which stop sequence ended the output."""

    _matched: str | None = None

    @classmethod
    def for_messages(cls, tokenizer: Any, req: MessagesRequest, max_tokens: int,
                     reasoning: Markers | None = None) -> AnthropicAssembler:
        return cls(tokenizer, stop=req.stop_sequences, max_tokens=max_tokens,
                   tools=req.active_tools, reasoning=reasoning)

    def _first_stop(self) -> int:
        hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if not hits:
            return -1
        at, self._matched = min(hits)
        return at

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence found in the output, or None (EOS, length, tool call)."""
        return self._matched if self._stopped else None


def stop_reason(result: Assembled, stop_sequence: str | None = None) -> StopReason:
    """``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use`` for an output."""
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """A ``toolu_`` id for an assembler's call id (the same for a stream and its message)."""
    return call_id if call_id.startswith("toolu_") else \
        f"toolu_{call_id.removeprefix('call_')}"


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An assembler call ``{id, function: {name, arguments}}`` as a ``tool_use`` block.

    ``input`` must be an object: arguments that are not a JSON object are kept, as a
    string, under ``"arguments"``.
    """
    raw = call["function"]["arguments"]
    try:
        args = json.loads(raw)
    except ValueError:
        args = None
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"arguments": raw}}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt tokens not read from the prefix
    cache (their sum with ``cache_read_input_tokens`` is the whole prompt, as in the API)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


@dataclass(frozen=True)
class MessageMeta:
    id: str
    model: str

    @classmethod
    def new(cls, model: str) -> MessageMeta:
        return cls(new_message_id(), model)


def message(meta: MessageMeta, content: list[dict[str, Any]], stop_reason: StopReason | None,
            stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    """The ``message`` object (also the one in ``message_start``, with no stop reason)."""
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage}


class BlockStream:
    """Assembler deltas → content blocks in the model's order, and their stream events.

    Consecutive text (or reasoning) deltas share one ``text`` (or ``thinking``) block; each
    tool call is one ``tool_use`` block whose input arrives as one ``input_json_delta``.
    A ``thinking`` block carries an empty ``signature`` (there is no signing key here; the
    SDK types require the field). :attr:`blocks` is the finished content of the
    non-streamed message; :meth:`feed` and :meth:`close` return the events.
    """

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # "text" or "thinking" while such a block is open

    def feed(self, deltas: Iterable[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, TextDelta | ReasoningDelta):
                kind, field = ("thinking", "thinking") if isinstance(d, ReasoningDelta) \
                    else ("text", "text")
                if self._open != kind:
                    events += self.close()
                    start = {"type": kind, field: ""} | (
                        {"signature": ""} if kind == "thinking" else {})
                    self.blocks.append(dict(start))
                    self._open = kind
                    events.append({"type": "content_block_start", "index": self._index,
                                   "content_block": start})
                self.blocks[-1][field] += d.text
                events.append({"type": "content_block_delta", "index": self._index,
                               "delta": {"type": f"{kind}_delta", field: d.text}})
            elif isinstance(d, ToolCallDelta):
                events += self.close()
                block = tool_use_block(d.call)
                self.blocks.append(block)
                events += [
                    {"type": "content_block_start", "index": self._index,
                     "content_block": {**block, "input": {}}},
                    {"type": "content_block_delta", "index": self._index,
                     "delta": {"type": "input_json_delta",
                               "partial_json": json.dumps(block["input"], ensure_ascii=False)}},
                    {"type": "content_block_stop", "index": self._index}]
        return events

    def close(self) -> list[dict[str, Any]]:
        """The stop event of an open text or thinking block (none if none is open); a
        thinking block's ``signature_delta`` comes first, as Anthropic sends it."""
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":
            events.append({"type": "content_block_delta", "index": self._index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self._open = None
        return [*events, {"type": "content_block_stop", "index": self._index}]

    @property
    def _index(self) -> int:
        return len(self.blocks) - 1


def message_start(meta: MessageMeta, usage: dict[str, Any]) -> list[dict[str, Any]]:
    """What a stream opens with: ``message_start`` (empty content) and a ``ping``."""
    return [{"type": "message_start", "message": message(meta, [], None, None, usage)},
            {"type": "ping"}]


def message_end(blocks: BlockStream, stop_reason: StopReason, stop_sequence: str | None,
                usage: dict[str, Any]) -> list[dict[str, Any]]:
    """What a stream ends with: the open block's stop, ``message_delta``, ``message_stop``."""
    return [*blocks.close(),
            {"type": "message_delta",
             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": usage},
            {"type": "message_stop"}]


_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # made once, not per call


def sse_event(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event named by the object's type: ``event: <type>\\ndata: <json>``."""
    data = _COMPACT.encode(obj)
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()
