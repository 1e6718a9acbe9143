"""Every pool figure, in one place, pure: blocks per sequence, fixed blocks, the right-sized
pool, the worker's start-up check, the cache and MLX buffer caps, the shared envelope and the
release check. Admission, launch, the worker, the proxy and the cluster plan all call these,
so no two of them can disagree about what a pool holds.

**No headroom.** With a block-paged pool (:mod:`plimsoll.worker.pool`) nothing moves, so
a sequence of ``context`` tokens needs ``ceil(context / block_tokens)`` table blocks plus
the fixed blocks of its recurrent state (or window), and ``concurrency`` of them fit when
``concurrency × blocks_per_seq ≤ pool``. Units: bytes and tokens.

**Right-sized pools.** Admission's pool fills whatever the envelope leaves (docs/DESIGN.md,
"Admission"), which is right for one worker alone but means a single worker claims the
whole envelope and nothing can ever be co-resident. The proxy therefore caps each worker's
pool at what its admitted concurrency and context can use at once,
``concurrency × blocks_per_seq`` (:func:`pool_for`, the figure the worker checks at start),
and accounts co-resident workers by that smaller footprint. Admission still bounds the pool
from above (it may clamp); right-sizing only ever shrinks it.

**Verified release.** After a worker's process exits, the in-use figure must come back
down by what the process held before a replacement may start:
``in_use_now ≤ in_use_before_stop − held + tolerance``. ``held`` is what the exit gives
back (anonymous resident memory on Linux, phys_footprint on macOS; see :mod:`plimsoll.probes.held`),
read together with ``in_use_before_stop`` while the process was still alive. The in-use
figure is the binding cgroup's usage, or macOS's wired memory; where it is host-wide
(Linux with no cgroup limit) it is the memory the kernel holds with content
(``probes.held.content_bytes``: anonymous, shared, unreclaimable kernel memory; not
``MemTotal − MemAvailable``, which a VM's free page reporting holds up for seconds after
an exit) and every *other* process's anonymous memory is subtracted from it
(``Supervisor.unaccounted``), so another tenant
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
from typing import TypeVar

from pydantic import BaseModel

from plimsoll.core.units import MIB, fmt_bytes

#: An ``AdmissionDecision`` (admission imports this module, so it is not imported back).
Decision = TypeVar("Decision", bound=BaseModel)

RELEASE_TOLERANCE_FLOOR = 64 * MIB
RELEASE_TOLERANCE_FRACTION = 0.10


def fixed_blocks(per_sequence_fixed_bytes: int, block_bytes: int) -> int:
    """Blocks a sequence holds whatever its length (recurrent state, windows), rounded up."""
    return math.ceil(per_sequence_fixed_bytes / block_bytes) if per_sequence_fixed_bytes else 0


def blocks_for(tokens: int, block_tokens: int, fixed: int = 0) -> int:
    """Blocks one sequence of ``tokens`` total context reserves (docs/DESIGN.md, "The
    arithmetic": ceil(context / block)), its fixed blocks included."""
    return math.ceil(tokens / block_tokens) + fixed


def pool_for(concurrency: int, context: int, block_tokens: int, fixed: int = 0) -> int:
    """The right-sized pool: exactly ``concurrency`` full-context sequences at once."""
    return concurrency * blocks_for(context, block_tokens, fixed)


def sequences_held(pool_blocks: int, context: int, block_tokens: int, fixed: int = 0) -> int:
    """How many full-context sequences a pool of ``pool_blocks`` holds at once."""
    return pool_blocks // blocks_for(context, block_tokens, fixed)


def context_for(pool_blocks: int, block_tokens: int, fixed: int = 0) -> int:
    """The longest context one sequence may have in this pool (the clamp's target)."""
    return max(0, pool_blocks - fixed) * block_tokens


def pool_problem(pool_blocks: int, context: int, block_tokens: int, fixed: int,
                 concurrency: int = 1) -> str | None:
    """The worker's start-up check (and admission's): why a pool cannot hold
    ``concurrency`` sequences of ``context`` tokens, or ``None`` when it can."""
    per_seq = blocks_for(context, block_tokens, fixed)
    if concurrency * per_seq <= pool_blocks:
        return None
    fixed_note = f" ({fixed} of them fixed state)" if fixed else ""
    return (f"--max-cache-blocks {pool_blocks} cannot hold {concurrency} sequence(s) of "
            f"--context {context}: each needs {per_seq} blocks of {block_tokens} tokens"
            f"{fixed_note}; raise the pool to {concurrency * per_seq} blocks, or lower the "
            f"context to {context_for(pool_blocks // concurrency, block_tokens, fixed)}"
            + (" or --max-num-seqs" if concurrency > 1 else ""))


def block_bytes(kv_bytes_per_token: int, block_tokens: int) -> int:
    return kv_bytes_per_token * block_tokens


def cache_cap_blocks(cache_memory_bytes: int, block_bytes_: int, pool_blocks: int) -> int:
    """Cached (prefix) blocks allowed under ``--cache-memory-mb``, inside the pool."""
    return min(cache_memory_bytes // block_bytes_, pool_blocks)


#: The most MLX's buffer cache may keep, MiB. Freed buffers it keeps are held memory (on
#: an H200 the device's used memory follows it), and a paced step reuses a few layers'
#: buffers: measured there at a 256 MiB cap, an agentic session's prefill was no slower than
#: at 2.4 GiB (bench/results/agentic-memory-h200-2026-12-03.md).
MLX_CACHE_MOST_MB = 256


def mlx_cache_mb(transient_reserve_bytes: int) -> int:
    """MLX's buffer-cache cap: half the transient reserve, at most
    :data:`MLX_CACHE_MOST_MB`, at least 1 MiB."""
    return max(1, min(MLX_CACHE_MOST_MB, transient_reserve_bytes // 2 // MIB))


def compute_transient_bytes(transient_reserve_bytes: int) -> int:
    """What the reserve leaves for compute transients once MLX's buffer cache has its cap."""
    return max(0, transient_reserve_bytes - mlx_cache_mb(transient_reserve_bytes) * MIB)


def reserve_for_compute(compute_bytes: int) -> int:
    """The smallest-enough transient reserve whose compute share
    (:func:`compute_transient_bytes`: the reserve less MLX's buffer-cache cap) holds
    ``compute_bytes``; admission counts a transient the engine must hold through it."""
    if compute_bytes <= 0:
        return 0
    return max(2 * compute_bytes, compute_bytes + MIB)


def largest_fitting(low: int, high: int, fits, step: int = 1) -> int | None:
    """The largest multiple of ``step`` in ``[low, high]`` for which the monotone ``fits``
    holds (true below some point, false above), or ``None`` when not even ``low`` fits.
    The one bisection admission's context searches share."""
    lo, hi = -(-low // step), high // step
    if lo > hi or not fits(lo * step):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


#: The output reservation of a request that names none (``--default-max-tokens``, a policy
#: entry's ``defaultMaxTokens``), at most the largest the worker allows.
DEFAULT_OUTPUT_TOKENS = 512
#: The cap on the default output limit ``plimsoll launch`` / ``admit`` give a model whose
#: policy entry and flags name none: a modest reservation for a general-purpose worker.
LAUNCH_OUTPUT_CAP = 1024
#: The cap on the output limit ``plimsoll serve`` sizes for coding clients (Claude Code,
#: OpenCode and Codex ask for 32000 tokens; a larger request is clamped to the limit).
CLIENT_OUTPUT_CAP = 32768


def output_limit(context: int, cap: int | None = None) -> int:
    """The largest output reservation when none is given: a quarter of the context, at most
    ``cap`` (``None``: no cap, as ``plimsoll worker`` started by hand), at least one token,
    always below the context. The one output-length rule: the worker, launch's admission
    and ``plimsoll serve``'s sizing all call it, each with its cap."""
    quarter = context // 4 if cap is None else min(cap, context // 4)
    return max(1, min(quarter, context - 1))


def default_output(max_tokens: int, given: int | None = None) -> int:
    """The output reservation of a request that names none: ``given`` (else
    :data:`DEFAULT_OUTPUT_TOKENS`), at most ``max_tokens``."""
    return min(given or DEFAULT_OUTPUT_TOKENS, max_tokens)


def default_max_batch(max_num_seqs: int) -> int:
    """Sequences decoded together by default: the runtime bound, separate from the
    load-time worst-case ``max_num_seqs`` (short requests fit many more at once)."""
    return max(64, max_num_seqs)


def envelope_bytes(ceiling: int, total_ram: int, budget: int, trip_offset: float,
                   u_margin: float) -> int:
    """What all co-resident workers may hold together: admission's envelope, resident = 0.

    ``min(floor((u − margin) × ceiling), budget)`` with ``u = ceiling / total − offset −
    margin`` (the same figure :func:`plimsoll.core.admission.admit` fills its pool up to).
    """
    ceiling = min(ceiling, total_ram)
    u = max(ceiling / total_ram - trip_offset - u_margin, 0.0)
    return min(math.floor(max(u - u_margin, 0.0) * ceiling), budget)


def right_size(decision: Decision) -> Decision:
    """The decision with its pool capped at what its sequences can use at once."""
    if not decision.admitted:
        return decision
    need = pool_for(decision.concurrency, decision.context, decision.block_tokens,
                    decision.fixed_blocks_per_seq)
    pool = min(decision.pool_blocks, need)
    if pool == decision.pool_blocks:
        return decision
    pool_bytes = pool * decision.block_bytes
    footprint = decision.footprint_at(pool)
    return decision.model_copy(update={
        "pool_blocks": pool, "pool_bytes": pool_bytes, "footprint_bytes": footprint,
        "draft_pool_bytes": pool * decision.draft_block_bytes,
        "band_low": (footprint + decision.resident_bytes) / decision.ceiling_bytes,
        "reasons": [*decision.reasons,
                    f"pool right-sized to {pool} blocks ({fmt_bytes(pool_bytes)}): "
                    f"{decision.concurrency} × {decision.blocks_per_seq} blocks/seq, instead of "
                    f"the {decision.pool_blocks} the envelope leaves"],
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
