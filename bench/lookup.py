"""What prompt lookup's n-gram search costs the scheduler a sequence and a step.

Prompt lookup (``plimsoll worker --prompt-lookup N``) searches a speculating sequence's
whole history (prompt and output) for its last ``n`` tokens on every verifying step, on the
scheduler's thread. Coding agents, for whom it is meant, send 16-40k-token prompts. This
times :func:`plimsoll.worker.ngram.prompt_lookup` over a grown
:class:`~plimsoll.worker.ngram.History` against the plain-Python scan it replaced, on
random histories (no match: every ``n`` scans it all, the worst case) and on ones whose tail
recurs (a match at ``n`` = 3), at several lengths; each figure the median of ``--repeats``
calls. No model, no mlx::

    PYTHONPATH=python python bench/lookup.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from plimsoll.worker.ngram import History, prompt_lookup

from lib import report


def scan_lookup(seq: list[int], longest: int, k: int) -> tuple[int, ...]:
    """The search as it was (plimsoll at 0833ee1): one candidate at a time in Python."""
    size = len(seq)
    if k <= 0 or size < 2:
        return ()
    seq = list(seq)
    last = seq[-1]
    for n in range(min(longest, size - 1), 0, -1):
        tail, found = seq[size - n:], -1
        for i in range(size - n - 1, -1, -1):
            if seq[i + n - 1] == last and seq[i:i + n] == tail:
                if i + n + k <= size:
                    return tuple(seq[i + n:i + n + k])
                found = i if found < 0 else found
        if found >= 0:
            return tuple(seq[found + n:found + n + k])
    return ()


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for size in args.sizes:
        for case in ("no match", "match"):
            seq = [rng.randrange(args.vocab) for _ in range(size)]
            if case == "match":  # the last 3 tokens also stand a quarter of the way in
                at = size // 4
                seq[at:at + 3] = seq[-3:]
            history = History()
            history.of(seq)
            assert prompt_lookup(history.of(seq), 3, 3) == scan_lookup(seq, 3, 3)
            scan = timed(lambda s=seq: scan_lookup(s, 3, 3), args.repeats)
            vec = timed(lambda s=seq, h=history: prompt_lookup(h.of(s), 3, 3), args.repeats)
            rows.append({"tokens": size, "case": case, "scan_ms": 1000 * scan,
                         "vectorized_ms": 1000 * vec, "speedup": scan / vec})
            print(rows[-1], flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [*report.heading("Prompt lookup's search, a sequence and a step", result),
             "n-grams up to 3, 3 drafts; medians of "
             f"{result['args']['repeats']} calls. `scan`: the plain-Python search of "
             "0833ee1; `vectorized`: numpy over the sequence's grown history (now).", ""]
    lines += report.table(["history tokens", "case", "scan ms", "vectorized ms", "× faster"],
                          [[r["tokens"], r["case"], report.num(r["scan_ms"]),
                            report.num(r["vectorized_ms"]), report.num(r["speedup"])]
                           for r in result["rows"]])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 4096, 16384, 32768])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=21)
    report.output_args(ap, "lookup")
    args = ap.parse_args()
    return report.measure_and_write(args, "lookup", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
