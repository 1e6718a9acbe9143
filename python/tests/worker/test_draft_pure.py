"""Speculation's pure parts beside a draft model: a retry's back-off, a new sequence's start
length, when an empty step shortens a sequence's drafts (their estimated rate against the
measured cost of a verifying step), a retry's gap in the draft KV filled once it accepts,
the draft model's load-time checks (vocabulary, fit) and admission's refusal of a draft
that leaves no room."""

from __future__ import annotations

import pytest

from plimsoll.core.admission import AdmissionRequest, admit
from plimsoll.worker.draft_model import DraftModel, fit_problem, vocab_problem
from plimsoll.worker.speculate import (
    MAX_RETRY_STEPS,
    RETRY_STEPS,
    Drafter,
    Figures,
    start_length,
    start_wait,
)

pytestmark = pytest.mark.pure


def test_retries_back_off_while_they_accept_nothing():
    d, toks = Drafter(3, 1), [1, 2, 1, 2, 1, 2]

    def retry(accepted: int) -> int:
        """Steps (ticks) until the sequence may draft again; its retry, settled: the step."""
        d.tick()
        while not d.wants(7):
            assert d.propose(7, toks, 10) == ()  # plain decoding between retries
            d.tick()
        assert d.propose(7, toks, 10) == (1,)
        d.started(7, 5, 1)
        d.settle(7, accepted)
        return d.clock

    assert d.propose(7, toks, 10) == (1,)
    d.started(7, 5, 1)
    d.settle(7, 0)  # down to 0
    steps = [retry(0) for _ in range(7)]
    # the interval doubles after each empty retry, up to MAX_RETRY_STEPS; every retry falls
    # on a multiple of its interval (the shared clock), so the first back-off waits only
    # to the next multiple of 32
    assert steps == [RETRY_STEPS, 32, 64, 128, MAX_RETRY_STEPS, 2 * MAX_RETRY_STEPS,
                     3 * MAX_RETRY_STEPS]
    retry(1)  # accepted: its wait reset; its length stays 0 (one right in nine: no pay)
    assert d.retrying(7) and d._retry(7) == RETRY_STEPS
    at = d.clock
    assert retry(0) == (at // RETRY_STEPS + 1) * RETRY_STEPS


def test_a_retry_that_accepts_drafts_again_where_its_drafts_may_pay():
    """A retry is judged hopefully (its rate one standard error up): a sequence of a
    proposer right 70 % of the time, at 0 after an unlucky run, drafts again once a retry
    accepts; where a verifying step costs four plain ones, it stays at 0."""
    for cost, back in ((2.0, 2), (4.0, 0)):
        d = Drafter(3, 3, figures=Figures(proposed=100, accepted=70, rejected=30))
        d.costs.verifying.extend([(1, 4, cost)] * 8)
        d.costs.plain.extend([(1, 1.0)] * 8)
        for _ in range(3):
            d.started(7, 0, 3)
            d.settle(7, 0)
        assert d.retrying(7) and d.rate(7) < 0.5 < d.rate(7, hopeful=True)
        d.started(7, 0, 1)
        d.settle(7, 1)
        assert d.length(7) == back


def test_sequences_whose_drafts_fail_retry_in_the_same_step():
    """At length 0, whatever step each fell to it and whatever its back-off, the retries of
    several sequences land on the same steps (one unpipelined step for all of them)."""
    d, toks = Drafter(3, 1), [1, 2, 1, 2, 1, 2]
    falls = {3: 1, 9: 2, 14: 3}  # the step at which each sequence's length fell to 0
    d._wait[3] = 2 * RETRY_STEPS  # one of them backed off once already
    retried: dict[int, list[int]] = {1: [], 2: [], 3: []}
    while d.clock < 4 * RETRY_STEPS:
        d.tick()
        if d.clock in falls:
            d._length[falls[d.clock]] = 0
        for sid in retried:
            if sid in d._length and d.propose(sid, toks, 10):
                retried[sid].append(d.clock)
                d.started(sid, 5, 1)
                d.settle(sid, 0)  # rejected: its interval doubles
    assert retried[1] == retried[2] == [16, 32, 64]
    assert retried[3] == [32, 64]


def test_a_new_sequence_starts_short_where_drafts_have_mostly_failed():
    """Most drafts rejected: a new sequence starts at 1; nearly all: it waits for a retry step."""
    assert start_length(3, Figures()) == 3  # nothing verified yet
    assert start_length(3, Figures(proposed=10, accepted=5)) == 3
    assert start_length(3, Figures(proposed=10, accepted=4)) == 1
    assert start_length(3, Figures(proposed=12, accepted=2)) == 0  # a retry at the next retry step
    d = Drafter(3, 3, figures=Figures(proposed=12, accepted=2))
    assert not d.wants(7) and d.length(7) == 0  # it waits for the next retry step
    while not d.wants(7):
        d.tick()
    assert d.length(7) == 1 and d.propose(7, [1, 2, 1], 5) == (2,)
    d.started(7, 2, 1)
    d.settle(7, 0)  # a retry that accepted nothing: the next waits twice as long
    assert not d.wants(7) and d._retry(7) == 2 * RETRY_STEPS


def test_one_empty_step_stops_only_drafts_that_stopped_paying():
    """A sequence whose drafts have mostly been right keeps its length through a step that
    accepts none (the old rule shortened it, and a proposer right 80 % of the time spent
    its time at shorter lengths); one whose drafts mostly fail decodes plainly at once."""
    good = Drafter(3, 3)
    for a in (3, 2, 3, 3, 1):
        good.started(7, 0, good.length(7))
        good.settle(7, a)
    assert good.rate(7) > 0.7 and good.length(7) == 3
    good.started(7, 0, 3)
    good.settle(7, 0)
    # drafts right a fifth of the time so far (every sequence's): one draft of three right
    bad = Drafter(3, 3, figures=Figures(proposed=60, accepted=12, rejected=18))
    bad._length[7] = 3
    bad.started(7, 0, 3)
    bad.settle(7, 1)
    assert bad.rate(7) < 0.5  # 1 + p + p² + p³ < 2: not worth a verifying step
    assert good.length(7) == 3 and bad.length(7) == 0 and bad.retrying(7)


def test_a_sequences_rate_leans_on_every_sequences_until_it_has_its_own():
    d = Drafter(3, 3, figures=Figures(proposed=40, accepted=36, rejected=4))
    assert d.rate(1) == pytest.approx(37 / 42)  # nothing of its own: the figures' rate
    for _ in range(6):
        d.started(1, 0, 3)
        d.settle(1, 0)  # its own drafts keep failing
    assert d.rate(1) < 0.5 and d.rate(2) > 0.75  # (every sequence's rate fell a little)
    d.forget(1)
    assert d.rate(1) == d.rate(2)


def test_a_retry_that_accepts_rewinds_the_draft_to_its_gap():
    d = DraftModel(0, 3)
    d._length[7], d._gap[7] = 0, 40  # at length 0; its draft KV unwritten from 40
    d.started(7, 90, 1)
    d.settle(7, 0)  # rejected: valid through the verified token, the gap stays
    assert d._seen[7] == 91 and d._gap[7] == 40
    d.started(7, 120, 1)
    d.settle(7, 1)  # accepted: drafting again, from a catch-up that starts at the gap
    assert d._seen[7] == 40 and 7 not in d._gap and d.length(7) == 2


def test_a_draft_that_does_not_fit_is_refused_by_admission():
    req = AdmissionRequest(ceiling_bytes=16 << 30, total_ram_bytes=16 << 30,
                           budget_bytes=4 << 30, weights_bytes=3 << 30,
                           kv_bytes_per_token=4096, transient_reserve=0.05, block_tokens=16,
                           concurrency=1, context=4096, max_tokens=512)
    assert admit(req).admitted
    d = admit(req.model_copy(update={"draft_weights_bytes": 1 << 30,
                                     "draft_kv_bytes_per_token": 1024}))
    assert not d.admitted
    assert any("the draft model's weights 1.00 GiB" in r for r in d.reasons), d.reasons
    assert any("a smaller draft model" in r for r in d.reasons)


def test_the_vocabulary_must_be_the_models():
    vocab = {"a": 0, "b": 1, "c": 2}
    assert vocab_problem(vocab, dict(vocab), "/d") == ""
    why = vocab_problem(vocab, {"a": 0, "b": 2, "c": 1}, "/d")  # same size, other ids
    assert "--draft-model /d" in why and "2 differ" in why and "same tokenizer" in why
    assert "4 tokens" in vocab_problem(vocab, {**vocab, "d": 3}, "/d")


def test_both_models_and_both_pools_must_fit_the_allocation_limit():
    figures = dict(weights=100, draft_weights=50, blocks=10, block_bytes=8,
                   draft_block_bytes=2, transient=30)
    assert fit_problem(**figures, limit=280) == ""  # 100 + 50 + 10 × 10 + 30
    why = fit_problem(**figures, limit=279)
    assert "does not fit" in why and "10 blocks × (8 B + the draft's 2 B)" in why
    assert "plimsoll launch --draft-model" in why


def test_where_drafts_fail_everywhere_a_new_sequence_retries_later():
    """Fewer than one in 16 of at least 16 verified drafts accepted: a sequence's first
    retry waits four intervals (a short answer pays fewer unpipelined retry steps)."""
    assert start_wait(Figures()) == RETRY_STEPS
    assert start_wait(Figures(proposed=15, accepted=0)) == RETRY_STEPS  # too few to say
    assert start_wait(Figures(proposed=32, accepted=2)) == RETRY_STEPS  # one in 16: not yet
    assert start_wait(Figures(proposed=32, accepted=1)) == 4 * RETRY_STEPS
    d = Drafter(3, 3, figures=Figures(proposed=40, accepted=0))
    while not d.wants(7):
        d.tick()
    assert d.clock == 4 * RETRY_STEPS and d.propose(7, [1, 2, 1], 5) == (2,)
