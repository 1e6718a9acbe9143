"""What is wrong with a policy, said so the user can fix it: the error and its messages.

Two checks report here, with one message format (a line per field): the shape check
against the committed JSON Schema and the models' cross-field invariants
(:mod:`plimsoll.core.policy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError


class PolicyError(ValueError):
    """A policy that can't be used; the message names the field and what to change."""


def validation_message(err: ValidationError, source: str) -> str:
    """Pydantic's errors as one message, a line per field, each saying what to change."""
    lines = [f"{source}: invalid policy ({err.error_count()} problem(s)):"]
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (remove it, or check its spelling against `plimsoll policy schema`)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def schema_errors(schema: Mapping[str, Any], data: Mapping[str, Any], source: str) -> str | None:
    """Shape errors of ``data`` against ``schema`` (the committed one, which Nix validates
    against too) as one message, or None when it has none."""
    import jsonschema  # imported here: only loading a policy needs it, not CLI start-up

    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return None
    lines = [f"{source}: invalid policy ({len(errors)} problem(s)):"]
    for e in errors:
        loc = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        lines.append(f"  - {loc}: {e.message}")
    return "\n".join(lines)
