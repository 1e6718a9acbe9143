"""The engine in process (no HTTP, no scheduler): decode rates, KV bytes and read paths.

One subcommand per figure, each on its own model (build one with ``plimsoll demo-model`` or
``bench/gpu_model.py``), each writing ``--out-dir``/``--name``.{json,md}:

- ``paged``: decode tok/s of :class:`plimsoll.engine.Engine` (1 stream, and N streams decoded
  as one forward per step, pipelined, block ids shuffled so every read goes through the gather)
  against mlx-lm's ``stream_generate`` and ``BatchGenerator``, first tokens excluded; modes
  interleaved over ``--rounds`` so a busy neighbour hurts every mode alike; medians;
- ``kv-quant``: per KV format (the model's dtype, q8, q4): one sequence prefilled to
  ``--context`` in ``--chunk`` chunks then ``--decode`` tokens decoded, then ``--rows``
  sequences of ``--row-context`` decoded together; the pool arrays' nbytes (physical truth)
  against the facts' formula, MLX peak of the prefill, prefill time, decode rates; formats
  interleaved ``--repeats`` times; small growth slabs so the arrays follow the tokens written;
- ``window``: bytes held for sliding-window layers as one sequence grows, plimsoll's rings
  against mlx-lm's ``RotatingKVCache``, on a random gemma3_text-shaped model;
- ``constrained``: decode tok/s with and without a ``json_schema`` constraint (llguidance),
  batch 1 and 4, pipelined and not, and llguidance's mask time per token replayed alone;
- ``attention``: the two quantized read paths of one layer (dequantize + fused SDPA against
  mlx-lm's quantized matmuls), decode and prefill shapes
  (the last two in :mod:`lib.kv_layouts`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

from lib import report
from lib.engine import BLOCK, LENGTHS, code_prompts, decode_rate, drive_timed, mlx_batch, mlx_single
from lib.kv_layouts import attention, attention_md, window, window_md

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"},
                         "notes": {"type": "array", "items": {"type": "string"}},
                         "count": {"type": "integer"}},
          "required": ["title", "notes", "count"], "additionalProperties": False}
PROMPT = "Summarise the meeting as JSON with a title, notes and a count.\n" * 4


def device() -> dict:
    import mlx.core as mx

    return {"machine": f"{platform.machine()} {platform.system()}",
            "device": str(mx.default_device()), "mlx": mx.__version__}


def paged(a) -> dict:
    from plimsoll.engine import Engine

    streams = [int(s) for s in a.streams.split(",")]
    pool = sum(math.ceil((n + a.new_tokens) / BLOCK)
               for n in LENGTHS * (max(streams) // len(LENGTHS) + 1))
    eng = Engine.load(a.model, block_tokens=BLOCK, max_blocks=pool)
    warm = code_prompts(eng.tokenizer, 2)
    decode_rate(eng, warm[:1], 8, shuffle_seed=0)
    mlx_single(eng.model, eng.tokenizer, warm[0], 8)
    runs: dict[str, list] = {}
    for _ in range(a.rounds):
        for n in streams:
            prompts = code_prompts(eng.tokenizer, n)
            theirs = (("mlx-single", lambda p=prompts: mlx_single(eng.model, eng.tokenizer, p[0],
                                                                    a.new_tokens))
                      if n == 1 else (f"mlx-batch-{n}", lambda p=prompts: mlx_batch(
                          eng.model, p, a.new_tokens)))
            mine = ("engine-single" if n == 1 else f"engine-batch-{n}",
                    lambda p=prompts: decode_rate(eng, p, a.new_tokens, shuffle_seed=0))
            for mode, fn in (theirs, mine):
                got = fn()
                runs.setdefault(mode, []).append(got)
                print(mode, json.dumps(got), flush=True)
    out: dict = {"new_tokens": a.new_tokens, "rounds": a.rounds, "streams": streams, "modes": {}}
    for mode, got in runs.items():
        tps = sorted(g["tps"] if isinstance(g, dict) else g for g in got)
        out["modes"][mode] = {"median_tps": tps[len(tps) // 2], "runs_tps": tps}
        if isinstance(got[0], dict):
            out["modes"][mode] |= {k: got[-1][k] for k in ("kv_bytes_allocated",
                                                           "kv_bytes_written")}
    out["engine_over_mlx_lm"] = {
        f"{n}-stream": out["modes"][mine]["median_tps"] / out["modes"][theirs]["median_tps"]
        for n in streams for mine, theirs in [("engine-single", "mlx-single") if n == 1 else
                                              (f"engine-batch-{n}", f"mlx-batch-{n}")]}
    return out


def paged_md(r: dict) -> list[str]:
    def runs(mode: str) -> str:
        m = r["modes"][mode]
        return f"{m['median_tps']:.1f} ({', '.join(f'{x:.1f}' for x in m['runs_tps'])})"

    return report.table(
        ["streams", "mlx-lm tok/s (runs)", "engine tok/s (runs)", "engine ÷ mlx-lm (medians)"],
        [[n, runs("mlx-single" if n == 1 else f"mlx-batch-{n}"),
          runs("engine-single" if n == 1 else f"engine-batch-{n}"),
          f"{r['engine_over_mlx_lm'][f'{n}-stream']:.2f}"] for n in r["streams"]])


def kv_quant(a) -> dict:
    import mlx.core as mx
    from plimsoll.core.model_facts import inspect_model
    from plimsoll.engine import Engine
    from plimsoll.engine.drive import Blocks, seqs_for, text

    def one(kv: str) -> dict:
        fmt = None if kv == "auto" else kv
        blocks = max(a.context + a.decode, a.rows * (a.row_context + a.decode)) // BLOCK + 8
        eng = Engine.load(a.model, block_tokens=BLOCK, max_blocks=blocks, kv_dtype=fmt,
                          slab_blocks=a.slab)
        facts = inspect_model(a.model, kv_dtype=fmt)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        prompt = text(eng.tokenizer, a.context, salt=1)
        pre, dec, steps = drive_timed(eng, seqs_for([prompt], a.decode, BLOCK, Blocks(blocks)),
                                      a.chunk)
        written = -(-(a.context + a.decode) // BLOCK) * BLOCK
        out = {"kv": kv, "kv_bytes_allocated": eng.kv_bytes_allocated(),
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

    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeats):
        for kv in a.kv.split(","):
            r = one(kv)
            print(json.dumps(r), flush=True)
            runs.setdefault(kv, []).append(r)
    med = {kv: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "kv"}
           for kv, rs in runs.items()}
    base = med.get("auto")
    ratios = {kv: {k: round(v / base[k], 3) for k, v in m.items() if base and base.get(k)}
              for kv, m in med.items() if kv != "auto"}
    return {"median": med, "ratio_to_model_dtype": ratios, "runs": runs}


def kv_quant_md(r: dict) -> list[str]:
    kvs = list(r["median"])
    keys = [("kv_bytes_allocated", "pool arrays allocated (MB)", 1e6),
            ("formula_bytes", "the facts' formula (MB)", 1e6),
            ("peak_over_load", "MLX peak of the prefill over the loaded model (MB)", 1e6),
            ("prefill_s", "prefill (s)", 1), ("decode_tps", "1-row decode (tok/s)", 1),
            ("batched_tps", "rows decoded together, aggregate (tok/s)", 1)]
    return report.table(
        ["figure", *kvs, *(f"{kv} ÷ auto" for kv in r["ratio_to_model_dtype"])],
        [[name, *(report.num(r["median"][kv][key] / scale) for kv in kvs),
          *(report.num(x.get(key)) for x in r["ratio_to_model_dtype"].values())]
         for key, name, scale in keys])


def constrained(a) -> dict:
    from plimsoll import constrain
    from plimsoll.engine import Engine

    rows = 4
    eng = Engine.load(a.model, block_tokens=BLOCK, max_blocks=rows * (
        -(-(len(PROMPT) + a.new_tokens) // BLOCK) + 1) + 8)
    t0 = time.perf_counter()
    cons = constrain.Constrainer(eng.tokenizer)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        cons.constraint(constrain.json_value(SCHEMA))
    compile_ms = (time.perf_counter() - t0) / 20 * 1000
    base = eng.tokenizer.encode(PROMPT)
    out: dict = {"vocab": cons.vocab, "new_tokens": a.new_tokens, "repeats": a.repeats,
                 "schema": SCHEMA, "constrainer_setup_s": round(setup_s, 4),
                 "grammar_compile_ms": round(compile_ms, 3)}
    modes = {"unconstrained": (False, True), "unconstrained_no_pipeline": (False, False),
             "json_schema": (True, True)}  # name: (constrained, pipelined)
    replay: list[list[int]] = []
    for batch in (1, rows):
        prompts = [base[:len(base) - 7 * i] for i in range(batch)]

        def run(constrained: bool, pipelined: bool, new: int, prompts=prompts) -> dict:
            cs = [cons.constraint(constrain.json_value(SCHEMA)) for _ in prompts] \
                if constrained else None
            return decode_rate(eng, prompts, new, constraints=cs, pipelined=pipelined,
                               keep_tokens=constrained)

        for flags in modes.values():  # warm-up, untimed
            run(*flags, 8)
        runs: dict[str, list[dict]] = {k: [] for k in modes}
        for _ in range(a.repeats):
            for name, flags in modes.items():
                runs[name].append(got := run(*flags, a.new_tokens))
                replay += got.get("tokens", [])
        med = {k: statistics.median(r["tps"] for r in v) for k, v in runs.items()}
        out[f"batch{batch}"] = {
            k: {"tokens_per_s": round(v, 1), "ms_per_step": round(1000 * batch / v, 3),
                "runs": [round(r["tps"], 1) for r in runs[k]]} for k, v in med.items()}
        out[f"batch{batch}"] |= {
            "ratio_constrained_vs_unconstrained": round(med["json_schema"]
                                                        / med["unconstrained"], 3),
            "ratio_no_pipeline_vs_unconstrained": round(med["unconstrained_no_pipeline"]
                                                        / med["unconstrained"], 3)}
    out["mask_only"] = mask_only(cons, replay)
    return out


def mask_only(cons, seqs: list[list[int]]) -> dict[str, float]:
    """llguidance alone: the per-token mask time replaying generated constrained tokens."""
    from plimsoll import constrain

    times = []
    for toks in seqs:
        c = cons.constraint(constrain.json_value(SCHEMA))
        for t in toks:
            s = time.perf_counter()
            c.advance(t)
            times.append(time.perf_counter() - s)
            if c.done():
                break
    ms = sorted(x * 1000 for x in times) or [0.0]
    return {"tokens": len(times), "median_ms": round(statistics.median(ms), 4),
            "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def constrained_md(r: dict) -> list[str]:
    def cell(b: dict, k: str) -> str:
        return f"{b[k]['tokens_per_s']} tok/s ({b[k]['ms_per_step']} ms/step)"

    m = r["mask_only"]
    return [*report.table(
        ["batch", "unconstrained (pipelined)", "unconstrained, no pipeline",
         "json_schema (llguidance)", "constrained ÷ unconstrained",
         "no-pipeline ÷ unconstrained"],
        [[b[5:], cell(r[b], "unconstrained"), cell(r[b], "unconstrained_no_pipeline"),
          cell(r[b], "json_schema"), r[b]["ratio_constrained_vs_unconstrained"],
          r[b]["ratio_no_pipeline_vs_unconstrained"]] for b in ("batch1", "batch4")]),
        "", f"Mask alone (llguidance, {m['tokens']} generated tokens replayed): median "
        f"{m['median_ms']} ms, p95 {m['p95_ms']} ms, mean {m['mean_ms']} ms; grammar compile "
        f"{r['grammar_compile_ms']} ms; tokenizer setup {r['constrainer_setup_s']} s."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="figure", required=True)
    cmd = sub.add_parser("paged", help="engine vs mlx-lm decode tok/s at 1 and N streams")
    cmd.add_argument("--model", type=Path, required=True)
    cmd.add_argument("--new-tokens", type=int, default=128)
    cmd.add_argument("--streams", default="1,8,32", help="batch sizes, comma-separated")
    cmd.add_argument("--rounds", type=int, default=3)
    cmd = sub.add_parser("kv-quant", help="KV bytes and step rates at the model's dtype, q8, q4")
    cmd.add_argument("--model", type=Path, required=True)
    cmd.add_argument("--kv", default="auto,q8,q4")
    cmd.add_argument("--context", type=int, default=6700)
    cmd.add_argument("--chunk", type=int, default=512)
    cmd.add_argument("--decode", type=int, default=48)
    cmd.add_argument("--rows", type=int, default=8)
    cmd.add_argument("--row-context", type=int, default=512)
    cmd.add_argument("--slab", type=int, default=8, help="growth slab, blocks")
    cmd.add_argument("--repeats", type=int, default=2)
    cmd = sub.add_parser("window", help="sliding-window bytes held: plimsoll vs mlx-lm")
    cmd.add_argument("--window", type=int, default=512)
    cmd.add_argument("--tokens", type=int, default=4096)
    cmd.add_argument("--prompt", type=int, default=1024)
    cmd = sub.add_parser("constrained", help="decode tok/s with and without json_schema")
    cmd.add_argument("--model", type=Path, required=True)
    cmd.add_argument("--new-tokens", type=int, default=128)
    cmd.add_argument("--repeats", type=int, default=3)
    cmd = sub.add_parser("attention", help="quantized KV read paths of one layer")
    cmd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cmd.add_argument("--repeats", type=int, default=7)
    for figure, cmd in sub.choices.items():
        report.output_args(cmd, f"engine-{figure}")
    a = p.parse_args(argv)
    run, md, title = {"paged": (paged, paged_md, "Paged engine vs mlx-lm, in process"),
                      "kv-quant": (kv_quant, kv_quant_md, "Quantized KV in process"),
                      "window": (window, window_md, "Sliding-window bytes held"),
                      "constrained": (constrained, constrained_md, "Constrained decoding"),
                      "attention": (attention, attention_md, "Quantized KV read paths"),
                      }[a.figure]
    result = {"figure": a.figure, "command": report.command(), "host": report.host_facts(),
              **device(), "args": {k: str(v) for k, v in vars(a).items()}}
    result |= run(a)
    result["host"]["loadavg_end"] = report.loadavg()
    name = a.name or report.default_name(f"engine-{a.figure}")
    report.write(result, a.out_dir, name, lambda r: "\n".join([
        f"# {title}: {name}", "", f"Command: `{r['command']}`", "",
        f"{r['device']} ({r['machine']}, mlx {r['mlx']}). {report.host_line(r['host'])}", "",
        *md(r)]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
