"""Prompt tokens the engine computes for shared-prefix requests submitted at once.

N requests, each a shared prefix plus its own task, are submitted together to the worker's
scheduler, in process, over the real paged engine on the tiny random-weight demo model
(CPU, block 16). The figure is what the engine actually computes: ``Engine.run_async`` is
wrapped to sum the lengths of each step's prefill chunks. The ideal is one prefix plus
the tasks; the ratio is computed ÷ ideal (1.0: the prefix computed once). A prefix that is
not a whole number of blocks has its last partial block computed by every request (only
full blocks are shared), so the floor is a little above 1.

``--baseline`` names an earlier run's JSON (another commit's sources on ``PYTHONPATH``,
named by ``--sources``) whose figures are printed beside this run's. Writes
``--out-dir``/``--name``.{json,md}. Run: ``python bench/dedup.py``
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lib import report

BLOCK = 16
CASES = (  # (requests, shared prefix tokens, own tokens, prefill_tokens budget, chunk cap)
    (8, 256, 48, 512, None),
    (8, 1000, 200, 2048, None),
    (8, 1000, 200, 8192, None),
    (8, 1000, 200, 8192, 256),  # a prompt's chunk capped (the transient bound on a device)
)


def run_case(model_dir: Path, n: int, shared: int, own: int, budget: int,
             chunk: int | None) -> dict:
    """The case as the scheduler runs it and, where it waits for in-flight blocks, as it
    would run without that wait (``no_wait_computed``)."""
    from plimsoll.worker import scheduler

    out = _run(model_dir, n, shared, own, budget, chunk)
    if hasattr(scheduler, "in_flight"):
        kept, scheduler.in_flight = scheduler.in_flight, (lambda *args: False)
        try:
            out["no_wait_computed"] = _run(model_dir, n, shared, own, budget, chunk)["computed"]
        finally:
            scheduler.in_flight = kept
    return out


def _run(model_dir: Path, n: int, shared: int, own: int, budget: int,
         chunk: int | None) -> dict:
    from plimsoll.engine.core import Engine
    from plimsoll.engine.drive import text
    from plimsoll.worker.events import GenRequest, SchedulerLimits, Started
    from plimsoll.worker.pool import BlockPool
    from plimsoll.worker.scheduler import Scheduler

    blocks = n * -(-(shared + own + 4) // BLOCK) + 8
    eng = Engine.load(model_dir, block_tokens=BLOCK, max_blocks=blocks)
    computed, steps = [], 0
    run_async = eng.run_async

    def counted(step):
        computed.append(sum(w.length for w in step.prefills))
        return run_async(step)

    eng.run_async = counted
    pool = BlockPool(total=blocks, block_tokens=BLOCK, cache_cap_blocks=blocks)
    limits = SchedulerLimits(max_num_seqs=n, max_queue=64, max_wait_s=600,
                             trip_bytes=1 << 62, max_batch=n, prefill_tokens=budget,
                             chunk_for=None if chunk is None else (lambda _: chunk))
    s = Scheduler(lambda stack: (eng, pool), limits, lambda: {})
    s.engine, s.pool, s.eos_ids = eng, pool, set()
    prefix = text(eng.tokenizer, shared, salt=1)
    started: list[Started] = []

    def sink(ev) -> None:
        if isinstance(ev, Started):
            started.append(ev)

    for i in range(n):
        task = [3 + i, *text(eng.tokenizer, own - 1, salt=100 + 10 * i)]  # differs at once
        s.submit(GenRequest(prompt=prefix + task, max_tokens=2, sink=sink))
    while s._running or s._waiting or s._inbox or s._pending is not None:
        s.iterate()
        steps += 1
        if steps > 10_000:
            raise RuntimeError("the scheduler did not drain")
    ideal = shared + n * own
    total = sum(computed)
    return {"requests": n, "shared": shared, "own": own, "prefill_tokens": budget, "chunk": chunk,
            "computed": total, "ideal": ideal, "ratio": round(total / ideal, 3),
            "steps_with_prefill": sum(1 for c in computed if c),
            "cached_tokens": [e.cached_tokens for e in started]}


def markdown(result: dict) -> str:
    def key(c: dict) -> tuple:
        return c["requests"], c["shared"], c["own"], c["prefill_tokens"], c.get("chunk")

    base = {key(c): c for c in (result.get("baseline") or {}).get("cases", [])}
    rows = []
    for c in result["cases"]:
        b = base.get(key(c))
        rows.append((f"{c['requests']} × ({c['shared']} shared + {c['own']} own)",
                     c["prefill_tokens"], c["chunk"], c["ideal"],
                     None if b is None else b["computed"], None if b is None else b["ratio"],
                     c.get("no_wait_computed"), c["computed"], c["ratio"],
                     c["steps_with_prefill"]))
    lines = [
        "# Shared-prefix prefill: tokens computed ÷ one prefix + the tasks", "",
        "Requests submitted at once to the scheduler in process, the real paged engine on "
        f"the tiny demo model (CPU, block {BLOCK}); computed = the sum of every step's "
        "prefill chunk lengths as the engine received them. Before: a chunk's blocks were "
        "registered after its step was submitted, so a request admitted in the same step "
        "computed the prefix again. After: they are registered when the chunk is planned, "
        "and a waiter whose next block a running prefill is still to write (a capped chunk) "
        "waits for it while the step has prompt work anyway. The floor is above 1 where the "
        "prefix is not a whole number of blocks (its partial last block is every request's). "
        "No wait: this run's scheduler with that wait switched off (registration at plan "
        "time only).",
        "",
        *report.table(("requests", "budget", "chunk cap", "ideal", "before", "before ÷ ideal",
                       "no wait", "computed", "÷ ideal", "prefill steps"), rows), "",
        f"Before: the scheduler at {(result.get('baseline') or {}).get('sources', '–')}; "
        f"after: at {result['sources']}. "
        f"Command: `{result['command']}`; before: `PYTHONPATH=<those sources> "
        f"{(result.get('baseline') or {}).get('command', '–')}`", "",
        report.host_line(result["host"]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report.output_args(parser, "dedup")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="an earlier run's JSON, shown beside this run's figures")
    parser.add_argument("--sources", default=None,
                        help="what plimsoll sources PYTHONPATH names (default: this checkout's "
                             "commit)")
    args = parser.parse_args()
    from plimsoll.demo.model import build_demo_model

    host = report.host_facts()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "tiny", preset="tiny")
        cases = [run_case(model_dir, *case) for case in CASES]
    host["loadavg_end"] = report.loadavg()
    for c in cases:
        print(c, flush=True)
    result = {"command": report.command(), "host": host, "cases": cases,
              "sources": args.sources or host["git_head"],
              "baseline": json.loads(args.baseline.read_text()) if args.baseline else None}
    report.write(result, args.out_dir, args.name or report.default_name("dedup"), markdown)


if __name__ == "__main__":
    main()
