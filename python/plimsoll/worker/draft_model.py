"""Speculation with a draft model (``--draft-model``): a smaller model of the same vocabulary
proposes each sequence's drafts, the target verifies them in its one forward (:mod:`.speculate`).

The draft model is a second :class:`~plimsoll.engine.core.Engine` in the engine process, on
its own bounded paged KV: pools of as many blocks as the target's, addressed by the target's
block tables (the scheduler's pool owns the ids; a sequence's reservation covers its drafted
positions, so the draft never writes outside it). Nothing is an unbounded cache.

Per step, before the target's step is planned (:meth:`DraftModel.prepare`), for every
sequence that drafts (unconstrained, greedy or sampled, length > 0; the draft proposes
greedily, so a sampled sequence's verification treats it as a point mass):

1. catch up: the tokens its draft KV has not seen (the whole prompt the first time, then the
   one or two tokens the last verification added) as one chunk (a one-token catch-up joins
   the decode rows) of one draft step of at most ``chunk`` tokens over every sequence, which
   samples its first draft. A catch-up that does not fit takes what is left of the step and
   goes on at the next step, the sequence decoding plainly meanwhile (so running streams
   wait for at most one draft chunk a step, as for one prompt chunk). A sequence at draft
   length 0 does no draft work at all until a retry is due, and a retry catches up at most
   ``probe`` tokens, the last ones (the draft KV between what it had seen and them is left
   unwritten: a gap whose stale contents only make the retry's draft worse, never the
   output); a retry that accepts rewinds the draft to the gap's start, so the next catch-ups
   fill it and redo what follows, and the sequence drafts from a whole context again (a
   sequence whose first step is a retry, :func:`.speculate.start_length`, catches up only
   its prompt's last ``probe`` tokens the same way);
2. propose: ``k - 1`` more draft decode steps (``k`` from the :class:`.speculate.Drafter`'s
   adaptive length), every sequence a row of one batch, pipelined (each names the token the
   step before sampled); then every step's tokens are read.

A sequence's draft KV is valid up to ``seen``: after a verification that accepted ``m`` of
``k`` drafts it is ``start + min(k, m + 1)`` — rejected positions roll back by length and are
overwritten by the next catch-up. A sequence's first catch-up starts at 0, so blocks it shares
with another (a prefix hit) get their draft KV written again with the same tokens: only the
draft's own figures depend on it, never the output.

:func:`vocab_problem` is mlx-lm's compatibility check, made strict (the same vocabulary, not
only its size), and :func:`fit_problem` the load-time check that both models and both pools fit
the allocation limit. This module never imports mlx: the draft engine is handed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.core.units import fmt_bytes
from plimsoll.engine.work import Step, Work

from .speculate import Drafter, may_draft
from .waiting import Run


def vocab_problem(target: Mapping[str, int], draft: Mapping[str, int], draft_dir: str) -> str:
    """Why ``draft``'s tokenizer vocabulary cannot propose for ``target``'s ("" when it can):
    the target reads the draft's token ids, so both must name the same tokens."""
    if target == draft:
        return ""
    differ = sum(1 for t, i in draft.items() if target.get(t) != i) + sum(
        1 for t in target if t not in draft)
    return (f"--draft-model {draft_dir}: its tokenizer's vocabulary ({len(draft)} tokens) is "
            f"not the model's ({len(target)} tokens; {differ} differ): the model reads the "
            "draft's token ids, so both need the same tokenizer: pass a smaller model of the "
            "same family (the same tokenizer), or drop --draft-model")


def fit_problem(*, weights: int, draft_weights: int, blocks: int, block_bytes: int,
                draft_block_bytes: int, transient: int, limit: int) -> str:
    """Why the model and its draft model, their pools of ``blocks`` blocks each and the
    transient do not fit the allocation limit ("" when they do)."""
    need = weights + draft_weights + blocks * (block_bytes + draft_block_bytes) + transient
    if need <= limit:
        return ""
    return (f"the draft model does not fit: weights {fmt_bytes(weights)} + draft weights "
            f"{fmt_bytes(draft_weights)} + {blocks} blocks × ({block_bytes} B + the draft's "
            f"{draft_block_bytes} B) + transient {fmt_bytes(transient)} = {fmt_bytes(need)} "
            f"> the allocation limit {fmt_bytes(limit)}: use a smaller draft model, lower "
            "--max-cache-blocks, or start it with `plimsoll launch --draft-model`, whose "
            "admission counts the draft")


@dataclass
class DraftModel(Drafter):
    """Drafts from a draft model's greedy tokens (see the module docstring)."""

    proposer = "draft_model"
    looks_ahead = False  # its drafts come from its own state, read after each step
    engine: Any = None  # the draft model's Engine (its pools: the target's block ids); None
    #                     where refused (the model cannot speculate: no draft is loaded)
    chunk: int = 512    # most catch-up tokens per draft step, over every sequence
    probe: int = 16     # most catch-up tokens of a retry (a sequence at draft length 0)
    vocab: int = 0      # the target's embedding rows: a draft token at or past it ends a draft
    name: str = ""      # the draft model's directory, for the status
    kv_bytes: int = 0   # the draft pools' bytes allocated after the last draft pass (status)
    _seen: dict[int, int] = field(default_factory=dict)
    _ready: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _catching: set[int] = field(default_factory=set)  # still catching up at this step
    _gap: dict[int, int] = field(default_factory=dict)  # where its unwritten draft KV starts

    def lookup(self, seq_id: int, tokens: Sequence[int], k: int,
               ahead: Sequence[int] = ()) -> tuple[int, ...]:
        return self._ready.get(seq_id, ())[:k]

    def prepare(self, pool: Any, running: dict[int, Run]) -> None:
        """Every drafting sequence's drafts for this step, batched (the module docstring)."""
        self._ready, self._catching = {}, set()
        want: list[tuple[Run, int, tuple[int, ...]]] = []
        for run in running.values():
            if (run.prefilling or run.pending or run.generated >= run.req.max_tokens
                    or not may_draft(self, run)):
                continue
            k = min(self.length(run.req.id), run.req.max_tokens - run.generated - 1)
            table = pool.grow(run.req.id, run.written + 1 + k) if k > 0 else None
            if table is not None:
                want.append((run, k, table))
        if want:
            self._ready = self._draft(want)

    def propose(self, seq_id: int, tokens: Sequence[int], room: int,
                ahead: Sequence[int] = ()) -> tuple[int, ...]:
        if seq_id in self._catching:  # its draft KV is still catching up: no drafts this
            return ()                 # step, and no shorter draft length for it either
        return super().propose(seq_id, tokens, room, ahead)

    def _draft(self, want: list[tuple[Run, int, tuple[int, ...]]]) -> dict[int, tuple[int, ...]]:
        """One catch-up step (at most ``chunk`` tokens over every sequence: a sequence whose
        catch-up does not fit takes what is left and drafts at a later step), then the draft
        decode steps; every drafting sequence's drafts."""
        eng, left = self.engine, self.chunk
        works, drafting = [], []
        for run, k, table in want:
            sid = run.req.id
            seen, end = self._seen.get(sid, 0), len(run.tokens)
            if self.retrying(sid) and end - seen > self.probe:  # a retry: the last tokens
                self._gap.setdefault(sid, seen)
                seen = end - self.probe
            take = min(end - seen, left)
            if take > 0:
                works.append(Work(sid, tuple(run.tokens[seen:seen + take]), seen, table,
                                  seen + take == end))
                left -= take
                self._seen[sid] = seen + take  # written by the step below, in order
            if seen + take == end:
                drafting.append((run, k, table))
            else:
                self._catching.add(sid)
        first = eng.run_async(Step(tuple(w for w in works if w.length == 1),
                                   tuple(w for w in works if w.length > 1)))
        later = []  # draft decode steps 2..k, each naming the token the step before sampled
        for j in range(1, max((k for _, k, _ in drafting), default=1)):
            rows = tuple(Work(run.req.id, None, run.written + j, table, True)
                         for run, k, table in drafting if k > j)
            later.append((eng.run_async(Step(rows)), {w.seq_id for w in rows}))
        out = {}
        for run, k, _table in drafting:
            sid = run.req.id
            drafts = [first.result()[sid]]
            drafts += [p.result()[sid] for p, ids in later[:k - 1] if sid in ids]
            cut = next((i for i, t in enumerate(drafts) if self.vocab and t >= self.vocab),
                       len(drafts))
            out[sid] = tuple(drafts[:cut])
        self.kv_bytes = eng.kv_bytes_allocated()  # read here, on the engine's thread
        return out

    def settle(self, seq_id: int, accepted: int, found: int | None = None) -> tuple[int, int]:
        """As :meth:`Drafter.settle`; the draft KV stays valid through the accepted drafts
        (the rejected positions roll back by length)."""
        start, drafts = super().settle(seq_id, accepted, found)
        self._seen[seq_id] = start + min(drafts, accepted + 1)
        if accepted and seq_id in self._gap:  # drafting again: fill the gap from its start
            self._seen[seq_id] = self._gap.pop(seq_id)
        return start, drafts

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self._seen.pop(seq_id, None)
        self._ready.pop(seq_id, None)
        self._catching.discard(seq_id)
        self._gap.pop(seq_id, None)
        if self.engine is not None:
            self.engine.free_state(seq_id)

    def report(self) -> dict:
        out = super().report()
        if self.on:
            out.pop("prompt_lookup", None)
            out.update(draft_model=self.name,
                       draft_kv_bytes_allocated=self.kv_bytes,
                       draft_block_bytes=self.engine.block_bytes)
        return out
