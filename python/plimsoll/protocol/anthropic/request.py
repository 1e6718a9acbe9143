"""The Anthropic Messages API's request bodies: strict models, parsed from bytes.

:func:`parse_messages` / :func:`parse_count_tokens` turn a body into a
:class:`MessagesRequest` / :class:`CountTokensRequest` or the :class:`ProtocolError` that
names the field; :func:`error_body` renders any refusal in Anthropic's error shape,
``{"type": "error", "error": {"type", "message"}}``, with the type from the status
(``overloaded_error`` for the pool's 503: the SDK retries it, honouring ``Retry-After``).

Fields real clients send that change nothing here (``cache_control`` anywhere,
``metadata``, ``service_tier``, ``context_management``, a tool's ``defer_loading``, …) are
listed with their reasons in :mod:`..tolerated` and dropped before validation; every
other unknown field is refused by name. ``system``-role messages inside ``messages``
(Claude Code sends them) are accepted, text only; :mod:`.prompt` places them. ``thinking``
of any type is accepted (``enabled`` with a ``budget_tokens``, ``adaptive``, ``disabled``);
the model thinks as its chat template lets it and its reasoning comes back as ``thinking``
blocks. ``top_k`` is applied as mlx-lm applies it (greedy decoding at ``temperature: 0``
is unaffected). ``thinking`` blocks in past
assistant turns are dropped, as Anthropic itself drops them from earlier turns. Refused
by name: ``output_config.format``, images, documents, server tools, ``max_tokens: 0``
(cache pre-warming), and any field not in the table.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .. import tool_choice as tool_choices
from ..errors import ProtocolError
from ..parse import Untagged, validate_body
from ..requests import MAX_TOKENS_LIMIT, _Strict, text_parts

MAX_STOP_SEQUENCES = 16
"""Stop sequences a request may send (each is checked against every decoded token)."""

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
    tolerated_scope: ClassVar[str] = "anthropic.text"
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    tolerated_scope: ClassVar[str] = "anthropic.tool_use"
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    tolerated_scope: ClassVar[str] = "anthropic.tool_result"
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False

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


class SystemBlock(TextBlock):
    tolerated_scope: ClassVar[str] = "anthropic.system"


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
_BLOCKS = ("text", "tool_use", "tool_result")


class Message(_Strict):
    """One turn; ``content`` is normalised to a list of blocks (a string is one text block).

    A ``system`` message (sent inside ``messages`` by Claude Code) holds text blocks only.
    """

    role: Literal["user", "assistant", "system"]
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
            if isinstance(kind, str) and kind in _UNSUPPORTED_BLOCKS:  # a list is unhashable
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
        if self.role == "system" and kinds - {"text"}:
            raise ValueError("a system message holds text blocks only")
        return self

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


class Tool(_Strict):
    """A client tool; ``input_schema`` is its JSON Schema (passed to the chat template)."""

    tolerated_scope: ClassVar[str] = "anthropic.tool"
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]

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
    tolerated_scope: ClassVar[str] = "anthropic.tool_choice"
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('send name with {"type": "tool"} only')
        return self

    @property
    def normal(self) -> tool_choices.ToolChoice:
        """This choice in the one normal form (:mod:`plimsoll.protocol.tool_choice`)."""
        return tool_choices.from_anthropic(self.type, self.name)


class Thinking(_Strict):
    """``enabled`` (with a ``budget_tokens``), ``adaptive`` or ``disabled``: all accepted.

    Whether the model reasons is its chat template's choice; its reasoning comes back as
    ``thinking`` blocks either way, and counts against ``max_tokens``.
    """

    tolerated_scope: ClassVar[str] = "anthropic.thinking"
    type: Literal["enabled", "disabled", "adaptive"]


class OutputConfig(_Strict):
    """``effort`` is tolerated (a hint); ``format`` would need constrained decoding."""

    tolerated_scope: ClassVar[str] = "anthropic.output_config"
    format: dict[str, Any] | None = None

    @field_validator("format")
    @classmethod
    def _no_format(cls, value: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("structured output formats are not supported (no constrained "
                         "decoding here); remove output_config.format")


class _Conversation(_Strict):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    tolerated_scope: ClassVar[str] = "anthropic.request"
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: list[SystemBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    @field_validator("messages")
    @classmethod
    def _a_turn(cls, messages: list[Message]) -> list[Message]:
        if all(m.role == "system" for m in messages):
            raise ValueError("messages holds only system messages; send at least one user "
                             "turn")
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: ToolChoice, info: ValidationInfo) -> ToolChoice:
        tool_choices.check(choice.normal, {t.name for t in info.data.get("tools") or []},
                           f'tool_choice {{"type": "{choice.type}"}}', "tool")
        return choice

    @property
    def system_text(self) -> str | None:
        """The ``system`` field's text blocks joined (None when absent)."""
        return "\n\n".join(b.text for b in self.system) if self.system else None

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """Tools to render and parse, in the function shape (None with ``"none"``).

        ``any`` and a named ``tool`` are passed to the template (a named choice renders only
        that tool) and enforced by constrained decoding (plimsoll.protocol.structured).
        """
        choice = self.tool_choice.normal if self.tool_choice else None
        tools = tool_choices.chosen(self.tools, choice, lambda t: t.name)
        return None if tools is None else [t.as_function() for t in tools]


class MessagesRequest(_Conversation):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="Sample among the k most likely tokens; "
                       "0 (or absent) is off.")
    stream: bool = False
    output_config: OutputConfig | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the prompt only (no ``max_tokens``)."""


def _parse(model: type[_Conversation], raw: bytes) -> Any:
    return validate_body(model, raw, lambda e: Untagged(e, frozenset(_BLOCKS)))


def parse_messages(raw: bytes) -> MessagesRequest | ProtocolError:
    """A ``/v1/messages`` body, or the 400/413 that names the field and what to send."""
    return _parse(MessagesRequest, raw)


def parse_count_tokens(raw: bytes) -> CountTokensRequest | ProtocolError:
    """A ``/v1/messages/count_tokens`` body, or the 400/413 that says what is wrong."""
    return _parse(CountTokensRequest, raw)


