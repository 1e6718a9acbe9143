"""Admission's side of the scheduler: the bounded queue's intake, a running sequence's
state, whether one more fits the decode batch, which waiters a step admits
(:func:`admit_waiting`, through the scheduler's admit and refuse), expiry, and what a waiter
waits for. The rest is pure.

A waiter joins the running batch, FIFO, while ``max_batch``, the pool (its reservation of
``ceil((prompt + max_tokens) / block)`` blocks) and the decode step's transient bound allow;
a waiter whose next blocks a running prefill is about to write waits for them while that
step has prompt work anyway (no budget goes idle for it), letting the waiters behind it
go first; one that waits past ``--max-wait`` is refused with exactly what it waited for — blocks, a
decode slot, or other prompts' prefill — never a vague "slots busy".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from plimsoll.engine.work import Sampling

from .events import GenRequest, SchedulerLimits
from .pool import BlockPool, Grant, Refusal


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
    (every row gathers the longest row's slots; a speculating sequence's drafts are rows
    of it, ``limits.decode_rows_per_seq``)."""
    bytes_for = limits.decode_bytes
    if bytes_for is None:
        return True
    longest = max([len(req.prompt) + req.max_tokens,
                   *(r.prompt_len + r.req.max_tokens for r in running)])
    rows = (len(running) + 1) * limits.decode_rows_per_seq
    return bytes_for(rows, longest) <= limits.transient_bytes


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


def hashes(pool: BlockPool, req: GenRequest) -> list[bytes]:
    """``req``'s prompt block hashes, computed once and kept on it."""
    req.hashes = req.hashes if req.hashes is not None else pool.prompt_hashes(req.prompt)
    return req.hashes


def admit_waiting(queue: deque[GenRequest], running: dict[int, Run], limits: SchedulerLimits,
                  pool: BlockPool, over: Callable[[int], bool], budget: int, prefills: list,
                  refuse: Callable[[GenRequest, int, str, str], None],
                  admit: Callable[[GenRequest, Grant, int], int]) -> None:
    """Admit waiters from the head of ``queue``, FIFO, while ``budget`` prefill tokens,
    ``max_batch``, the decode bound and the pool allow: ``admit(req, grant, budget)`` plans
    its first chunk (into ``prefills``) and returns its size; one that can never fit is
    refused. A waiter whose next blocks a running prefill writes waits while the step has
    prompt work, and those behind it go first; ``over`` probes memory before each admission
    but the first (each prefill can be a spike)."""
    deferred = 0  # waiters at the head left for a running prefill's blocks
    while budget > 0 and len(queue) > deferred and len(running) < limits.max_batch:
        req = queue[deferred]
        if running and not decode_fits(limits, req, running.values()):
            break
        grant = pool.can_allocate(req.prompt, req.max_tokens, hashes(pool, req))
        if isinstance(grant, Refusal):
            if not grant.never_fits:
                break  # FIFO: the head waits for blocks; nothing jumps the queue
            del queue[deferred]
            refuse(req, 503, grant.message, "pool_exhausted")
            continue
        if prefills and in_flight(req, grant.hit_count, pool.block_tokens, running.values()):
            deferred += 1  # its next blocks are being computed: wait, not recompute
            continue
        if running and over(limits.trip_bytes):
            break
        del queue[deferred]
        budget -= admit(req, grant, budget)


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
