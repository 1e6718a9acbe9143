"""What a request asks the decoder to produce, as values, and its grammar as text (pure).

A :class:`Spec` is built by the protocol layer from ``response_format`` / ``text.format``
(JSON, with or without a schema) or from a forced ``tool_choice`` (one tool call in the
model's own tool-call markup, its arguments matching the tool's input schema). :func:`lark`
turns it into an llguidance grammar given the markup; nothing here imports llguidance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Spec:
    """``json``: a JSON value matching ``schema`` (``{"type": "object"}`` for json_object);
    ``tool_call``: one call of one of ``tools`` (name, input schema)."""

    kind: Literal["json", "tool_call"]
    schema: dict[str, Any] = field(default_factory=lambda: dict(ANY_OBJECT))
    tools: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class ToolMarkup:
    """How this model writes a call: grammar atoms for the markers around the JSON body
    ``{"name": ..., "arguments": {...}}`` (mlx-lm's ``json_tools`` format: Qwen, Hermes)."""

    start: str
    end: str


class SpecError(ValueError):
    """A schema that is not a JSON Schema (the message says where)."""


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema object, else :class:`SpecError` naming ``where``."""
    if not isinstance(schema, dict):
        raise SpecError(f"{where} must be a JSON Schema object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        path = "/".join(str(p) for p in e.path) or "(root)"
        raise SpecError(f"{where} is not a valid JSON Schema at {path}: {e.message}") from e
    return schema


def json_value(schema: dict[str, Any] | None = None, where: str = "schema") -> Spec:
    """JSON output: any object (json_object) or one matching ``schema`` (json_schema)."""
    return Spec("json", check_schema(schema, where) if schema is not None else dict(ANY_OBJECT))


def tool_call(tools: list[dict[str, Any]]) -> Spec:
    """One forced call among ``tools`` (the function shape: ``{"type": "function",
    "function": {"name", "parameters"}}``, as the chat templates get them)."""
    pairs = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or ANY_OBJECT
        pairs.append((fn["name"], check_schema(params, f"tool {fn['name']!r} parameters")))
    if not pairs:
        raise SpecError("a forced tool choice needs at least one tool")
    return Spec("tool_call", tools=tuple(pairs))


def _call_schema(tools: tuple[tuple[str, dict[str, Any]], ...]) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def lark(spec: Spec, markup: ToolMarkup | None) -> str:
    """The llguidance (Lark) grammar of ``spec``: compact JSON (no free whitespace, so a
    model cannot pad forever), a tool call wrapped in ``markup``'s markers."""
    options = {"whitespace_flexible": False}
    if spec.kind == "json":
        return "start: body\nbody: %json " + json.dumps({**spec.schema, "x-guidance": options})
    if markup is None:
        raise SpecError("this model's tool-call format is not known")
    schema = {**_call_schema(spec.tools), "x-guidance": options}
    return (f'start: {markup.start} "\\n" body "\\n" {markup.end}\n'
            f"body: %json {json.dumps(schema)}")
