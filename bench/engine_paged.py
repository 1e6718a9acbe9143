"""Decode throughput of plimsoll's paged engine against mlx-lm's own generators, in process.

By hand, not a test. On one model directory (build one with ``plimsoll demo-model``):

- ``mlx-single``: ``mlx_lm.stream_generate`` (its own ``generation_tps``);
- ``engine-single``: :class:`plimsoll.engine.Engine`, one sequence, pipelined Steps
  (``run_async`` of step n+1 before ``result()`` of step n, decodes with tokens=None);
- ``mlx-batch``: ``mlx_lm.generate.BatchGenerator`` with N prompts of different lengths;
- ``engine-batch``: the engine, N sequences decoded as one forward per step, pipelined,
  block ids scattered (the gather path, as a long-running pool would hand them out).

Batch figures are aggregate decode tokens/s, timed from the moment every sequence has
its first token to the last token (prefill excluded for both). Modes are interleaved
over ``--rounds`` so a busy neighbour hurts every mode alike; medians are reported.
Run with OpenBLAS on a Linux CPU::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python bench/engine_paged.py --model /tmp/eng/tiny --new-tokens 128 --streams 1,8,32 \\
      --json bench/results/engine_paged_cpu_tiny.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator

from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work

_LENGTHS = [48, 120, 200, 300, 400, 500, 80, 250, 160, 350, 90, 220, 60, 270, 180, 330]
BLOCK = 16


def _prompts(tok, n: int) -> list[list[int]]:
    base = tok.encode("import os\nclass Foo:\n    def bar(self, x):\n        return x + 1\n" * 64)
    return [base[i:i + _LENGTHS[i % len(_LENGTHS)]] for i in range(n)]


def mlx_single(eng: Engine, prompt: list[int], new: int) -> float:
    last = None
    for last in stream_generate(eng.model, eng.tokenizer, prompt, max_tokens=new):
        pass
    return last.generation_tps


def mlx_batch(eng: Engine, prompts: list[list[int]], new: int) -> float:
    gen = BatchGenerator(eng.model, max_tokens=new, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts, [new] * len(prompts))
    seen: set[int] = set()
    t0 = None
    count = 0
    while responses := gen.next_generated():
        for r in responses:
            if r.uid not in seen:
                seen.add(r.uid)
                continue
            count += 1
        if t0 is None and len(seen) == len(prompts):
            t0 = time.perf_counter()
            count = 0
    dt = time.perf_counter() - t0
    gen.close()
    return count / dt


def engine_decode(eng: Engine, prompts: list[list[int]], new: int, seed: int = 0) -> dict:
    """Prefill every prompt (one chunk each), then ``new - 1`` pipelined batched decode steps."""
    need = [math.ceil((len(p) + new) / BLOCK) for p in prompts]
    ids = list(range(sum(need)))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(tuple(ids[at:at + n]))
        at += n
    for i, p in enumerate(prompts):
        eng.run(Step(prefills=(Work(i, tuple(p), 0, tables[i], True),)))
    t0 = time.perf_counter()
    pending, count = None, 0
    for k in range(new - 1):
        step = Step(decodes=tuple(Work(i, None, len(p) + k, tables[i], True)
                                  for i, p in enumerate(prompts)))
        nxt = eng.run_async(step)
        if pending is not None:
            count += len(pending.result())
        pending = nxt
    count += len(pending.result())
    dt = time.perf_counter() - t0
    out = {"tps": count / dt, "kv_bytes_allocated": eng.kv_bytes_allocated(),
           "kv_bytes_written": sum(len(p) + new for p in prompts) * eng.facts.kv_bytes_per_token}
    for i in range(len(prompts)):
        eng.free_state(i)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--streams", default="1,8,32", help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    pool = sum(math.ceil((n + args.new_tokens) / BLOCK)
               for n in _LENGTHS * (max(streams) // len(_LENGTHS) + 1))
    eng = Engine.load(args.model, block_tokens=BLOCK, max_blocks=pool)
    results: dict = {"model": args.model, "new_tokens": args.new_tokens, "rounds": args.rounds,
                     "machine": f"{platform.machine()} {platform.system()}",
                     "device": str(mx.default_device()), "mlx": mx.__version__}
    warm = _prompts(eng.tokenizer, 2)
    engine_decode(eng, warm[:1], 8)
    mlx_single(eng, warm[0], 8)
    runs: dict[str, list] = {}
    for _ in range(args.rounds):
        for n in streams:
            prompts = _prompts(eng.tokenizer, n)
            if n == 1:
                pairs = [("mlx-single", lambda p=prompts: mlx_single(eng, p[0], args.new_tokens)),
                         ("engine-single",
                          lambda p=prompts: engine_decode(eng, p, args.new_tokens))]
            else:
                pairs = [(f"mlx-batch-{n}", lambda p=prompts: mlx_batch(eng, p, args.new_tokens)),
                         (f"engine-batch-{n}",
                          lambda p=prompts: engine_decode(eng, p, args.new_tokens))]
            for mode, fn in pairs:
                got = fn()
                runs.setdefault(mode, []).append(got)
                print(mode, json.dumps(got), flush=True)
    for mode, got in runs.items():
        tps = sorted(g["tps"] if isinstance(g, dict) else g for g in got)
        results[mode] = {"median_tps": tps[len(tps) // 2], "runs_tps": tps}
    ratios = {}
    for n in streams:
        mine, theirs = ("engine-single", "mlx-single") if n == 1 else \
            (f"engine-batch-{n}", f"mlx-batch-{n}")
        ratios[f"{n}-stream"] = results[mine]["median_tps"] / results[theirs]["median_tps"]
    results["engine_over_mlx_lm"] = ratios
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
