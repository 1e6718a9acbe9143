"""Speculation with the checkpoint's MTP head (where the checkpoint has one, no
``--draft-model`` is given and ``--no-mtp`` is not).

The head (:mod:`plimsoll.engine.mtp_head`, handed in: this module never imports mlx) is a
model of one layer on an :class:`~plimsoll.engine.core.Engine` of its own, whose bounded
paged pools take the target's block ids (as a draft model's do), and it drafts from the
target's hidden states, which the target's one forward hands over every step. Per step,
before the target's step is planned (:meth:`MTPDrafter.prepare`), as one batch:

1. catch up: every sequence that is prefilling or drafts this step writes the head's KV
   over the positions whose hidden state and next token are now known (a chunk each, a
   one-token catch-up a decode row; at most ``chunk`` tokens over all of them, the rest at
   the next step); the rows of those that draft sample the first draft;
2. propose: ``k - 1`` more head decode steps, every drafting sequence a row, pipelined
   (each names the token the step before sampled, and is fed the head's own output there);
   then every step's tokens are read.

The head's KV is valid up to ``seen``: the positions its drafts wrote are written again
from the target's hidden states at the next catch-up, so a rejection needs no rollback. A
sequence at draft length 0 does no head work until a retry is due (its captures are kept
only for the last ``probe`` positions); the retry catches up from there, and the head KV
between is left stale, which only makes the retry's draft worse, never the output. A
sequence that began at a prefix hit reads the head KV its shared blocks got from whoever
computed them. A constrained sequence never drafts: nothing is kept for it.

Memory: the head's weights and its pool (a block for every pool block) are checked
against the allocation limit at load (:func:`fit_problem`), together with the model and its
pool; a head that does not fit is not used (the worker logs the figures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.core.units import fmt_bytes
from plimsoll.engine.work import Step, Work

from .speculate import Drafter, may_draft
from .waiting import Run


def fit_problem(*, weights: int, mtp_weights: int, blocks: int, block_bytes: int,
                mtp_block_bytes: int, transient: int, limit: int) -> str:
    """Why the model, its MTP head, the pool of ``blocks`` blocks and the head's (as many
    blocks) and the transient do not fit the allocation limit ("" when they do)."""
    need = weights + mtp_weights + blocks * (block_bytes + mtp_block_bytes) + transient
    if need <= limit:
        return ""
    return (f"the MTP head does not fit: weights {fmt_bytes(weights)} + MTP weights "
            f"{fmt_bytes(mtp_weights)} + {blocks} blocks × ({block_bytes} B + the head's "
            f"{mtp_block_bytes} B) + transient {fmt_bytes(transient)} = {fmt_bytes(need)} > "
            f"the allocation limit {fmt_bytes(limit)}: pass --no-mtp, lower "
            "--max-cache-blocks, or start it with `plimsoll launch`, whose admission counts "
            "the head")


@dataclass
class MTPDrafter(Drafter):
    """Drafts from the checkpoint's MTP head (see the module docstring)."""

    proposer = "mtp"
    looks_ahead = False  # its drafts come from its own state, read after each step
    engine: Any = None  # the head's Engine (its model: the Head); None where refused
    hidden: Any = None  # the target's hidden states handed over (mtp_head.Hidden)
    chunk: int = 512    # most catch-up tokens per head step, over every sequence
    probe: int = 16     # positions kept for a sequence at draft length 0 (its retry's)
    kv_bytes: int = 0   # the head's pools allocated, as of the last prepare (status)
    _seen: dict[int, int] = field(default_factory=dict)
    _ready: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _waiting: set[int] = field(default_factory=set)  # wants to draft, not caught up yet

    def lookup(self, seq_id: int, tokens: Sequence[int], k: int,
               ahead: Sequence[int] = ()) -> tuple[int, ...]:
        return self._ready.get(seq_id, ())[:k]

    def propose(self, seq_id: int, tokens: Sequence[int], room: int,
                ahead: Sequence[int] = ()) -> tuple[int, ...]:
        if seq_id in self._waiting:  # its head KV is still catching up: no drafts this
            return ()                # step, and no shorter draft length for it either
        return super().propose(seq_id, tokens, room, ahead)

    def prepare(self, pool: Any, running: dict[int, Run]) -> None:
        """The head's catch-up and drafts for this step, batched (the module docstring)."""
        self._ready, self._waiting = {}, set()
        works, feeds, drafting, left = [], {}, [], self.chunk
        for run in running.values():
            sid = run.req.id
            if run.req.constraint is not None:
                self._drop(sid)
                continue
            k = 0
            if not (run.prefilling or run.pending or run.generated >= run.req.max_tokens) \
                    and may_draft(self, run):
                k = min(self.length(sid), run.req.max_tokens - run.generated - 1)
            end = len(run.tokens) - 1  # positions whose next token is known
            if k <= 0 and not run.prefilling:
                self.hidden.keep_from(sid, end - self.probe)  # no head work until a retry
                continue
            lo = self._seen.get(sid)
            first = self.hidden.first(sid)
            if first is not None and (lo is None or first > lo):
                lo = first  # its first capture, or a gap (a retry after length 0)
            if lo is None:
                continue
            hi, rows = self.hidden.span(sid, lo, min(end, lo + left))
            table = pool.grow(sid, max(hi, run.written + 1 + k if k else 0))
            if table is None:
                continue
            if hi > lo:
                works.append(Work(sid, tuple(run.tokens[lo + 1:hi + 1]), lo, table,
                                  k > 0 and hi == end))
                feeds[sid] = rows
                left -= hi - lo
                self._seen[sid] = hi
                self.hidden.keep_from(sid, hi)
            if k > 0:
                if hi == end and hi > lo:
                    drafting.append((sid, k, end, table))
                else:
                    self._waiting.add(sid)
        if works:
            self._ready = self._draft(works, feeds, drafting)
        self.kv_bytes = self.engine.kv_bytes_allocated()  # read here, on the engine's thread

    def _draft(self, works: list[Work], feeds: dict, drafting: list) -> dict[int, tuple[int, ...]]:
        eng, head = self.engine, self.engine.model
        step = Step(tuple(w for w in works if w.length == 1),
                    tuple(w for w in works if w.length > 1))
        head.feed([feeds[w.seq_id] for w in (*step.decodes, *step.prefills)])
        first = eng.run_async(step)
        order = [w.seq_id for w in (*step.decodes, *step.prefills) if w.sample]
        later = []  # head decode steps 2..k: the token and the output the step before made
        for j in range(1, max((k for _, k, _, _ in drafting), default=1)):
            rows = [(sid, pos, table) for sid, k, pos, table in drafting if k > j]
            head.chain([order.index(sid) for sid, _, _ in rows])
            later.append((eng.run_async(Step(tuple(Work(sid, None, pos - 1 + j, table, True)
                                                   for sid, pos, table in rows))),
                          {sid for sid, _, _ in rows}))
            order = [sid for sid, _, _ in rows]
        head.feed(None)
        if not drafting:
            return {}
        out = {}
        for sid, k, _pos, _table in drafting:
            drafts = [first.result()[sid]]
            drafts += [p.result()[sid] for p, ids in later[:k - 1] if sid in ids]
            out[sid] = tuple(drafts)
        return out

    def _drop(self, seq_id: int) -> None:
        self._seen.pop(seq_id, None)
        if self.hidden is not None:
            self.hidden.forget(seq_id)

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self._drop(seq_id)
        self._ready.pop(seq_id, None)
        self._waiting.discard(seq_id)
        if self.engine is not None:
            self.engine.free_state(seq_id)

    def report(self) -> dict:
        out = super().report()
        if self.on:
            out.pop("prompt_lookup", None)
            out.update(mtp_weights_bytes=self.engine.model.weights_bytes,
                       mtp_block_bytes=self.engine.block_bytes,
                       mtp_kv_bytes_allocated=self.kv_bytes)
        return out

