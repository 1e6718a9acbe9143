"""Which of the engine's CUDA kernels, on or off, give mlx-lm's greedy tokens (MLX's CUDA backend).

The tiny demo model, sharpened; three prompts in 32-token chunks beside running decodes, on
blocks in order and shuffled, synchronous and pipelined; every combination of the in-place
pool write, the gather kernel and the paged-decode kernel. Found the in-place write racing its
readers inside one command batch (bench/results/cuda-probes-h200-2026-12-03-ordering.txt).
Ends with the reference's top-1 minus top-2 log-probability at each step (how close a flip is).

    python3 bench/pool_order.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from plimsoll.demo.model import build_demo_model
from plimsoll.engine import Engine
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text

MODES = {"all": (1, 1, 1), "no-inplace": (0, 1, 1), "no-gather": (1, 0, 1),
         "no-decode-kernel": (1, 1, 0), "none": (0, 0, 0), "inplace-only": (1, 0, 0)}


def main() -> None:
    eng = Engine.load(build_demo_model(Path(tempfile.mkdtemp()), "tiny"), block_tokens=16,
                      max_blocks=64)
    sharpen(eng.model)
    print("dtype", eng._compute_dtype, "kernels",
          [(v.name, v.used, v.reason[:80]) for v in eng.kernels.verdicts])
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 70)]
    ref = [reference(eng.model, p, 6) for p in prompts]
    print("ref", ref)
    kept = [(p, p.inplace, p.fast_gather) for p in eng._pools]
    decode, gathers = eng.kernels.decode, eng.decode_gathers
    for name, (inplace, gather, kernel) in MODES.items():
        for p, write, fast in kept:
            p.inplace = write if inplace else None
            p.fast_gather = fast if gather else None
        eng.kernels.decode = decode if kernel else None
        eng.decode_gathers = gathers if kernel else True
        for shuffle in (True, False):
            for pipelined in (False, True):
                got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=shuffle)),
                            chunk=32, pipelined=pipelined)
                print(f"{name:18s} shuffle={shuffle:d} pipe={pipelined:d} equal={got == ref} "
                      f"{got if got != ref else ''}", flush=True)
    for p in prompts:
        gaps = []
        for _, logprobs in generate_step(mx.array(p), eng.model, max_tokens=6):
            s = mx.sort(logprobs.astype(mx.float32))
            gaps.append(round((s[-1] - s[-2]).item(), 4))
        print("top1-top2 logprob gaps", gaps)


if __name__ == "__main__":
    main()
