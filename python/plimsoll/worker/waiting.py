"""Admission's side of the scheduler (pure): the bounded queue's intake, a running sequence's
state, whether one more fits the decode batch, expiry, and what a waiter waits for.

A waiter joins the running batch, FIFO, while ``max_batch``, the pool (its reservation of
``ceil((prompt + max_tokens) / block)`` blocks) and the decode step's transient bound allow;
a waiter whose next blocks a running prefill is about to write waits for them while that
step has prompt work anyway (no budget goes idle for it), letting the waiters behind it
go first; one that waits past ``--max-wait`` is refused with exactly what it waited for — blocks, a
decode slot, or other prompts' prefill — never a vague "slots busy".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from plimsoll.engine.work import Sampling

from .events import GenRequest, SchedulerLimits
from .pool import Refusal


@dataclass
class Run:
    """A running sequence: what is written, sampled, and still in flight."""

    req: GenRequest
    tokens: list[int]      # prompt, then every sampled token known
    prompt_len: int
    written: int           # positions whose KV a submitted step writes
    cached_tokens: int
    pending: int = 0       # sampled tokens not read yet (0 or 1)
    generated: int = 0
    full_committed: int = -1  # full blocks whose hashes were last registered
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        r = self.req
        self.sampling = Sampling(r.temperature, r.top_p, r.seed, r.top_k, r.min_p)

    @property
    def prefilling(self) -> bool:
        return self.written < self.prompt_len


def end_reason(run: Run, token: int, eos_ids: Collection[int]) -> str | None:
    """Why ``run`` ends with ``token`` just read (``eos``, ``stop``, ``length``), or None."""
    if token in eos_ids and not run.req.ignore_eos:
        return "eos"
    if run.req.constraint is not None and run.req.constraint.done():
        return "stop"
    return "length" if run.generated >= run.req.max_tokens else None


def decode_fits(limits: SchedulerLimits, req: GenRequest, running: Collection[Run]) -> bool:
    """Whether the decode step's transient stays under its bound with ``req`` running too
    (every row gathers the longest row's slots)."""
    bytes_for = limits.decode_bytes
    if bytes_for is None:
        return True
    longest = max([len(req.prompt) + req.max_tokens,
                   *(r.prompt_len + r.req.max_tokens for r in running)])
    return bytes_for(len(running) + 1, longest) <= limits.transient_bytes


def in_flight(req: GenRequest, hits: int, block_tokens: int, running: Iterable[Run]) -> bool:
    """Whether the block right after ``req``'s ``hits`` mapped blocks is one a running
    prefill is still to write (the same chained hash: the same tokens up to its end). Then
    the waiter waits for it to be registered instead of computing it a second time (SGLang's
    in-batch prefix check); a block past what any prompt may map is no reason to wait."""
    hashes = req.hashes or ()
    if hits >= min(len(hashes), (len(req.prompt) - 1) // block_tokens):
        return False
    return any(r.prefilling and r.req.hashes is not None and hits < len(r.req.hashes)
               and r.req.hashes[hits] == hashes[hits] for r in running)


def why_waiting(req: GenRequest, grant: object, running: Collection[Run],
                limits: SchedulerLimits) -> tuple[str, str]:
    """What a waiter waits for, exactly (its refusal's code and message): blocks (``grant``
    is the pool's answer to it now), a decode slot, or other prefills."""
    if isinstance(grant, Refusal):
        return "pool_exhausted", grant.message
    if len(running) >= limits.max_batch:
        return "batch_full", (f"all {limits.max_batch} decode slots (--max-batch) are "
                              "running sequences")
    if running and not decode_fits(limits, req, running):
        return "batch_full", (f"{len(running)} running sequences: one more would take "
                              "the decode step's transient past its bound "
                              f"({limits.transient_bytes} B)")
    ahead = [r for r in running if r.prefilling]
    left = sum(r.prompt_len - r.written for r in ahead)
    if not ahead:
        return "queue_timeout", ("the requests queued before it were admitted first "
                                 "(or memory was near the trip line)")
    return "prefill_busy", (f"waiting behind the prefill of {len(ahead)} prompt(s) "
                            f"({left} tokens left at {limits.prefill_tokens} per "
                            "step) and the requests queued before it")


def intake(new: list[GenRequest], waiting: deque[GenRequest], tripped: str,
           max_queue: int) -> list[tuple[GenRequest, str, str]]:
    """New submissions into the bounded ``waiting`` queue, in order; returns those refused
    at once, with their message and code: all of them while memory is tripped, and any
    past ``max_queue`` waiters."""
    refused = []
    for req in new:
        if tripped:
            refused.append((req, f"memory trip: {tripped}; the worker refuses new work until "
                            "memory comes back", "memory_trip"))
        elif len(waiting) >= max_queue:
            refused.append((req, f"the waiting queue is full ({max_queue} requests): retry "
                            "later", "queue_full"))
        else:
            waiting.append(req)
    return refused


def expire(waiting: deque[GenRequest], now: float
           ) -> tuple[deque[GenRequest], int, list[GenRequest]]:
    """The waiters still waiting at ``now``, how many were cancelled, and those past their
    deadline (in queue order: each is refused with :func:`why_waiting`)."""
    kept: deque[GenRequest] = deque()
    cancelled, expired = 0, []
    for req in waiting:
        if req.cancelled.is_set():
            cancelled += 1
        elif now >= req.deadline:
            expired.append(req)
        else:
            kept.append(req)
    return kept, cancelled, expired
