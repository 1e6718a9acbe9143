"""Which served model a request's body names (pure): the proxy routes on it, nothing more.

The body is decoded as the worker decodes it (UTF-8, one JSON object, no NaN, bounded
depth), so a body the proxy passes on is one the worker can parse, and one it refuses gets
the same 400; the rest of the request is the worker's to check. A name the policy does not
serve is looked up in its aliases (:func:`plimsoll.core.aliases.resolve`).
"""

from __future__ import annotations

import json

from plimsoll.core.aliases import resolve
from plimsoll.core.policy import Policy

from .. import protocol
from ..protocol import ProtocolError


def route_model(raw: bytes, known: list[str], policy: Policy | None = None
                ) -> tuple[str, bytes] | ProtocolError:
    """The served model a body names (the only one when it names none; an alias of the
    policy), and the body to relay (its ``model`` rewritten to the served name when it was
    an alias), or why not."""
    data = protocol.decode_json_body(raw)
    if isinstance(data, ProtocolError):
        return data
    model = data.get("model")
    if model is None and len(known) == 1:
        return known[0], raw
    if model is not None and not isinstance(model, str):
        return ProtocolError(400, f"Invalid 'model': send the model's name as a string, got "
                             f"{json.dumps(model)[:60]}; known models: "
                             f"{', '.join(known) or '(none)'}", param="model",
                             code="invalid_request")
    if model in known:
        return model, raw
    served = resolve(model, policy) if policy is not None and model is not None else None
    if served is None or served not in known:
        return ProtocolError(404, f"the model {model!r} is not served here; known models: "
                             f"{', '.join(known) or '(none)'} (or an alias of the policy's "
                             "'aliases')", param="model", code="model_not_found")
    return served, json.dumps({**data, "model": served}, ensure_ascii=False).encode()
