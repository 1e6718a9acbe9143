"""The Anthropic Messages API of the worker, pure: bytes in, token ids out, dicts and SSE out.

The same engine path as the OpenAI side, with Anthropic's shapes at both ends:
:func:`parse_messages` (or :func:`parse_count_tokens`) → :func:`render_messages` (the
conversation converted by :func:`template_messages` into the chat-template message list
the OpenAI path uses: ``system`` a system message, ``tool_use`` blocks assistant
``tool_calls``, ``tool_result`` blocks ``tool`` messages) → (admission, engine) → an
:class:`AnthropicAssembler` (a :class:`TextAssembler` that also remembers which stop
sequence ended the output) → a :class:`BlockStream`, which turns its deltas into content
blocks in the order the model wrote them and, for streams, into Anthropic's events
(``message_start``, ``ping``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``), each framed by :func:`sse_event`.

Refusals are the OpenAI layer's :class:`ProtocolError` (its messages say what to change);
:func:`error_body` renders any of them in Anthropic's error shape,
``{"type": "error", "error": {"type", "message"}}``, with the type from the status
(``overloaded_error`` for the pool's 503: the SDK retries it, honouring ``Retry-After``).

What is accepted and ignored, and why: ``metadata`` (no user tracking here),
``cache_control`` at the top or on any block or tool (the prefix cache is automatic),
``service_tier``, ``output_config.effort`` (a hint), ``citations``/``caller``/
``toolset_name`` echoed back on blocks, a tool's ``strict`` and ``eager_input_streaming``,
``disable_parallel_tool_use`` (several calls are always parsed), ``thinking`` of type
``disabled`` or ``adaptive``, and ``top_k`` (the engine's sampler takes temperature and
top-p only; greedy decoding at ``temperature: 0`` is unaffected). ``temperature`` and
``top_p`` are applied (the current SDK no longer lists them; its users pass them in
``extra_body``, and older clients send them). ``thinking`` blocks in past assistant turns
are dropped, as Anthropic itself drops them from earlier turns. Refused by name: thinking
with a budget (``enabled``), ``output_config.format``, images, documents, server tools,
``max_tokens: 0`` (cache pre-warming), and any other unknown field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .assembler import Assembled, Delta, TextAssembler, TextDelta, ToolCallDelta
from .errors import ProtocolError
from .parse import validate_body
from .render import apply_template
from .requests import MAX_TOKENS_LIMIT, _Strict, text_parts

MAX_STOP_SEQUENCES = 16
"""Stop sequences a request may send (each is checked against every decoded token)."""

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


# --- errors -------------------------------------------------------------------------------

def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (other 4xx: invalid request; 5xx: api)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type": ..., "message": ...}}`` for a status."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def protocol_error_body(err: ProtocolError) -> dict[str, Any]:
    """A :class:`ProtocolError` in Anthropic's shape (its status picks the type)."""
    return error_body(err.status, err.message)


# --- the request --------------------------------------------------------------------------

_UNSUPPORTED_BLOCKS = {
    "image": "images are not supported (this worker serves text-only models)",
    "document": "documents are not supported; send their text in a text block",
    "search_result": "search_result blocks are not supported; send their text in a text block",
    "server_tool_use": "server tools are not available here",
    "web_search_tool_result": "server tools are not available here",
}
_THINKING_BLOCKS = ("thinking", "redacted_thinking")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted, ignored (automatic prefix cache)
    citations: list[Any] | None = None  # echoed back by clients; ignored


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None  # echoed back by the SDK; ignored
    toolset_name: str | None = None  # echoed back; ignored


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None  # echoed back; ignored

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        return text_parts(value, "tool_result content block type {kind!r} is not supported; "
                          "send a string or text blocks",
                          "tool_result content must be a string or a list of text blocks")

    @property
    def text(self) -> str:
        body = "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
_BLOCKS = ("text", "tool_use", "tool_result")


class Message(_Strict):
    """One turn; ``content`` is normalised to a list of blocks (a string is one text block)."""

    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content blocks")
        out = []
        for block in value:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _THINKING_BLOCKS:
                continue  # past reasoning: dropped, as Anthropic drops it from earlier turns
            if kind in _UNSUPPORTED_BLOCKS:
                raise ValueError(f"content block type {kind!r}: {_UNSUPPORTED_BLOCKS[kind]}")
            if kind not in _BLOCKS:
                raise ValueError(f"content block type {kind!r} is not supported; send text, "
                                 "tool_use or tool_result blocks")
            out.append(block)
        return out

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> Message:
        kinds = {b.type for b in self.content}
        if self.role == "user" and "tool_use" in kinds:
            raise ValueError("tool_use blocks belong in assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong in user messages")
        return self


class Tool(_Strict):
    """A client tool; ``input_schema`` is its JSON Schema (passed to the chat template)."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; a forced tool_choice constrains its input anyway
    eager_input_streaming: bool | None = None  # accepted; each call's input is one delta

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is a server tool, not available here; send "
                             "client tools ({name, description, input_schema})")
        return data

    def as_function(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face function shape chat templates and tool parsers expect."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        return {"type": "function", "function": function}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted; several calls are always parsed

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('send name with {"type": "tool"} only')
        return self


class Thinking(_Strict):
    """``disabled``, or ``adaptive`` (the model may think; these do not): both accepted."""

    model_config = ConfigDict(strict=True, extra="ignore")  # the type decides; say so

    type: str

    @field_validator("type")
    @classmethod
    def _no_budget(cls, value: str) -> str:
        if value not in ("disabled", "adaptive"):
            raise ValueError(f'thinking {value!r} is not supported here; omit thinking or send '
                             '{"type": "disabled"}')
        return value


class OutputConfig(_Strict):
    """``effort`` is accepted and ignored (a hint); ``format`` would need constrained
    decoding, which this worker does not do."""

    effort: str | None = None
    format: dict[str, Any] | None = None

    @field_validator("format")
    @classmethod
    def _no_format(cls, value: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("structured output formats are not supported (no constrained "
                         "decoding here); remove output_config.format")


class _Conversation(_Strict):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: ToolChoice, info: ValidationInfo) -> ToolChoice:
        names = {t.name for t in info.data.get("tools") or []}
        if choice.type in ("any", "tool") and not names:
            raise ValueError(f'tool_choice {{"type": "{choice.type}"}} needs tools; send tools '
                             "or drop tool_choice")
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool {choice.name!r} is not in tools; name one of "
                             f"{sorted(names)}")
        return choice

    @property
    def system_text(self) -> str | None:
        return "\n\n".join(b.text for b in self.system) if self.system else None

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """Tools to render and parse, in the function shape (None with ``"none"``).

        ``any`` and a named ``tool`` are passed to the template (a named choice renders only
        that tool) and enforced by constrained decoding (plimsoll.protocol.structured).
        """
        if not self.tools or (self.tool_choice and self.tool_choice.type == "none"):
            return None
        tools = self.tools
        if self.tool_choice and self.tool_choice.type == "tool":
            tools = [t for t in tools if t.name == self.tool_choice.name]
        return [t.as_function() for t in tools]


class MessagesRequest(_Conversation):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, description="Accepted, not applied.")
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, ignored
    cache_control: dict[str, Any] | None = None  # accepted, ignored (automatic prefix cache)
    service_tier: str | None = None  # accepted, ignored (one tier here)
    output_config: OutputConfig | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the prompt only (no ``max_tokens``)."""


class _UntaggedErrors:
    """A ValidationError whose locations skip the block-type tag pydantic inserts after a
    content index (``messages[0].content[1].input``, not ``...content[1].tool_use.input``)."""

    def __init__(self, exc: ValidationError) -> None:
        self._exc = exc

    def errors(self, **kwargs: Any) -> list[dict[str, Any]]:
        out = []
        for err in self._exc.errors(**kwargs):
            loc = err["loc"]
            out.append({**err, "loc": tuple(
                part for i, part in enumerate(loc)
                if not (part in _BLOCKS and i and isinstance(loc[i - 1], int)))})
        return out


def _parse(model: type[_Conversation], raw: bytes) -> Any:
    return validate_body(model, raw, _UntaggedErrors)


def parse_messages(raw: bytes) -> MessagesRequest | ProtocolError:
    """A ``/v1/messages`` body, or the 400/413 that names the field and what to send."""
    return _parse(MessagesRequest, raw)


def parse_count_tokens(raw: bytes) -> CountTokensRequest | ProtocolError:
    """A ``/v1/messages/count_tokens`` body, or the 400/413 that says what is wrong."""
    return _parse(CountTokensRequest, raw)


# --- the prompt ---------------------------------------------------------------------------

def template_messages(req: _Conversation) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (the OpenAI path's shape).

    ``system`` becomes a leading system message; an assistant turn's text blocks its
    content and its ``tool_use`` blocks its ``tool_calls`` (``arguments`` a dict, as
    templates render them with ``tojson``); in a user turn each ``tool_result`` becomes a
    ``tool`` message (an error result's text prefixed ``Error:``) and each run of text
    blocks a user message, in their order.
    """
    out: list[dict[str, Any]] = []
    if (system := req.system_text) is not None:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(
                b.text for b in m.content if isinstance(b, TextBlock))}
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": b.input}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        text: list[str] | None = None
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                text = None
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text})
            elif isinstance(b, TextBlock):
                if text is None:
                    text = []
                    out.append({"role": "user", "content": ""})
                text.append(b.text)
                out[-1]["content"] = "".join(text)
        if not m.content:
            out.append({"role": "user", "content": ""})
    return out


def render_messages(tokenizer: Any, req: _Conversation) -> list[int]:
    """Prompt token ids through the model's chat template (tools listed when active).

    A conversation that ends with an assistant turn is continued, not answered (Anthropic's
    prefill): that turn is left open and the output follows its text. Raises
    :class:`ProtocolError` (400) when the model has no chat template or the template
    refuses the conversation.
    """
    if not getattr(tokenizer, "has_chat_template", True):
        raise ProtocolError(400, "This model has no chat template, so it cannot serve "
                            "/v1/messages; send a plain prompt to /v1/completions instead.",
                            param="messages", code="no_chat_template")
    messages = template_messages(req)
    prefill = req.messages[-1].role == "assistant"
    return apply_template(tokenizer, messages, req.active_tools,
                          add_generation_prompt=not prefill,
                          **({"continue_final_message": True} if prefill else {}))


def count_tokens_body(prompt_tokens: int) -> dict[str, Any]:
    """The ``/v1/messages/count_tokens`` answer."""
    return {"input_tokens": prompt_tokens}


# --- the output ---------------------------------------------------------------------------

class AnthropicAssembler(TextAssembler):
    """A :class:`TextAssembler` that also reports which stop sequence ended the output."""

    _matched: str | None = None

    @classmethod
    def for_messages(cls, tokenizer: Any, req: MessagesRequest, max_tokens: int
                     ) -> AnthropicAssembler:
        return cls(tokenizer, stop=req.stop_sequences, max_tokens=max_tokens,
                   tools=req.active_tools)

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

    Consecutive text deltas share one text block; each tool call is one ``tool_use`` block
    whose input arrives as one ``input_json_delta``. :attr:`blocks` is the finished content
    of the non-streamed message; :meth:`feed` and :meth:`close` return the events.
    """

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open_text = False

    def feed(self, deltas: Iterable[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, TextDelta):
                if not self._open_text:
                    self.blocks.append({"type": "text", "text": ""})
                    self._open_text = True
                    events.append({"type": "content_block_start", "index": self._index,
                                   "content_block": {"type": "text", "text": ""}})
                self.blocks[-1]["text"] += d.text
                events.append({"type": "content_block_delta", "index": self._index,
                               "delta": {"type": "text_delta", "text": d.text}})
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
        """The stop event of an open text block (none if none is open)."""
        if not self._open_text:
            return []
        self._open_text = False
        return [{"type": "content_block_stop", "index": self._index}]

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


def sse_event(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event named by the object's type: ``event: <type>\\ndata: <json>``."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()
