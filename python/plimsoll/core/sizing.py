"""Pool sizing, pure: the shared envelope, move headroom, right-sized pools, release checks.

**Right-sized pools.** Admission's pool fills whatever the envelope leaves (DESIGN.md),
which is right for one worker alone but means a single worker claims the whole
envelope and nothing can ever be co-resident. The proxy therefore caps each worker's
pool at what its admitted concurrency and context can use at once,
``concurrency × blocks_per_seq + move headroom``, and accounts co-resident workers by
that smaller footprint. Admission still bounds the pool from above (it may clamp);
right-sizing only ever shrinks it.

**Verified release.** After a worker's process exits, the in-use figure must come back
down by what the process held before a replacement may start:
``in_use_now ≤ in_use_before_stop − held + tolerance``. ``held`` is what the exit gives
back (anonymous resident memory on Linux, phys_footprint on macOS; see :mod:`plimsoll.probes.held`),
read together with ``in_use_before_stop`` while the process was still alive. The in-use
figure is the binding cgroup's usage, or macOS's wired memory; where it is host-wide
(Linux with no cgroup limit: ``MemTotal − MemAvailable``) every *other* process's
anonymous memory is subtracted from it (``Supervisor.unaccounted``), so another tenant
of a shared host allocating a few hundred MiB does not read as memory the dead worker
kept, while memory it really left behind (shared memory, a driver's buffers) still
shows. The readings are seconds apart, not a baseline taken at load minutes earlier;
with nothing else moving this is the pre-load baseline. The tolerance is ``max(64 MiB, 10 % of
the larger of the admitted footprint and held)``: allocator and page-cache noise on one
side, a worker that kept its weights or pool alive (far larger) on the other. A worker
holding less than the floor passes trivially: below 64 MiB the host's own noise
dominates any honest measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.units import MIB, fmt_bytes

RELEASE_TOLERANCE_FLOOR = 64 * MIB
RELEASE_TOLERANCE_FRACTION = 0.10


def envelope_bytes(ceiling: int, total_ram: int, budget: int, trip_offset: float,
                   u_margin: float) -> int:
    """What all co-resident workers may hold together: admission's envelope, resident = 0.

    ``min(floor((u − margin) × ceiling), budget)`` with ``u = ceiling / total − offset −
    margin`` (the same figure :func:`plimsoll.core.admission.admit` fills its pool up to).
    """
    ceiling = min(ceiling, total_ram)
    u = max(ceiling / total_ram - trip_offset - u_margin, 0.0)
    return min(math.floor(max(u - u_margin, 0.0) * ceiling), budget)


def move_headroom_blocks(prefix_tokens: int, kv_layers: int, block_tokens: int) -> int:
    """Blocks held twice while a prefix of ``prefix_tokens`` moves: one array of it.

    A move copies one layer's K (then its V) at a time and frees the source at
    once, so the excess is one array: ``1 / (2 × kv_layers)`` of the prefix. The one
    definition: the engine (:mod:`plimsoll.engine.plan`) and the proxy's right-sizing share it.
    """
    if kv_layers <= 0 or prefix_tokens <= 0:
        return 0
    tokens = math.ceil(prefix_tokens / block_tokens) * block_tokens
    return math.ceil(tokens / (2 * kv_layers * block_tokens))


def right_size(decision: AdmissionDecision, kv_layers: int) -> AdmissionDecision:
    """The decision with its pool capped at what its sequences can use at once."""
    if not decision.admitted:
        return decision
    need = (decision.concurrency * decision.blocks_per_seq
            + move_headroom_blocks(decision.context, kv_layers, decision.block_tokens))
    pool = min(decision.pool_blocks, need)
    if pool == decision.pool_blocks:
        return decision
    pool_bytes = pool * decision.block_bytes
    footprint = decision.weights_bytes + decision.transient_reserve_bytes + pool_bytes
    return decision.model_copy(update={
        "pool_blocks": pool, "pool_bytes": pool_bytes, "footprint_bytes": footprint,
        "band_low": (footprint + decision.resident_bytes) / decision.ceiling_bytes,
        "reasons": [*decision.reasons,
                    f"pool right-sized to {pool} blocks ({fmt_bytes(pool_bytes)}): "
                    f"{decision.concurrency} × {decision.blocks_per_seq} blocks/seq + move "
                    f"headroom, instead of the {decision.pool_blocks} the envelope leaves"],
    })


def release_tolerance(admitted_bytes: int, held_bytes: int) -> int:
    return max(RELEASE_TOLERANCE_FLOOR,
               math.floor(RELEASE_TOLERANCE_FRACTION * max(admitted_bytes, held_bytes)))


@dataclass(frozen=True)
class ReleaseCheck:
    """What must be true of the in-use figure before a replacement may load."""

    model: str
    pid: int
    before_bytes: int  # host in-use while the worker was alive, just before it was stopped
    held_bytes: int  # what the process held that its exit gives back (see .held)
    tolerance_bytes: int

    @property
    def target_bytes(self) -> int:
        return self.before_bytes - self.held_bytes + self.tolerance_bytes

    def released(self, in_use_bytes: int) -> bool:
        return in_use_bytes <= self.target_bytes

    def figures(self, in_use_bytes: int) -> dict[str, int]:
        return {"pid": self.pid, "in_use_bytes": in_use_bytes,
                "before_stop_bytes": self.before_bytes, "held_bytes": self.held_bytes,
                "tolerance_bytes": self.tolerance_bytes, "target_bytes": self.target_bytes}

    def describe(self, in_use_bytes: int) -> str:
        return (f"memory of {self.model!r} (pid {self.pid}) not verified released: in use "
                f"{fmt_bytes(in_use_bytes)}, must be ≤ {fmt_bytes(self.target_bytes)} "
                f"(before stop {fmt_bytes(self.before_bytes)} − held "
                f"{fmt_bytes(self.held_bytes)} + tolerance {fmt_bytes(self.tolerance_bytes)})")
