"""Where a small step's time goes on a GPU: matmuls of few rows, and the engine's step.

By hand, not a test (meant for MLX's CUDA backend; runs anywhere). Two parts:

- ``matmul``: the model's linear layers (``--model``'s config: q, k, v, o, gate, up, down per
  layer, distinct weights for every layer, plus the lm head), ``rows`` tokens through all of
  them in one graph, bf16: ms per pass for rows 1, 2, 4, 8, 16, 32, on CUDA through the
  engine's few-row kernel too (engine/skinny_cuda.py), and for 4 and 8 rows two other
  formulations (``W @ xᵀ``, and one matrix-vector product per row);
- ``engine``: :class:`plimsoll.engine.Engine` in process, pipelined steps of ``rows`` decode
  rows, and of ``rows`` sequences each verifying 3 drafts (4 tokens, every draft taken as
  accepted), eager and with ``compile_decode``: ms per step and host ms per step (the time
  ``run_async`` takes to build and submit a step).

Writes ``--out-dir``/``--name``.{json,md}::

    python3 bench/gpu_step.py --model /tmp/qwen3-4b-shaped --out-dir $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from plimsoll.engine import backend
from plimsoll.engine.skinny_cuda import skinny

from lib import report

ROWS = [1, 2, 4, 8, 16, 32]


def _shapes(cfg: dict) -> list[tuple[int, int]]:
    h, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return [(heads * d, h), (kvh * d, h), (kvh * d, h), (h, heads * d), (inter, h), (inter, h),
            (h, inter)]


def matmuls(cfg: dict, reps: int, row_counts: list[int] = ROWS) -> dict:
    layers = cfg["num_hidden_layers"]
    shapes = _shapes(cfg)
    ws = [[mx.random.normal((o, i)).astype(mx.bfloat16) * 0.02 for o, i in shapes]
          for _ in range(layers)]
    head = mx.random.normal((cfg["vocab_size"], cfg["hidden_size"])).astype(mx.bfloat16) * 0.02
    mx.eval(ws, head)
    out: dict = {}

    def timed(name: str, fn) -> None:
        for _ in range(2):
            mx.eval(fn())
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t0)
        out[name] = round(1e3 * statistics.median(times), 3)
        print(f"matmul {name:>16}: {out[name]:.3f} ms", flush=True)

    for rows in row_counts:
        x = {i: mx.random.normal((rows, i)).astype(mx.bfloat16) for _, i in shapes}
        mx.eval(x)

        def plain(x=x):
            return [x[w.shape[1]] @ w.T for layer in ws for w in layer] + [
                x[head.shape[1]] @ head.T]
        timed(f"{rows} rows", plain)
        if 2 <= rows <= 8 and backend.name() == "cuda":
            def through_skinny(x=x):
                return [skinny(x[w.shape[1]], w) for layer in ws for w in layer] + [
                    skinny(x[head.shape[1]], head)]
            try:
                timed(f"{rows} rows skinny", through_skinny)
            except Exception as err:  # a report, not a test
                out[f"{rows} rows skinny"] = f"failed: {err}"
                print(f"skinny failed: {err}", flush=True)
        if rows in (4, 8):
            def right(x=x):
                return [(w @ x[w.shape[1]].T).T for layer in ws for w in layer]
            timed(f"{rows} rows W@xT", right)

            def per_row(x=x, rows=rows):
                return [x[w.shape[1]][r:r + 1] @ w.T for layer in ws for w in layer
                        for r in range(rows)]
            timed(f"{rows} rows gemv×n", per_row)
    mx.clear_cache()
    return out


def _steps(eng, rows: int, verify: bool, steps: int) -> dict:
    from plimsoll.engine.work import Step, Work

    bt = eng.block_tokens
    per = -(-(128 + 4 * steps + 8) // bt)
    prompt = tuple(range(5, 133))
    tables = [tuple(range(s * per, (s + 1) * per)) for s in range(rows)]
    eng.run(Step(prefills=tuple(Work(s, prompt, 0, tables[s], True) for s in range(rows))))
    pos = len(prompt)
    pending, host, done, t0 = None, [], [], time.perf_counter()
    for _ in range(steps):
        h0 = time.perf_counter()
        if verify:
            step = Step(prefills=tuple(Work(s, (7,) * 4, pos, tables[s], True, draft=3)
                                       for s in range(rows)))
        else:
            step = Step(decodes=tuple(Work(s, None if pending else (7,), pos, tables[s], True)
                                      for s in range(rows)))
        nxt = eng.run_async(step)
        host.append(time.perf_counter() - h0)
        if pending is not None:
            pending.result()
            done.append(time.perf_counter())
        pending = nxt
        pos += 4 if verify else 1
    pending.result()
    dt = time.perf_counter() - t0
    for s in range(rows):
        eng.free_state(s)
    gaps = [b - a for a, b in itertools.pairwise(done)]
    return {"ms_per_step": round(1e3 * dt / steps, 3),
            "p50_ms_per_step": round(1e3 * statistics.median(gaps), 3) if gaps else None,
            "host_ms_per_step": round(1e3 * statistics.median(host), 3)}


def engine(model: Path, steps: int, rows_list: list[int], compile_decode: bool,
           max_blocks: int = 4096) -> dict:
    """Steps of an engine loaded with ``compile_decode`` (which also decides its pool writes:
    scatters where True, the CUDA in-place write kernel where False and it passed its check);
    ``compiled`` rows only where True."""
    from plimsoll.engine import Engine

    eng = Engine.load(model, block_tokens=16, max_blocks=max_blocks,
                      compile_decode=compile_decode)
    traced = eng.compiled
    writes = "scatter" if compile_decode else "in place"
    print("kernels:", [(v.name, v.used) for v in eng.kernels.verdicts], flush=True)
    out: dict = {}
    for rows in rows_list:
        for mode in ("eager", "compiled", "verify") if traced else ("eager", "verify"):
            eng.compiled = traced if mode == "compiled" else None
            _steps(eng, rows, mode == "verify", 8)  # warm (and traces the bucket)
            r = _steps(eng, rows, mode == "verify", steps)
            out[f"{mode} {rows} ({writes})"] = r
            print(f"engine {mode:>8} {rows:>2} rows, writes {writes}: {r}", flush=True)
    eng.compiled = traced
    del eng
    mx.clear_cache()
    return out


def markdown(res: dict) -> str:
    lines = [f"# Small steps on {res['device']}", "", f"Command: `{res['command']}`", "",
             "## Linear layers of every layer + lm head, one graph (ms)", "",
             *report.table(["rows / formulation", "ms"],
                           [(k, v) for k, v in res.get("matmul", {}).items()]), "",
             "## Engine steps in process, pipelined (ms per step, host ms per step)", "",
             *report.table(["mode rows", "ms per step", "p50 ms between steps",
                            "host ms per step"],
                           [(k, v["ms_per_step"], v.get("p50_ms_per_step"),
                             v["host_ms_per_step"])
                            for k, v in res.get("engine", {}).items()])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--parts", default="matmul,engine")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 32])
    ap.add_argument("--matmul-rows", type=lambda s: [int(x) for x in s.split(",")],
                    default=ROWS, help="rows of the matmul part (default 1,2,4,8,16,32; the "
                    "few-row kernel is timed beside cuBLAS at 2-8)")
    ap.add_argument("--compile", type=lambda s: s.split(","), default=["on"],
                    help="engines to load: on (compile_decode, scatter writes), off (in-place "
                    "writes where the CUDA kernel passed its check), or on,off")
    ap.add_argument("--max-blocks", type=int, default=4096,
                    help="the engine's pool, in blocks of 16 tokens (a served model's pool is "
                    "larger: `launch --concurrency 8 --context 40960` holds ~20,480)")
    ap.add_argument("--out-dir", type=Path, default=report.OUT)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    cfg = json.loads((args.model / "config.json").read_text())
    res: dict = {"device": str(mx.default_device()), "command": "python3 " + " ".join(sys.argv),
                 "mlx_env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}
    parts = args.parts.split(",")
    if "matmul" in parts:
        res["matmul"] = matmuls(cfg, args.reps, args.matmul_rows)
    if "engine" in parts:
        res["engine"] = {}
        for flag in args.compile:
            res["engine"] |= engine(args.model, args.steps, args.rows, flag == "on",
                                    args.max_blocks)
    name = args.name or f"gpu-step-{report.machine()}-{time.strftime('%Y-%m-%d')}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    (args.out_dir / f"{name}.md").write_text(markdown(res))
    print(f"wrote {args.out_dir / name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
