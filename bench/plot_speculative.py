"""The plot of a bench/speculative.py run with ``--noise`` and ``--lengths``: speed over plain
against acceptance (k fixed, the ``plain``, ``lookup`` and ``lookup noise F`` modes) and against
the draft length (the ``lookup`` and ``lookup k=K`` modes), one line per stream count, with
the break-even acceptance (where the line crosses 1.0) read off by linear interpolation.

    python bench/plot_speculative.py bench/results/speculative-h200-2026-12-04-curve.json

writes ``….png`` beside the JSON and prints the break-even figures. Needs matplotlib (the
``bench`` extra of python/pyproject.toml)."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path


def points(modes: dict, streams: str) -> tuple[list[tuple[float, float]], list[tuple[int, float]]]:
    """(acceptance, × plain) of the k-fixed modes and (k, × plain) of the length modes."""
    plain = modes["plain"][streams]["tok_s"]
    by_acc, by_k = [], []
    for mode, by in modes.items():
        m = by.get(streams)
        if m is None or mode.endswith("before"):
            continue
        ratio = m["tok_s"] / plain
        if mode == "lookup" or mode.startswith("lookup noise"):
            by_acc.append((m["acceptance"] or 0.0, ratio))
        if mode == "lookup" or (k := re.fullmatch(r"lookup k=(\d+)", mode)):
            by_k.append((int(k.group(1)) if mode != "lookup" else 0, ratio))
    return sorted(by_acc), sorted(by_k)


def break_even(by_acc: list[tuple[float, float]]) -> float | None:
    """The acceptance where × plain crosses 1.0 going up (None: it never does)."""
    for (a0, r0), (a1, r1) in itertools.pairwise(by_acc):
        if r0 < 1.0 <= r1 and a1 > a0:
            return a0 + (1.0 - r0) * (a1 - a0) / (r1 - r0)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a bench/speculative.py JSON")
    ap.add_argument("--regime", default="repeat")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(args.result.read_text())
    modes, k = r["regimes"][args.regime], r["num_draft_tokens"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for n in map(str, r["streams"]):
        by_acc, by_k = points(modes, n)
        by_k = [(k if x == 0 else x, y) for x, y in by_k]
        left.plot(*zip(*by_acc, strict=True), marker="o", label=f"{n} stream(s)")
        right.plot(*zip(*sorted(by_k), strict=True), marker="o", label=f"{n} stream(s)")
        even = break_even(by_acc)
        print(f"{n} streams: break-even acceptance "
              f"{'none in range' if even is None else f'{even:.2f}'}; "
              + ", ".join(f"{a:.2f} → {y:.2f} ×" for a, y in by_acc))
    for ax in (left, right):
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel("tok/s ÷ plain decoding")
        ax.legend()
    left.set_xlabel(f"acceptance (accepted ÷ proposed), k = {k}")
    right.set_xlabel("draft length k (acceptance ≈ 1)")
    model = r.get('model_about', 'the tiny demo').split(' (')[0]
    fig.suptitle(f"prompt lookup, {r['machine']}, regime {args.regime}: {model}",
                 fontsize=9)
    fig.tight_layout()
    out = args.result.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
