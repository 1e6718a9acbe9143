"""The engine's arithmetic and value types: pure, no mlx (the engine core is the effect edge).

Everything the scheduler may want to ask before it commits blocks lives here, so it
can be answered (and tested) without a model: how many tokens of KV a sequence
holds, how much a prefix move transiently holds twice, how much of a prompt a
retained prefix covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plimsoll.core.sizing import move_headroom_blocks  # noqa: F401  (one definition, in core)
from plimsoll.engine.pool import reusable_tokens  # noqa: F401  (one definition, shared with the pool)


class CapacityError(RuntimeError):
    """A write would pass a sequence's reserved capacity (a caller bug: stop at max_tokens)."""


@dataclass
class Prefix:
    """A finished sequence's KV kept for reuse: ``tokens`` are exactly the tokens it covers."""

    handle: int
    tokens: tuple[int, ...]
    caches: list = field(repr=False)


@dataclass
class AddResult:
    """What ``Engine.add`` did: the first sampled token and how the prompt was covered."""

    first_token: int
    reused_tokens: int
    prefilled_tokens: int
    capacity_tokens: int


def capacity_tokens(prompt_tokens: int, max_tokens: int, block_tokens: int) -> int:
    """Tokens of KV a sequence holds: its reservation rounded up to whole blocks."""
    return math.ceil((prompt_tokens + max_tokens) / block_tokens) * block_tokens
