"""The engine's decode step with and without its host-side savings, in process, interleaved.

By hand, not a test; meant for a GPU, where a one-row step is host-bound. Variants (each
over the same prompts and tables, pipelined as the worker runs them):

- ``plain``: every layer's new K/V written by the pool's write before the decode kernel
  reads (``Engine.decode_writes`` off);
- ``writes``: a decode-only step's K/V stored by the decode kernel's own launch
  (engine/decode_write.py ``check_writing``) — what the engine does by default.

First the greedy tokens of ``plain`` and ``writes`` compared (4 rows and 1 row, 80
steps); then ``--rounds`` rounds of every variant at each of ``--rows``, ``--steps`` steps:
mean ``run_async`` ms (the host's building and the backend's encoding) and ms per step.
Writes ``--out-dir``/``--name`` (JSON and markdown)::

    cd bench && PYTHONPATH=../python python decode_ab.py --model /tmp/qwen3-4b-shaped
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from plimsoll.engine import Engine

from lib import report, step_split
from lib.engine import decode_rate

BT = 16
VARIANTS = {"plain": False, "writes": True}


class Runner:
    def __init__(self, model: Path, prompt_tokens: int):
        self.eng = Engine.load(model, block_tokens=BT, max_blocks=6000)
        self.prompt = tuple(range(1000, 1000 + prompt_tokens))
        self.can_write = self.eng.decode_writes

    def loop(self, rows: int, variant: str, steps: int, keep: bool = False) -> dict:
        """``variant`` at ``rows`` rows: the bench's pipelined decode (``lib.engine``), its
        ``run_async`` timed (``lib.step_split``): mean ms of it and ms per step."""
        self.eng.decode_writes = VARIANTS[variant] and self.can_write
        prompts = [list(self.prompt[r:] + self.prompt[:r]) for r in range(rows)]
        clock = step_split.StepClock()
        got = decode_rate(step_split.TimedEngine(self.eng, clock, open_on_decode=True),
                          prompts, steps, keep_tokens=keep)
        clock.close()
        f = clock.figures()
        return {"run_async_ms": f.get("build_ms"), "step_ms": f.get("step_ms"),
                "tokens": got.get("tokens")}


def run(args) -> dict:
    r = Runner(args.model, args.prompt_tokens)
    out: dict = {"verdicts": r.eng.kernels.report(), "decode_writes": r.can_write,
                 "equal": {}, "rows": []}
    for rows in (4, 1):
        a = r.loop(rows, "plain", 80, keep=True)["tokens"]
        b = r.loop(rows, "writes", 80, keep=True)["tokens"]
        out["equal"][str(rows)] = a == b
        print(f"greedy tokens equal at {rows} rows: {a == b}", flush=True)
    runs: dict[tuple, list] = {}
    for rnd in range(args.rounds):
        for rows in args.rows:
            for variant in VARIANTS:
                got = r.loop(rows, variant, args.steps)
                runs.setdefault((rows, variant), []).append(got)
                print(f"round {rnd} rows {rows} {variant}: run_async {got['run_async_ms']:.2f}"
                      f" ms, step {got['step_ms']:.2f} ms", flush=True)
    for (rows, variant), got in runs.items():
        out["rows"].append({"rows": rows, "variant": variant,
                            "run_async_ms": statistics.median(g["run_async_ms"] for g in got),
                            "step_ms": statistics.median(g["step_ms"] for g in got),
                            "step_ms_runs": [round(g["step_ms"], 3) for g in got]})
    return out


def markdown(result: dict) -> str:
    lines = [*report.heading("The decode step's host-side savings, A/B", result),
             f"Decode writing in its kernel available: {result['decode_writes']}; greedy "
             "tokens of `plain` and `writes` equal: "
             + ", ".join(f"{k} rows {v}" for k, v in result["equal"].items()) + ".", "",
             "Medians over the rounds (interleaved) of each run's mean `run_async` ms (building "
             "and encoding) and ms per step (pipelined).", ""]
    lines += report.table(["rows", "variant", "run_async ms", "ms/step", "ms/step by round"],
                          [[r["rows"], r["variant"], report.num(r["run_async_ms"]),
                            report.num(r["step_ms"]), r["step_ms_runs"]]
                           for r in sorted(result["ab"]["rows"], key=lambda r: r["rows"])])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    report.output_args(ap, "decode-ab")
    args = ap.parse_args()
    return report.measure_and_write(args, "decode-ab", run, markdown, key="ab",
                                    more=lambda out: {k: out[k] for k in ("decode_writes",
                                                                          "equal")})


if __name__ == "__main__":
    sys.exit(main())
