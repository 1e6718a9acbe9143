"""Where a one-row decode step's host time goes: the engine's own loop against the scheduler's.

By hand, not a test; meant for a GPU, where ``run_async`` (the graph built and encoded) is
the whole step at one row. ``bench/overhead.py`` found the worker's scheduler loop ~2.7 ms a
step slower than the engine driven alone (bench/results/overhead-h100-2026-12-05-split.md);
this separates the suspects, one row each, ``STEPS`` steps, pipelined:

- ``A``: the engine on the main thread, one table of consecutive blocks (the baseline);
- ``B``: the table's blocks shuffled; ``C``: a new table tuple every step (as a growing table);
- ``D``: the scheduler's sampling parameters; ``E``: a second engine loaded and driven on a
  thread of its own (MLX streams belong to their thread);
- ``S``: the worker's :class:`~plimsoll.worker.scheduler.Scheduler` over a third engine, a
  request of ``STEPS`` tokens (its table and Work printed);

each with the median wall and thread-CPU ms of ``run_async`` and the garbage collector's time
per step; ``A`` and ``S`` also profiled (``cProfile``, top functions by own time). Prints only::

    MODEL=/tmp/qwen3-4b-shaped STEPS=250 PYTHONPATH=python python bench/run_async_split.py
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import random
import statistics
import threading
import time

import mlx.core as mx
from plimsoll.engine import Engine
from plimsoll.engine.work import Sampling, Step, Work
from plimsoll.worker.events import Finished, GenRequest, SchedulerLimits, Token
from plimsoll.worker.pool import BlockPool
from plimsoll.worker.scheduler import Scheduler

MODEL = os.environ.get("MODEL", "/tmp/qwen3-4b-shaped")
STEPS = int(os.environ.get("STEPS", "200"))
BT = 16
POOL = 4000
WARM = 20
PROMPT = tuple(range(1000, 1400))


class GcClock:
    """The collector's time and collections while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.t, self.n, self._t0 = 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.t += time.perf_counter() - self._t0
            self.n[info["generation"]] += 1

    def reset(self) -> None:
        self.t, self.n = 0.0, [0, 0, 0]


GC = GcClock()


def report(label: str, walls: list[float], cpus: list[float]) -> None:
    walls, cpus = walls[WARM:], cpus[WARM:]
    print(f"{label}: run_async wall med {1e3 * statistics.median(walls):.2f} ms, cpu med "
          f"{1e3 * statistics.median(cpus):.2f} ms, n={len(walls)}; gc "
          f"{1e3 * GC.t / max(len(walls), 1):.3f} ms/step, collections by gen {GC.n}",
          flush=True)


def profile(label: str, pr: cProfile.Profile, top: int = 22) -> None:
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(f"--- profile {label}\n" + "\n".join(s.getvalue().splitlines()[6:6 + top + 3]),
          flush=True)


def engine_loop(eng, label: str, table: tuple, sampling: Sampling | None = None,
                new_tuple: bool = False, prof: bool = False) -> None:
    eng.run(Step(prefills=(Work(0, PROMPT, 0, table, True),)))
    pos, pending, walls, cpus = len(PROMPT), None, [], []
    pr = cProfile.Profile()
    GC.reset()
    for i in range(STEPS):
        t = tuple(table[:-(-(pos + 1) // BT)]) if new_tuple else table
        kw = {} if sampling is None else {"sampling": sampling}
        step = Step(decodes=(Work(0, None if pending else (7,), pos, t, True, **kw),))
        t0, c0 = time.perf_counter(), time.thread_time()
        if prof and i >= WARM:
            pr.enable()
        nxt = eng.run_async(step)
        if prof and i >= WARM:
            pr.disable()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        if pending is not None:
            pending.result()
        pending, pos = nxt, pos + 1
    pending.result()
    eng.free_state(0)
    report(label, walls, cpus)
    if prof:
        profile(label, pr)


class Hooked:
    """The scheduler's engine, its decode-only ``run_async`` timed (and profiled when on)."""

    def __init__(self, eng) -> None:
        self._eng, self.walls, self.cpus, self.works = eng, [], [], []
        self.pr, self.profiling = cProfile.Profile(), False

    def __getattr__(self, name: str):
        return getattr(self._eng, name)

    def run_async(self, step):
        decode = bool(step.decodes) and not step.prefills
        t0, c0 = time.perf_counter(), time.thread_time()
        if decode and self.profiling:
            self.pr.enable()
        pending = self._eng.run_async(step)
        if decode and self.profiling:
            self.pr.disable()
        if decode:
            self.walls.append(time.perf_counter() - t0)
            self.cpus.append(time.thread_time() - c0)
            self.works.append(step.decodes[0])
        return pending

    def run(self, step):
        return self.run_async(step).result()

    def clear(self) -> None:
        self.walls, self.cpus, self.works = [], [], []


def scheduler_runs() -> None:
    hooked: dict[str, Hooked] = {}

    def setup(stack):
        hooked["e"] = Hooked(Engine.load(MODEL, block_tokens=BT, max_blocks=POOL))
        return hooked["e"], BlockPool(total=POOL, block_tokens=BT, cache_cap_blocks=POOL,
                                      extra_key=b"split")

    limits = SchedulerLimits(max_num_seqs=4, max_queue=16, max_wait_s=600, trip_bytes=1 << 62,
                             max_batch=4, prefill_tokens=512)
    sched = Scheduler(setup, limits, lambda: {"mlx_active": mx.get_active_memory()})
    sched.start()
    sched.ready.wait()

    def one(first: int, n: int = STEPS) -> None:
        done = threading.Event()

        def sink(ev) -> None:
            if isinstance(ev, Finished) or not (isinstance(ev, Token)
                                                or hasattr(ev, "prompt_tokens")):
                done.set()

        sched.submit(GenRequest(prompt=list(range(first, first + 400)), max_tokens=n,
                                sink=sink))
        done.wait(600)

    try:
        h = None
        one(5000, 40)  # warm
        h = hooked["e"]
        h.clear()
        GC.reset()
        one(2000)
        report("S scheduler", h.walls, h.cpus)
        w = h.works[-1]
        print("S last work:", {k: getattr(w, k) for k in ("seq_id", "start", "sampling",
                                                           "constraint", "draft", "lookup")},
              "table:", w.block_table, flush=True)
        h.clear()
        h.profiling = True
        GC.reset()
        one(3000)
        h.profiling = False
        report("S scheduler profiled", h.walls, h.cpus)
        profile("S scheduler", h.pr)
    finally:
        sched.stop()


def main() -> int:
    eng = Engine.load(MODEL, block_tokens=BT, max_blocks=POOL)
    need = -(-(len(PROMPT) + STEPS + 8) // BT)
    consecutive = tuple(range(need))
    ids = list(range(100, 100 + 4 * need))
    random.Random(7).shuffle(ids)
    engine_loop(eng, "A consecutive", consecutive)
    engine_loop(eng, "A consecutive (again)", consecutive)
    engine_loop(eng, "B shuffled", tuple(ids[:need]))
    engine_loop(eng, "C growing tuples, consecutive", consecutive, new_tuple=True)
    engine_loop(eng, "A consecutive profiled", consecutive, prof=True)
    engine_loop(eng, "D consecutive, the scheduler's sampling", consecutive,
                sampling=Sampling(temperature=0.0))

    def own_thread() -> None:
        other = Engine.load(MODEL, block_tokens=BT, max_blocks=POOL)
        engine_loop(other, "E consecutive, engine on its own thread", consecutive)
        engine_loop(other, "E again", consecutive)

    thread = threading.Thread(target=own_thread)
    thread.start()
    thread.join()
    del eng
    mx.clear_cache()
    scheduler_runs()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
