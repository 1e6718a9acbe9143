"""Responses API output: the ``response`` object, its typed SSE events, the bounded store.

:class:`ResponseBuilder` is fed the chat assembler's deltas (text and parsed tool calls)
and returns the events a stream sends, in the order the ``openai`` SDK's types and Codex
CLI expect: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added`` → (``response.content_part.added``,
``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``) or (``response.function_call_arguments.delta``,
``response.function_call_arguments.done``) → ``response.output_item.done``, and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ran out,
``response.failed`` on an error). A non-streamed answer is the same builder's final
``response`` object, so both agree by construction.

:class:`ResponseStore` keeps, for ``previous_response_id``, the conversation of the last
``cap`` stored responses (least recently used dropped first): bounded in count and in bytes
(a conversation's size is its JSON encoding; one alone over the byte bound is not kept).
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from typing import Any

from .assembler import Assembled, Delta, TextDelta, ToolCallDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def sse_event(event: dict[str, Any]) -> bytes:
    """``event: <type>`` and ``data: <json>``, as the API streams them."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseBuilder:
    """One response's output items and events; ``echo`` holds the request fields the
    response object repeats (model, instructions, tools, tool_choice, …)."""

    def __init__(self, echo: dict[str, Any], response_id: str | None = None):
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        self.echo = echo
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message item text is going into
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        """The ``response`` object in ``status`` with the items so far."""
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "background": False, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "output": [dict(i) for i in self.items], "usage": usage, **self.echo}

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, TextDelta):
                out += self._text(d.text)
            elif isinstance(d, ToolCallDelta):
                out += self._close_message() + self._call(d.call)
        return out

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None:
            self._open = {"id": new_id("msg"), "type": "message", "role": "assistant",
                          "status": "in_progress", "content": []}
            self.items.append(self._open)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.items) - 1, item=dict(self._open)))
            self._open["content"] = [{"type": "output_text", "text": "", "annotations": [],
                                      "logprobs": []}]
            out.append(self._event("response.content_part.added", **self._where(self._open),
                                   content_index=0, part={"type": "output_text", "text": "",
                                                          "annotations": [], "logprobs": []}))
        if text:
            self._open["content"][0]["text"] += text
            out.append(self._event("response.output_text.delta", **self._where(self._open),
                                   content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        item["status"] = "completed"
        where = self._where(item)
        return [self._event("response.output_text.done", **where, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=dict(item))]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call["function"]
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": fn["name"], "arguments": "", "status": "in_progress"}
        self.items.append(item)
        where = self._where(item)
        out = [self._event("response.output_item.added", output_index=where["output_index"],
                           item=dict(item))]
        item["arguments"] = fn["arguments"]
        out.append(self._event("response.function_call_arguments.delta", **where,
                               delta=fn["arguments"]))
        out.append(self._event("response.function_call_arguments.done", **where,
                               name=fn["name"], arguments=fn["arguments"]))
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=dict(item)))
        return out

    def finish(self, result: Assembled, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open item; ``response.completed`` (or ``.incomplete`` at the limit)."""
        out = []
        if not self.items:  # an empty answer is still one (empty) message
            out += self._text("")
        out += self._close_message()
        if result.finish_reason == "length":
            out.append(self._event("response.incomplete", response=self.response(
                "incomplete", usage, incomplete="max_output_tokens")))
        else:
            out.append(self._event("response.completed",
                                   response=self.response("completed", usage)))
        return out

    def fail(self, code: str, message: str) -> dict[str, Any]:
        return self._event("response.failed", response=self.response(
            "failed", error={"code": code, "message": message}))

    def final(self, result: Assembled, usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed ``response`` object (the builder fed every delta)."""
        return self.finish(result, usage)[-1]["response"]


def assistant_message(result: Assembled) -> dict[str, Any]:
    """The answer as a chat message, for the stored conversation."""
    msg: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        msg["tool_calls"] = result.tool_calls
    return msg


class ResponseStore:
    """``previous_response_id`` → the conversation it ended, for the last ``cap`` responses
    within ``max_bytes`` (LRU). Thread-safe (routes run on the event loop, renders in a
    thread pool)."""

    def __init__(self, cap: int = 256, max_bytes: int = 64 << 20):
        if cap < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.cap, self.max_bytes = cap, max_bytes
        self._items: collections.OrderedDict[str, tuple[list[dict[str, Any]], int]] = \
            collections.OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> bool:
        """Keep ``messages``; False when it alone is over the byte bound (not kept)."""
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if size > self.max_bytes:
            return False
        with self._lock:
            if (old := self._items.pop(response_id, None)) is not None:
                self.bytes -= old[1]
            self._items[response_id] = (messages, size)
            self.bytes += size
            while len(self._items) > self.cap or self.bytes > self.max_bytes:
                self.bytes -= self._items.popitem(last=False)[1][1]
        return True

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._items.move_to_end(response_id)
            return found[0]

    def __len__(self) -> int:
        return len(self._items)
