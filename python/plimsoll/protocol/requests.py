"""The OpenAI request bodies the worker accepts, as strict pydantic models.

Strict by design (as simonw/llm's option models): unknown fields are refused by name
(``extra="forbid"``) and types are not coerced (``"5"`` is not an integer, ``true`` is
not a number), so a client bug is a 400 that names the field instead of a surprise.
Fields clients send that change nothing here (``user``, ``store``, ``metadata``,
``parallel_tool_calls``, ``prediction``, ``reasoning_effort``, …) are listed with their
reasons in :mod:`.tolerated` (one table, each logged once) and dropped before validation.
A few more are accepted at their harmless value only (``n: 1``, zero penalties,
``response_format: text``, ``logprobs: false``); their other values are refused with what
is supported (the JSON ``response_format`` types are enforced by constrained
decoding). JSON ``null`` means "absent" everywhere.

Normalisation happens here, once: message ``content`` is always a list of text parts,
``stop`` a list of strings, ``tool_choice`` a :class:`ToolChoice`, a completion
``prompt`` a string or a list of token ids.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import tool_choice as tool_choices
from .tolerated import drop_tolerated
from .tool_choice import ToolChoice

MAX_TOKENS_LIMIT = 1 << 20
"""Sanity cap on ``max_tokens`` (the configured context is the real bound, checked later)."""
MAX_STOP = 4
_INT64 = 1 << 63


class _Strict(BaseModel):
    """Strict, unknown fields refused; those :data:`.tolerated.TOLERATED` lists for
    ``tolerated_scope`` are dropped (and logged once) first."""

    model_config = ConfigDict(strict=True, extra="forbid")
    tolerated_scope: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = drop_tolerated(cls.tolerated_scope, data)
            return {k: v for k, v in data.items() if v is not None}
        return data


def _must_be(value: Any, allowed: Any, hint: str) -> Any:
    if value != allowed:
        raise ValueError(f"{json.dumps(value)} is not supported; {hint}")
    return value


NoLogprobs = Annotated[bool, AfterValidator(lambda value: _must_be(
    value, False, "log probabilities are not returned; send false or omit"))]
"""A ``logprobs`` flag: only false (no API here returns log probabilities)."""
NoTopLogprobs = Annotated[int, AfterValidator(lambda value: _must_be(
    value, 0, "log probabilities are not returned; omit top_logprobs"))]
"""A ``top_logprobs`` count: only 0."""


# --- chat messages ------------------------------------------------------------------------

class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="A JSON object, as a string (as the API returns it).")


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def text_parts(value: Any, unsupported: str, not_text: str) -> Any:
    """Text-only content, before validation: a string is one text part; a list must hold
    only text parts (``unsupported`` names the first other ``{kind!r}``); anything else is
    ``not_text``. Shared by OpenAI messages and Anthropic tool results."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(unsupported.format(kind=kind))
        return value
    raise ValueError(not_text)


class ChatMessage(_Strict):
    """One message of any role; ``developer`` is treated as ``system``."""

    tolerated_scope: ClassVar[str] = "openai.message"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(
        default=None, description="Passed to chat templates that render past reasoning.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return text_parts(value, "content part type {kind!r} is not supported; send a string "
                          'or a list of {{"type": "text", "text": ...}} parts',
                          "content must be a string or a list of text parts")

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        """The content parts joined into one string ('' for none)."""
        return "".join(part.text for part in self.content or [])


# --- tools --------------------------------------------------------------------------------

class FunctionDef(_Strict):
    tolerated_scope: ClassVar[str] = "openai.function"
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    tolerated_scope: ClassVar[str] = "openai.stream_options"
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: enforced by constrained decoding (strict or not)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text``, ``json_object`` (any JSON object) or ``json_schema``: the last two are
    enforced token by token (:mod:`plimsoll.constrain`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('send json_schema ({"name", "schema", "strict"}) with type '
                             '"json_schema", and only then')
        return self


# --- the requests -------------------------------------------------------------------------

class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = Field(default=None, description="Checked against the served model by "
                              "the app; omitted means the served model.")
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    top_k: int = Field(default=0, ge=-1, description=(
        "An extension clients send (vLLM, llama.cpp): sample among the k most likely "
        "tokens; 0 or -1 is off."))
    min_p: float = Field(default=0.0, ge=0, le=1, description=(
        "An extension clients send (vLLM, llama.cpp): drop tokens less likely than min_p "
        "times the most likely one; 0 is off."))
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = Field(default=False, description=(
        "vLLM's extension, as benchmarks send it: the end-of-sequence token does not end the "
        "answer (it is counted, not shown); max_tokens and stop strings still do."))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"stop must be a string or a list of up to {MAX_STOP} strings")
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return max(value, 0)  # vLLM's -1 is off, as 0

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        return _must_be(value, 1, "this worker returns one choice per request; send n=1 or "
                        "omit n, and send several requests for several samples")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        return _must_be(value, 0, "penalties are not implemented; send 0 or omit the field")

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``.

    ``tool_choice: "required"`` and a named function are passed to the template (a named
    choice renders only that tool) and enforced by constrained decoding: the output is one
    call in the model's tool-call markup whose arguments match the tool's parameters.
    """

    tolerated_scope: ClassVar[str] = "openai.chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: NoLogprobs = False
    top_logprobs: NoTopLogprobs = 0

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return tool_choices.from_openai(value)

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value: int, info: ValidationInfo) -> int:
        other = info.data.get("max_tokens")
        if other is not None and other != value:
            raise ValueError(f"max_tokens ({other}) and max_completion_tokens ({value}) differ; "
                             "send only one")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: ToolChoice, info: ValidationInfo) -> ToolChoice:
        tool_choices.check(choice, {t.function.name for t in info.data.get("tools") or []},
                           f'"{choice.name or choice.mode}"')
        return choice

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` or ``max_tokens``; None means the worker's default."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """Tools to render and parse, as plain dicts (None with ``tool_choice: "none"``)."""
        tools = tool_choices.chosen(self.tools, self.tool_choice, lambda t: t.function.name)
        return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (a string or token ids)."""

    tolerated_scope: ClassVar[str] = "openai.completion"
    prompt: str | list[int]
    echo: bool = False
    logprobs: int = 0
    best_of: int = 1
    suffix: str = ""

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(
                isinstance(p, str | list) for p in value):
            raise ValueError(f"{len(value)} prompts were sent; this worker takes one prompt per "
                             "request: send them as separate requests")
        raise ValueError("prompt must be a string or a non-empty list of token ids (ints ≥ 0)")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        return _must_be(value, False, "echo is not supported; send false or omit it")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int) -> int:
        return _must_be(value, 0, "log probabilities are not returned; omit logprobs")

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int) -> int:
        return _must_be(value, 1, "send best_of=1 or omit it")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str) -> str:
        return _must_be(value, "", "suffix (insertion) is not supported; omit it")

    @property
    def max_output_tokens(self) -> int | None:
        """``max_tokens``; None means the worker's default."""
        return self.max_tokens


Request = ChatCompletionRequest | CompletionRequest
