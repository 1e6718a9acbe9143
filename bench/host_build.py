"""The host's Python time to build one step, without MLX's evaluation: decode and verifying steps.

By hand, not a test. On a GPU the engine's step is set by the host (bench/results/
gpu-step-h200-2026-12-04.md: ``run_async`` takes about the whole step); this measures the part
of it that is Python building the graph — ``run_async``'s time less the time inside MLX's
``eval`` / ``async_eval`` — on any backend, so a change to it can be measured on the CPU box.
Use a model with the 4B model's 36 layers at micro width (``python bench/gpu_model.py
/tmp/deep2 --shape deep --tokenizer-vocab 3000 --dtype float32``): its compute is next to
nothing, its graph has the 4B model's ops.

Kinds of step, each over ``--steps`` steps after a warm-up, ``rows`` sequences:

- ``decode``: one token each, the token sampled by the step before (pipelined);
- ``verify``: 3 drafts each (4 rows), tokens given;
- ``chained``: 3 drafts each, drafted on the device from the step before (engine/chain.py).

Per kind: median ms of Python per step and of MLX's own calls. Writes ``--out-dir``/``--name``::

    PYTHONPATH=python python bench/host_build.py --model /tmp/deep2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work

from lib import report

K = 3


class EvalClock:
    """Time spent inside ``mx.eval`` / ``mx.async_eval`` while installed."""

    def __init__(self):
        self.inside = 0.0
        self._saved = (mx.eval, mx.async_eval)

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - t
        return timed

    def __enter__(self):
        mx.eval, mx.async_eval = self._wrap(self._saved[0]), self._wrap(self._saved[1])
        return self

    def __exit__(self, *exc):
        mx.eval, mx.async_eval = self._saved


def _steps(eng: Engine, kind: str, rows: int, steps: int, clock: EvalClock) -> list[tuple]:
    bt = eng.block_tokens
    prompt = tuple(range(5, 69)) * 2
    per = -(-(len(prompt) + (K + 1) * (steps + 2)) // bt)
    tables = [tuple(range(s * per, (s + 1) * per)) for s in range(rows)]
    eng.run(Step(prefills=tuple(Work(s, prompt, 0, tables[s], True) for s in range(rows))))
    pos = [len(prompt)] * rows
    out, pending = [], None
    for i in range(steps):
        if kind == "decode":
            step = Step(decodes=tuple(Work(s, None if pending else (7,), pos[s], tables[s], True)
                                      for s in range(rows)))
        elif kind == "verify" or i == 0:
            hist = np.asarray(prompt, dtype=np.int32)
            step = Step(prefills=tuple(
                Work(s, (7, *prompt[:K]), pos[s], tables[s], True, draft=K,
                     **({"lookup": 3, "history": hist} if kind == "chained" else {}))
                for s in range(rows)))
        else:  # at the highest position the chain can reach, as the scheduler names it
            step = Step(prefills=tuple(Work(s, None, pos[s], tables[s], True, draft=K, lookup=3)
                                       for s in range(rows)))
        before, t = clock.inside, time.perf_counter()
        nxt = eng.run_async(step)
        total, mlx = time.perf_counter() - t, clock.inside - before
        out.append((total - mlx, mlx))
        if pending is not None:
            pending.result()
        pending = nxt
        pos = [p + (1 if kind == "decode" else K + 1 if kind == "chained" else 0) for p in pos]
    pending.result()
    for s in range(rows):
        eng.free_state(s)
    return out[2:]


def run(args) -> list[dict]:
    eng = Engine.load(args.model, block_tokens=16, max_blocks=64 * max(args.rows) + 64)
    rows_out = []
    with EvalClock() as clock:
        for rows in args.rows:
            for kind in args.kinds:
                if kind == "chained" and not eng.chains_drafts:
                    continue
                _steps(eng, kind, rows, 6, clock)  # warm
                got = _steps(eng, kind, rows, args.steps, clock)
                row = {"kind": kind, "rows": rows,
                       "python_ms": 1e3 * statistics.median(g[0] for g in got),
                       "mlx_ms": 1e3 * statistics.median(g[1] for g in got)}
                rows_out.append(row)
                print(row, flush=True)
    return rows_out


def markdown(result: dict) -> str:
    lines = [*report.heading("The host's Python per step", result),
             "Median per step over the steps after a warm-up: Python building the step "
             "(`run_async` less MLX's `eval`/`async_eval`), and MLX's calls (on the CPU they "
             "also compute).", ""]
    lines += report.table(["kind", "sequences", "Python ms", "MLX calls ms"],
                          [[r["kind"], r["rows"], report.num(r["python_ms"]),
                            report.num(r["mlx_ms"])] for r in result["rows"]])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=["decode", "verify",
                                                                     "chained"])
    ap.add_argument("--steps", type=int, default=40)
    report.output_args(ap, "host-build")
    args = ap.parse_args()
    return report.measure_and_write(args, "host-build", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
