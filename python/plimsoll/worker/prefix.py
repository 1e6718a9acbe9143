"""What a step leaves for later prompts: full blocks registered as prefix hits, and the state
snapshots of hybrid models (pure bookkeeping over the pool; the engine only snapshots); and
what an admitted prompt takes from earlier ones (:func:`admit`: its hit blocks mapped, a
snapshot or disk blocks restored) and how its prompt is cut into chunks (:func:`chunk`).

A full block's hash is registered once every token in it is known (a prompt token, or a
token already read back) and its write is planned: a prompt chunk's blocks when the chunk is
planned, a decode's block when its last token is read. So a later prompt with the same
leading blocks maps them, even one admitted in the same step.

Hybrid models (recurrent state) cannot cut a state, so a prefix is reused only where the
engine holds a snapshot of the state at the end of a block. The rule: whenever a submitted
step leaves a sequence's written tokens on a block boundary (a prompt chunk — a hybrid
prompt's chunks end on blocks, the last one stopping at the prompt's last block boundary
first, so the same prompt again is a hit — or a decode that fills a block), its state is
snapshotted if the pool has room (each snapshot is charged ``fixed_blocks_per_seq`` under
the cache cap, reclaimable, LRU); it becomes a hit once that block's hash is registered,
and a later prompt maps the blocks up to the last one with a snapshot and resumes from it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from plimsoll.engine.work import Step, Work

from .events import GenRequest
from .pool import BlockPool, Grant
from .waiting import Run


def admit(pool: BlockPool, engine: Any, disk: Any, req: GenRequest, grant: Grant) -> Run:
    """``req`` admitted under ``grant``: map the hit blocks, count the reservation, restore a
    hybrid state snapshot and the prompt's next blocks from ``disk`` (the tier, or None);
    returns its Run, its hit tokens already written."""
    pool.allocate(req.id, grant)
    if grant.snapshot is not None:
        engine.restore_state(grant.snapshot, req.id)
    hit = grant.hit_count * pool.block_tokens
    if disk is not None:  # the prompt's next blocks, read back from disk
        hit += disk.restore(pool, req.id, grant.hashes, grant.hit_count, len(req.prompt))
    run = Run(req, list(req.prompt), len(req.prompt), hit, hit)
    if disk is not None:
        commit(pool, run)  # restored blocks: prefix hits for the next prompt
    return run


def chunk(pool: BlockPool, chunk_for: Callable[[int], int] | None, run: Run,
          budget: int, align: int = 0) -> Work:
    """The next chunk of ``run``'s prompt, at most ``budget`` tokens (and ``chunk_for``'s
    transient bound at its length); a hybrid prompt's chunk ends on a block, so a state
    snapshot can go there. Its full blocks are registered as it is planned."""
    n = min(run.prompt_len - run.written, budget)
    if chunk_for is not None:  # the transient bound at this prompt's length
        n = max(1, min(n, chunk_for(run.prompt_len)))
    n = aligned(run.written, n, run.prompt_len, align)
    block = pool.block_tokens
    if pool.hybrid and n >= block:  # end on a block: a state snapshot can go there
        if run.written + n < run.prompt_len:
            n -= (run.written + n) % block
        elif (last := (run.prompt_len - 1) // block * block) > run.written:
            n = last - run.written  # the prompt's last boundary, so all of it can be hit
    table = pool.grow(run.req.id, run.written + n)
    end = run.written + n
    register_planned(pool, run, end)  # a prompt admitted next maps them
    return Work(run.req.id, tuple(run.tokens[run.written:end]), run.written, table,
                end == run.prompt_len, run.sampling, run.req.constraint)


def aligned(start: int, n: int, prompt_len: int, align: int) -> int:
    """``n`` cut so a chunk that is not the prompt's last ends on a multiple of ``align``
    (the engine's ``chunk_align``: on MLX's CUDA backend a chunk after a 32-token prefix
    hit would otherwise pad every chunk's attention by a grid step, each a shape no plan
    was built for: 2048-token chunks took 0.10-0.15 s against 0.05-0.07 s aligned on an
    H200); kept as it is where the cut would lose half of it or more."""
    if align <= 0 or start + n >= prompt_len:
        return n
    cut = (start + n) // align * align - start
    return cut if cut * 2 > n else n


def commit(pool: BlockPool, run: Run) -> None:
    """Register the full blocks of ``run`` whose every token is known (a call that fills
    no new block changes nothing, so it is skipped: a block fills once per
    ``block_tokens`` tokens)."""
    full = min(run.written, len(run.tokens)) // pool.block_tokens
    if full == run.full_committed and not pool.hybrid:
        return
    run.full_committed = full
    pool.commit(run.req.id, run.tokens, run.written)
    if pool.hybrid:
        pool.bind_snapshots(run.req.id)


def register_planned(pool: BlockPool, run: Run, end: int) -> None:
    """Register the full blocks of ``run``'s prompt up to ``end`` as soon as the chunk that
    writes them is planned, so a prompt admitted later in the same step (or the next)
    maps them instead of computing them again. Safe to read before they are computed:
    steps run in order on one stream, and within a step a later chunk's attention runs
    after the earlier chunk's write of the same layer (the one forward calls each layer's
    groups in plan order, and every read takes the pool as the writes before it left it)."""
    pool.commit(run.req.id, run.tokens, min(end, run.prompt_len))


def after_submit(pool: BlockPool, engine: Any, running: dict[int, Run], step: Step,
                 counters: Counter[str]) -> None:
    """Count what the submitted ``step`` writes and samples; register full blocks whose
    tokens are known; snapshot hybrid state where a Work ends on a block."""
    prefills = {w.seq_id for w in step.prefills if not w.draft}  # drafts are not prompt
    for w in (*step.decodes, *step.prefills):
        run = running.get(w.seq_id)
        if run is None:  # ended when the previous step's tokens were read before submission
            continue
        run.written += w.length
        run.pending += 1 if w.sample else 0
        if w.seq_id in prefills:
            pool.count_prefill(w.length)
            counters["prefill_tokens"] += w.length
        if w.tokens is not None or pool.hybrid:  # a pipelined decode's token is not known
            commit(pool, run)                    # yet: no block can fill before it is read
        if (pool.hybrid and run.written % pool.block_tokens == 0
                and pool.can_snapshot()):
            key = ("snap", run.req.id, run.written)
            engine.snapshot_state(run.req.id, key)
            pool.add_snapshot(run.req.id, key)
            pool.bind_snapshots(run.req.id)
    drop_snapshots(pool, engine)


def drop_snapshots(pool: BlockPool, engine: Any) -> None:
    """Tell the engine which state snapshots the pool dropped."""
    for key in pool.take_dropped_snapshots():
        engine.drop_snapshot(key)
