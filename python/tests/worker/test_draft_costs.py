"""What drafts cost (worker/draft_costs.py): the tokens a step must yield for its drafts to
pay, a verifying step's cost measured against a plain one, and the cost per token of a batch
where other sequences verify anyway — a GPU's (nearly free) and a CPU's (their arithmetic) —
and what the drafter does with each."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.worker.draft_costs import MAX_COST, MIN_TIMED, VERIFY_COST, StepCosts, pays
from plimsoll.worker.speculate import Drafter

pytestmark = pytest.mark.pure


def test_drafts_pay_where_a_step_yields_more_than_it_costs():
    assert pays(0.85, 3) and pays(1.0, 1)
    assert not pays(0.0, 3) and not pays(0.3, 3)
    assert not pays(0.7, 1) and pays(0.7, 3)  # more drafts, more yield for the same step
    # the threshold is the cost: 1 + p + ... + p^k against the plain steps a step costs
    assert pays(VERIFY_COST - 1, 1) and not pays(VERIFY_COST - 1.01, 1)
    assert pays(0.6, 3, cost=1.5) and not pays(0.6, 3, cost=2.7)  # the H200's, the CPU's


def test_the_cost_of_a_verifying_step_is_measured_once_both_kinds_were_timed():
    costs = StepCosts()
    for _ in range(MIN_TIMED - 1):
        costs.add(1, 1, 4, 0.030)
        costs.add(1, 0, 1, 0.010)
    assert costs.ratio() == VERIFY_COST  # too few yet
    costs.add(1, 1, 4, 0.030)
    costs.add(1, 0, 1, 0.010)
    assert costs.ratio() == pytest.approx(3.0)
    for _ in range(MIN_TIMED):  # a few prefill-slowed plain steps move the median little
        costs.add(1, 0, 1, 0.011)
    costs.add(1, 0, 1, 1.0)
    assert 2.5 < costs.ratio() < 3.0
    cheap = StepCosts()
    for _ in range(MIN_TIMED):
        cheap.add(1, 1, 4, 0.009)
        cheap.add(1, 0, 1, 0.010)
    assert cheap.ratio() == 1.0  # never below a plain step
    rows = StepCosts()  # row for row: 8 rows plain against 1 row verifying
    for _ in range(MIN_TIMED):
        rows.add(8, 0, 8, 0.016)
        rows.add(1, 1, 4, 0.004)
    assert rows.ratio() == pytest.approx(2.0)


def batch(per_token: float, fixed: float = 0.010, rows: int = 8) -> StepCosts:
    """Verifying steps of ``rows`` rows whose drafts vary (1..3 each), timed as
    ``fixed + per_token`` a query token; plain steps of ``rows`` tokens."""
    costs = StepCosts()
    for i in range(2 * MIN_TIMED):
        tokens = rows + rows * (1 + i % 3)
        costs.add(rows, rows, tokens, fixed + per_token * tokens)
        costs.add(rows, 0, rows, 0.8 * fixed + per_token * rows)
    costs.add(rows, rows, 4 * rows, fixed + per_token * 4 * rows)  # the last: all verify
    return costs


def test_the_cost_per_token_is_the_verifying_steps_slope():
    gpu, cpu = batch(0.00002), batch(0.001, fixed=0.001)
    assert gpu.line() == pytest.approx((0.010, 0.00002))
    assert cpu.line() == pytest.approx((0.001, 0.001))
    same = StepCosts()
    for _ in range(MIN_TIMED):
        same.add(8, 8, 32, 0.02)  # every row drafts 3: no spread, no slope
    assert same.line() is None
    noisy = StepCosts()
    for i in range(MIN_TIMED):
        noisy.add(8, 8, 16 + 8 * (i % 3), 0.02 - 0.001 * (i % 3))  # faster with more tokens
    assert noisy.line()[1] == 0.0


def test_where_plain_steps_are_rare_the_line_stands_in_for_them():
    """Every row drafting: a plain step of 8 rows is the verifying steps' line at 8 tokens
    — nearly a verifying step's on a GPU, a quarter of one on a CPU."""
    gpu, cpu = StepCosts(), StepCosts()
    for i in range(MIN_TIMED):
        tokens = 8 + 8 * (1 + i % 3)
        gpu.add(8, 8, tokens, 0.010 + 0.00002 * tokens)
        cpu.add(8, 8, tokens, 0.001 + 0.001 * tokens)
    assert gpu.ratio() < 1.1
    assert cpu.ratio() == pytest.approx((0.001 + 0.024) / (0.001 + 0.008))


def test_drafts_in_a_verifying_batch_cost_their_tokens_share():
    """Where others verify anyway, k drafts cost their tokens' time, paid by every token
    the batch yields in it: nearly nothing on a GPU, most of a step on a CPU."""
    gpu, cpu = batch(0.00002), batch(0.001, fixed=0.001)
    assert gpu.cost(3, yields=2.5) < 1.2
    assert 2.0 < cpu.cost(3, yields=2.5) <= MAX_COST
    assert gpu.cost(3, yields=2.5) < gpu.ratio()  # not a whole verifying step's
    alone = batch(0.00002, rows=1)  # one stream: its drafts make the step a verifying one
    assert alone.cost(3, yields=2.5) == alone.ratio()
    fresh = StepCosts()
    assert fresh.cost(3, yields=2.5) == VERIFY_COST


@given(st.floats(0.0, 0.01), st.floats(0.001, 0.05), st.integers(1, 64),
       st.floats(1.0, 6.0), st.integers(1, 8))
def test_a_cost_is_never_below_one_plain_token_nor_above_the_cap(per_token, fixed, rows,
                                                                 yields, k):
    cost = batch(per_token, fixed, rows).cost(k, yields)
    assert 1.0 <= cost <= MAX_COST


def test_a_rejected_draft_stops_a_sequence_only_where_its_batch_makes_drafts_dear():
    """A sequence right about half the time: on a GPU's batch its drafts ride nearly free
    and it keeps drafting after a rejection; on a CPU's they cost most of a step and it
    decodes plainly."""
    lengths = {}
    for name, costs in (("gpu", batch(0.00002)), ("cpu", batch(0.001, fixed=0.001))):
        d = Drafter(3, 3, costs=costs)
        for a in (1, 1, 0, 2, 0, 1):
            d.started(7, 0, d.length(7) or 3)
            d.settle(7, a)
        assert 0.4 < d.rate(7) < 0.6
        lengths[name] = d.length(7)
    assert lengths == {"gpu": 3, "cpu": 0}


def test_a_seeded_sequence_pays_a_fixed_cost():
    """Which steps verify decides a seeded sequence's draws: its cost is never a timing."""
    d = Drafter(3, 3, costs=batch(0.001, fixed=0.001))
    d.own_clock(7)
    assert d.cost(7) == VERIFY_COST and d.cost(8) != VERIFY_COST


def test_a_batch_whose_verifying_steps_lose_falls_back_to_a_whole_steps_cost():
    """Verifying steps three times a plain one's, yielding 2.5 tokens a row: each sequence's
    share of a step is small, but the batch makes its tokens slower than plain decoding."""
    costs = StepCosts()
    for i in range(MIN_TIMED):
        costs.add(8, 0, 8, 0.010)
        costs.add(8, 8, 8 + 8 * (1 + i % 3), 0.030 + 0.0001 * (i % 3))
    assert not costs.batch_pays(8 * 2.5) and costs.batch_pays(8 * 3.5)
    assert costs.cost(3, yields=2.5) == costs.ratio() == pytest.approx(3.0, rel=0.05)
    assert costs.cost(3, yields=3.5) < 1.5
