"""Ollama's API, pure: bytes in, the OpenAI request model in between, NDJSON out.

The same engine path as the OpenAI and Anthropic sides, with Ollama's shapes at both ends:
:mod:`.request` (:func:`parse_chat` / :func:`parse_generate`: strict models, ``options``
mapped, the tolerated fields dropped; :func:`to_chat` / :func:`to_completion`: the
equivalent OpenAI request, rendered and assembled as on ``/v1/chat/completions``;
:func:`format_spec`: ``format`` for the constrained decoder) → (admission, engine) →
:mod:`.stream` (NDJSON chunks and the final object, durations in ns). :mod:`.catalog`
builds ``/api/tags``, ``/api/ps``, ``/api/show`` and ``/api/version`` from the proxy's
figures. Refusals are the OpenAI layer's :class:`ProtocolError`, answered in Ollama's
``{"error": "..."}`` (:func:`error_body`).
"""

from . import catalog
from .request import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ChatRequest,
    GenerateRequest,
    Message,
    Options,
    ShowRequest,
    Tool,
    chat_messages,
    check_num_ctx,
    error_body,
    format_spec,
    loads_only,
    output_within_num_ctx,
    parse_chat,
    parse_generate,
    parse_show,
    to_chat,
    to_completion,
)
from .stream import (
    NDJSON,
    Counts,
    Kind,
    Meta,
    chunk,
    done_reason,
    final,
    lines,
    loaded,
    ndjson,
    timestamp,
    tool_call,
)

__all__ = [
    "DEFAULT_TEMPERATURE", "DEFAULT_TOP_P", "NDJSON", "ChatRequest", "Counts", "GenerateRequest",
    "Kind", "Message", "Meta", "Options", "ShowRequest", "Tool", "catalog", "chat_messages",
    "check_num_ctx", "chunk", "done_reason", "error_body", "final", "format_spec", "lines",
    "loaded", "loads_only", "ndjson", "output_within_num_ctx", "parse_chat", "parse_generate",
    "parse_show", "timestamp", "to_chat", "to_completion", "tool_call",
]
