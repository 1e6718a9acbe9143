"""Ollama's request bodies (``/api/chat``, ``/api/generate``, ``/api/show``): strict models,
parsed from bytes, and their translation onto the OpenAI request model.

Strict as every route here: an unknown field is refused by name; fields Ollama's clients
send that change nothing here (``keep_alive``, ``truncate``, llama.cpp's load-time
``options`` such as ``num_gpu``) are listed with their reasons in :mod:`..tolerated` and
dropped first. ``options`` are mapped where they mean the same: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``num_predict`` (the output
reservation; 0 or negative: the worker's default), ``num_ctx`` (this request's context,
checked against the one the model is served with). Sampling options that would change the
output and are not implemented (``repeat_penalty``, ``presence_penalty``, ``mirostat``, …) are
accepted at their neutral value only. Absent, temperature and top-p take Ollama's own
defaults (0.8, 0.9).

A chat request becomes a :class:`~..requests.ChatCompletionRequest` (:func:`to_chat`):
tool calls' ``arguments`` objects become JSON strings, each ``tool`` message is tied to the
call it answers, ``thinking`` is the turn's ``reasoning_content``. ``/api/generate`` is a
one-turn chat (``system``, then ``prompt``) through the chat template, or with ``raw`` the
prompt as it is (a :class:`~..requests.CompletionRequest`). ``format`` (``"json"`` or a
JSON Schema) is enforced by the constrained decoder (:func:`format_spec`). Refused by
name: images, ``suffix`` (fill-in-the-middle), ``template``, ``context``, log
probabilities.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator

from ... import constrain
from .. import structured
from ..errors import ProtocolError
from ..parse import from_validation, validate_body
from ..requests import (
    _INT64,
    MAX_STOP,
    MAX_TOKENS_LIMIT,
    ChatCompletionRequest,
    CompletionRequest,
    NoLogprobs,
    NoTopLogprobs,
    _must_be,
    _Strict,
)

DEFAULT_TEMPERATURE = 0.8
"""Ollama's temperature when a request sets none."""
DEFAULT_TOP_P = 0.9
"""Ollama's top-p when a request sets none."""
_NEUTRAL = "this sampler setting is not implemented here; send {value} (off) or omit it"


def error_body(message: str, code: str | None = None) -> dict[str, Any]:
    """Ollama's error shape, ``{"error": "..."}``; ``code`` rides beside it (Ollama's
    clients read ``error`` only) so the access log and the metrics can tell refusals apart."""
    return {"error": message, **({"code": code} if code else {})}


# --- options ------------------------------------------------------------------------------

class Options(_Strict):
    """``options``: the runtime parameters of one request."""

    tolerated_scope: ClassVar[str] = "ollama.options"
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, description="0: off.")
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    num_predict: int | None = Field(default=None, le=MAX_TOKENS_LIMIT)
    num_ctx: int | None = Field(default=None, ge=1)
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    mirostat: int = 0
    min_p: float = Field(default=0.0, ge=0, le=1)
    typical_p: float = 1.0
    tfs_z: float = 1.0

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        value = [value] if isinstance(value, str) else value
        if isinstance(value, list) and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("repeat_penalty", "typical_p", "tfs_z")
    @classmethod
    def _one_is_off(cls, value: float) -> float:
        return _must_be(value, 1, _NEUTRAL.format(value=1))

    @field_validator("presence_penalty", "frequency_penalty", "mirostat")
    @classmethod
    def _zero_is_off(cls, value: float) -> float:
        return _must_be(value, 0, _NEUTRAL.format(value=0))

    @property
    def max_tokens(self) -> int | None:
        """``num_predict`` as an output reservation (None: the worker's default)."""
        return self.num_predict if self.num_predict is not None and self.num_predict > 0 \
            else None


# --- chat messages and tools --------------------------------------------------------------

def _no_images(value: Any) -> Any:
    if value:
        raise ValueError("images are not supported (this server serves text-only models); "
                         "remove them")
    return value


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Strict):
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, value: list[Any]) -> list[Any]:
        return _no_images(value)


class Function(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: Function


# --- the requests -------------------------------------------------------------------------

class _Generation(_Strict):
    """What ``/api/chat`` and ``/api/generate`` share."""

    tolerated_scope: ClassVar[str] = "ollama.request"
    model: str = Field(min_length=1)
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: NoLogprobs = False
    top_logprobs: NoTopLogprobs = 0

    @field_validator("format")
    @classmethod
    def _format(cls, value: str | dict[str, Any]) -> str | dict[str, Any] | None:
        if isinstance(value, str) and value not in ("", "json"):
            raise ValueError(f'{json.dumps(value)} is not a format; send "json" or a JSON '
                             "Schema object")
        return value or None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``think: false`` turns a thinking model's reasoning off (mlx-lm maps the name to
        the template's own switch); otherwise the template decides."""
        return {"enable_thinking": False} if self.think is False else {}

    def sampling(self) -> dict[str, Any]:
        """The OpenAI request fields these options mean."""
        o = self.options
        return {"stream": self.stream, "stop": o.stop, "max_tokens": o.max_tokens,
                "temperature": DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
                "top_p": DEFAULT_TOP_P if o.top_p is None else o.top_p,
                "top_k": o.top_k or 0, "min_p": o.min_p,
                "seed": o.seed if o.seed is not None and o.seed >= 0 else None}


class ChatRequest(_Generation):
    """``POST /api/chat``. No messages: the model is loaded and nothing generated."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_Generation):
    """``POST /api/generate``. No prompt: the model is loaded and nothing generated."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str = ""
    template: str = ""
    context: list[int] = Field(default_factory=list)
    images: list[Any] | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, value: list[Any]) -> list[Any]:
        return _no_images(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str) -> str:
        return _must_be(value, "", "fill-in-the-middle is not implemented here; omit suffix")

    @field_validator("template")
    @classmethod
    def _no_template(cls, value: str) -> str:
        return _must_be(value, "", "the model's own chat template renders the prompt; omit "
                        "template (or send raw: true with the prompt already formatted)")

    @field_validator("context")
    @classmethod
    def _no_context(cls, value: list[int]) -> list[int]:
        return _must_be(value, [], "context (token ids of an earlier answer) is not kept "
                        "here; send the conversation to /api/chat instead")


class ShowRequest(_Strict):
    """``POST /api/show``: ``model`` (older clients send ``name``)."""

    tolerated_scope: ClassVar[str] = "ollama.show"
    model: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)
    verbose: bool = False

    @property
    def target(self) -> str | None:
        return self.model or self.name


def parse_chat(raw: bytes) -> ChatRequest | ProtocolError:
    """An ``/api/chat`` body, or the 400/413 that names the field and what to send."""
    return validate_body(ChatRequest, raw)


def parse_generate(raw: bytes) -> GenerateRequest | ProtocolError:
    """An ``/api/generate`` body, or the 400/413 that names the field and what to send."""
    return validate_body(GenerateRequest, raw)


def parse_show(raw: bytes) -> ShowRequest | ProtocolError:
    """An ``/api/show`` body naming a model, or the 400 that says what to send."""
    req = validate_body(ShowRequest, raw)
    if isinstance(req, ShowRequest) and req.target is None:
        return ProtocolError(400, "Missing required field 'model'.", param="model",
                             code="invalid_request")
    return req


# --- onto the OpenAI request model --------------------------------------------------------

def loads_only(req: ChatRequest | GenerateRequest) -> bool:
    """True for a request with nothing to answer (Ollama clients load a model so)."""
    return not req.messages if isinstance(req, ChatRequest) else not req.prompt


def _answering(pending: list[tuple[str, str]], name: str | None, index: int) -> str:
    """The id of the call a tool message answers: the first unanswered call of its tool
    (or, with no ``tool_name``, the first unanswered call), taken off ``pending``."""
    for i, (call_id, call_name) in enumerate(pending):
        if name is None or call_name == name:
            del pending[i]
            return call_id
    return f"call_{index}"


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI chat messages (before validation): each assistant call gets
    an id (its own, else ``call_N``) and each tool message the id of the call it answers."""
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for j, c in enumerate(m.tool_calls)]
            pending = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or _answering(pending, m.tool_name, i)
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def _validated(model: type[Any], body: dict[str, Any], shown: type[_Strict]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e, shown) from e


def to_chat(req: ChatRequest | GenerateRequest) -> ChatCompletionRequest:
    """The chat request an ``/api/chat`` (or a templated ``/api/generate``) request means;
    raises the 400 (:class:`ProtocolError`) for one the chat path refuses."""
    if isinstance(req, ChatRequest):
        messages = chat_messages(req.messages)
    else:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt}]
    body: dict[str, Any] = {"messages": messages, **req.sampling()}
    if isinstance(req, ChatRequest) and req.tools:
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return _validated(ChatCompletionRequest, body, type(req))


def to_completion(req: GenerateRequest) -> CompletionRequest:
    """A ``raw`` ``/api/generate`` request: its prompt as it is."""
    return _validated(CompletionRequest, {"prompt": req.prompt, **req.sampling()},
                      GenerateRequest)


def format_spec(req: ChatRequest | GenerateRequest) -> constrain.Spec | None:
    """The constrained-decoding spec of ``format`` (``"json"``: any JSON object; a JSON
    Schema: output that validates against it), or None for free text."""
    if req.format is None:
        return None
    if req.format == "json":
        return structured.json_format("json_object", None, "format")
    return structured.json_format("json_schema", req.format, "format")


# --- the context a request asks for ---------------------------------------------------------

def check_num_ctx(num_ctx: int | None, context: int, native_max: int | None
                  ) -> ProtocolError | None:
    """The 400 for ``options.num_ctx`` over the context the model is served with."""
    if num_ctx is None or num_ctx <= context:
        return None
    native = f"{native_max} tokens" if native_max else "unknown"
    return ProtocolError(400, f"options.num_ctx {num_ctx} is over the context this model is "
                         f"served with ({context} tokens; model-native maximum context: "
                         f"{native}): send num_ctx {context} or less, or omit it (POST "
                         "/api/show reports it as model_info's context_length), or restart "
                         "the server with a larger context for this model.",
                         param="options.num_ctx", code="context_length_exceeded")


def output_within_num_ctx(num_ctx: int | None, prompt_tokens: int, asked: int | None,
                          default: int) -> int | ProtocolError | None:
    """The output reservation to ask for when ``num_ctx`` bounds this request's context
    (``prompt + output ≤ num_ctx``), ``asked`` unchanged without it, or the 400 for a prompt
    that alone fills ``num_ctx``."""
    if num_ctx is None:
        return asked
    if prompt_tokens >= num_ctx:
        return ProtocolError(400, f"The prompt is {prompt_tokens} tokens, which leaves no room "
                             f"for output in options.num_ctx {num_ctx}: raise num_ctx (up to "
                             "the context the model is served with) or shorten the prompt.",
                             param="options.num_ctx", code="context_length_exceeded")
    return min(asked if asked is not None else default, num_ctx - prompt_tokens)
