"""The engine: an mlx-lm model over sequences whose KV maps onto reserved blocks.

``adapter`` is the one module of plimsoll's worker that imports mlx / mlx_lm (see its
docstring for the design and the physical bound); ``plan`` holds the pure arithmetic
and value types the scheduler can use without a model.
"""

from plimsoll.engine.adapter import Engine, SlotKV, active_memory, process_limits
from plimsoll.engine.plan import (
    AddResult,
    CapacityError,
    Prefix,
    capacity_tokens,
    move_headroom_blocks,
    reusable_tokens,
)

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
