"""The engine: an mlx-lm model over sequences whose KV maps onto reserved blocks.

Owns: :mod:`.adapter` (the one module of plimsoll's worker that imports mlx / mlx_lm; see its
docstring for the design and the physical bound), :mod:`.plan` (the pure arithmetic and value
types the scheduler can use without a model) and :mod:`.pool` (the KV pool in blocks: live
reservations plus retained prefixes, pure).

May import: :mod:`plimsoll.core`, mlx, mlx_lm (in :mod:`.adapter` only).

The names below are loaded on first use (PEP 562), so ``plimsoll.engine.plan`` and
``plimsoll.engine.pool`` import without mlx; ``from plimsoll.engine import Engine`` loads
the adapter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "adapter", "SlotKV": "adapter", "active_memory": "adapter",
    "process_limits": "adapter",
    "AddResult": "plan", "CapacityError": "plan", "Prefix": "plan", "capacity_tokens": "plan",
    "move_headroom_blocks": "plan", "reusable_tokens": "plan",
}

__all__ = [
    "AddResult",
    "CapacityError",
    "Engine",
    "Prefix",
    "SlotKV",
    "active_memory",
    "capacity_tokens",
    "move_headroom_blocks",
    "process_limits",
    "reusable_tokens",
]

if TYPE_CHECKING:
    from plimsoll.engine.adapter import Engine, SlotKV, active_memory, process_limits
    from plimsoll.engine.plan import (
        AddResult,
        CapacityError,
        Prefix,
        capacity_tokens,
        move_headroom_blocks,
        reusable_tokens,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
