"""The scheduler chaining verifying steps on the device (engine/chain.py), against a fake engine
that chains as the real one does (pure): after a verifying Work that drafts by lookup it keeps
the sequence's start and tokens, and a chained Work (``tokens`` None) gets its token and its
drafts (the host's own lookup rule, -1 past what it finds) from them. The fake refuses what
the real engine refuses — a chained Work with no chain, a table that does not cover its
positions, a write past the reservation — and checks the host's ``start`` is the highest the
chain can reach and no higher than one step's drafts beyond it (``written`` kept exact).

The outputs must be a plain run's, with drafts right, rejected, and beside a long prompt
whose chunks make steps heavy (the step in flight is then read before a chained step is
submitted)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_scheduler_plan import FakePending, drain, request, tokens
from test_scheduler_speculative import (
    RIGHT,
    SLOW,
    VerifyingEngine,
    beside_a_long_prompt,
    plain_tokens,
    speculating,
)

from plimsoll.engine.work import Accepted
from plimsoll.worker.ngram import prompt_lookup

pytestmark = pytest.mark.pure

MOST = 3
WRONG = [x for v in range(111, 990, 11) for x in (v, v + 5)] + [100]  # every draft rejected


class ChainingEngine(VerifyingEngine):
    """The verifying fake with the real engine's chains."""

    chains_drafts = True

    def __init__(self, pool):
        super().__init__(pool)
        self.chain: dict[int, tuple[int, list[int]]] = {}  # seq -> (start, tokens to it)
        self.chained = 0
        self.found = 0  # drafts that existed, over every verifying Work
        self.empty = 0  # chained Works whose drafts the rule did not find

    def run_async(self, step):
        works = []
        for w in step.prefills:
            if w.chained:
                assert w.seq_id in self.chain, f"seq {w.seq_id}: chained with no chain"
                start, history = self.chain[w.seq_id]
                assert start <= w.start <= start + MOST, (w.start, start)
                found = prompt_lookup(history, w.lookup, w.draft)
                self.empty += not found
                w = replace(w, tokens=(history[-1], *found, *[-1] * (w.draft - len(found))),
                            start=start)
                self.chained += 1
            elif w.lookup:
                assert len(w.history) == w.start + 1 and w.history[-1] == w.tokens[0]
                self.chain[w.seq_id] = (w.start, list(w.history))
            works.append(w)
        out = super().run_async(replace(step, prefills=tuple(works))).result()
        for w in works:
            if w.draft:  # as the real engine's Pending: the drafts that existed
                out[w.seq_id] = Accepted(out[w.seq_id], sum(t >= 0 for t in w.tokens[1:]))
                self.found += out[w.seq_id].found
            if w.lookup:
                start, history = self.chain[w.seq_id]
                self.chain[w.seq_id] = (start + len(out[w.seq_id]),
                                        history + list(out[w.seq_id]))
        for w in step.decodes:  # a plain step ends a chain
            self.chain.pop(w.seq_id, None)
        return FakePending(out)

    def free_state(self, seq):
        super().free_state(seq)
        self.chain.pop(seq, None)


def chaining(**kw):
    s, _eng, pool = speculating(**kw)
    eng = ChainingEngine(pool)
    s.engine = eng
    s.drafter.chains = True
    return s, eng, pool


NOTHING = [*range(100, 400, 7)]  # no n-gram recurs: the device rule finds no drafts


@pytest.mark.parametrize("n", [7, 13, 80])
@pytest.mark.parametrize("prompt, accepts", [(RIGHT, True), (WRONG, False), (NOTHING, False)],
                         ids=["right", "wrong", "nothing"])
def test_chained_speculation_gives_the_plain_tokens(prompt, accepts, n):
    want = plain_tokens(prompt, n)
    s, eng, pool = chaining(total=256)
    req, ev = request(s, prompt, n)
    drain(s)
    assert tokens(ev) == want
    figures = s.drafter.figures
    assert eng.chained == figures.chained  # chained steps whatever the acceptance ...
    assert (figures.chained > 0) is (prompt is not NOTHING)  # (... where a chain began)
    assert (figures.accepted > 0) is accepts and req.accepted == figures.accepted
    # proposed: the drafts that existed, not the rows a chained step verified for nothing
    assert figures.proposed == eng.found == req.drafted
    if accepts:  # every verifying step after the first chained: none read before planning
        assert figures.chained >= figures.steps - 2
    if prompt is RIGHT and n == 80:  # its output leaves the prompt's run: nothing found
        assert eng.empty > 0
    assert pool.held == 0 and s.drafter.inflight == {}


@pytest.mark.parametrize("arrives_after", [2, 5, 13])
def test_chained_steps_beside_a_prompt_being_prefilled(arrives_after):
    s, eng, pool = chaining(total=256, prefill=8)
    assert beside_a_long_prompt(s, RIGHT, arrives_after) == \
        [plain_tokens(RIGHT, 40), plain_tokens(SLOW, 12)]
    assert eng.chained > 0 and pool.held == 0 and s.drafter.inflight == {}


def test_a_seeded_request_is_not_chained():
    s, eng, _pool = chaining(total=256)
    request(s, RIGHT, 30, temperature=0.7, seed=3)
    drain(s)
    assert s.drafter.figures.proposed > 0 and eng.chained == 0
