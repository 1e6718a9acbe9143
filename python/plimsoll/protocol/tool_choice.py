"""``tool_choice`` in each API's shape, normalised once.

OpenAI chat (``"required"``, ``{"type": "function", "function": {"name": ...}}``), the
Responses API (``{"type": "function", "name": ...}``) and Anthropic (``{"type": "any"}``,
``{"type": "tool", "name": ...}``) say the same four things: let the model choose
(``auto``), offer no tools (``none``), force one call of any tool (``required``), force one
call of a named tool (``function``). Each shape is read into one :class:`ToolChoice`;
the checks against the request's tools and the tools left to render and parse are the
functions below, for every route. A forced choice is enforced by constrained decoding
(:mod:`.structured`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")
_ANTHROPIC_MODES = {"auto": "auto", "none": "none", "any": "required", "tool": "function"}


class ToolChoice(BaseModel):
    """A mode, and the tool's name for a named choice."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        """True when the answer must be one tool call (``required`` or a named tool)."""
        return self.mode in ("required", "function")

    def responses_shape(self) -> str | dict[str, str]:
        """As the Responses API echoes it back."""
        return {"type": "function", "name": self.name} if self.mode == "function" \
            else self.mode


def from_openai(value: Any) -> Any:
    """A chat ``tool_choice`` (before validation) as :class:`ToolChoice` fields; a
    :class:`ToolChoice` passes as it is (the Responses route hands its own over)."""
    if isinstance(value, ToolChoice):
        return value
    if value in ("auto", "none", "required"):
        return {"mode": value}
    function = value.get("function") if isinstance(value, dict) else None
    if (isinstance(value, dict) and value.get("type") == "function" and set(value) <=
            {"type", "function"} and isinstance(function, dict) and set(function) == {"name"}
            and isinstance(function["name"], str)):
        return {"mode": "function", "name": function["name"]}
    raise ValueError('tool_choice must be "auto", "none", "required" or '
                     '{"type": "function", "function": {"name": ...}}')


def from_responses(value: Any) -> Any:
    """A Responses ``tool_choice`` (before validation) as :class:`ToolChoice` fields."""
    if value in ("auto", "none", "required"):
        return {"mode": value}
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(
            value.get("name"), str) and set(value) <= {"type", "name"}:
        return {"mode": "function", "name": value["name"]}
    raise ValueError('tool_choice must be "auto", "none", "required" or '
                     '{"type": "function", "name": ...}')


def from_anthropic(kind: str, name: str | None) -> ToolChoice:
    """Anthropic's ``{"type": auto | any | tool | none, "name"}`` (already validated)."""
    return ToolChoice(mode=_ANTHROPIC_MODES[kind], name=name)


def check(choice: ToolChoice, names: set[str], shown: str, tool_word: str = "function"
          ) -> None:
    """Raise the ValueError for a forced choice with no tools, or a named tool that is not
    among ``names``; ``shown`` is how the request spelled the choice."""
    if choice.forced and not names:
        raise ValueError(f"{shown} needs tools; send tools or drop tool_choice")
    if choice.mode == "function" and choice.name not in names:
        raise ValueError(f"{tool_word} {choice.name!r} is not in tools; name one of "
                         f"{sorted(names)}")


def chosen(tools: list[T] | None, choice: ToolChoice | None, name_of: Callable[[T], str]
           ) -> list[T] | None:
    """The tools to render and parse: none for no tools or ``none``, only the named one for a
    named choice (the template then offers only it), else all of them."""
    if not tools or (choice is not None and choice.mode == "none"):
        return None
    if choice is not None and choice.mode == "function":
        return [t for t in tools if name_of(t) == choice.name]
    return list(tools)
