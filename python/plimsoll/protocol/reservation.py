"""The output reservation a request is admitted with: ``max_tokens`` clamped, or refused.

Clients ask for more output than a local worker reserves (Claude Code and OpenCode send
``max_tokens: 32000``). By default (``clamp``) such a request is served with the largest
reservation that fits: the worker's limit, or what the context leaves after the prompt,
whichever is smaller; the answer then ends with ``length`` / ``max_tokens`` if the model
reaches it, and the applied figure is reported (the ``x-plimsoll-max-tokens`` header and
the access log). ``refuse`` keeps the strict behaviour: a 400 that says what to lower.
A prompt that alone fills the context is a 400 in both, with the five context figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import ProtocolError, context_overflow

OverLimit = Literal["clamp", "refuse"]
HEADER = "x-plimsoll-max-tokens"


@dataclass(frozen=True)
class Reservation:
    max_tokens: int  # what the request is admitted with
    asked: int  # max_tokens as sent, or the worker's default

    @property
    def clamped(self) -> bool:
        return self.max_tokens < self.asked


def reserve(asked: int | None, *, default: int, limit: int, context: int,
            prompt_tokens: int, native_max: int | None, over_limit: OverLimit = "clamp",
            prompt_param: str = "messages") -> Reservation | ProtocolError:
    """The reservation for a prompt of ``prompt_tokens`` asking ``asked`` (None: the
    default), or the 400 that says what to change."""
    wanted = asked if asked is not None else default
    if prompt_tokens >= context:
        return context_overflow(native_max, context, prompt_tokens, wanted, prompt_param)
    if over_limit == "refuse":
        if wanted > limit:
            return ProtocolError(400, f"max_tokens {wanted} exceeds this worker's output "
                                 f"reservation limit of {limit}: lower max_tokens (or serve "
                                 'with maxTokensOverLimit "clamp")', param="max_tokens",
                                 code="max_tokens_too_large")
        err = context_overflow(native_max, context, prompt_tokens, wanted, prompt_param)
        return err if err is not None else Reservation(wanted, wanted)
    return Reservation(min(wanted, limit, context - prompt_tokens), wanted)
