"""The engine: an mlx-lm model over block-paged KV, driven one :class:`Step` at a time.

``work`` holds the pure contract (Sampling, TokenConstraint, Work, Step and the
transient arithmetic admission counts); it never imports mlx. Everything else here
is the worker's mlx edge and is imported lazily (PEP 562), so
``import plimsoll.engine.work`` or ``import plimsoll.engine`` stays mlx-free.
"""

from __future__ import annotations

import importlib
from typing import Any

from plimsoll.engine.work import Sampling, Step, TokenConstraint, Work

_LAZY = {
    "Engine": "plimsoll.engine.adapter",
    "SlotKV": "plimsoll.engine.adapter",
    "active_memory": "plimsoll.engine.adapter",
    "process_limits": "plimsoll.engine.adapter",
    "AddResult": "plimsoll.engine.plan",
    "CapacityError": "plimsoll.engine.plan",
    "Prefix": "plimsoll.engine.plan",
    "capacity_tokens": "plimsoll.engine.plan",
    "move_headroom_blocks": "plimsoll.engine.plan",
    "reusable_tokens": "plimsoll.engine.plan",
}

__all__ = ["Sampling", "Step", "TokenConstraint", "Work", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'plimsoll.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
