"""The worker's KV pool: exact counts, reuse of a growing conversation, refusals as values."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from plimsoll.engine.pool import KVPool, Plan, Refusal


def pool(total=100, block=16, cap=50, **kw) -> KVPool:
    return KVPool(total=total, block_tokens=block, cache_cap_blocks=cap, **kw)


def test_reservation_counts_prompt_plus_output():
    p = pool()
    plan = p.plan(list(range(100)), 28)
    assert isinstance(plan, Plan) and plan.blocks == 8  # ceil(128 / 16)
    p.admit("a", plan)
    assert (p.used, p.cached, p.free) == (8, 0, 92)


def test_refusal_is_a_value_with_figures():
    p = pool(total=10)
    p.admit("a", p.plan([1] * 100, 28))  # 8 blocks
    r = p.plan([2] * 40, 8)  # 3 blocks
    assert isinstance(r, Refusal)
    assert (r.asked, r.free, r.cached, r.held, r.total) == (3, 2, 0, 8, 10)
    assert "needs 3 blocks" in r.message and "2 are free" in r.message
    assert not r.never_fits
    assert pool(total=10).plan([1] * 200, 16).never_fits
    assert p.used == 8  # nothing changed


def test_growing_conversation_holds_one_copy():
    p = pool(total=1000, cap=1000)
    history: list[int] = []
    for turn in range(12):
        history += [turn * 1000 + i for i in range(500)]  # ~500 new tokens of tool output
        plan = p.plan(history, 16)
        assert isinstance(plan, Plan)
        if turn:
            # all but the new text and the last answer token (its KV is never written)
            assert plan.reused_tokens == len(history) - 500 - 1
        p.admit(turn, plan)
        history += [7] * 16  # the model's answer
        evicted = p.retain(turn, handle=turn, tokens=history[:-1])
        assert evicted == ()
        assert p.stats()["prefixes"] == 1  # one copy, not one per turn
        assert p.cached == -(-(len(history) - 1) // 16)


def test_cached_prefixes_are_reclaimed_for_live_work_lru_first():
    p = pool(total=20, cap=20)
    for h in range(3):
        p.admit(h, p.plan([h] * 64, 16))  # 5 blocks each
        p.retain(h, handle=h, tokens=[h] * 64)  # 4 blocks cached each
    assert (p.cached, p.free) == (12, 8)
    plan = p.plan([9] * 150, 10)  # 10 blocks: evict the oldest prefix only
    assert plan.evict == (0,)
    p.admit("new", plan)
    assert p.stats()["prefixes"] == 2 and p.free == 2


def test_cache_cap_evicts_oldest():
    p = pool(total=100, cap=8)
    for h in range(3):
        p.admit(h, p.plan([h] * 64, 16))
        assert p.retain(h, handle=h, tokens=[h] * 64) == ((h - 2,) if h >= 2 else ())
    assert p.cached == 8


def test_whole_prefix_only_for_recurrent_state():
    p = pool(whole_prefix_only=True, fixed_blocks_per_seq=2)
    p.admit("a", p.plan([1, 2, 3, 4], 4))
    assert p.used == 1 + 2
    p.retain("a", handle=1, tokens=[1, 2, 3, 4])
    assert p.reusable_tokens(1, [1, 2, 9, 9, 9]) == 0
    assert p.reusable_tokens(1, [1, 2, 3, 4, 5]) == 4


def test_programming_errors_raise():
    p = pool()
    with pytest.raises(KeyError, match="unknown sequence"):
        p.release("ghost")
    p.admit("a", p.plan([1], 1))
    with pytest.raises(ValueError, match="already admitted"):
        p.admit("a", p.plan([1], 1))
    with pytest.raises(ValueError, match="headroom"):
        pool(total=4, headroom=4)


class PoolMachine(RuleBasedStateMachine):
    """Random admits, releases, retains and trips keep the counts exact and non-negative."""

    def __init__(self):
        super().__init__()
        self.p = KVPool(total=64, block_tokens=8, cache_cap_blocks=24, headroom=2)
        self.live: dict[int, list[int]] = {}
        self.next = 0

    @rule(stem=st.integers(0, 3), extra=st.integers(1, 120), out=st.integers(1, 40))
    def request(self, stem, extra, out):
        prompt = [stem] * 40 + list(range(extra))
        plan = self.p.plan(prompt, out)
        if isinstance(plan, Refusal):
            assert plan.asked > plan.free + plan.cached or plan.asked > plan.total
            return
        self.p.admit(self.next, plan)
        self.live[self.next] = prompt
        self.next += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data, keep):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live.pop(seq)
        if keep and self.p.can_retain(seq, len(tokens)):
            self.p.retain(seq, handle=seq, tokens=tokens)
        else:
            self.p.release(seq)

    @rule()
    def trip(self):
        self.p.drop_cached()
        assert self.p.cached == 0

    @invariant()
    def counts_are_exact(self):
        s = self.p.stats()
        assert s["used"] + s["cached"] + s["headroom"] + s["free"] == s["total"]
        assert s["free"] >= 0 and s["cached"] <= s["cache_cap"]


TestPoolMachine = PoolMachine.TestCase


def test_a_shared_template_header_does_not_consume_another_conversation():
    p = pool(total=100, cap=100)
    conversation = list(range(1, 200))
    p.admit("a", p.plan(conversation, 8))
    p.retain("a", handle=1, tokens=conversation)
    header_only = conversation[:5] + [999] * 50  # same chat-template header, new text
    plan = p.plan(header_only, 8)
    assert plan.prefix is None and plan.reused_tokens == 0
    most = conversation[:150] + [999] * 10  # covers most of it: reuse
    assert p.plan(most, 8).reused_tokens == 150
