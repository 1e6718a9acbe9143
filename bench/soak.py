"""The soak that shows the bound (issue 25): ``plimsoll serve`` then ``mlx_lm.server``, each in
a memory cgroup sized so that an unbounded server is OOM-killed, under the same load for a
fixed time (:mod:`plimsoll.reliability.soak`; ``plimsoll verify --soak`` is the short form).

Run as root on Linux with a memory controller (cgroup v1 or v2), OpenBLAS preloaded for the
float32 CPU models:

    python bench/soak.py --model /tmp/soak-models/qwen3-0.6b \\
        --model-b /tmp/soak-models/qwen3-0.6b-b --limit-gib 5 --duration 1800 \\
        --contrast-duration 900 --out bench/results --stem soak-cpu-2026-12-01

(any longer: ``--duration 7200``). The models are demo models with the Qwen3-0.6B shape
(``plimsoll demo-model --preset qwen3-0.6b OUT``, and again with ``--seed 1`` for b). The
report is ``<out>/<stem>.json`` and ``.md``; the servers' logs and every request
(``*.requests.jsonl``) stay in the work directory it names.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from plimsoll.core.units import GIB
from plimsoll.reliability.soak import Shape, Soak, run_soak, write

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model a (the one mostly asked)")
    p.add_argument("--model-b", type=Path, help="model b (default: a again, another name)")
    p.add_argument("--limit-gib", type=float, default=5.0, help="the cgroup's hard limit")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load, plimsoll")
    p.add_argument("--contrast-duration", type=float, help="seconds for mlx_lm.server "
                   "(default: --duration; it ends earlier once restarts are used up)")
    p.add_argument("--no-contrast", action="store_true")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=2, help="plimsoll's sequences at once "
                   "(the load itself runs 2-8 clients; the rest wait or are refused)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--idle-ttl", type=float, default=20.0)
    p.add_argument("--swap-hold", type=float, default=30.0, help="plimsoll serve --swap-hold: "
                   "a loaded model keeps its slot this long (fewer swaps to thrash)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--stem", help="report file name without suffix (default: soak-<time>)")
    p.add_argument("--workdir", type=Path, help="logs and requests (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = dict(os.environ)
    if os.path.exists(OPENBLAS):
        env.setdefault("LD_PRELOAD", OPENBLAS)
    shape = Shape(duration_s=args.duration, phase_s=60.0, idle_every_s=300.0,
                  idle_gap_s=args.idle_ttl + 15, shared_words=400, turn_words=(120, 320),
                  session_turns=(8, 24), churn_words=(200, 900), max_tokens=args.max_tokens,
                  p_churn=0.2, p_cancel=0.15, p_other_model=0.03, seed=args.seed)
    soak = Soak(args.model, args.model_b or args.model, int(args.limit_gib * GIB), shape,
                context=args.context, concurrency=args.concurrency,
                max_tokens=args.max_tokens, idle_ttl_s=args.idle_ttl,
                swap_hold_s=args.swap_hold, env=env)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="plimsoll-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"soak: logs and requests in {work}", flush=True)
    result = run_soak(soak, work, contrast=not args.no_contrast,
                      contrast_duration_s=args.contrast_duration,
                      report=lambda m: print(f"soak: {m}", flush=True))
    result["soak"]["command"] = " ".join(["python", "bench/soak.py", *sys.argv[1:]])
    js, md = write(result, args.out, args.stem)
    print(md.read_text())
    print(f"report: {js}\n        {md}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
