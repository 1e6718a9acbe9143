"""Request bytes to a validated request, or a 400 that says what to change.

Every way a body can be wrong ends here as a :class:`ProtocolError`: too large (413),
not UTF-8, not JSON, not an object, or not a valid request (pydantic's first error,
rewritten to name the field as ``messages[0].content`` and say what to send instead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from .errors import ProtocolError, check_body_size
from .requests import ChatCompletionRequest, CompletionRequest, Request

_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "chat": ChatCompletionRequest, "completion": CompletionRequest}


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def _describe(error: dict[str, Any], model: type[BaseModel]) -> tuple[str, str | None]:
    param = _param(error["loc"]) or None
    kind, msg = error["type"], error["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields)) if len(error["loc"]) == 1 else None
        hint = f" This endpoint accepts: {known}." if known else ""
        return f"Unknown field '{param}': remove it.{hint}", param
    if kind == "missing":
        return f"Missing required field '{param}'.", param
    if kind == "value_error":
        return (f"Invalid '{param}': {msg}." if param else f"Invalid request: {msg}."), param
    got = json.dumps(error.get("input"), ensure_ascii=False, default=str)
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"Invalid '{param}': {msg}, got {got}.", param


def from_validation(exc: ValidationError | Untagged, model: type[BaseModel]) -> ProtocolError:
    """pydantic's errors as the 400 that names the first one's field and what to send."""
    errors = exc.errors(include_url=False)
    message, param = _describe(errors[0], model)
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} after this.)"
    return ProtocolError(400, message, param=param, code="invalid_request")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; send a finite number")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A ``\\uD800``–``\\uDFFF`` escape: only then can a parsed string hold a lone surrogate."""


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) holding a lone UTF-16 surrogate, else None.

    JSON lets ``"\\ud800"`` through, but such a string is not text: it cannot be encoded
    as UTF-8, so a tokenizer raises deep inside the engine. Walked with a stack, not
    recursion: the decoder has already bounded the depth, this must not add a limit.
    """
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
    return None


def decode_json_body(raw: bytes) -> dict[str, Any] | ProtocolError:
    """Bytes to a JSON object, or the 400/413 that says what is wrong with them."""
    if too_big := check_body_size(len(raw)):
        return too_big
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        return ProtocolError(400, f"The request body is not valid UTF-8 (bad byte at offset "
                             f"{e.start}); encode the JSON body as UTF-8.", code="invalid_json")
    if not text.strip():
        return ProtocolError(400, "The request body is empty; send a JSON object.",
                             code="invalid_json")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        return ProtocolError(400, f"The request body is not valid JSON: {e.msg} at line "
                             f"{e.lineno}, column {e.colno}.", code="invalid_json")
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        if "integer string conversion" in reason:  # Python's int-size guard, not the client's
            reason = "a number has more digits than any field accepts; send a smaller number"
        return ProtocolError(400, f"The request body is not valid JSON: {reason}.",
                             code="invalid_json")
    if not isinstance(obj, dict):
        return ProtocolError(400, f"The request body must be a JSON object, not a JSON "
                             f"{type(obj).__name__}.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text) and (bad := _lone_surrogate(obj)) is not None:
        shown = json.dumps(bad[:40])
        return ProtocolError(400, f"The request body holds a string with an unpaired UTF-16 "
                             f"surrogate escape ({shown}), which is not text; send valid "
                             "Unicode (a \\uD8xx escape must be followed by a \\uDCxx one).",
                             code="invalid_json")
    return obj


def parse_request(kind: Literal["chat", "completion"], raw: bytes) -> Request | ProtocolError:
    """Parse a request body for ``/v1/chat/completions`` (``"chat"``) or ``/v1/completions``.

    Returns the validated request, or a :class:`ProtocolError` (400, or 413 over
    :data:`~plimsoll.protocol.errors.MAX_BODY_BYTES`) whose message names the field and what
    to send instead.
    """
    return validate_body(_MODELS[kind], raw)


class Untagged:
    """A ValidationError whose locations skip the union tag pydantic inserts after a list
    index (``input[0].content``, not ``input[0].message.content``); ``tags`` names them."""

    def __init__(self, exc: ValidationError, tags: frozenset[str]) -> None:
        self._exc, self._tags = exc, tags

    def errors(self, **kwargs: Any) -> list[dict[str, Any]]:
        return [{**err, "loc": tuple(part for i, part in enumerate(err["loc"]) if not (
            part in self._tags and i and isinstance(err["loc"][i - 1], int)))}
                for err in self._exc.errors(**kwargs)]


def validate_body(model: type[BaseModel], raw: bytes,
                  errors: Callable[[ValidationError], Any] | None = None) -> Any:
    """Decode ``raw`` and validate it as ``model``: the model, or the :class:`ProtocolError`
    that names the field; ``errors`` may rewrite pydantic's error locations first."""
    obj = decode_json_body(raw)
    if isinstance(obj, ProtocolError):
        return obj
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        return from_validation(errors(e) if errors else e, model)
