"""The OpenAI protocol of the worker, pure: bytes in, token ids to the engine, dicts out.

No mlx and no I/O: the HTTP app calls these functions and the tokenizer (mlx-lm's
``TokenizerWrapper``) arrives as a parameter. The request path is
:func:`parse_request` → :func:`render_chat` / :func:`render_completion` → (admission,
engine) → a :class:`TextAssembler` fed each generated id → the builders of
:mod:`.responses` (and :func:`sse` for streams). Every refusal is a
:class:`ProtocolError` in the OpenAI error shape.

May import: nothing of plimsoll (pure; pydantic only). The HTTP edge around it is
:mod:`plimsoll.web`.
"""

from .assembler import (
    Assembled,
    Delta,
    FinishReason,
    TextAssembler,
    TextDelta,
    ToolCallDelta,
    new_tool_call_id,
)
from .errors import (
    MAX_BODY_BYTES,
    ProtocolError,
    check_body_size,
    check_model,
    context_overflow,
    context_overflow_message,
    error_body,
)
from .parse import decode_json_body, parse_request
from .render import render_chat, render_completion, template_messages
from .requests import (
    MAX_STOP,
    MAX_TOKENS_LIMIT,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Request,
    Tool,
    ToolChoice,
)
from .responses import (
    SSE_DONE,
    Kind,
    ResponseMeta,
    chat_chunk,
    chat_completion,
    chat_delta,
    completion,
    completion_chunk,
    delta_chunks,
    final_chunks,
    first_chunks,
    model_card,
    models_list,
    response,
    sse,
    usage,
    usage_chunk,
)

__all__ = [
    "MAX_BODY_BYTES", "MAX_STOP", "MAX_TOKENS_LIMIT", "SSE_DONE", "Assembled",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "Delta", "FinishReason", "Kind",
    "ProtocolError", "Request", "ResponseMeta", "TextAssembler", "TextDelta", "Tool",
    "ToolCallDelta", "ToolChoice", "chat_chunk", "chat_completion", "chat_delta",
    "check_body_size", "check_model", "completion", "completion_chunk", "context_overflow",
    "context_overflow_message", "decode_json_body", "delta_chunks", "error_body",
    "final_chunks", "first_chunks", "model_card", "models_list", "new_tool_call_id",
    "parse_request", "render_chat", "render_completion", "response", "sse",
    "template_messages", "usage", "usage_chunk",
]
