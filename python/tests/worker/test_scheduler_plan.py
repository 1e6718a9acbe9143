"""The token-budget scheduler's planning, against a fake engine (pure unit tests).

The fake engine keeps the KV contents of every block as token values and checks what a
real engine relies on: a table covers the positions written, a shared prefix's blocks
hold exactly the prompt's tokens when a later prompt maps them, no sequence writes a
block another table references, and a write never passes the reservation. The real
engine's behaviour is tested in test_worker_paged.py."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.engine.work import Step
from plimsoll.worker import prefix
from plimsoll.worker.events import Finished, GenRequest, Refused, SchedulerLimits, Started, Token
from plimsoll.worker.pool import BlockPool
from plimsoll.worker.scheduler import Scheduler
from plimsoll.worker.trip import PROBE_INTERVAL_S, MemoryLine

pytestmark = pytest.mark.pure

EOS = 3


class FakePending:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result


class FakeEngine:
    """Writes token values into blocks; samples ``(last token + 1) % 1000 + 10``."""

    block_bytes = 100

    def __init__(self, pool: BlockPool, eos_after: dict[int, int] | None = None):
        self.pool = pool
        self.tokenizer = type("T", (), {"eos_token_ids": [EOS]})()
        self.kv: dict[tuple[int, int], int] = {}
        self.last: dict[int, int] = {}
        self.steps: list[Step] = []
        self.eos_after = eos_after or {}  # seq → emit EOS as its n-th token
        self.sampled: dict[int, int] = {}
        self.freed: list[int] = []
        self.max_block = -1

    def _write(self, seq, table, pos, token):
        B = self.pool.block_tokens
        assert pos // B < len(table), f"seq {seq}: table does not cover {pos}"
        block = table[pos // B]
        assert self.pool._ref[block] == 1, f"seq {seq} writes shared block {block}"
        assert pos < self.pool.reserved_tokens(seq) if seq in self.pool._seqs else True
        self.kv[(block, pos % B)] = token
        self.max_block = max(self.max_block, block)

    def run_async(self, step: Step) -> FakePending:
        self.steps.append(step)
        out = {}
        B = self.pool.block_tokens
        for w in step.prefills:
            for p in range(w.start):  # mapped prefix: must hold the prompt's tokens
                assert self.kv.get((w.block_table[p // B], p % B)) is not None
            for i, t in enumerate(w.tokens):
                self._write(w.seq_id, w.block_table, w.start + i, t)
            if w.sample:
                out[w.seq_id] = self._sample(w.seq_id, w.tokens[-1])
        for w in step.decodes:
            token = self.last[w.seq_id] if w.tokens is None else w.tokens[0]
            self._write(w.seq_id, w.block_table, w.start, token)
            out[w.seq_id] = self._sample(w.seq_id, token)
        self.last.update(out)
        return FakePending(out)

    def _sample(self, seq, prev):
        n = self.sampled[seq] = self.sampled.get(seq, 0) + 1
        return EOS if self.eos_after.get(seq) == n else (prev + 1) % 1000 + 10

    def free_state(self, seq):
        self.freed.append(seq)

    def kv_bytes_allocated(self):
        return (self.max_block + 1) * self.block_bytes

    def state_bytes_held(self):
        return 0

    def clear_cache(self):
        pass

    def drop_snapshot(self, key):
        pass


def make(total=64, block=4, max_batch=8, prefill=8, cap=64, eos_after=None, queue=16,
         wait=30.0, align=0):
    pool = BlockPool(total=total, block_tokens=block, cache_cap_blocks=cap)
    eng = FakeEngine(pool, eos_after)
    limits = SchedulerLimits(max_num_seqs=1, max_queue=queue, max_wait_s=wait,
                             trip_bytes=1 << 60, max_batch=max_batch, prefill_tokens=prefill,
                             chunk_align=align)
    s = Scheduler(lambda stack: (eng, pool), limits, lambda: {})
    s.engine, s.pool, s.eos_ids = eng, pool, {EOS}
    return s, eng, pool


def request(s, prompt, max_tokens, **kw):
    events = []
    req = GenRequest(prompt=list(prompt), max_tokens=max_tokens, sink=events.append, **kw)
    s.submit(req)
    return req, events


def drain(s, limit=10_000):
    for _ in range(limit):
        s.iterate()
        if not s._running and not s._waiting and s._pending is None and not s._inbox:
            return
    raise AssertionError("scheduler did not drain")


def tokens(events):
    return [e.token_id for e in events if isinstance(e, Token)]


def test_one_request_runs_its_reservation_and_leaves_its_blocks_cached():
    s, eng, pool = make()
    _, ev = request(s, range(100, 110), 6)
    drain(s)
    assert isinstance(ev[0], Started) and ev[0].cached_tokens == 0
    assert len(tokens(ev)) == 6 and ev[-1] == Finished("length", 6)
    assert pool.held == 0 and pool.cached == 3  # 10 + 5 written tokens: 3 full blocks
    # the pipelined extra step wrote the last token inside the reservation
    assert max(w.start for st in eng.steps for w in st.decodes) < 10 + 6


def test_reservation_exactly_full_never_raises():
    """prompt + max_tokens a whole number of blocks: the pipelined step's token fits."""
    s, _eng, pool = make(total=4, block=4)
    _, ev = request(s, range(10, 22), 4)  # 16 tokens = the whole pool
    drain(s)
    assert ev[-1] == Finished("length", 4)
    assert s.counters.get("refused_worker_error", 0) == 0 and pool.committed == 0


def test_concurrent_requests_share_the_prompt_blocks_once():
    s, eng, pool = make(prefill=64)
    system = list(range(200, 216))  # 4 full blocks
    _, a = request(s, [*system, 1, 2], 20)
    s.iterate()  # a's prompt is written and its blocks registered
    _, b = request(s, [*system, 7], 20)
    s.iterate()
    assert b[0] == Started(17, 16)
    assert pool.shared == 4
    st = s.stats
    assert st["shared_blocks"] == 4
    assert st["kv_bytes_held"] == (pool.held + pool.cached) * eng.block_bytes
    assert st["prefix"]["hit_tokens"] == 16
    drain(s)
    assert a[-1] == Finished("length", 20) and b[-1] == Finished("length", 20)


def test_edited_conversation_keeps_the_blocks_before_the_edit():
    s, _eng, _pool = make(prefill=64)
    conv = list(range(300, 340))
    request(s, conv, 2)
    drain(s)
    edited = [*conv[:21], 999, *conv[22:]]
    _, ev = request(s, edited, 2)
    drain(s)
    assert ev[0].cached_tokens == 20  # blocks 0..4 kept, the edit's block recomputed
    assert s.counters["prefill_tokens"] == 40 + 20


def test_long_prefill_delays_running_streams_by_one_chunk_per_step():
    s, _eng, _pool = make(total=4096, block=4, prefill=32, max_batch=8)
    reqs = [request(s, range(10 * i, 10 * i + 6), 400) for i in range(3)]
    streams = [ev for _, ev in reqs]
    for _ in range(5):
        s.iterate()
    assert all(len(tokens(e)) > 0 for e in streams)
    _, long = request(s, range(5000, 5000 + 8000), 4)
    start = s._steps
    while not any(isinstance(e, Token) for e in long):
        s.iterate()
    during = [entry for entry in s.step_log if entry[0] > start]
    assert len(during) >= 8000 // 32
    for _step, decoded, chunks in during:
        assert sum(chunks.values()) <= 32  # at most one chunk per step
        assert {r.id for r, _ in reqs} <= set(decoded)  # every stream decoded every step
    drain(s)


def test_max_batch_is_separate_from_max_num_seqs():
    s, eng, _pool = make(total=256, max_batch=16, prefill=512, queue=32)
    evs = [request(s, range(20 * i, 20 * i + 8), 8)[1] for i in range(20)]
    s.iterate()
    s.iterate()
    assert len(s._running) == 16 and len(s._waiting) == 4
    assert max(len(st.decodes) for st in eng.steps) == 16
    drain(s)
    assert all(e[-1] == Finished("length", 8) for e in evs)


def test_eos_ends_a_sequence_and_the_pipelined_token_is_dropped():
    s, eng, _pool = make()
    req, ev = request(s, range(40, 45), 10)
    eng.eos_after[req.id] = 3
    drain(s)
    assert tokens(ev)[-1] == EOS and len(tokens(ev)) == 3
    assert ev[-1] == Finished("eos", 3)
    assert req.id in eng.freed


def test_a_finished_constraint_stops_with_reason_stop():
    class Two:
        def __init__(self):
            self.n = 0

        def allowed(self):
            return None

        def advance(self, token_id):
            self.n += 1

        def done(self):
            self.n += 1  # the fake engine does not advance; count reads instead
            return self.n >= 2

    s, eng, _pool = make()
    _, ev = request(s, range(40, 45), 10, constraint=Two())
    drain(s)
    assert ev[-1] == Finished("stop", 2)
    assert all(w.constraint is not None for st in eng.steps for w in st.decodes)


def test_waiting_for_blocks_is_a_503_that_says_so():
    s, _eng, _pool = make(total=8, wait=0.0)
    request(s, range(10, 20), 20)  # 8 blocks: the whole pool
    s.iterate()
    _, ev = request(s, range(50, 54), 4)
    s.iterate()
    (r,) = [e for e in ev if isinstance(e, Refused)]
    assert r.code == "pool_exhausted" and "needs 2 blocks" in r.message


def test_waiting_behind_a_prefill_is_a_503_that_says_so():
    s, _eng, _pool = make(total=4096, prefill=8, wait=0.0)
    request(s, range(0, 2000), 4)
    s.iterate()
    _, ev = request(s, range(50, 54), 4)
    s._waiting.append(s._inbox.popleft())  # queued behind the prefill, deadline passed
    s._expire_waiting()
    (r,) = [e for e in ev if isinstance(e, Refused)]
    assert r.code == "prefill_busy" and "behind the prefill of 1 prompt" in r.message


def test_a_request_that_can_never_fit_is_refused_at_once():
    s, _eng, _pool = make(total=4)
    _, ev = request(s, range(10, 30), 4)
    s.iterate()
    assert isinstance(ev[-1], Refused) and "can never fit" in ev[-1].message


def test_cancel_frees_blocks_and_keeps_full_ones_cached():
    s, _eng, pool = make()
    req, ev = request(s, range(60, 72), 50)
    for _ in range(4):
        s.iterate()
    req.cancelled.set()
    drain(s)
    assert ev[-1].reason == "cancelled" and pool.held == 0 and pool.cached >= 3


def test_eviction_under_pressure_serves_new_work():
    s, _eng, pool = make(total=12, cap=12, prefill=64)
    for i in range(3):
        request(s, range(100 * i + 10, 100 * i + 26), 4)  # 5 blocks each, 4 cached after
        drain(s)
    assert pool.cached == 12 or pool.counters["evicted_blocks"] > 0
    _, ev = request(s, range(900, 936), 4)  # 10 blocks: evicts cached ones
    drain(s)
    assert ev[-1] == Finished("length", 4) and pool.counters["evicted_blocks"] >= 4


@pytest.mark.parametrize("n", [1, 5])
def test_allocated_bytes_stay_under_the_pool(n):
    s, eng, pool = make(total=32, block=4, prefill=16)
    system = list(range(500, 512))
    for i in range(n):
        request(s, system + list(range(i * 7, i * 7 + 5)), 6)
    drain(s)
    assert eng.kv_bytes_allocated() <= pool.total * eng.block_bytes
    assert s.stats["kv_bytes_peak"] <= pool.total * eng.block_bytes


def test_fail_all_releases_everything():
    s, _eng, pool = make()
    request(s, range(10, 20), 30)
    s.iterate()
    with contextlib.suppress(Exception):
        s._fail_all("boom")
    assert pool.held == 0 and pool.committed == 0 and not s._running


def _tripping(reading: dict) -> tuple[Scheduler, BlockPool]:
    """A scheduler whose memory probe reads ``reading``, its trip at 1,000 B."""
    pool = BlockPool(total=64, block_tokens=4, cache_cap_blocks=64)
    eng = FakeEngine(pool)
    limits = SchedulerLimits(max_num_seqs=1, max_queue=16, max_wait_s=30.0, trip_bytes=1000,
                             max_batch=8, prefill_tokens=8)
    s = Scheduler(lambda stack: (eng, pool), limits, lambda: dict(reading))
    s.engine, s.pool, s.eos_ids = eng, pool, {EOS}
    return s, pool


def test_over_the_trip_the_cache_goes_first_then_the_waiters_then_the_newest_running():
    """The trip (worker.trip.MemoryLine, acted on by the scheduler): over the line, cached
    blocks are dropped and memory probed again; still over, every waiter and then the
    newest running request are refused ``memory_trip``, one running request an iteration;
    back under, the worker takes work again."""
    reading = {"mlx_active": 0}
    s, pool = _tripping(reading)
    request(s, range(100, 110), 6)
    drain(s)
    assert pool.cached == 3 and not s.tripped
    _, old = request(s, range(200, 210), 50)
    _, new = request(s, range(300, 310), 50)
    for _ in range(3):
        s.iterate()
    assert len(s._running) == 2
    reading["mlx_active"] = 5000  # over the trip, and the clear cannot bring it down
    _, waiter = request(s, range(400, 410), 4)
    s.iterate()
    assert s.counters["trips"] == 1  # the clear ran (there were cached blocks to drop)
    assert "over the trip at 1000 B" in s.tripped and s.stats["tripped"]
    assert [e.code for e in waiter if isinstance(e, Refused)] == ["memory_trip"]
    assert [e.code for e in new if isinstance(e, Refused)] == ["memory_trip"]
    assert not any(isinstance(e, Refused) for e in old)  # the oldest work may finish
    reading["mlx_active"] = 0
    time.sleep(PROBE_INTERVAL_S)  # decode-only steps probe on a cadence
    s.iterate()
    assert not s.tripped
    _, again = request(s, range(100, 110), 4)  # its cached prefix went in the clear
    _, later = request(s, range(500, 510), 4)
    drain(s)
    assert again[0].cached_tokens == 0 and later[-1] == Finished("length", 4)


def test_over_a_line_with_nothing_cached_the_engine_still_hands_back_freed_memory():
    """A step in flight at the first clear frees its buffers after it: every probe over a
    line clears the engine's freed memory again (not only while blocks are cached), and
    memory that comes back under the line lifts the trip; no trip is counted without blocks
    to drop."""
    reading = {"mlx_active": 5000}
    cleared = []

    class Engine:
        def clear_cache(self):
            cleared.append(reading["mlx_active"])
            reading["mlx_active"] = 500  # the freed buffers went back

        def drop_snapshot(self, key):
            raise AssertionError(key)

    line, counters = MemoryLine(lambda: dict(reading)), Counter()
    pool = BlockPool(total=8, block_tokens=4, cache_cap_blocks=8)
    assert line.check(1000, pool, Engine(), counters) is False  # under again after the clear
    assert cleared == [5000] and not line.tripped and counters["trips"] == 0
    line.check(1000, pool, Engine(), counters)  # under the line: nothing to clear
    assert cleared == [5000]


def test_the_first_request_after_memory_came_back_is_served():
    """An idle tripped worker judges a new request on memory read now: the probe comes
    before intake, so the request that arrives once memory is back is not refused on the
    reading from before."""
    reading = {"mlx_active": 5000}
    s, _pool = _tripping(reading)
    _, refused = request(s, range(100, 110), 4)
    s.iterate()
    assert [e.code for e in refused if isinstance(e, Refused)] == ["memory_trip"]
    assert s.tripped
    reading["mlx_active"] = 0
    _, served = request(s, range(200, 210), 4)
    drain(s)
    assert not s.tripped and served[-1] == Finished("length", 4)


def test_chunks_after_a_prefix_hit_end_on_the_alignment():
    """With ``chunk_align`` (the engine's causal grid on CUDA) a prompt that hits a short
    cached prefix is cut so every chunk but its last ends on a multiple: the whole chunks
    then have the shapes of a prompt from position 0 (no grid padding, warmed plans)."""
    s, eng, _pool = make(total=512, block=4, prefill=32, align=16)
    header = list(range(200, 208))  # 2 blocks every prompt shares
    request(s, [*header, 1], 2)
    drain(s)
    eng.steps.clear()
    _, ev = request(s, [*header, *range(500, 600)], 2)
    drain(s)
    assert ev[0].cached_tokens == 8
    chunks = [(w.start, w.length) for st in eng.steps for w in st.prefills]
    assert chunks[0] == (8, 24)  # 8 + 24 = 32: on the alignment, not at 8 + 32
    assert all((start + n) % 16 == 0 for start, n in chunks[:-1]), chunks
    assert sum(n for _, n in chunks) == 100


@given(start=st.integers(0, 5000), n=st.integers(1, 4096), rest=st.integers(0, 5000),
       align=st.sampled_from([0, 16, 512]))
def test_an_aligned_cut_loses_less_than_half_and_never_the_last_chunk(start, n, rest, align):
    prompt_len = start + n + rest
    got = prefix.aligned(start, n, prompt_len, align)
    if align == 0 or rest == 0:
        assert got == n
    else:
        assert 0 < got <= n and (got == n or ((start + got) % align == 0 and got * 2 > n))


def test_a_speculating_worker_counts_every_draft_as_a_decode_row():
    """decode_fits charges a running sequence 1 + its drafts rows when speculation is on
    (verified drafts are rows of the decode step, engine/forward.rows_of_works)."""
    from plimsoll.worker.waiting import Run, decode_fits

    def bytes_for(rows: int, longest: int) -> int:
        return rows * longest

    plain = SchedulerLimits(8, 8, 1.0, 1 << 40, transient_bytes=4 * 100,
                            decode_bytes=bytes_for)
    spec = SchedulerLimits(8, 8, 1.0, 1 << 40, transient_bytes=4 * 100,
                           decode_bytes=bytes_for, decode_rows_per_seq=4)
    req = GenRequest(list(range(50)), 50, lambda e: None)
    running = [Run(GenRequest(list(range(50)), 50, lambda e: None), list(range(50)), 50, 50, 0)]
    assert decode_fits(plain, req, running)  # 2 rows × 100
    assert not decode_fits(spec, req, running)  # 8 rows × 100 > 4 × 100
    assert decode_fits(spec, req, [])  # 4 rows × 100
