"""One engine step that mixes 4 decodes and a 256-token chunk at a prefix offset, in process.

By hand, not a test. Standalone: builds a demo model (``--preset``, default ``tiny``) into
``--dir`` unless one is there, loads :class:`plimsoll.engine.Engine`, prefills four sequences
(300-460 tokens) and a fifth one's 512-token prefix, then times ``--steps`` steps that each
decode the four (one token each, explicit tokens, positions advancing) while the fifth
writes a 256-token chunk at position 512 that samples (the tail of a prompt whose prefix is
cached). Per step:

- ``host_ms``: :meth:`Engine.run_async` returning (the graph built and submitted);
- ``total_ms``: run_async + ``result()`` + ``mx.synchronize()`` (everything computed);
- ``forwards``: calls of the model's ``__call__`` in the step (a wrapper on its class).

Steps are interleaved with nothing else; medians and the spread are reported. Run with
OpenBLAS on a Linux CPU::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/one_forward.py --label after \\
      --json bench/results/one-forward-cpu-2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx
from plimsoll.demo.model import build_demo_model
from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work

BLOCK = 16
DECODES = (300, 350, 400, 460)  # the four decoding sequences' prompt lengths
PREFIX, CHUNK = 512, 256


def _tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((7 * i + 13 * salt) % 400 + 20 for i in range(n))


def _count_forwards(model) -> list[int]:
    cls = type(model)
    calls = [0]
    original = cls.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    cls.__call__ = counted
    return calls


def measure(eng: Engine, steps: int) -> dict:
    tables, at = [], 0
    for n in (*DECODES, PREFIX + CHUNK):
        need = -(-(n + steps + 2) // BLOCK)
        tables.append(tuple(range(at, at + need)))
        at += need
    for i, n in enumerate(DECODES):
        eng.run(Step(prefills=(Work(i, _tokens(n, i), 0, tables[i], True),)))
    last = len(DECODES)
    eng.run(Step(prefills=(Work(last, _tokens(PREFIX, last), 0, tables[last], False),)))
    mx.synchronize()
    calls = _count_forwards(eng.model)
    host, total, forwards = [], [], []
    chunk = _tokens(CHUNK, 99)
    for k in range(steps + 1):
        decodes = tuple(Work(i, (5 + k,), n + k, tables[i], True) for i, n in enumerate(DECODES))
        step = Step(decodes=decodes,
                    prefills=(Work(last, chunk, PREFIX, tables[last], True),))
        calls[0] = 0
        t0 = time.perf_counter()
        pending = eng.run_async(step)
        t1 = time.perf_counter()
        pending.result()
        mx.synchronize()
        t2 = time.perf_counter()
        if k:  # the first step is a warm-up
            host.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
            forwards.append(calls[0])
    return {"host_ms_median": statistics.median(host), "host_ms_min": min(host),
            "host_ms_max": max(host), "total_ms_median": statistics.median(total),
            "total_ms_min": min(total), "total_ms_max": max(total),
            "forwards_per_step": sorted(set(forwards)), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dir", default="/tmp/one-forward-model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--label", required=True, help="e.g. before / after")
    ap.add_argument("--json", help="append the result under --label to this JSON file")
    args = ap.parse_args()
    path = build_demo_model(Path(args.dir) / args.preset, args.preset)
    eng = Engine.load(path, block_tokens=BLOCK, max_blocks=512)
    result = {"label": args.label, "preset": args.preset, "device": str(mx.default_device()),
              "mlx": mx.__version__, "machine": f"{platform.machine()} {platform.system()}",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       check=False, capture_output=True,
                                       text=True).stdout.strip(),
              "decodes": list(DECODES), "chunk": CHUNK, "chunk_start": PREFIX,
              **measure(eng, args.steps)}
    print(json.dumps(result))
    if args.json:
        out = Path(args.json)
        data = json.loads(out.read_text()) if out.exists() else {}
        data.setdefault(args.preset, {})[args.label] = result
        out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
