"""A verifying step in process: drafted on the host and read before the next, or chained on
the device and pipelined (engine/chain.py).

By hand, not a test. Loads :class:`plimsoll.engine.Engine` on a model (``--model`` DIR, or
the tiny demo built under ``--dir``), prefills ``streams`` sequences of a repeated sentence,
then runs ``--steps`` steps that each verify ``k`` drafts a sequence, two ways, in
interleaved rounds:

- ``host``: the drafts found by :func:`plimsoll.worker.ngram.prompt_lookup` on the host, each
  step read before the next is built (what the scheduler does for a drafter that does not
  chain);
- ``chained``: the first step's drafts from the host, every later step chained on the one
  before (``tokens`` None), submitted before that one is read.

Per mode: ms per step and tokens per second (every sequence's accepted tokens), medians over
the rounds. Greedy, so both yield the model's own tokens; the sequences' outputs are checked
equal. On a CPU the "device" is the host's own cores, so what this shows there is the chain's
cost, not the overlap it buys on a GPU::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/chain_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from plimsoll.demo.model import build_demo_model
from plimsoll.engine import Engine
from plimsoll.engine.drive import text
from plimsoll.engine.work import Step, Work
from plimsoll.worker.ngram import prompt_lookup

from lib import report

LONGEST = 3


def _session(eng: Engine, streams: int, base: int) -> tuple[dict, dict, dict]:
    """Prefilled sequences: their prompts' tokens plus the first sampled, tables, starts."""
    prompts = {base + s: tuple(text(eng.tokenizer, 40, s)) * 4 for s in range(streams)}
    blocks = 48
    tables = {sid: tuple(range(j * blocks, (j + 1) * blocks)) for j, sid in enumerate(prompts)}
    first = eng.run(Step(prefills=tuple(Work(s, p, 0, tables[s], True)
                                        for s, p in prompts.items())))
    return ({s: [*p, first[s]] for s, p in prompts.items()}, tables,
            {s: len(p) for s, p in prompts.items()})


def _host(eng, toks, tables, start, k: int, steps: int, submit: list[float]) -> int:
    n = 0
    for _ in range(steps):
        works = []
        for s in toks:
            d = prompt_lookup(toks[s], LONGEST, k) or tuple(toks[s][:k])
            works.append(Work(s, (toks[s][-1], *d), start[s], tables[s], True, draft=len(d)))
        t = time.perf_counter()
        pending = eng.run_async(Step(prefills=tuple(works)))
        submit.append(time.perf_counter() - t)
        for s, out in pending.result().items():
            toks[s] += out
            start[s] += len(out)
            n += len(out)
    return n


def _chained(eng, toks, tables, start, k: int, steps: int, submit: list[float]) -> int:
    works = []
    for s in toks:
        d = prompt_lookup(toks[s], LONGEST, k) or tuple(toks[s][:k])
        works.append(Work(s, (toks[s][-1], *d), start[s], tables[s], True, draft=len(d),
                          lookup=LONGEST, history=np.asarray(toks[s], dtype=np.int32)))
    drafted = {w.seq_id: w.draft for w in works}
    pending, n = eng.run_async(Step(prefills=tuple(works))), 0
    for _ in range(steps - 1):
        t = time.perf_counter()
        nxt = eng.run_async(Step(prefills=tuple(
            Work(s, None, start[s] + drafted[s] + 1, tables[s], True, draft=k, lookup=LONGEST)
            for s in toks)))
        submit.append(time.perf_counter() - t)
        for s, out in pending.result().items():
            toks[s] += out
            start[s] += len(out)
            drafted[s] = k
            n += len(out)
        pending = nxt
    for s, out in pending.result().items():
        toks[s] += out
        n += len(out)
    return n


def run(args) -> list[dict]:
    model = args.model or build_demo_model(args.dir / "tiny", preset="tiny")
    eng = Engine.load(model, block_tokens=16, max_blocks=48 * 2 * max(args.streams) + 64)
    rows = []
    for streams in args.streams:
        times: dict[str, list[float]] = {"host": [], "chained": []}
        tokens: dict[str, list[float]] = {"host": [], "chained": []}
        outputs, submit = {}, {"host": [], "chained": []}
        for r in range(args.rounds + 1):  # the first round warms up
            for mode, fn in (("host", _host), ("chained", _chained)):
                toks, tables, start = _session(eng, streams, 100)
                t = time.perf_counter()
                n = fn(eng, toks, tables, start, args.k, args.steps, submit[mode])
                dt = time.perf_counter() - t
                for s in toks:
                    eng.free_state(s)
                outputs[mode] = {s: toks[s][:len(toks[s]) - args.k - 1] for s in toks}
                if r:
                    times[mode].append(1000 * dt / args.steps)
                    tokens[mode].append(n / dt)
        short = {s: min(len(outputs["host"][s]), len(outputs["chained"][s]))
                 for s in outputs["host"]}
        # equal in float32; in bf16 steps of other shapes may round a near tie the other way
        row = {"streams": streams, "equal": sum(outputs["host"][s][:m] == outputs["chained"][s][:m]
                                                for s, m in short.items())}
        for mode in times:
            row[f"{mode}_submit_ms"] = 1000 * statistics.median(submit[mode])
            row[f"{mode}_ms"] = statistics.median(times[mode])
            row[f"{mode}_tok_s"] = statistics.median(tokens[mode])
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [*report.heading("A verifying step drafted on the host or chained on the device",
                             result),
             f"k = {a['k']}, {a['steps']} steps a round, medians of {a['rounds']} interleaved "
             "rounds; `host`: drafts by lookup on the host, each step read before the next; "
             "`chained`: drafted on the device from the step before, submitted before it is "
             "read. `equal`: sequences whose outputs are equal (all of them in float32); `submit`: "
             "median ms `run_async` takes.", ""]
    lines += report.table(["streams", "equal", "host submit ms", "chained submit ms",
                           "host ms/step", "chained ms/step", "host tok/s",
                           "chained tok/s", "chained ÷ host (tok/s)"],
                          [[r["streams"], r.get("equal", "–"),
                            report.num(r.get("host_submit_ms")),
                            report.num(r.get("chained_submit_ms")),
                            report.num(r["host_ms"]), report.num(r["chained_ms"]),
                            report.num(r["host_tok_s"]), report.num(r["chained_tok_s"]),
                            report.num(r["chained_tok_s"] / r["host_tok_s"])]
                           for r in result["rows"]])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a built model directory (default: tiny demo)")
    ap.add_argument("--dir", type=Path, default=report.OUT / "chain_step")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    report.output_args(ap, "chain-step")
    args = ap.parse_args()
    return report.measure_and_write(args, "chain-step", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
