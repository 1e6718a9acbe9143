"""The cost per token of constrained decoding (by hand, not a test).

In process, on one model directory: decode tokens/s of :class:`plimsoll.engine.Engine` with
and without a ``json_schema`` constraint (llguidance, :mod:`plimsoll.constrain`), greedy, at
batch 1 and batch 4, after an untimed warm-up of each, interleaved over ``--repeats``
rounds (median reported). A constrained
step pays the mask (computed after each token), its transfer into the sampler, and the loss
of pipelining (the next step's mask needs this step's token), so the unconstrained engine is
also run with ``pipeline=False`` to split the two. The schema allows long output (an array
of free strings) so a constrained run is not cut short by its grammar; every run stops at
``--new-tokens`` or at the grammar's end, and tokens/s counts what was generated. Also
reported: llguidance's mask time alone per token (the same tokens replayed) and the
grammar compile time. Run with OpenBLAS::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python bench/constrained.py --model DIR --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from plimsoll import constrain as C
from plimsoll.engine import Engine

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"},
                         "notes": {"type": "array", "items": {"type": "string"}},
                         "count": {"type": "integer"}},
          "required": ["title", "notes", "count"], "additionalProperties": False}
PROMPT = "Summarise the meeting as JSON with a title, notes and a count.\n" * 4


def run(eng: Engine, cons: C.Constrainer | None, prompts: list[list[int]], new: int
        ) -> tuple[int, float, list[list[int]]]:
    """(decode tokens, seconds, each sequence's tokens): first tokens excluded, as in
    bench/engine_spike.py."""
    live: dict[int, C.GrammarConstraint | None] = {}
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        c = cons.constraint(C.json_value(SCHEMA)) if cons else None
        res = eng.add(i, p, new, constraint=c)
        live[i], out[i] = c, [res.first_token]
    tokens, t0 = 0, time.perf_counter()
    while live:
        for seq, tok in eng.step():
            if seq not in live:
                continue
            out[seq].append(tok)
            tokens += 1
            c = live[seq]
            if len(out[seq]) >= new or (c is not None and c.done()):
                eng.finish(seq)
                del live[seq]
    return tokens, time.perf_counter() - t0, list(out.values())


def mask_only(cons: C.Constrainer, seqs: list[list[int]]) -> dict[str, float]:
    """llguidance alone: the per-token mask time replaying generated constrained tokens."""
    times = []
    for toks in seqs:
        c = cons.constraint(C.json_value(SCHEMA))
        for t in toks:
            s = time.perf_counter()
            c.advance(t)
            times.append(time.perf_counter() - s)
            if c.done():
                break
    ms = sorted(x * 1000 for x in times)
    return {"tokens": len(ms), "median_ms": round(statistics.median(ms), 4),
            "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load0 = os.getloadavg()
    piped = Engine.load(args.model, block_tokens=16, pipeline=True)
    plain = Engine(piped.model, piped.tokenizer, piped.facts, 16, pipeline=False)
    t0 = time.perf_counter()
    cons = C.Constrainer(piped.tokenizer)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        cons.constraint(C.json_value(SCHEMA))
    compile_ms = (time.perf_counter() - t0) / 20 * 1000
    base = piped.tokenizer.encode(PROMPT)
    results: dict[str, dict] = {}
    seqs_seen: list[list[int]] = []
    for batch in (1, 4):
        prompts = [base[:len(base) - 7 * i] for i in range(batch)]
        runs: dict[str, list[float]] = {"unconstrained": [], "unconstrained_no_pipeline": [],
                                        "json_schema": []}
        tokens: dict[str, int] = {}
        for eng, c in ((piped, None), (plain, None), (piped, cons)):  # warm-up, untimed
            run(eng, c, prompts, 8)
        for _ in range(args.repeats):
            for name, eng, c in (("unconstrained", piped, None),
                                 ("unconstrained_no_pipeline", plain, None),
                                 ("json_schema", piped, cons)):
                n, dt, seqs = run(eng, c, prompts, args.new_tokens)
                runs[name].append(n / dt)
                tokens[name] = n
                if c is not None:
                    seqs_seen += seqs
        med = {k: statistics.median(v) for k, v in runs.items()}
        results[f"batch{batch}"] = {
            k: {"tokens_per_s": round(v, 1), "ms_per_step": round(1000 * batch / v, 3),
                "decode_tokens": tokens[k], "runs": [round(x, 1) for x in runs[k]]}
            for k, v in med.items()}
        results[f"batch{batch}"]["ratio_constrained_vs_unconstrained"] = round(
            med["json_schema"] / med["unconstrained"], 3)
        results[f"batch{batch}"]["ratio_no_pipeline_vs_unconstrained"] = round(
            med["unconstrained_no_pipeline"] / med["unconstrained"], 3)
    report = {"started": started, "load_avg_start": load0, "load_avg_end": os.getloadavg(),
              "model": str(args.model), "vocab": cons.vocab, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "schema": SCHEMA,
              "constrainer_setup_s": round(setup_s, 4), "grammar_compile_ms": round(
                  compile_ms, 3), "mask_only": mask_only(cons, seqs_seen), **results}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "constrained.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
