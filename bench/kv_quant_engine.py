"""Quantized KV in process, by hand: physical bytes and step rates of the paged engine at the
model's dtype, q8 and q4 (no HTTP, no server: the engine alone, small growth slabs so the
arrays allocated follow the tokens written).

Per KV format: one sequence prefilled to ``--context`` tokens in ``--chunk`` chunks, then
``--decode`` tokens decoded; then ``--rows`` sequences of ``--row-context`` tokens decoded
together for ``--decode`` steps. Figures: the pool arrays' nbytes after the prefill (physical
truth, against the facts' formula), MLX peak memory of the prefill (reset after load), the
prefill time, 1-row and batched decode tok/s. The formats run interleaved ``--repeats`` times
(A B C A B C …) so a loaded machine's drift hits them alike; medians reported.

    python bench/kv_quant_engine.py --model /tmp/kvq-models/tiny64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
from plimsoll.engine.drive import Blocks, plan_step, seqs_for, text
from plimsoll.core.model_facts import inspect_model
from plimsoll.engine import Engine

BLOCK = 16


def drive_timed(eng, seqs, chunk):
    """plimsoll.engine.drive.drive, timing the prefill steps and the decode-only steps apart."""
    by_id = {s.seq_id: s for s in seqs}
    pre = dec = 0.0
    steps = 0
    while (step := plan_step(seqs, chunk, concrete=True)) is not None:
        t = time.perf_counter()
        for sid, tok in eng.run(step).items():
            by_id[sid].out.append(tok)
        if step.prefills:
            pre += time.perf_counter() - t
        else:
            dec += time.perf_counter() - t
            steps += 1
    for s in seqs:
        eng.free_state(s.seq_id)
    return pre, dec, steps


def one(model: Path, kv: str, a) -> dict:
    blocks = max(a.context + a.decode, a.rows * (a.row_context + a.decode)) // BLOCK + 8
    eng = Engine.load(model, block_tokens=BLOCK, max_blocks=blocks,
                      kv_dtype=None if kv == "auto" else kv, slab_blocks=a.slab)
    facts = inspect_model(model, kv_dtype=None if kv == "auto" else kv)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    prompt = text(eng.tokenizer, a.context, salt=1)
    pre, dec, steps = drive_timed(eng, seqs_for([prompt], a.decode, BLOCK, Blocks(blocks)),
                                  a.chunk)
    allocated = eng.kv_bytes_allocated()
    written = -(-(a.context + a.decode) // BLOCK) * BLOCK
    out = {"kv": kv, "kv_bytes_allocated": allocated,
           "formula_bytes": facts.kv_bytes_per_token * written,
           "peak_over_load": mx.get_peak_memory() - base,
           "prefill_s": pre, "decode_tps": steps / dec if dec else None}
    prompts = [text(eng.tokenizer, a.row_context, salt=10 + i) for i in range(a.rows)]
    _, dec, steps = drive_timed(eng, seqs_for(prompts, a.decode, BLOCK, Blocks(blocks)),
                                a.row_context)
    out["batched_tps"] = a.rows * steps / dec if dec else None
    del eng
    mx.clear_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--kv", default="auto,q8,q4")
    p.add_argument("--context", type=int, default=6700)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--decode", type=int, default=48)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--row-context", type=int, default=512)
    p.add_argument("--slab", type=int, default=8, help="growth slab, blocks")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "kv-quant-engine-cpu.json")
    a = p.parse_args()
    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeats):
        for kv in a.kv.split(","):
            r = one(a.model, kv, a)
            print(json.dumps(r), flush=True)
            runs.setdefault(kv, []).append(r)
    med = {kv: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "kv"}
           for kv, rs in runs.items()}
    base = med.get("auto")
    ratios = {kv: {k: round(v / base[k], 3) for k, v in m.items() if base and base.get(k)}
              for kv, m in med.items() if kv != "auto"}
    doc = {"model": str(a.model), "args": vars(a) | {"model": str(a.model), "out": str(a.out)},
           "median": med, "ratio_to_model_dtype": ratios, "runs": runs,
           "command": "python bench/kv_quant_engine.py " + " ".join(sys.argv[1:])}
    a.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps({"median": med, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
