"""The engine's host time for a decode step, a verifying step drafted on the host and one
chained on the device: Python building the step, in process.

By hand, not a test. Loads :class:`plimsoll.engine.Engine` on ``--model`` (default: the tiny
demo built under ``--dir``), prefills three sequences of ``--prompt`` random tokens, then for
``--steps`` rounds times, per kind of step, :meth:`Engine.run_async` minus its time inside
``mx.async_eval`` (thread CPU time: on the CPU backend that call blocks on compute, on a GPU it
is the backend's encoding and its throttle), and counts the nodes of each kind's graph once
(``mx.export_to_dot``; on the CPU MLX's fast ops are their fallback graphs). The question it
answers: is a verifying step's extra cost on a GPU Python's, or inside ``mx.async_eval``?
With ``--ab`` the same steps run ``--rounds`` times with the model's linear layers plain
(mlx's ``nn.Linear``) and held (:mod:`plimsoll.engine.linear`: what the engine serves
with), interleaved; the layers the few-row CUDA kernel took (``engine/skinny_cuda``) stay held.
Greedy, k = 3::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/verify_host.py --model /tmp/deep2
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from plimsoll.demo.model import build_demo_model
from plimsoll.engine import Engine, forward, linear
from plimsoll.engine.work import Step, Work

from lib import report

K = 3


class HostClock:
    """Wraps ``mx.async_eval`` in :mod:`plimsoll.engine.forward`: the thread CPU time spent
    inside it, and each named step's graph nodes the first time that step submits."""

    def __init__(self, dot_dir: Path) -> None:
        self.inside, self.inside_wall, self.current, self.nodes = 0.0, 0.0, None, {}
        self._dir, self.original = dot_dir, mx.async_eval

    def __call__(self, *args, **kw):
        if self.current is not None and self.current not in self.nodes:
            arrays = args[0] if isinstance(args[0], list | tuple) else list(args)
            path = self._dir / f"{self.current}.dot"
            mx.export_to_dot(str(path), *[a for a in arrays if isinstance(a, mx.array)])
            self.nodes[self.current] = collections.Counter(
                re.findall(r'label ?="([A-Za-z]\w*)', path.read_text()))
        t, w = time.thread_time(), time.perf_counter()
        out = self.original(*args, **kw)
        self.inside += time.thread_time() - t
        self.inside_wall += time.perf_counter() - w
        return out

    def host_ms(self, name: str, eng: Engine, step: Step):
        """``eng.run_async(step)`` timed; (pending, (host ms, CPU ms inside ``mx.async_eval``,
        wall ms inside it))."""
        self.current, self.inside, self.inside_wall = name, 0.0, 0.0
        t = time.thread_time()
        pending = eng.run_async(step)
        host = time.thread_time() - t - self.inside
        self.current = None
        return pending, (1e3 * host, 1e3 * self.inside, 1e3 * self.inside_wall)


def _plain(model) -> None:
    """mlx's own linear layers: the held views dropped."""
    linear.release(model)


def _held(model) -> None:
    """What the engine serves with: held views."""
    linear.hold(model)


def run(args) -> dict:
    model = args.model or build_demo_model(args.dir / "tiny", preset="tiny")
    eng = Engine.load(model, block_tokens=16, max_blocks=512)
    eng.transient_budget = 1 << 40  # as the worker: no pacing of these small steps
    clock = HostClock(Path(tempfile.mkdtemp()))
    forward.mx.async_eval = clock  # (forward's mx is mlx.core: every caller is timed)
    try:
        if not args.ab:
            return _steps(args, eng, clock)
        out: dict = {}
        for _ in range(args.rounds):
            for mode, swap in (("plain", _plain), ("held", _held)):
                swap(eng.model)
                for name, r in _steps(args, eng, clock, f" ({mode})").items():
                    out.setdefault(name, []).append(r)
        return {name: {**rs[0], **{k: statistics.median(r[k] for r in rs) for k in rs[0]
                                   if k.endswith("_median")},
                       "host_ms_min": min(r["host_ms_min"] for r in rs), "rounds": len(rs)}
                for name, rs in out.items()}
    finally:
        forward.mx.async_eval = clock.original


def _steps(args, eng: Engine, clock: HostClock, suffix: str = "") -> dict:
    """The three kinds of step, ``args.steps`` each (named with ``suffix``); their host ms
    and graph nodes. The sequences are freed after."""
    rng = np.random.default_rng(0)
    prompt = tuple(int(x) for x in rng.integers(5, 4000, args.prompt))

    def table(i: int) -> tuple[int, ...]:
        return tuple(range(i * 64, i * 64 + 64))

    first = eng.run(Step(prefills=tuple(Work(s, prompt, 0, table(s), True) for s in (0, 1, 2))))
    pos = dict.fromkeys((0, 1, 2), len(prompt))
    hist = {s: [*prompt, first[s]] for s in (0, 1, 2)}
    times = collections.defaultdict(list)
    for _ in range(args.steps):
        pending, ms = clock.host_ms("decode" + suffix, eng, Step(decodes=(
            Work(0, (hist[0][-1],), pos[0], table(0), True),)))
        times["decode" + suffix].append(ms)
        hist[0].append(pending.result()[0])
        pos[0] += 1
        drafts = tuple(hist[1][-K:])
        pending, ms = clock.host_ms("verify" + suffix, eng, Step(prefills=(
            Work(1, (hist[1][-1], *drafts), pos[1], table(1), True, draft=K),)))
        times["verify" + suffix].append(ms)
        got = pending.result()[1]
        hist[1] += got
        pos[1] += len(got)
    pending = eng.run_async(Step(prefills=(Work(
        2, (hist[2][-1], *hist[2][-K:]), pos[2], table(2), True, draft=K, lookup=K,
        history=np.asarray(hist[2], dtype=np.int32)),)))
    for _ in range(args.steps):
        nxt, ms = clock.host_ms("chained" + suffix, eng, Step(prefills=(
            Work(2, None, pos[2] + K + 1, table(2), True, draft=K, lookup=K),)))
        times["chained" + suffix].append(ms)
        pos[2] += len(pending.result()[2])
        pending = nxt
    pending.result()
    for s in (0, 1, 2):
        eng.free_state(s)
    skip = min(3, args.steps - 1)
    def median(v: list, i: int) -> float:
        return statistics.median(x[i] for x in v[skip:])

    return {name: {"host_ms_median": median(v, 0), "host_ms_min": min(x[0] for x in v[skip:]),
                   "eval_cpu_ms_median": median(v, 1), "eval_wall_ms_median": median(v, 2),
                   "nodes": sum(clock.nodes.get(name, {}).values()),
                   "ops": dict(clock.nodes.get(name, {}).most_common())}
            for name, v in times.items()}


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [*report.heading("Host time of a decode and a verifying step", result),
             f"Model {a['model'] or 'the tiny demo'}, prompts of {a['prompt']} tokens, k = {K}, "
             f"{a['steps']} steps each (the first three left out). Host ms: `run_async` minus "
             "its thread time inside `mx.async_eval`; `async_eval` CPU / wall ms: the thread "
             "time and the wall time inside it (the backend's encoding, and on a GPU its "
             "throttle's wait: wall less CPU).", ""]
    lines += report.table(["step", "host ms (median)", "host ms (lowest)", "async_eval CPU ms",
                           "async_eval wall ms", "graph nodes"],
                          [[name, report.num(r["host_ms_median"]), report.num(r["host_ms_min"]),
                            report.num(r.get("eval_cpu_ms_median")),
                            report.num(r.get("eval_wall_ms_median")), r["nodes"]]
                           for name, r in result["steps"].items()])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a built model directory (default: tiny demo)")
    ap.add_argument("--dir", type=Path, default=report.OUT / "verify_host")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ab", action="store_true",
                    help="plain against held linear layers, interleaved (medians of rounds)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --ab")
    report.output_args(ap, "verify-host")
    args = ap.parse_args()
    return report.measure_and_write(args, "verify-host", run, markdown, key="steps")


if __name__ == "__main__":
    sys.exit(main())
