"""The scheduler and block pool over the real paged engine (mlx-lm, tiny models, CPU).

The scheduler is driven step by step on this thread (``Scheduler.iterate``), so the
assertions are on scheduler steps and physical block ids, not on wall time: shared
prompt blocks held once, partial matches, eviction under pressure, a long prefill that
delays running streams by one chunk per step, and greedy output equal to mlx-lm's own
for the tiny and the hybrid demo, batched."""

from __future__ import annotations

import itertools

import pytest

from plimsoll.core.sizing import fixed_blocks
from plimsoll.demo.model import build_demo_model
from plimsoll.engine.core import Engine
from plimsoll.engine.drive import reference, sharpen, text
from plimsoll.worker.events import Finished, GenRequest, SchedulerLimits, Started, Token
from plimsoll.worker.pool import BlockPool
from plimsoll.worker.scheduler import Scheduler

BLOCK = 16


def load(model_dir, max_blocks: int) -> Engine:
    eng = Engine.load(model_dir, block_tokens=BLOCK, max_blocks=max_blocks)
    sharpen(eng.model)  # greedy output that varies token to token: equality means something
    return eng


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("paged") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("paged") / "hybrid", preset="hybrid")


def scheduler(eng: Engine, total: int, cap: int | None = None, prefill: int = 64,
              max_batch: int = 16) -> Scheduler:
    facts = eng.facts
    pool = BlockPool(total=total, block_tokens=BLOCK,
                     cache_cap_blocks=total if cap is None else cap,
                     fixed_blocks_per_seq=fixed_blocks(facts.per_sequence_fixed_bytes,
                                                       eng.block_bytes),
                     hybrid=eng.state_bytes_per_seq > 0)
    limits = SchedulerLimits(max_num_seqs=1, max_queue=64, max_wait_s=600, trip_bytes=1 << 62,
                             max_batch=max_batch, prefill_tokens=prefill)
    s = Scheduler(lambda stack: (eng, pool), limits, lambda: {})
    s.engine, s.pool = eng, pool
    s.eos_ids = set()  # random weights: run every reservation to its end
    return s


class Req:
    def __init__(self, s: Scheduler, prompt: list[int], n: int):
        self.events: list = []
        self.steps: list[int] = []  # the scheduler step in which each token was read
        self.s = s

        def sink(ev):
            self.events.append(ev)
            if isinstance(ev, Token):
                self.steps.append(s._steps)

        self.gen = GenRequest(prompt=list(prompt), max_tokens=n, sink=sink)
        s.submit(self.gen)

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, Token)]

    @property
    def started(self) -> Started:
        return next(e for e in self.events if isinstance(e, Started))

    @property
    def done(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], Finished)


def drain(s: Scheduler, limit: int = 20_000) -> None:
    for _ in range(limit):
        s.iterate()
        if not s._running and not s._waiting and not s._inbox and s._pending is None:
            return
    raise AssertionError("the scheduler did not drain")


def test_two_live_sequences_share_physical_blocks_counted_once(tiny_dir):
    eng = load(tiny_dir, 256)
    s = scheduler(eng, 256)
    system = text(eng.tokenizer, 8 * BLOCK, salt=1)
    prompts = [system + text(eng.tokenizer, 9, salt=s_) for s_ in (50, 60)]
    a = Req(s, prompts[0], 24)
    for _ in range(4):
        s.iterate()
    b = Req(s, prompts[1], 24)
    s.iterate()
    assert b.started.cached_tokens == 8 * BLOCK  # mapped from a's running blocks
    assert s.pool.shared == 8
    assert s.pool.table(b.gen.id)[:8] == s.pool.table(a.gen.id)[:8]  # the same physical ids
    st = s.stats
    assert st["shared_blocks"] == 8
    distinct = len(set(s.pool.table(a.gen.id)) | set(s.pool.table(b.gen.id)))
    assert st["kv_bytes_held"] == (distinct + s.pool.cached) * eng.block_bytes
    assert st["kv_bytes_allocated"] <= 256 * eng.block_bytes
    drain(s)
    assert [a.tokens, b.tokens] == [reference(eng.model, p, 24) for p in prompts]
    assert s.stats["prefill_tokens_computed"] == len(prompts[0]) + 9  # the prefix once


def test_an_edited_conversation_keeps_the_blocks_before_the_edit(tiny_dir):
    eng = load(tiny_dir, 256)
    s = scheduler(eng, 256)
    conv = text(eng.tokenizer, 10 * BLOCK + 5, salt=3)
    first = Req(s, conv, 4)
    drain(s)
    edited = [*conv[:6 * BLOCK + 3], conv[6 * BLOCK + 3] + 1, *conv[6 * BLOCK + 4:]]
    second = Req(s, edited, 12)
    drain(s)
    assert first.started.cached_tokens == 0
    assert second.started.cached_tokens == 6 * BLOCK  # up to the first differing block
    assert second.tokens == reference(eng.model, edited, 12)
    assert s.stats["prefix"]["hit_blocks"] == 6


def test_cached_blocks_are_evicted_under_pressure_and_stay_correct(tiny_dir):
    eng = load(tiny_dir, 24)
    s = scheduler(eng, 24, prefill=32)
    prompts = [text(eng.tokenizer, 5 * BLOCK + 2, salt=k) for k in (100, 200, 300, 400, 500, 600)]
    runs = []
    for p in prompts:  # each holds 6 of 24 blocks while it runs, leaves 5 cached: 30 > 24
        runs.append(Req(s, p, 8))
        drain(s)
    assert s.pool.counters["evicted_blocks"] > 0
    again = Req(s, prompts[-1], 8)  # the newest survived: a hit
    drain(s)
    assert again.started.cached_tokens == 5 * BLOCK
    for r, p in zip([*runs, again], [*prompts, prompts[-1]], strict=True):
        assert r.tokens == reference(eng.model, p, 8)
    assert s.stats["kv_bytes_peak"] <= 24 * eng.block_bytes


def test_a_long_prefill_delays_running_streams_by_one_chunk_per_step(tiny_dir):
    eng = load(tiny_dir, 256)
    s = scheduler(eng, 256, prefill=128)
    streams = [Req(s, text(eng.tokenizer, 20, salt=k), 100) for k in (7, 8, 9)]
    for _ in range(6):
        s.iterate()
    assert all(r.tokens for r in streams)
    long = Req(s, text(eng.tokenizer, 2048, salt=11), 4)
    begin = s._steps
    while not long.tokens:
        s.iterate()
    end = s._steps
    assert end - begin >= 2048 // 128  # it took many steps ...
    for r in streams:  # ... and every stream got a token in every one of them
        during = [t for t in r.steps if begin < t <= end]
        assert len(during) >= end - begin - 1
        assert all(b - a == 1 for a, b in itertools.pairwise(during))
    for step, decoded, chunks in s.step_log:
        if begin < step <= end:
            assert sum(chunks.values()) <= 128
            assert {r.gen.id for r in streams} <= set(decoded)
    drain(s)
    assert streams[0].tokens == reference(eng.model, streams[0].gen.prompt, 100)


def test_batched_greedy_equals_mlx_lm_tiny(tiny_dir):
    eng = load(tiny_dir, 256)
    s = scheduler(eng, 256, prefill=40)
    prompts = [text(eng.tokenizer, n, salt=n) for n in (5, 17, 33, 64, 90)]
    reqs = [Req(s, p, 10) for p in prompts]
    drain(s)
    assert max(len(w) for _, w, _ in s.step_log) >= 4  # really batched
    assert [r.tokens for r in reqs] == [reference(eng.model, p, 10) for p in prompts]


def test_hybrid_greedy_equals_mlx_lm_batched_and_through_a_snapshot(hybrid_dir):
    eng = load(hybrid_dir, 256)
    s = scheduler(eng, 256, prefill=48)  # the first prompt's first chunk ends on block 3
    assert s.pool.hybrid and s.pool.fixed_blocks_per_seq >= 1
    base = text(eng.tokenizer, 3 * BLOCK, salt=5)
    prompts = [base + text(eng.tokenizer, n, salt=n) for n in (7, 20, 35)]
    first = Req(s, prompts[0], 6)
    drain(s)
    reqs = [Req(s, p, 6) for p in prompts[1:]]
    drain(s)
    assert first.started.cached_tokens == 0
    # the state snapshot at the end of a block of the first prompt lets them map it; the
    # last one's fourth block is the second's too (text() begins alike for every salt): it
    # waits one step for the second's snapshot there instead of computing that block again
    assert [r.started.cached_tokens for r in reqs] == [3 * BLOCK, 4 * BLOCK]
    assert [first.tokens, *(r.tokens for r in reqs)] == [
        reference(eng.model, p, 6) for p in prompts]
    drain(s)
    assert eng.state_bytes_held() <= (s.pool.stats()["snapshots"]) * eng.state_bytes_per_seq


def test_a_reservation_filled_to_its_last_block_never_fails(tiny_dir):
    """Issue 14's retain off-by-one: the pipelined step writes one token past the last one
    read; it lies inside the reservation (positions < prompt + max_tokens), so a pool of
    exactly one reservation serves it, and serves it again from its cached blocks."""
    eng = load(tiny_dir, 4)
    s = scheduler(eng, 4, prefill=64)
    prompt = text(eng.tokenizer, 40, salt=13)
    first = Req(s, prompt, 24)  # 64 tokens = 4 blocks = the whole pool
    drain(s)
    again = Req(s, prompt, 24)
    drain(s)
    want = reference(eng.model, prompt, 24)
    assert first.events[-1] == Finished("length", 24) and first.tokens == want
    assert again.started.cached_tokens == 2 * BLOCK and again.tokens == want
    assert s.counters.get("refused_worker_error", 0) == 0 and s.pool.committed == 0


def test_an_idle_scheduler_builds_attention_plans_ahead_only_while_idle(tiny_dir, monkeypatch):
    """The scheduler thread runs the plan warmer (engine/warmup.PlanWarmer) while nothing
    runs or waits, one shape a pass; a request that arrives meanwhile is served first and
    exactly, and the status reports the warmer's progress."""
    import threading
    import time

    import mlx.core as mx

    from plimsoll.engine import attention
    from plimsoll.engine.warmup import PlanWarmer

    eng = load(tiny_dir, 256)  # this thread's: the reference and the pool's figures
    pool = scheduler(eng, 256).pool
    held: list = []  # events wait for the pass's flush, as the engine process's do

    def flush():
        while held:
            deliver(held.pop(0))

    s = Scheduler(lambda stack: (load(tiny_dir, 256), pool), scheduler(eng, 256).limits,
                  lambda: {}, flush=flush)  # the thread loads its own (MLX streams are per thread)
    busy_builds = []
    real = attention.build_plan

    def build(sig, q, k):
        busy_builds.append(bool(s._running or s._waiting or s._inbox))
        time.sleep(0.002)
        real(sig, q, k)

    monkeypatch.setattr(attention, "_SIGNATURES", {(4, 16, 2, 16, mx.float32, None): None})
    monkeypatch.setattr(attention, "build_plan", build)
    s.warmer = PlanWarmer([(16 * (i % 4 + 1), 16 * (i % 4 + 1) + 64) for i in range(400)])
    prompt = text(eng.tokenizer, 40, salt=9)
    done = threading.Event()
    tokens: list[int] = []

    built_at_end: list[int] = []

    def deliver(ev):
        if isinstance(ev, Token):
            tokens.append(ev.token_id)
        if isinstance(ev, Finished):
            built_at_end.append(s.warmer.built)
            done.set()

    sink = held.append

    s.start()
    try:
        deadline = time.monotonic() + 60
        while s.warmer.built < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.submit(GenRequest(prompt=list(prompt), max_tokens=8, sink=sink, ignore_eos=True))
        assert done.wait(60)
        while s.warmer.built < 400 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
    finally:
        s.stop()
    assert s.warmer.built == 400 and not any(busy_builds)
    assert built_at_end[0] < 400  # the request's end went out before the warming went on
    assert s.stats["attention_plans"]["built"] == 400
    assert tokens == reference(eng.model, prompt, 8)
