"""Decode throughput of plimsoll's engine against mlx-lm's own generators (by hand, not a test).

Measures, on one model directory (build one with ``plimsoll demo-model``):

- ``mlx-single``: ``mlx_lm.stream_generate`` (its reported ``generation_tps``);
- ``engine-single``: :class:`plimsoll.engine.Engine`, one sequence, ``step()`` loop;
- ``mlx-batch``: ``mlx_lm.generate.BatchGenerator`` with N prompts of different lengths;
- ``engine-batch``: the engine, N sequences batched, per-sequence attention (the design);
- ``engine-pad``: the engine with option (a), pad-and-stack per layer per step, for comparison.

Batch figures are aggregate decode tokens/s, timed from the moment every sequence has
its first token to the last token (prefill excluded for both). Run with OpenBLAS::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python bench/engine_spike.py --model /tmp/eng/tiny --new-tokens 256 --streams 8
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator
from plimsoll.engine import Engine
from plimsoll.engine import adapter as engine_mod

_LENGTHS = [48, 120, 200, 300, 400, 500, 80, 250, 160, 350, 90, 220, 60, 270, 180, 330]


def _prompts(tok, n: int) -> list[list[int]]:
    base = tok.encode("import os\nclass Foo:\n    def bar(self, x):\n        return x + 1\n" * 64)
    return [base[i:i + _LENGTHS[i % len(_LENGTHS)]] for i in range(n)]


def mlx_single(eng: Engine, prompt: list[int], new: int) -> float:
    last = None
    for last in stream_generate(eng.model, eng.tokenizer, prompt, max_tokens=new):
        pass
    return last.generation_tps


def engine_single(eng: Engine, prompt: list[int], new: int) -> float:
    eng.add("s", prompt, new)
    t0 = time.perf_counter()
    for _ in range(new - 1):
        eng.step()
    dt = time.perf_counter() - t0
    eng.finish("s")
    return (new - 1) / dt


def mlx_batch(eng: Engine, prompts: list[list[int]], new: int) -> float:
    gen = BatchGenerator(eng.model, max_tokens=new, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts, [new] * len(prompts))
    seen: set[int] = set()
    t0 = None
    count = 0
    while responses := gen.next_generated():
        for r in responses:
            if r.uid not in seen:
                seen.add(r.uid)
                continue
            count += 1
        if t0 is None and len(seen) == len(prompts):
            t0 = time.perf_counter()
            count = 0
    dt = time.perf_counter() - t0
    gen.close()
    return count / dt


def engine_batch(eng: Engine, prompts: list[list[int]], new: int) -> dict:
    eng.reset_peak()
    for i, p in enumerate(prompts):
        eng.add(i, p, new)
    reserved = sum(eng.capacity_tokens(len(p), new) for p in prompts) * eng.facts.kv_bytes_per_token
    active0 = mx.get_active_memory()
    t0 = time.perf_counter()
    count = 0
    for _ in range(new - 1):
        count += len(eng.step())
    dt = time.perf_counter() - t0
    active1 = mx.get_active_memory()
    held, peak = eng.kv_bytes_held(), eng.kv_bytes_peak()
    for i in range(len(prompts)):
        eng.finish(i)
    return {"tps": count / dt, "kv_bytes_held": held, "kv_bytes_peak": peak,
            "reserved_bytes": reserved, "active_growth_during_decode": active1 - active0}


def _pad_attend(self, queries, scale, sinks):
    """Option (a): left-pad every sequence's K/V to the longest and stack (a copy)."""
    self.attended += 1
    longest = max(s.offset for s in self.slots)
    ks, vs, pads = [], [], []
    for s in self.slots:
        k, v = s.fetch()
        pad = longest - s.offset
        pads.append(pad)
        if pad:
            widths = [(0, 0), (0, 0), (pad, 0), (0, 0)]
            k, v = mx.pad(k, widths), mx.pad(v, widths)
        ks.append(k)
        vs.append(v)
    mask = (mx.arange(longest)[None] >= mx.array(pads)[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, mx.concatenate(ks),
                                                mx.concatenate(vs), scale=scale, mask=mask,
                                                sinks=sinks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="mlx-single,engine-single,mlx-batch,engine-batch,"
                                        "engine-pad")
    args = ap.parse_args()
    eng = Engine.load(args.model, block_tokens=16)
    prompts = _prompts(eng.tokenizer, args.streams)
    results: dict = {"model": args.model, "new_tokens": args.new_tokens,
                     "streams": args.streams, "prompt_lengths": [len(p) for p in prompts]}
    # warm up both paths
    engine_single(eng, prompts[0], 8)
    mlx_single(eng, prompts[0], 8)
    runs: dict[str, list] = {}
    for _ in range(args.rounds):  # interleaved, so a busy neighbour hurts every mode alike
        for mode in args.modes.split(","):
            if mode == "mlx-single":
                got = mlx_single(eng, prompts[3], args.new_tokens)
            elif mode == "engine-single":
                got = engine_single(eng, prompts[3], args.new_tokens)
            elif mode == "mlx-batch":
                got = mlx_batch(eng, prompts, args.new_tokens)
            elif mode == "engine-batch":
                got = engine_batch(eng, prompts, args.new_tokens)
            elif mode == "engine-pad":
                original = engine_mod._BatchSlots.attend
                engine_mod._BatchSlots.attend = _pad_attend
                try:
                    got = engine_batch(eng, prompts, args.new_tokens)
                finally:
                    engine_mod._BatchSlots.attend = original
            else:
                raise SystemExit(f"unknown mode {mode}")
            runs.setdefault(mode, []).append(got)
            print(mode, json.dumps(got), flush=True)
    for mode, got in runs.items():
        tps = sorted(g["tps"] if isinstance(g, dict) else g for g in got)
        results[mode] = {"median_tps": tps[len(tps) // 2], "runs_tps": tps,
                         "last": got[-1]}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
