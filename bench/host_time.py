"""Host time per decode step: the graph built in Python against the whole step, in process.

By hand, not a test. Loads :class:`plimsoll.engine.Engine` on a demo model (``--preset``, built
into ``--dir`` unless one is there), prefills ``rows`` sequences of different lengths
(``LENGTH`` + 7 × row tokens) and then times ``--steps`` decode steps of all of them, each
step waited for (not pipelined, so one step's figures are its own), at every ``--rows``. Per
step:

- ``host_ms``: the engine's own host time in :meth:`Engine.run_async` (the graph built), its
  time inside ``mx.async_eval`` left out (on the CPU backend that call blocks while the queue
  is full, so it is compute, not host work);
- ``total_ms``: run_async + ``result()`` + ``mx.synchronize()`` (everything computed);
- ``ops``: the nodes of the step's graph (``mx.export_to_dot`` of what the step submits,
  counted once per row count: the kernels a step launches, give or take fused ones).

Medians and the lowest value over the steps (the first step of each row count is a warm-up).
Run with OpenBLAS on a Linux CPU::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/host_time.py --label after \\
      --json bench/results/host-time-cpu-2026-12-02.json
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import re
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
from plimsoll.demo.model import build_demo_model
from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work

BLOCK = 16
LENGTH = 200


def _tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((7 * i + 13 * salt) % 400 + 20 for i in range(n))


class _Submit:
    """``mx.async_eval`` wrapped: the seconds spent inside it, and (once asked) the node count
    of the graph it is handed."""

    def __init__(self) -> None:
        self.spent, self.count_next, self.ops = 0.0, False, 0
        self.kinds: Counter = Counter()
        self._original = mx.async_eval
        mx.async_eval = self

    def __call__(self, *args):
        if self.count_next:
            dot = io.StringIO()
            mx.export_to_dot(dot, *args)
            for label in re.findall(r'label ="([^"]+)", shape=rect', dot.getvalue()):
                self.ops += 1
                self.kinds[label] += 1
        t0 = time.perf_counter()
        try:
            return self._original(*args)
        finally:
            self.spent += time.perf_counter() - t0


def measure(eng: Engine, rows: int, steps: int, submit: _Submit, base: int,
            modes: tuple[str, ...]) -> dict:
    """Every figure per mode: ``compiled`` (the engine as loaded) and ``eager`` (its compiled
    decode switched off), the modes taking turns step by step (so a busy neighbour slows both
    alike); the first two steps of each mode are its warm-up and its op count."""
    lengths = [LENGTH + 7 * r for r in range(rows)]
    total_steps = len(modes) * (steps + 2)
    tables, at = [], 0
    for n in lengths:
        need = -(-(n + total_steps + 2) // BLOCK)
        tables.append(tuple(range(at, at + need)))
        at += need
    ids = [base + r for r in range(rows)]
    for i, n, t in zip(ids, lengths, tables, strict=True):
        eng.run(Step(prefills=(Work(i, _tokens(n, i), 0, t, True),)))
    mx.synchronize()
    held = getattr(eng, "compiled", None)
    out = {m: {"host": [], "total": [], "ops": 0, "kinds": {}} for m in modes}
    for k in range(total_steps):
        mode, turn = modes[k % len(modes)], k // len(modes)
        eng.compiled = held if mode == "compiled" else None
        step = Step(decodes=tuple(Work(i, None, n + k, t, True)
                                  for i, n, t in zip(ids, lengths, tables, strict=True)))
        submit.spent, submit.count_next, submit.ops = 0.0, turn == 1, 0
        submit.kinds.clear()
        t0 = time.perf_counter()
        pending = eng.run_async(step)
        t1 = time.perf_counter()
        built = t1 - t0 - submit.spent
        pending.result()
        mx.synchronize()
        t2 = time.perf_counter()
        if turn == 1:  # the counted step's times include the export
            out[mode]["ops"], out[mode]["kinds"] = submit.ops, dict(submit.kinds)
            submit.count_next = False
        elif turn:
            out[mode]["host"].append(built * 1e3)
            out[mode]["total"].append((t2 - t0) * 1e3)
    eng.compiled = held
    for i in ids:
        eng.free_state(i)
    return {m: {"host_ms_median": round(statistics.median(o["host"]), 3),
                "host_ms_min": round(min(o["host"]), 3),
                "total_ms_median": round(statistics.median(o["total"]), 3),
                "total_ms_min": round(min(o["total"]), 3), "ops": o["ops"],
                "ops_by_kind": dict(sorted(o["kinds"].items(), key=lambda kv: -kv[1])),
                "steps": len(o["host"])} for m, o in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dir", default="/tmp/one-forward-model")
    ap.add_argument("--model", type=Path, help="a built model directory instead of a preset "
                    "(e.g. bench/gpu_model.py's on a GPU)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--label", required=True, help="e.g. before / after")
    ap.add_argument("--json", help="append the result under --label to this JSON file")
    args = ap.parse_args()
    path = args.model or build_demo_model(Path(args.dir) / args.preset, args.preset)
    if args.model:
        args.preset = args.model.name
    need = sum(-(-(LENGTH + 7 * r + 2 * (args.steps + 2) + 2) // BLOCK)
               for r in range(max(args.rows)))
    try:  # the compiled decode where this engine has it (off by default)
        eng = Engine.load(path, block_tokens=BLOCK, max_blocks=need + 8, compile_decode=True)
    except TypeError:
        eng = Engine.load(path, block_tokens=BLOCK, max_blocks=need + 8)
    submit = _Submit()
    result = {"label": args.label, "preset": args.preset, "device": str(mx.default_device()),
              "mlx": mx.__version__, "machine": f"{platform.machine()} {platform.system()}",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                                       capture_output=True, text=True).stdout.strip(),
              "length": LENGTH}
    modes = ("eager", "compiled") if getattr(eng, "compiled", None) is not None else ("eager",)
    for k, rows in enumerate(args.rows):
        result[str(rows)] = measure(eng, rows, args.steps, submit, 1000 * k, modes)
        for mode, figures in result[str(rows)].items():
            short = {key: v for key, v in figures.items() if key != "ops_by_kind"}
            print(f"[{args.label}] {rows} rows, {mode}: {short}", flush=True)
    if args.json:
        out = Path(args.json)
        data = json.loads(out.read_text()) if out.exists() else {}
        data.setdefault(args.preset, {})[args.label] = result
        out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
