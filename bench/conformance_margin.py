"""The family conformance run, margin-aware: where plimsoll's batched greedy tokens differ from
mlx-lm's single-sequence ones, is the reference's choice there a near tie?

By hand, not a test (the suite asserts equality on the CPU: tests/worker/test_families_served.py,
tests/engine/). Meant for a GPU, where batched rows may take other kernels (TF32 matmuls,
other reduction orders) than one sequence does: a first difference where mlx-lm's top-2
log-prob margin is small is float noise; **one where it exceeds ``--defect-margin`` (0.01) is a
defect** to find.

Each family of ``python/tests/families.py`` (tiny random-weight models in mlx-lm's layout,
float32) that the engine serves: its prompts (``--lengths``) driven together through
:class:`plimsoll.engine.Engine` (prefill chunks of ``--chunk`` beside the others' decodes,
pipelined, block ids shuffled), ``--new`` greedy tokens each, against mlx-lm's own
``generate_step`` of each prompt alone. For every sequence: equal, or the first differing
position and the reference's margin there (its top log-prob minus its second).
Each family's row names the custom kernels its engine passed and used (``kernels``);
``--refuse a,b`` makes the engine's start-time checks refuse those kernels, to bisect a
difference seen only on a backend that has them (CUDA). ``--emulate-tf32`` (on the CPU) rounds
float32 products of two or more rows to TF32 as MLX's CUDA backend does by default
(``bench/lib/tf32.py``), so a CUDA-only difference can be told from that rounding; on a GPU
run with ``MLX_ENABLE_TF32=0`` for the same; ``--gather-unsorted`` drops ``mx.gather_mm``'s
sorted-indices hint (a mixture of experts then takes MLX's unsorted kernels). Writes
``--out-dir``/``--name`` (JSON and markdown)::

    PYTHONPATH=python python bench/conformance_margin.py [--families a,b] [--refuse a,b]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import traceback
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from lib import report, tf32

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))
from families import FAMILIES, build_family, has_module
from plimsoll.core.capability import check
from plimsoll.core.model_facts import inspect_model
from plimsoll.demo import tokenizer as tokenizer_build
from plimsoll.engine import Engine, backend
from plimsoll.engine.drive import Blocks, drive, family_prompts, seqs_for

BT = 16


def refuse(names: set[str]) -> None:
    """The engine's start-time kernel checks refuse ``names`` from now on in this process:
    each check still runs, its verdict is replaced before the engine reads it, so a refused
    kernel is never installed (the few-row matmul, installed by its own check, is not even
    checked)."""
    from plimsoll.engine import decode_write, kernels

    def no(verdict):
        return verdict if verdict is None or verdict.name not in names else \
            dataclasses.replace(verdict, used=False, reason="refused by --refuse")

    def refusing(check):
        return lambda *a, **k: no(check(*a, **k))

    for module, fn in ((kernels, "check_gather"), (kernels, "check_write"),
                       (kernels, "check_quantized"), (decode_write, "check_writing")):
        setattr(module, fn, refusing(getattr(module, fn)))
    if "skinny_matmul_cuda" in names:
        kernels.check_skinny = lambda model: kernels.Verdict(
            "skinny_matmul_cuda", "cuda", False, "refused by --refuse")
    select = kernels.select

    def select_refusing(*a, **k):
        chosen = select(*a, **k)
        return kernels.Selection([no(v) for v in chosen.verdicts],
                                 None if chosen.decode is None or chosen.decode.name in names
                                 else chosen.decode)

    kernels.select = select_refusing


def reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens of ``prompt`` alone and its top-2 log-prob margin at each."""
    tokens, margins = [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n):
        top2 = mx.topk(logprobs.astype(mx.float32), 2)
        tokens.append(int(tok))
        margins.append(float(mx.max(top2) - mx.min(top2)))
    return tokens, margins


def one_family(name: str, root: Path, tok, args) -> dict:
    model_dir = build_family(name, root / name, tok)
    refusal = check(inspect_model(model_dir), name)
    if refusal is not None:
        return {"family": name, "served": False, "reason": str(refusal)}
    prompts = family_prompts(*args.lengths)
    blocks = sum(-(-(len(p) + args.new) // BT) for p in prompts) + 8
    eng = Engine.load(model_dir, block_tokens=BT, max_blocks=blocks)
    got = drive(eng, seqs_for(prompts, args.new, BT, Blocks(blocks, shuffle=True)),
                chunk=args.chunk, pipelined=True)
    rows = []
    for prompt, mine in zip(prompts, got, strict=True):
        want, margins = reference(eng.model, prompt, args.new)
        first = next((i for i, (a, b) in enumerate(zip(mine, want, strict=False)) if a != b), None)
        rows.append({"prompt_tokens": len(prompt), "equal": mine == want, "first_diff": first,
                     "margin": None if first is None else round(margins[first], 5),
                     "min_margin": round(min(margins), 5)})
    worst = max((r["margin"] for r in rows if r["margin"] is not None), default=None)
    return {"family": name, "served": True, "rows": rows, "worst_margin": worst,
            "kernels": [v.name for v in eng.kernels.verdicts if v.used],
            "defect": worst is not None and worst > args.defect_margin}


def run(args) -> list[dict]:
    tok = tokenizer_build.train_tokenizer(512)
    names = args.families or [n for n, f in FAMILIES.items() if has_module(f)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                r = one_family(name, Path(tmp), tok, args)
            except Exception as err:  # a family that fails is a row, not the run's end
                r = {"family": name, "served": None,
                     "error": f"{type(err).__name__}: {err}",
                     "trace": traceback.format_exc(limit=4)}
            print(name, {k: v for k, v in r.items() if k not in ("rows", "trace")}, flush=True)
            out.append(r)
            mx.clear_cache()
    return out


def markdown(result: dict) -> str:
    fams = result["families"]
    served = [f for f in fams if f.get("served")]
    lines = [*report.heading("Family conformance, margin-aware", result),
             f"Backend: {result['backend']}"
             + (f" (TF32 products emulated: {result['tf32_emulated']})"
                if result.get("tf32_emulated") else
                f" (MLX_ENABLE_TF32={result['tf32']})" if result.get("tf32") else "")
             + f". {len(served)} families served, "
             f"{sum(all(r['equal'] for r in f['rows']) for f in served)} with every sequence "
             f"equal to mlx-lm's; defects (a first difference where mlx-lm's top-2 margin > "
             f"{result['args']['defect_margin']}): "
             f"{', '.join(f['family'] for f in served if f['defect']) or 'none'}.", "",
             "Per family: each sequence `prompt tokens: equal`, or the first differing "
             "position and mlx-lm's top-2 log-prob margin there.", ""]
    rows = []
    for f in fams:
        if f.get("served"):
            cells = "; ".join(
                f"{r['prompt_tokens']}: " + ("equal" if r["equal"]
                                             else f"at {r['first_diff']}, margin {r['margin']}")
                for r in f["rows"])
            rows.append([f["family"], cells, report.num(f["worst_margin"]),
                         ", ".join(f.get("kernels", [])) or "none",
                         "**defect**" if f["defect"] else "ok"])
        else:
            rows.append([f["family"], f.get("reason") or f.get("error", ""), "–", "–",
                         "refused" if f.get("served") is False else "**error**"])
    lines += report.table(["family", "sequences", "worst margin", "kernels used", "verdict"],
                          rows)
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", type=lambda s: s.split(","), default=None,
                    help="comma-separated family names (default: every one mlx-lm has)")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[20, 45, 70], help="prompt lengths, driven together")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens a sequence")
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk tokens")
    ap.add_argument("--defect-margin", type=float, default=0.01)
    ap.add_argument("--refuse", type=lambda s: set(s.split(",")), default=set(),
                    help="kernel names the engine's checks refuse (as the status names them)")
    ap.add_argument("--gather-unsorted", action="store_true",
                    help="drop mx.gather_mm's sorted_indices hint (MoE layers then take the "
                         "unsorted kernels): to bisect a difference in mixture-of-experts models")
    ap.add_argument("--emulate-tf32", action="store_true",
                    help="round float32 products of 2+ rows to TF32 as MLX's CUDA backend does")
    report.output_args(ap, "conformance-margin")
    args = ap.parse_args()
    refuse(args.refuse)
    if args.emulate_tf32:
        tf32.install()
    if args.gather_unsorted:
        gather = mx.gather_mm
        mx.gather_mm = lambda *a, **k: gather(*a, **{**k, "sorted_indices": False})
    return report.measure_and_write(
        args, "conformance-margin", run, markdown, key="families",
        more=lambda _: {"backend": backend.name(), "tf32": os.environ.get("MLX_ENABLE_TF32"),
                        **({"tf32_emulated": dict(tf32.COUNTS)} if args.emulate_tf32 else {})})


if __name__ == "__main__":
    sys.exit(main())
