"""An Anthropic conversation to prompt token ids, through the model's own chat template.

:func:`template_messages` converts the request into the chat-template message list the
OpenAI path uses (``system`` a system message, ``tool_use`` blocks assistant
``tool_calls``, ``tool_result`` blocks ``tool`` messages); :func:`render_messages` applies
the template. ``system``-role messages inside ``messages`` (Claude Code sends its
environment notes that way) are placed as the template allows: those before the first
turn join the ``system`` prompt; a later one stays a system message where it was, and if
the template refuses a system message there (many accept one only first), it is folded
into the next user turn's text instead, so no template refuses the conversation for it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError
from ..render import apply_template
from .request import TextBlock, ToolResultBlock, ToolUseBlock, _Conversation


def _system_parts(req: _Conversation) -> tuple[list[str], int]:
    """The leading system texts (the ``system`` field, then system messages before the first
    turn) and the index of the first message that is not one of them."""
    parts = [req.system_text] if req.system_text is not None else []
    first = 0
    while first < len(req.messages) and req.messages[first].role == "system":
        parts.append(req.messages[first].text)
        first += 1
    return parts, first


def template_messages(req: _Conversation, fold_system: bool = False) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (the OpenAI path's shape).

    The system texts before the first turn become one leading system message; an
    assistant turn's text blocks its content and its ``tool_use`` blocks its ``tool_calls``
    (``arguments`` a dict, as templates render them with ``tojson``); in a user turn each
    ``tool_result`` becomes a ``tool`` message (an error result's text prefixed ``Error:``)
    and each run of text blocks a user message, in their order. A later system message
    stays a system message in place, or with ``fold_system`` is prefixed to the next user
    text (a user message of its own at the end).
    """
    out: list[dict[str, Any]] = []
    parts, first = _system_parts(req)
    if parts:
        out.append({"role": "system", "content": "\n\n".join(parts)})
    folded: list[str] = []
    for m in req.messages[first:]:
        if m.role == "system":
            if fold_system:
                folded.append(m.text)
            else:
                out.append({"role": "system", "content": m.text})
            continue
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
                    text = [*(s + "\n\n" for s in folded)]
                    folded = []
                    out.append({"role": "user", "content": ""})
                text.append(b.text)
                out[-1]["content"] = "".join(text)
        if not m.content:
            out.append({"role": "user", "content": ""})
    if folded:
        out.append({"role": "user", "content": "\n\n".join(folded)})
    return out


def _thinking_kwargs(tokenizer: Any, req: _Conversation) -> dict[str, Any]:
    """``enable_thinking=False`` for ``thinking: disabled`` on a model that can think (mlx-lm
    maps the name to the template's own switch); otherwise the template's default."""
    if req.thinking is not None and req.thinking.type == "disabled" and getattr(
            tokenizer, "has_thinking", False):
        return {"enable_thinking": False}
    return {}


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
    prefill = req.messages[-1].role == "assistant"
    kwargs: dict[str, Any] = {"add_generation_prompt": not prefill, **_thinking_kwargs(
        tokenizer, req), **({"continue_final_message": True} if prefill else {})}
    try:
        return apply_template(tokenizer, template_messages(req), req.active_tools, **kwargs)
    except ProtocolError:
        _parts, first = _system_parts(req)
        if not any(m.role == "system" for m in req.messages[first:]):
            raise
    return apply_template(tokenizer, template_messages(req, fold_system=True),
                          req.active_tools, **kwargs)


def count_tokens_body(prompt_tokens: int) -> dict[str, Any]:
    """The ``/v1/messages/count_tokens`` answer."""
    return {"input_tokens": prompt_tokens}
