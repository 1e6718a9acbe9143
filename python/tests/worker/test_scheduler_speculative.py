"""The scheduler speculating by prompt lookup, against the fake engine of test_scheduler_plan
(pure): a verifying Work is answered by the greedy rule over the fake's own next-token
function (each token + 11), and the fake refuses what a real engine refuses — a pipelined decode
(``tokens=None``) after a verifying step, a write past the reservation.

Two prompts control acceptance: one that holds the fake's own progression (its drafts are
right), one whose matches are followed by the wrong tokens (every draft rejected: the
sequence's draft length falls to 0 and it retries on every RETRY_STEPS-th step, pipelined
between). Both must produce exactly the tokens of a plain run."""

from __future__ import annotations

import pytest
from test_scheduler_plan import FakeEngine, FakePending, drain, make, request, tokens

from plimsoll.worker import speculate
from plimsoll.worker.events import Finished
from plimsoll.worker.speculate import Drafter

pytestmark = pytest.mark.pure


def _next(prev: int) -> int:
    return (prev + 1) % 1000 + 10


class VerifyingEngine(FakeEngine):
    """The fake engine that also verifies drafts (greedy: its next-token rule)."""

    def run_async(self, step):
        verify = [w for w in step.prefills if w.draft]
        rest = type(step)(step.decodes, tuple(w for w in step.prefills if not w.draft))
        for w in step.decodes:
            assert w.tokens is not None or w.seq_id in self.last, \
                f"seq {w.seq_id}: pipelined after a verifying step"
        out = {}
        if rest.decodes or rest.prefills:
            out = dict(super().run_async(rest).result())
            self.steps.pop()
        self.steps.append(step)
        for w in verify:
            for i, t in enumerate(w.tokens):
                self._write(w.seq_id, w.block_table, w.start + i, t)
            targets = [_next(t) for t in w.tokens]
            m = 0
            while m < w.draft and w.tokens[1 + m] == targets[m]:
                m += 1
            out[w.seq_id] = (*w.tokens[1:1 + m], targets[m])
            self.last.pop(w.seq_id, None)
        return FakePending(out)


def speculating(**kw):
    s, _eng, pool = make(**kw)
    eng = VerifyingEngine(pool)
    s.engine = eng
    s.drafter = Drafter(3, 3)
    return s, eng, pool


def plain_tokens(prompt, n):
    s, _eng, _pool = make(total=256)
    _, ev = request(s, prompt, n)
    drain(s)
    return tokens(ev)


@pytest.mark.parametrize("prompt, accepts", [
    ([*range(500, 940, 11), 500], True),  # its matches continue as the fake does (+11)
    # every token it reaches is in it, followed by the wrong one: every draft rejected
    ([x for v in range(111, 990, 11) for x in (v, v + 5)] + [100], False),
])
def test_speculation_gives_the_plain_tokens(prompt, accepts):
    want = plain_tokens(prompt, 80)
    s, _eng, pool = speculating(total=256)
    req, ev = request(s, prompt, 80)
    drain(s)
    assert tokens(ev) == want and ev[-1] == Finished("length", 80, req.drafted, req.accepted)
    figures = s.drafter.figures
    assert figures.proposed > 0 and req.drafted == figures.proposed
    assert (figures.accepted > 0) is accepts and req.accepted == figures.accepted
    # planned ahead of the step in flight only where predictions kept coming true
    assert (figures.ahead > 0) is accepts and figures.ahead_void < max(1, figures.ahead)
    if not accepts:  # fell to length 0, then retried (pipelined in between)
        assert 3 < s.counters["speculation_unpipelined"] < 80 // 4
    assert pool.held == 0 and s.drafter.inflight == {}


def test_speculation_beside_plain_and_sampled_requests():
    prompts = [[*range(500, 940, 11), 500], [*range(122, 990, 22), 100], [*range(700, 720)]]
    want = [plain_tokens(p, 30) for p in prompts]
    s, eng, pool = speculating(total=256, prefill=64)
    reqs = [request(s, p, 30) for p in prompts]
    sampled, sampled_ev = request(s, prompts[0], 10, temperature=0.7)
    drain(s)
    assert [tokens(ev) for _, ev in reqs] == want
    # a sampled request speculates too (the fake verifies every row by its one rule)
    assert sampled.drafted > 0 and tokens(sampled_ev) == plain_tokens(prompts[0], 10)
    assert any(w.draft for st in eng.steps for w in st.prefills)
    assert pool.held == 0


RIGHT = [*range(500, 940, 11), 500]  # its drafts are right
SLOW = [*range(300, 420)]  # 15 chunks of prompt at prefill=8: heavy steps
# right in runs, broken twice: a prediction fails after a run of right ones
MIXED = [*range(500, 632, 11), 7, *range(643, 808, 11), 8, *range(819, 940, 11), 500]


def beside_a_long_prompt(s, fast: list[int], arrives_after: int) -> list[list[int]]:
    """``fast`` (40 tokens) runs alone for ``arrives_after`` iterations, then :data:`SLOW`
    (12) arrives and both run out: their tokens."""
    _, fast_ev = request(s, fast, 40)
    for _ in range(arrives_after):
        s.iterate()
    _, slow_ev = request(s, SLOW, 12)
    drain(s)
    return [tokens(fast_ev), tokens(slow_ev)]


@pytest.mark.parametrize("arrives_after", [2, 5, 13])
@pytest.mark.parametrize("fast", [RIGHT, MIXED], ids=["right", "mixed"])
def test_steps_planned_ahead_beside_a_prompt_being_prefilled(fast, arrives_after,
                                                            monkeypatch):
    """A greedy sequence is planned ahead of its verifying step in flight; a long prompt
    arriving meanwhile makes steps heavy (their previous step is read after them then, not
    before), and a prediction that fails drops the step planned on it (its writes rolled
    back): both sequences' tokens are still a plain run's, and every write stays in its
    reservation."""
    monkeypatch.setattr(speculate, "AHEAD_AFTER", 2)  # the mechanism: more steps ahead
    s, _eng, pool = speculating(total=256, prefill=8)
    assert beside_a_long_prompt(s, fast, arrives_after) == \
        [plain_tokens(fast, 40), plain_tokens(SLOW, 12)]
    figures = s.drafter.figures
    assert figures.ahead > 0
    assert (figures.ahead_void == 0) if fast is RIGHT else (figures.ahead_void >= 1)
    assert pool.held == 0 and s.drafter.inflight == {}
