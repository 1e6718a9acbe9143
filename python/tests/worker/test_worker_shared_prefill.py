"""The scheduler's order and sharing over the real paged engine (mlx-lm, tiny demo, CPU).

Driven step by step on this thread (``Scheduler.iterate``), the engine wrapped only to
record what it is handed: a step with prompt chunks is submitted after the previous step's
tokens are out; a chunk's blocks are mapped by a prompt admitted in the same step; a
waiter whose next blocks a running prefill is still to write waits for them, so shared
prefixes are computed once; greedy output equals mlx-lm's own throughout."""

from __future__ import annotations

import pytest

from plimsoll.demo.model import build_demo_model
from plimsoll.engine.core import Engine
from plimsoll.engine.drive import reference, sharpen, text
from plimsoll.worker.events import Finished, GenRequest, SchedulerLimits, Started, Token
from plimsoll.worker.pool import BlockPool
from plimsoll.worker.scheduler import Scheduler

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("shared") / "tiny", preset="tiny")


class Recorded:
    """A real engine whose ``run_async`` records each step and the events out before it."""

    def __init__(self, model_dir, max_blocks: int):
        self.eng = Engine.load(model_dir, block_tokens=BLOCK, max_blocks=max_blocks)
        sharpen(self.eng.model)
        self.log: list = []  # ("submit", step) and ("event", request index, event), in order
        run_async = self.eng.run_async

        def recorded(step):
            self.log.append(("submit", step))
            return run_async(step)

        self.eng.run_async = recorded

    def prefill_tokens(self) -> int:
        return sum(w.length for kind, *rest in self.log if kind == "submit"
                   for w in rest[0].prefills)


def scheduler(rec: Recorded, total: int, prefill: int, chunk_for=None) -> Scheduler:
    pool = BlockPool(total=total, block_tokens=BLOCK, cache_cap_blocks=total)
    limits = SchedulerLimits(max_num_seqs=1, max_queue=64, max_wait_s=600, trip_bytes=1 << 62,
                             max_batch=16, prefill_tokens=prefill, chunk_for=chunk_for)
    s = Scheduler(lambda stack: (rec.eng, pool), limits, lambda: {})
    s.engine, s.pool, s.eos_ids = rec.eng, pool, set()
    return s


def submit(s: Scheduler, rec: Recorded, prompt: list[int], n: int) -> list:
    events: list = []
    index = sum(1 for e in rec.log if e[0] == "request")
    rec.log.append(("request", index))

    def sink(ev):
        events.append(ev)
        rec.log.append(("event", index, ev))

    s.submit(GenRequest(prompt=list(prompt), max_tokens=n, sink=sink))
    return events


def tokens(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, Token)]


def started(events: list) -> Started:
    return next(e for e in events if isinstance(e, Started))


def drain(s: Scheduler, limit: int = 5_000) -> None:
    for _ in range(limit):
        s.iterate()
        if not s._running and not s._waiting and not s._inbox and s._pending is None:
            return
    raise AssertionError("the scheduler did not drain")


def test_tokens_are_out_before_a_step_with_prompt_chunks_is_submitted(tiny_dir):
    rec = Recorded(tiny_dir, 128)
    s = scheduler(rec, 128, prefill=32)
    a_prompt, b_prompt = text(rec.eng.tokenizer, 20, salt=1), text(rec.eng.tokenizer, 100, salt=2)
    a = submit(s, rec, a_prompt, 30)
    for _ in range(4):
        s.iterate()
    b = submit(s, rec, b_prompt, 4)  # 3 chunks (past a's first block) while a decodes
    drain(s)
    sampled, out, checked = [], 0, {"prefill": 0, "decode": 0}
    for entry in rec.log:
        if entry[0] == "event" and isinstance(entry[2], Finished):
            break  # an ended sequence's last sampled token is dropped: counts stop here
        if entry[0] == "event":
            out += isinstance(entry[2], Token)
        elif entry[0] == "submit":
            step = entry[1]
            if sampled and step.prefills:  # every earlier step's tokens are out already
                assert out == sum(sampled), "a prompt chunk was submitted before tokens"
                checked["prefill"] += 1
            elif len(sampled) > 1:  # a decode-only step is submitted before the last is read
                assert out == sum(sampled[:-1])
                checked["decode"] += 1
            sampled.append(sum(w.sample for w in (*step.decodes, *step.prefills)))
    assert checked["prefill"] == 3 and checked["decode"] >= 2
    assert [tokens(a), tokens(b)] == [reference(rec.eng.model, a_prompt, 30),
                                      reference(rec.eng.model, b_prompt, 4)]


def test_a_request_admitted_in_the_same_step_maps_its_neighbours_blocks(tiny_dir):
    rec = Recorded(tiny_dir, 128)
    s = scheduler(rec, 128, prefill=512)
    system = text(rec.eng.tokenizer, 5 * BLOCK, salt=3)
    prompts = [[*system, 3 + i, *text(rec.eng.tokenizer, 12, salt=40 + i)] for i in range(2)]
    a, b = (submit(s, rec, p, 8) for p in prompts)
    s.iterate()
    assert set(s.step_log[-1][2]) == set(s._running)  # both admitted in this one step
    assert started(a).cached_tokens == 0
    assert started(b).cached_tokens == 5 * BLOCK  # a's blocks, planned in this very step
    drain(s)
    assert rec.prefill_tokens() == len(prompts[0]) + len(prompts[1]) - 5 * BLOCK
    assert [tokens(a), tokens(b)] == [reference(rec.eng.model, p, 8) for p in prompts]


def shared_prompts(rec: Recorded, n: int, shared: int, own: int) -> list[list[int]]:
    prefix = text(rec.eng.tokenizer, shared, salt=1)
    return [[*prefix, 3 + i, *text(rec.eng.tokenizer, own - 1, salt=100 + i)] for i in range(n)]


def test_eight_shared_prefix_requests_compute_the_prefix_once(tiny_dir):
    rec = Recorded(tiny_dir, 8 * 20 + 8)
    s = scheduler(rec, 8 * 20 + 8, prefill=512)
    prompts = shared_prompts(rec, 8, 256, 48)
    reqs = [submit(s, rec, p, 2) for p in prompts]
    drain(s)
    assert rec.prefill_tokens() == 256 + 8 * 48  # one prefix + the tasks
    assert [started(r).cached_tokens for r in reqs] == [0] + [256] * 7
    assert tokens(reqs[-1]) == reference(rec.eng.model, prompts[-1], 2)


def run_capped(model_dir) -> tuple[Recorded, Scheduler, list[list[int]], list]:
    rec = Recorded(model_dir, 8 * 20 + 8)
    # chunks of 64 (a transient bound) under a budget of 512: the shared prefix takes 4 steps
    s = scheduler(rec, 8 * 20 + 8, prefill=512, chunk_for=lambda n: 64)
    prompts = shared_prompts(rec, 8, 256, 48)
    reqs = [submit(s, rec, p, 2) for p in prompts]
    drain(s)
    return rec, s, prompts, reqs


def test_a_waiter_waits_for_the_blocks_a_running_prefill_is_still_to_write(
        tiny_dir, monkeypatch):
    rec, s, prompts, reqs = run_capped(tiny_dir)
    assert rec.prefill_tokens() == 256 + 8 * 48  # nobody computed the prefix a second time
    assert [started(r).cached_tokens for r in reqs] == [0] + [256] * 7
    admitted = [step for step, _, chunks in s.step_log if len(chunks) > 1]
    assert admitted and min(admitted) == 4  # with the first's chunk that ends the prefix
    assert tokens(reqs[3]) == reference(rec.eng.model, prompts[3], 2)
    # admitted as soon as the budget allows instead, they compute parts of it again
    monkeypatch.setattr("plimsoll.worker.waiting.in_flight", lambda *args: False)
    assert run_capped(tiny_dir)[0].prefill_tokens() > 256 + 8 * 48
