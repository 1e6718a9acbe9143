"""Requests to prompt token ids, through the model's own chat template.

The tokenizer is a parameter (mlx-lm's ``TokenizerWrapper``, duck-typed), so this module
imports neither mlx nor transformers. OpenAI messages are normalised into what Hugging
Face templates expect: content parts joined into one string, ``developer`` as ``system``,
and tool-call ``arguments`` parsed from their JSON string into a dict (templates render
them with ``tojson``; a string would be quoted twice).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ProtocolError
from .requests import ChatCompletionRequest, CompletionRequest


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text  # a truncated call echoed back: let the template show it as it was
    return value if isinstance(value, dict) else text


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as plain dicts for ``apply_chat_template``."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": m.text}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        out.append(msg)
    return out


def render_chat(tokenizer: Any, req: ChatCompletionRequest, **template_kwargs: Any
                ) -> list[int]:
    """Prompt token ids for a chat request (generation prompt appended; ``template_kwargs``
    go to the template, e.g. ``enable_thinking``).

    Tools (unless ``tool_choice`` is ``"none"``) are passed to the template, which lists
    their schemas in the prompt. Raises :class:`ProtocolError` (400) when the model has
    no chat template or the template refuses the conversation (templates raise on, e.g.,
    roles out of order): the message says which.
    """
    if not getattr(tokenizer, "has_chat_template", True):
        raise ProtocolError(400, "This model has no chat template; send a plain prompt to "
                            "/v1/completions instead.", param="messages", code="no_chat_template")
    return apply_template(tokenizer, template_messages(req), req.active_tools,
                          add_generation_prompt=True, **template_kwargs)


def apply_template(tokenizer: Any, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, **kwargs: Any) -> list[int]:
    """The model's chat template over normalised messages, as token ids; a failure is a 400.

    A tokenizer with ``encode_prompt`` (the worker's, :mod:`plimsoll.worker.prompt_pieces`)
    renders the text and tokenizes it itself, as mlx-lm does for its own templates
    (``encode(text, add_special_tokens=False)``, what ``tokenize=True`` does too)."""
    encode = getattr(tokenizer, "encode_prompt", None)
    try:
        if encode is None:
            ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)
        else:
            ids = encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       **kwargs))
    except Exception as e:  # template code is the model's, not ours: any failure is a 400
        raise ProtocolError(400, f"The model's chat template could not render these messages "
                            f"({type(e).__name__}: {e}). Check the roles and their order.",
                            param="messages", code="template_error") from e
    if isinstance(ids, dict):  # a BatchEncoding from tokenizers that ignore return_dict
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def render_completion(tokenizer: Any, req: CompletionRequest) -> list[int]:
    """Prompt token ids for a completion request: the text encoded, or the ids checked.

    Text is encoded with the tokenizer's special tokens (a BOS where the model has one),
    as ``mlx_lm.server`` does. Raises :class:`ProtocolError` (400) for an empty prompt or
    a token id outside the vocabulary.
    """
    if isinstance(req.prompt, str):
        try:
            ids = [int(t) for t in tokenizer.encode(req.prompt)]
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take: the client's
            raise ProtocolError(400, f"The prompt could not be tokenized ({type(e).__name__}: "
                                f"{e}); send plain Unicode text.", param="prompt",
                                code="invalid_prompt") from e
    else:
        ids = list(req.prompt)
        vocab = len(tokenizer)
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ProtocolError(400, f"Token id {bad[0]} is outside this model's vocabulary of "
                                f"{vocab} tokens; send ids below {vocab}.", param="prompt")
    if not ids:
        raise ProtocolError(400, "The prompt is empty; send at least one token of text.",
                            param="prompt")
    return ids
