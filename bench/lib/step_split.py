"""Where the engine thread's time per decode step goes, for bench/overhead.py's in-process modes.

:class:`StepClock` adds up wall and thread-CPU time of named parts of the thread that drives
the engine; :class:`TimedEngine` wraps an engine so that ``run_async`` (building the step's
graph and queueing it: ``build``) and ``Pending.result`` (waiting for the step's tokens and
reading them: ``wait``) are timed; :func:`timed_scheduler` makes a Scheduler subclass whose
``iterate`` is timed too, so the scheduler's own Python per step is ``iterate − build −
wait`` and the loop's time between two iterations (idle checks, publishing, flushing) is
``between``. Only what falls inside an open window counts (:meth:`StepClock.open` /
:meth:`StepClock.close`: the bench opens it once every stream decodes and closes it when
the first one ends), so the figures are those of steady decode, the same steps the engine
mode times.

How to read them on a GPU: pipelined, ``wait`` is where the host idles for the device (the
device is the bound); ``build`` beyond its thread CPU is time blocked inside ``async_eval``
(MLX's queue-depth or memory-limit throttle); a large ``scheduler`` or ``between`` is
Python that the device waits for.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from . import report

PARTS = ("iterate", "build", "wait", "between")


class StepClock:
    """Wall and thread-CPU seconds per part while a window is open; steps counted by build."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every figure: a new window (one per round)."""
        self.wall = dict.fromkeys(PARTS, 0.0)
        self.cpu = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self.on = False
        self.opened_at = self.closed_at = 0.0
        self.cpu_opened = self.cpu_closed = 0.0
        self.last_end: tuple[float, float] | None = None  # wall, thread CPU: last iterate's end

    def open(self) -> None:
        if not self.on and not self.opened_at:
            self.on, self.opened_at, self.cpu_opened = True, time.perf_counter(), \
                time.process_time()

    def close(self) -> None:
        if self.on:
            self.on, self.closed_at, self.cpu_closed = False, time.perf_counter(), \
                time.process_time()

    def add(self, part: str, wall: float, cpu: float) -> None:
        if self.on:
            self.wall[part] += wall
            self.cpu[part] += cpu

    def figures(self) -> dict[str, float | int | None]:
        """Per step of the window: ms of wall and of thread CPU by part, the scheduler's
        own share (iterate less build and wait), the window's ms per step and process CPU."""
        n = self.steps
        if not n or not self.closed_at:
            return {"steps": n}
        ms = {f"{p}_ms": 1000 * self.wall[p] / n for p in PARTS}
        ms |= {f"{p}_cpu_ms": 1000 * self.cpu[p] / n for p in PARTS}
        ms["scheduler_ms"] = ms["iterate_ms"] - ms["build_ms"] - ms["wait_ms"]
        ms["scheduler_cpu_ms"] = ms["iterate_cpu_ms"] - ms["build_cpu_ms"] - ms["wait_cpu_ms"]
        return {"steps": n, **ms,
                "step_ms": 1000 * (self.closed_at - self.opened_at) / n,
                "cpu_ms_per_step": 1000 * (self.cpu_closed - self.cpu_opened) / n}


class _TimedPending:
    def __init__(self, pending: Any, clock: StepClock) -> None:
        self._pending, self._clock = pending, clock

    def result(self):
        t, c = time.perf_counter(), time.thread_time()
        out = self._pending.result()
        self._clock.add("wait", time.perf_counter() - t, time.thread_time() - c)
        return out


class TimedEngine:
    """An engine whose ``run_async`` and its Pending's ``result`` are timed on ``clock``;
    every other attribute is the engine's own. ``open_on_decode``: the first step of
    decodes only opens the window (a loop that prefills every prompt first)."""

    def __init__(self, engine: Any, clock: StepClock, open_on_decode: bool = False) -> None:
        self._engine, self._clock, self._open_on_decode = engine, clock, open_on_decode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def run_async(self, step):
        if self._open_on_decode and step.decodes and not step.prefills:
            self._clock.open()  # the engine mode: its decode loop starts
        t, c = time.perf_counter(), time.thread_time()
        pending = self._engine.run_async(step)
        self._clock.add("build", time.perf_counter() - t, time.thread_time() - c)
        if self._clock.on and (step.decodes or step.prefills):
            self._clock.steps += 1
        return _TimedPending(pending, self._clock)

    def run(self, step):
        return self.run_async(step).result()


def timed_scheduler(base: type, clock: StepClock) -> type:
    """A subclass of the Scheduler class ``base`` whose ``iterate`` is timed on ``clock``
    (and the loop's time between two iterations)."""

    class Timed(base):
        def iterate(self) -> None:
            t, c = time.perf_counter(), time.thread_time()
            if clock.last_end is not None:
                clock.add("between", t - clock.last_end[0], c - clock.last_end[1])
            super().iterate()
            end, end_cpu = time.perf_counter(), time.thread_time()
            clock.add("iterate", end - t, end_cpu - c)
            clock.last_end = (end, end_cpu)

    return Timed


def kernel_verdicts(eng) -> list[dict]:
    """Which decode kernel the engine checked and uses (a verdict per kernel)."""
    return [{k: v[k] for k in ("name", "used", "reason")} for v in eng.kernels.report()]


def median_split(splits: list[dict]) -> dict:
    """Per key, the median over rounds of :meth:`StepClock.figures`."""
    keys = {k for s in splits for k in s}
    return {k: statistics.median(s[k] for s in splits if s.get(k) is not None)
            for k in sorted(keys) if any(s.get(k) is not None for s in splits)}


def split_table(result: dict) -> list[str]:
    """Steady decode (every stream decoding) per step, each in-process mode of the run: ms
    per step, process CPU ms, and the engine thread's split (wall ms, its own CPU ms in
    parentheses); each mode's added ms per step over the engine alone."""
    f = report.num
    modes = [m for m in ("engine", "engine_shuffled", "scheduler", "scheduler_main",
                         "scheduler_quiet") if m in result]
    if not modes:
        return []

    def part(sp: dict, name: str) -> str:
        if sp.get(f"{name}_ms") is None:
            return report.DASH
        return f"{sp[f'{name}_ms']:.2f} ({sp[f'{name}_cpu_ms']:.2f})"

    rows = []
    for n in result["streams"]:
        for mode in modes:
            at = result.get(mode, {}).get(str(n), {})
            sp = at.get("split", {})
            if not sp:
                continue
            eng = result.get("engine", {}).get(str(n), {}).get("split", {})
            sched = mode.startswith("scheduler")
            added = (sp.get("step_ms") - eng["step_ms"]
                     if mode != "engine" and eng.get("step_ms") and sp.get("step_ms") else None)
            rows.append([n, mode, f(sp.get("step_ms"), ".2f"), f(sp.get("cpu_ms_per_step"), ".2f"),
                         part(sp, "build"), part(sp, "wait"),
                         part(sp, "scheduler") if sched else report.DASH,
                         part(sp, "between") if sched else report.DASH,
                         f(added, ".2f")])
    kernels = {m: ", ".join(f"{k['name']} {'used' if k['used'] else 'not used'}"
                            for k in result.get(m, {}).get("kernels", []))
               for m in modes}
    return ["", "Steady decode in process (from the last stream's first token to the first "
            "stream's end; the engine alone: its decode loop), per step: wall ms, process CPU "
            "ms, and the engine thread's split, wall ms (its own CPU ms): build = "
            "`run_async` (graph built and queued), wait = `result()` (the step's tokens), "
            "scheduler = the rest of `iterate`, between = the loop between two iterations",
            "", *report.table(["streams", "mode", "ms/step", "CPU ms/step", "build", "wait",
                               "scheduler", "between", "added ms/step (− engine)"],
                              rows),
            "", "Decode kernels: " + "; ".join(f"{m} {k or report.DASH}"
                                               for m, k in kernels.items())]
