"""The block pool: reference counts, chained hashes, the LRU of cached blocks, reservations.

Pure unit tests of the pool's decisions (no engine): the engine-backed behaviour is in
test_worker_paged.py."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from plimsoll.worker.pool import BlockPool, Grant, Refusal, block_hash, chain_hashes

pytestmark = pytest.mark.pure


def pool(total=100, block=4, cap=100, **kw) -> BlockPool:
    return BlockPool(total=total, block_tokens=block, cache_cap_blocks=cap, **kw)


def run(p: BlockPool, seq, prompt, out=(), max_tokens=8):
    """Admit, write the prompt and ``out``, register the full blocks (no engine)."""
    g = p.can_allocate(prompt, max_tokens)
    assert isinstance(g, Grant), g
    p.allocate(seq, g)
    tokens = list(prompt) + list(out)
    assert p.grow(seq, len(tokens)) is not None
    p.commit(seq, tokens)
    return g


def test_hashes_chain_on_the_parent():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same tokens, different parents
    assert a[0] == block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4], b"float16") != a[0]  # the extra key counts
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, start=a[:1]) == a


def test_reservation_is_counted_but_blocks_are_taken_as_written():
    p = pool(total=10)
    g = p.can_allocate(list(range(10)), 10)  # ceil(20 / 4) = 5 blocks reserved
    assert isinstance(g, Grant) and g.reserve == 5 and g.hit_count == 0
    assert p.allocate("a", g) == ()
    assert (p.held, p.outstanding, p.committed) == (0, 5, 5)
    assert len(p.grow("a", 10)) == 3  # the prompt's 10 tokens: 3 blocks
    assert (p.held, p.outstanding, p.empty) == (3, 2, 7)
    assert p.grow("a", 21) is None  # past the reservation: a value, nothing changes
    assert p.held == 3


def test_refusal_is_a_value_with_figures():
    p = pool(total=10)
    p.allocate("a", p.can_allocate([1] * 20, 12))  # 8 blocks reserved
    r = p.can_allocate([2] * 8, 4)  # 3 blocks
    assert isinstance(r, Refusal)
    assert (r.asked, r.available, r.held, r.total) == (3, 2, 8, 10)
    assert "needs 3 blocks" in r.message and "2 are available" in r.message
    assert not r.never_fits
    assert pool(total=10).can_allocate([1] * 40, 16).never_fits


def test_running_sequences_share_full_prompt_blocks():
    p = pool(total=20)
    system = list(range(100, 112))  # 3 full blocks
    run(p, "a", [*system, 1, 2])
    g = p.can_allocate([*system, 7, 8, 9], 4)
    assert g.hit_count == 3 and g.hit_blocks == p.table("a")[:3]
    held = p.held
    p.allocate("b", g)
    assert p.held == held and p.shared == 3  # mapped, not copied: counted once
    p.grow("b", 15)
    assert p.held == held + 1
    p.free("a")
    assert p.shared == 0 and p.held == 4  # b keeps the shared blocks alive


def test_a_prompt_always_leaves_one_token_to_prefill():
    p = pool()
    run(p, "a", list(range(8)))
    p.free("a")
    g = p.can_allocate(list(range(8)), 4)  # exactly the two cached blocks
    assert g.hit_count == 1  # the last block is recomputed for its logits


def test_partial_match_reuses_up_to_the_first_differing_block():
    p = pool()
    conv = list(range(40))  # 10 blocks
    run(p, "a", conv, out=[7] * 3)
    p.free("a")
    edited = [*conv[:22], 999, *conv[23:]]  # one message edited inside block 5
    g = p.can_allocate(edited, 4)
    assert g.hit_count == 5  # blocks 0..4 kept; everything after the edit recomputed


def test_finished_blocks_stay_cached_and_are_evicted_lru_tail_first():
    p = pool(total=6, cap=6)
    run(p, "a", list(range(16)), max_tokens=1)  # 4 full blocks + 1 reserved
    p.free("a")
    assert (p.held, p.cached, p.empty) == (0, 4, 2)
    g = p.can_allocate([5] * 16, 4)  # 5 blocks: all 6 available (cached reclaimable)
    p.allocate("b", g)
    p.grow("b", 16)  # 2 empty + 2 evicted: the chain's tail first
    assert p.cached == 2 and p.counters["evicted_blocks"] == 2
    p.free("b")
    assert p.can_allocate([*list(range(16)), 1], 1).hit_count == 2  # the head survived


def test_cache_cap_bounds_cached_blocks():
    p = pool(total=100, cap=3)
    for s in range(3):
        run(p, s, [s] * 16)
        p.free(s)
        assert p.cached <= 3
    assert p.can_allocate([2] * 16 + [1], 1).hit_count == 3  # the newest kept


def test_trip_drops_every_cached_block():
    p = pool()
    run(p, "a", list(range(16)))
    p.free("a")
    assert p.drop_cached() == 4 and p.cached == 0 and p.empty == 100


def test_hybrid_hits_stop_at_the_last_snapshot():
    p = pool(total=40, fixed_blocks_per_seq=2, hybrid=True)
    g = p.can_allocate(list(range(20)), 4)
    p.allocate("a", g)
    p.grow("a", 12)
    assert p.can_snapshot()
    p.add_snapshot("a", "snap-a")  # state at the end of block 2 (12 tokens)
    p.commit("a", list(range(12)))
    p.bind_snapshots("a")
    p.grow("a", 20)
    p.commit("a", list(range(20)))
    p.free("a")
    g = p.can_allocate([*list(range(20)), 5], 4)
    assert g.hit_count == 3 and g.snapshot == "snap-a"  # 5 full blocks, state only at 3
    assert p.can_allocate([9, *list(range(1, 20))], 4).hit_count == 0
    p.drop_cached()
    assert p.take_dropped_snapshots() == ["snap-a"]


class PoolMachine(RuleBasedStateMachine):
    """Random admissions, writes, commits and frees keep every invariant."""

    def __init__(self):
        super().__init__()
        self.p = pool(total=24, block=4, cap=10)
        self.live: dict[int, list[int]] = {}  # seq → tokens written
        self.prompts: dict[int, list[int]] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          max_tokens=st.integers(1, 12))
    def admit(self, prefix, tail, max_tokens):
        prompt = prefix + tail
        g = self.p.can_allocate(prompt, max_tokens)
        if isinstance(g, Refusal):
            assert g.asked > g.available
            return
        self.n += 1
        assert self.p.allocate(self.n, g) == g.hit_blocks
        self.live[self.n] = prompt[:g.hit_count * 4]
        self.prompts[self.n] = prompt + [0] * max_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 9))
    def write(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        full = self.prompts[seq]
        n = min(len(self.live[seq]) + k, len(full))
        assert self.p.grow(seq, n) is not None
        self.live[seq] = full[:n]
        self.p.commit(seq, self.live[seq])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def overgrow(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        assert self.p.grow(seq, self.p.reserved_tokens(seq) + 1) is None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.p.free(seq)
        del self.live[seq]

    @rule()
    def trip(self):
        self.p.drop_cached()

    @invariant()
    def counts(self):
        p = self.p
        refs = p._ref
        assert min(refs) >= 0
        assert p.held == sum(1 for r in refs if r > 0)  # a shared block once
        assert p.held + p.cached + p.empty == p.total
        assert p.committed <= p.total
        assert p.cached <= p.cache_cap_blocks
        for seq in self.live:
            table = p.table(seq)
            assert len(table) <= p._seqs[seq].reserve  # never more than reserved
            assert all(refs[b] > 0 for b in table)
        expect = {}
        for seq in self.live:
            for b in p.table(seq):
                expect[b] = expect.get(b, 0) + 1
        assert all(refs[b] == expect.get(b, 0) for b in range(p.total))

    @invariant()
    def hashes_describe_contents(self):
        """A hashed block's hash is the chain hash of the tokens its writer wrote there."""
        p = self.p
        for seq, toks in self.live.items():
            hashes = chain_hashes(toks, 4)
            for i, b in enumerate(p.table(seq)[:len(hashes)]):
                if p._hash[b] is not None:
                    assert p._hash[b] == hashes[i]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
