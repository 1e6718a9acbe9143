"""Requests to constrained-decoding specs: which output a request forces, if any.

OpenAI chat: ``tool_choice`` ``"required"`` / a named function (one call of those tools),
else ``response_format`` ``json_object`` / ``json_schema``. Anthropic: ``tool_choice``
``any`` / ``tool``. Responses: ``tool_choice`` likewise, else ``text.format``. A schema that
is not a JSON Schema is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from plimsoll import constrain

from .errors import ProtocolError


def _spec(build: Any, param: str) -> constrain.Spec:
    try:
        return build()
    except constrain.SpecError as e:
        raise ProtocolError(400, f"Invalid '{param}': {e}.", param=param,
                            code="invalid_schema") from e


def forced_tools(tools: list[dict[str, Any]] | None, param: str = "tool_choice") -> constrain.Spec:
    """One call among ``tools`` (function shape, already narrowed to a named choice)."""
    return _spec(lambda: constrain.tool_call(tools or []), param)


def json_format(kind: str, schema: dict[str, Any] | None, param: str) -> constrain.Spec | None:
    """``json_object`` / ``json_schema`` to a spec; ``text`` (or anything else) to None."""
    if kind == "json_object":
        return constrain.json_value()
    if kind == "json_schema":
        return _spec(lambda: constrain.json_value(schema or {"type": "object"}, param), param)
    return None


def chat_spec(req: Any) -> constrain.Spec | None:
    """The spec of a :class:`~.requests.ChatCompletionRequest`, or None (free text)."""
    if req.tool_choice is not None and req.tool_choice.forced:
        return forced_tools(req.active_tools)
    fmt = req.response_format
    if fmt is None:
        return None
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    return json_format(fmt.type, schema, "response_format.json_schema.schema")


def anthropic_spec(req: Any) -> constrain.Spec | None:
    """The spec of an Anthropic messages request: ``tool_choice`` ``any`` / ``tool``."""
    if req.tool_choice is not None and req.tool_choice.normal.forced:
        return forced_tools(req.active_tools)
    return None
