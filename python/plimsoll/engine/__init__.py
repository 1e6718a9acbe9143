"""The engine: an mlx-lm model over block-paged KV, driven one :class:`Step` at a time.

Owns: :mod:`.work` (the pure contract between scheduler and engine: Sampling, TokenConstraint,
Work, Step; the transients a step holds are counted in :mod:`plimsoll.core.transients`),
:mod:`.core` (the Engine: steps, pipelining, recurrent state), :mod:`.forward` (a step as one
forward: its groups, the model call, sampling), :mod:`.verify` (a speculating sequence's drafts
checked: greedy, or by rejection sampling), :mod:`.chain` (prompt lookup on the device: the
next verifying step drafted from the one in flight), :mod:`.mtp_head` (a checkpoint's MTP layer
drafting from the target's hidden states), :mod:`.compiled` (decode-only steps compiled per
shape bucket), :mod:`.groups` (a step's groups and their views), :mod:`.mixers` (the model's
token-mixing modules regrouped inside that forward), :mod:`.linear` (the model's linear layers
multiplying by a transposed view of their weight kept across steps), :mod:`.fused` (sibling
projections of one input as one product for a single row), :mod:`.sampled_rows`
(logits only at the rows that sample), :mod:`.kernels` (custom attention kernels, each checked
on its device before use), :mod:`.decode_write` (decode steps storing their K/V by the decode
kernel's launch, checked), :mod:`.pool_cuda` (a pool's in-place writes and its gathers as CUDA
kernels), :mod:`.backend` (the one backend probe), :mod:`.paged` (the physical pools, one kind
per cache layer), :mod:`.attention` (the cache views mlx-lm's models see and the routed
attention), :mod:`.latent` (MLA's latent + rope-key blocks and view), :mod:`.composite` (mlx-lm
``CacheList`` layers, one kind per member), :mod:`.window` (sliding-window layers: a ring of
the window per sequence), :mod:`.sampling`, :mod:`.state` (recurrent state of hybrid models),
:mod:`.limits` (process-wide MLX limits), :mod:`.warmup` (a GPU backend's first-use compilation
paid at load), :mod:`.threads` (stopping a thread that ran MLX) and :mod:`.drive` (an
in-process driver for tests and benchmarks). Which block holds what is the scheduler's block
pool (:mod:`plimsoll.worker.pool`); the engine writes where a table says.

May import: :mod:`plimsoll.core`, mlx, mlx_lm (in core, forward, compiled, groups, mixers,
sampled_rows, linear, kernels, decode_write, pool_cuda, backend, paged, attention,
latent, composite, window, sampling, verify, chain, mtp_head, state, limits, warmup, threads
and drive only).

The names below are loaded on first use (PEP 562), so ``plimsoll.engine.work`` imports without
mlx; ``from plimsoll.engine import Engine`` loads the mlx edge.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plimsoll.engine.work import Sampling, Step, TokenConstraint, Work

_EXPORTS = {
    "Engine": "core", "Pending": "pending",
    "active_memory": "limits", "clear_buffer_cache": "limits", "process_limits": "limits",
    "plan_warmer": "warmup", "warm_up": "warmup",
}

__all__ = [
    "Engine",
    "Pending",
    "Sampling",
    "Step",
    "TokenConstraint",
    "Work",
    "active_memory",
    "clear_buffer_cache",
    "plan_warmer",
    "process_limits",
    "warm_up",
]

if TYPE_CHECKING:
    from plimsoll.engine.core import Engine
    from plimsoll.engine.limits import active_memory, clear_buffer_cache, process_limits
    from plimsoll.engine.pending import Pending
    from plimsoll.engine.warmup import plan_warmer, warm_up


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
