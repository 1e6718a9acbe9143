"""The draft-length rules simulated over a batch: which rule makes the most tokens a second.

By hand, not a test, and no model: ``--streams`` sequences of ``--tokens`` each, every draft
right with probability p (a step accepts up to its first wrong one), the real
:class:`plimsoll.worker.speculate.Drafter` of each code given (this checkout's and each
``--code`` DIR, a ``python/`` directory of another commit) deciding every sequence's draft
length, and a step's time from a cost model: a plain step ``fixed(rows) + per_token × rows``,
a verifying one ``(fixed(rows) + per_token × tokens) × (1 + unpipelined)`` (its drafts need
the step before's tokens), each ±10 %. Each step is timed into the drafter as the scheduler
times it. ``gpu``: an H200-like 4B step (6.6 ms + 0.7 ms a row, 0.05 ms a token); ``cpu``: the
CPU box's float32 tiny demo at 8 rows (0.8 ms + 0.1 ms a row, 0.9 ms a token). What it says is
only as good as the cost model; serve it (``bench/speculative.py``) to know::

    PYTHONPATH=python python bench/draft_sim.py --code /tmp/before/python --model gpu \\
        --unpipelined 0.15 --streams 1,8
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
from pathlib import Path

MODELS = {  # rows -> (fixed seconds a step, seconds a query token)
    "gpu": lambda rows: (0.0066 + 0.0007 * (rows - 1), 0.00005),
    "cpu": lambda rows: (0.0008 + 0.0001 * rows, 0.0009),
}


def drafter_of(root: Path):
    """The ``Drafter`` class of the plimsoll sources under ``root``."""
    for name in [m for m in sys.modules if m == "plimsoll" or m.startswith("plimsoll.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("plimsoll.worker.speculate").Drafter
    finally:
        sys.path.pop(0)


def simulate(drafter_cls, right: float, model: str, streams: int, tokens: int,
             unpipelined: float, seed: int, most: int = 3) -> float:
    """Tokens a second of ``streams`` sequences decoded to ``tokens`` each."""
    rng = random.Random(seed)
    d = drafter_cls(longest=3, most=most)
    fixed, per_token = MODELS[model](streams)
    left, made, clock = dict.fromkeys(range(streams), tokens), 0, 0.0
    while left:
        d.tick()
        ks = {i: min(d.length(i), left[i] - 1) if left[i] > 1 else 0 for i in left}
        verifying = [i for i, k in ks.items() if k > 0]
        queries = len(left) + sum(ks.values())
        seconds = (fixed + per_token * queries) * (1 + unpipelined * bool(verifying))
        seconds *= rng.uniform(0.9, 1.1)
        clock += seconds
        if hasattr(d, "costs"):
            try:
                d.costs.add(len(left), len(verifying), queries, seconds)
            except TypeError:  # the first cost rule's signature
                d.costs.add(bool(verifying), seconds)
        for i in list(left):
            got = 1
            if ks[i]:
                d.started(i, 0, ks[i])
                accepted = 0
                while accepted < ks[i] and rng.random() < right:
                    accepted += 1
                d.settle(i, accepted)
                got += accepted
            left[i] -= got
            made += got
            if left[i] <= 0:
                del left[i]
                d.forget(i)
    return made / clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", type=Path, action="append", default=[],
                    help="another commit's python/ directory (repeatable)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpu")
    ap.add_argument("--unpipelined", type=float, default=0.15,
                    help="a verifying step's extra time, as a fraction (default 0.15)")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rates", default="0,0.4,0.6,0.7,0.8,0.9,1")
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent / "python"
    rules = {"this": drafter_of(here), **{str(c): drafter_of(c) for c in args.code}}
    print(f"model {args.model}, unpipelined +{args.unpipelined:g}, × plain decoding")
    for streams in (int(s) for s in args.streams.split(",")):
        fixed, per_token = MODELS[args.model](streams)
        plain = streams / (fixed + per_token * streams)
        print(f"{streams} streams")
        for right in (float(r) for r in args.rates.split(",")):
            row = {name: sum(simulate(cls, right, args.model, streams, args.tokens,
                                      args.unpipelined, seed) for seed in range(args.seeds))
                   / args.seeds / plain for name, cls in rules.items()}
            print(f"  p={right:.2f}  " + "  ".join(f"{n} {v:.2f}x" for n, v in row.items()))


if __name__ == "__main__":
    main()
