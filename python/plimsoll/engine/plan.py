"""The engine's arithmetic and value types: pure, no mlx (the adapter is the effect edge).

Everything the scheduler may want to ask before it commits blocks lives here, so it
can be answered (and tested) without a model: how many tokens of KV a sequence
holds, how much a prefix move transiently holds twice, how much of a prompt a
retained prefix covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


def move_headroom_blocks(prefix_tokens: int, kv_layers: int, block_tokens: int) -> int:
    """Blocks held twice while a prefix of ``prefix_tokens`` moves: one array of it.

    A move copies one layer's K (then its V) at a time and frees the source at
    once, so the excess is one array: ``1 / (2 × kv_layers)`` of the prefix.
    """
    if kv_layers <= 0 or prefix_tokens <= 0:
        return 0
    tokens = math.ceil(prefix_tokens / block_tokens) * block_tokens
    return math.ceil(tokens / (2 * kv_layers * block_tokens))
