"""The Anthropic Messages API of the worker, pure: bytes in, token ids out, dicts and SSE out.

The same engine path as the OpenAI side, with Anthropic's shapes at both ends:
:mod:`.request` (:func:`parse_messages` / :func:`parse_count_tokens`: strict models, the
tolerated fields dropped, refusals in Anthropic's error shape) → :mod:`.prompt`
(:func:`render_messages`: the conversation through the model's chat template) →
(admission, engine) → :mod:`.stream` (an :class:`AnthropicAssembler` and a
:class:`BlockStream`: content blocks and stream events). Refusals are the OpenAI layer's
:class:`~plimsoll.protocol.errors.ProtocolError` (its messages say what to change).
"""

from .prompt import count_tokens_body, render_messages, template_messages
from .request import (
    MAX_STOP_SEQUENCES,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    Thinking,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    error_body,
    error_type,
    parse_count_tokens,
    parse_messages,
)
from .stream import (
    AnthropicAssembler,
    BlockStream,
    MessageMeta,
    StopReason,
    message,
    message_end,
    message_start,
    new_message_id,
    sse_event,
    stop_reason,
    tool_use_block,
    tool_use_id,
    usage,
)

__all__ = [
    "MAX_STOP_SEQUENCES", "AnthropicAssembler", "BlockStream", "CountTokensRequest", "Message",
    "MessageMeta", "MessagesRequest", "StopReason", "TextBlock", "Thinking", "Tool",
    "ToolChoice", "ToolResultBlock", "ToolUseBlock", "count_tokens_body", "error_body",
    "error_type", "message", "message_end", "message_start", "new_message_id",
    "parse_count_tokens", "parse_messages", "render_messages",
    "sse_event", "stop_reason", "template_messages", "tool_use_block", "tool_use_id", "usage",
]
