"""``POST /v1/responses`` request bodies (the OpenAI Responses API), strict, and their
translation onto the chat path.

A Responses request is validated here, then turned into the equivalent
:class:`~.requests.ChatCompletionRequest` (:func:`to_chat`): ``instructions`` a system
message, ``input`` items chat messages (a ``function_call`` an assistant tool call, a
``function_call_output`` a tool message), flat function tools nested as chat tools,
``text.format`` a ``response_format``. From there the prompt is rendered by the model's
chat template and the output assembled (tool calls parsed) exactly as for chat, so there
is one pipeline.

Fields real clients send that change nothing here are accepted and ignored, each named
with its reason in the one table of :mod:`.tolerated` (scopes ``openai.responses*``; Codex
CLI sends ``include``, ``prompt_cache_key``, ``reasoning``, ``text.verbosity``), and hosted
tool types are left out of the prompt by the same table; every other unknown field is
refused by name, as on the chat routes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import tolerated
from . import tool_choice as tool_choices
from .errors import ProtocolError
from .parse import Untagged, from_validation, validate_body
from .requests import _INT64, MAX_TOKENS_LIMIT, ChatCompletionRequest, _must_be, _Strict

TOOL_TYPES = "openai.responses.tool_type"
"""The table's scope of tool types left out of the prompt (not refused)."""


# --- input items --------------------------------------------------------------------------

class ContentPart(_Strict):
    """Text content: ``input_text`` (user, system), ``output_text`` (a replayed answer)."""

    tolerated_scope: ClassVar[str] = "openai.responses.content"
    type: Literal["input_text", "output_text", "text", "summary_text"]
    text: str


def _parts(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text", "summary_text"):
                raise ValueError(f"content part type {kind!r} is not supported here; send text "
                                 '(a string or {"type": "input_text", "text": ...} parts)')
    return value


class MessageItem(_Strict):
    tolerated_scope: ClassVar[str] = "openai.responses.message"
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _parts(value)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: list[ContentPart]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _parts(value)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.output)


class ReasoningItem(_Strict):
    """A replayed reasoning item: dropped (its text, if any, is not shown to the model)."""

    model_config = _Strict.model_config | {"extra": "ignore"}
    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # an easy input message may omit its type
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


# --- tools and formats --------------------------------------------------------------------

class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError('type "json_schema" needs name and schema')
        return self


class TextConfig(_Strict):
    tolerated_scope: ClassVar[str] = "openai.responses.text"
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    tolerated_scope: ClassVar[str] = "openai.responses"
    model: str | None = None
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: tool_choices.ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # echoed; several calls are always parsed
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # echoed back in the response
    background: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("input must be a string or a list of items")
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if not isinstance(kind, str) or kind not in _ITEM_TYPES:
                raise ValueError(f"item {i} has type {kind!r}; this worker takes message, "
                                 "function_call, function_call_output (and reasoning, ignored)")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        kept = []
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if tolerated.left_out(TOOL_TYPES, kind):
                continue
            if kind != "function":
                left = ", ".join(tolerated.names(TOOL_TYPES))
                raise ValueError(f"tool {i} has type {kind!r}; only function tools are offered "
                                 f"to the model here (and {left} are left out)")
            kept.append(tool)
        return kept

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return tool_choices.from_responses(value)

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: tool_choices.ToolChoice,
                         info: ValidationInfo) -> tool_choices.ToolChoice:
        tool_choices.check(choice, {t.name for t in info.data.get("tools") or []},
                           f'"{choice.name or choice.mode}"')
        return choice

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        return _must_be(value, False, "background responses are not supported; send false")


def parse_responses(raw: bytes) -> ResponsesRequest | ProtocolError:
    """A ``/v1/responses`` body, or the 400/413 that names the field and what to send."""
    return validate_body(ResponsesRequest, raw,
                         lambda e: Untagged(e, frozenset(_ITEM_TYPES)))


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls (and the assistant text
    before them) become one assistant message with ``tool_calls``."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return out


def _one_system(instructions: str | None, messages: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """``instructions`` and the system/developer messages that open the conversation as one
    system message (Codex opens with two developer messages; many chat templates take one
    system message, first)."""
    head = [instructions] if instructions else []
    i = 0
    while i < len(messages) and messages[i]["role"] in ("system", "developer"):
        head.append(messages[i]["content"])
        i += 1
    return ([{"role": "system", "content": "\n\n".join(head)}] if head else []) + messages[i:]


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request means, after ``history`` (the stored
    conversation of ``previous_response_id``); raises the 400 (:class:`ProtocolError`) for
    one the chat path refuses."""
    messages = _one_system(req.instructions, history + chat_messages(req.input))
    body: dict[str, Any] = {"messages": messages, "stream": req.stream,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "seed": req.seed, "max_tokens": req.max_output_tokens}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, exclude={"type"})} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                   "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation(e, ResponsesRequest) from e


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """The chat messages to store for a follow-up: the history and this input, without the
    instructions (the API does not carry ``instructions`` over to a ``previous_response_id``
    request)."""
    return history + chat_messages(req.input)
