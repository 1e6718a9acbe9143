"""CUDA probes (NVIDIA GPU, MLX's CUDA backend): what the engine's CUDA choices rest on.

One subcommand a device call, after the kit's setup (see bench/README.md); each prints its
raw figures (the results files quote them):

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` by (queries, keys) shape, first call vs
  a cached plan, ms (run again with ``MLX_CUDA_USE_CUDNN_SDPA=0`` for cuDNN off);
- ``prefill-chunks MODEL``: prefill chunks through the engine, ms each, with attention and
  with attention replaced by the identity (what the rest of the layer costs);
- ``first-use MODEL``: the same prefill schedule three times (first-use compilation), then a
  long prompt in big chunks, with MLX and NVML memory after each;
- ``batched-prefill MODEL``: N prompts of 115–575 tokens arriving together, a scheduler-like
  loop (2048 prompt tokens a step beside every running decode, pipelined) to 128 tokens each,
  ``Engine.batch_prefill`` off and on, alternating;
- ``subagents MODEL``: the sub-agent workload at the engine (no scheduler, no HTTP): one
  17,109-token prompt in 2048-token chunks, then 7 prompts that share its first 15,936 tokens'
  blocks and add 1,173 of their own, 2048 prompt tokens a step; each step synchronised and
  timed (host build, total) with its groups (tokens @ start). Rounds: ``cold`` (new shapes),
  ``warm`` (the same shapes, new tokens), ``no-attn`` (attention replaced by the identity:
  what the rest of the step costs). Run again with ``MLX_CUDA_USE_CUDNN_SDPA=0``;
- ``decode-kernels MODEL [--old FILE]``: decode tok/s at the engine at 1, 8 and 32 rows with
  the decode kernel in use, with the gather path (no kernel), and with an older
  ``paged_cuda`` module (FILE, e.g. ``git show REV:python/plimsoll/engine/paged_cuda.py``),
  alternating, plus each one's start-time check (kernel vs reference ms).

MODEL is bench/gpu_model.py's (``python3 bench/gpu_model.py /tmp/m``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

from lib.samplers import Gpu

VOCAB = 150000


def ids(n: int, seed: int, vocab: int = VOCAB + 10) -> tuple[int, ...]:
    """``n`` token ids in ``10 .. vocab - 1``, spread by ``seed``."""
    return tuple((seed * 7919 + i * 104729) % (vocab - 10) + 10 for i in range(n))


def sdpa(_) -> None:
    import mlx.core as mx

    heads, kv_heads, dim = 32, 8, 128
    attend = mx.fast.scaled_dot_product_attention

    def timed(fn, n: int = 5) -> tuple[float, float]:
        t0 = time.perf_counter()
        mx.eval(fn())
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            mx.eval(fn())
        return round(first * 1000, 1), round((time.perf_counter() - t0) / n * 1000, 2)

    pool_k = mx.random.normal((kv_heads, 40000, dim)).astype(mx.bfloat16)
    pool_v = mx.random.normal((kv_heads, 40000, dim)).astype(mx.bfloat16)
    mx.eval(pool_k, pool_v)
    print("cudnn env", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"), flush=True)
    for q_len, k_len in ((512, 512), (512, 4608), (512, 4624), (512, 16896), (2048, 18432),
                         (4096, 20480), (2720, 2720)):
        q = mx.random.normal((1, heads, q_len, dim)).astype(mx.bfloat16)
        kc, vc = mx.contiguous(pool_k[None, :, :k_len]), mx.contiguous(pool_v[None, :, :k_len])
        mx.eval(q, kc, vc)
        ks, vs = pool_k[None, :, 1024:1024 + k_len], pool_v[None, :, 1024:1024 + k_len]
        mask = mx.arange(k_len)[None, :] <= (mx.arange(q_len)[:, None] + k_len - q_len)
        cases = {"contig causal": (kc, vc, "causal"), "slice causal": (ks, vs, "causal"),
                 "contig nomask": (kc, vc, None), "contig boolmask": (kc, vc, mask)}
        print(q_len, k_len, {name: timed(lambda q=q, k=k, v=v, m=m: attend(q, k, v, scale=0.088,
                                                                           mask=m))
                             for name, (k, v, m) in cases.items()}, flush=True)


def prefill_chunks(a) -> None:
    from plimsoll.engine import Engine, attention
    from plimsoll.engine.work import Step, Work

    eng = Engine.load(a.model, block_tokens=16, max_blocks=2000)
    prompt = tuple((i * 104729) % VOCAB + 10 for i in range(12000))

    def go(seq: int, chunks: list[int]) -> list[float]:
        table, start, out = tuple(range(seq * 700, seq * 700 + 700)), 0, []
        for n in chunks:
            t0 = time.perf_counter()
            eng.run(Step(prefills=(Work(seq, prompt[start:start + n], start, table, False),)))
            out.append(round((time.perf_counter() - t0) * 1000, 1))
            start += n
        eng.free_state(seq)
        return out

    def identity(self, queries, scale, sinks):  # counted as attended, attends to nothing
        self.batch.attended += 1
        return queries

    print("warm", go(0, [2048, 512, 512, 2048]))
    print("real", go(1, [2048, 512, 512, 512, 2048, 2048]))
    real = attention.PagedView.attend
    attention.PagedView.attend = identity
    try:
        print("no-attn", go(2, [2048, 512, 512, 512, 2048, 2048]))
    finally:
        attention.PagedView.attend = real


def first_use(a) -> None:
    import mlx.core as mx
    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    gpu = Gpu()

    def nvml_gib() -> float:
        return (gpu.total_used() or 0) / 2**30

    def mem(tag: str) -> None:
        print(f"  [{tag}] active {mx.get_active_memory() / 2**30:.2f} cache "
              f"{mx.get_cache_memory() / 2**30:.2f} peak {mx.get_peak_memory() / 2**30:.2f} "
              f"nvml {nvml_gib():.2f} GiB", flush=True)

    print("nvml before load", nvml_gib())
    eng = Engine.load(a.model, block_tokens=16, max_blocks=3000)
    mx.set_cache_limit(256 << 20)
    mem("loaded")

    def run_seq(seq: int, prompt: tuple[int, ...], chunks: list[int],
                table: tuple[int, ...]) -> list[float]:
        times, start = [], 0
        for k, n in enumerate(chunks):
            t = time.perf_counter()
            eng.run(Step(prefills=(Work(seq, prompt[start:start + n], start, table,
                                        k == len(chunks) - 1),)))
            times.append(round(time.perf_counter() - t, 3))
            start += n
        return times

    chunks = [2720] + [512] * 5 + [300, 256, 128]
    for rep in range(3):
        table = tuple(range(rep * 520, rep * 520 + 520))
        print(f"rep {rep}: first chunk 2720 @0, then 512-chunks", flush=True)
        print("  times", run_seq(rep, ids(8192, rep), chunks, table), flush=True)
        mem(f"rep{rep}")
        t = time.perf_counter()
        for j in range(8):  # one row decoding after the prompt
            eng.run(Step(decodes=(Work(rep, (5,), sum(chunks) + j, table, True),)))
        print("  decode1 x8", round(time.perf_counter() - t, 3), flush=True)
        eng.free_state(rep)
    mx.clear_cache()
    mem("cleared")
    # a big transient: 4096-token chunks against a 20k context
    t = time.perf_counter()
    times = run_seq(9, ids(24000, 9), [4096] * 4 + [2048] * 2 + [1024],
                    tuple(range(1560, 1560 + 1500)))
    print("long", times, round(time.perf_counter() - t, 2))
    mem("long")
    mx.clear_cache()
    mem("long-cleared")


def batched_prefill(a) -> None:
    from plimsoll.engine import Engine, warm_up
    from plimsoll.engine.work import Step, Work

    eng = Engine.load(a.model, block_tokens=16, max_blocks=6000)
    eng.warm = warm_up(eng)
    rng = random.Random(0)

    def run(n: int, flag: bool, new: int = 128, budget: int = 2048, salt: int = 0) -> str:
        eng.batch_prefill = flag
        lens = [rng.randint(115, 575) for _ in range(n)]
        prompts = [tuple((salt * 7919 + i * 104729 + j * 31) % VOCAB + 10 for j in range(length))
                   for i, length in enumerate(lens)]
        tables, at = [], 0
        for length in lens:
            k = math.ceil((length + new) / 16)
            tables.append(tuple(range(at, at + k)))
            at += k
        written, out = [0] * n, [[] for _ in range(n)]
        first: list[float | None] = [None] * n
        inflight, pending, t0 = [0] * n, None, time.perf_counter()
        while True:
            dec = tuple(Work(i, None, lens[i] + len(out[i]) + inflight[i] - 1, tables[i], True)
                        for i in range(n) if written[i] == lens[i] and (out[i] or inflight[i])
                        and len(out[i]) + inflight[i] < new)
            pre, left = [], budget
            for i in range(n):
                if written[i] < lens[i] and left > 0:
                    take = min(left, lens[i] - written[i])
                    left -= take
                    pre.append(Work(i, prompts[i][written[i]:written[i] + take], written[i],
                                    tables[i], written[i] + take == lens[i]))
            if not dec and not pre and pending is None:
                break
            nxt = eng.run_async(Step(dec, tuple(pre))) if (dec or pre) else None
            for w in dec:
                inflight[w.seq_id] += 1
            for w in pre:
                written[w.seq_id] += len(w.tokens)
                inflight[w.seq_id] += w.sample
            if pending is not None:
                for seq, tok in pending.result().items():
                    out[seq].append(tok)
                    inflight[seq] -= 1
                    if first[seq] is None:
                        first[seq] = time.perf_counter() - t0
            pending = nxt
        dt = time.perf_counter() - t0
        for i in range(n):
            eng.free_state(i)
        return (f"n={n} batch_prefill={flag}: ttft max {max(first):.2f} mean "
                f"{sum(first) / n:.2f}; total {dt:.2f}s; agg {n * new / dt:.0f} tok/s")

    for salt, (n, flag) in enumerate([(8, False), (8, True), (32, False), (32, True),
                                      (32, False), (32, True), (8, False), (8, True)]):
        print(run(n, flag, salt=salt), flush=True)


def subagents(a) -> None:
    import mlx.core as mx
    from plimsoll.engine import Engine, attention, backend, limits, warm_up, warmup
    from plimsoll.engine.work import Step, Work

    bt, total, shared, budget = 16, 17109, 15936, 2048
    eng = Engine.load(a.model, block_tokens=bt, max_blocks=4000)
    eng.warm = warm_up(eng)
    import json
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    first = ids(total, 1, vocab)
    blocks = -(-(total + 64) // bt)
    base = tuple(range(blocks))

    def step(prefills: list[Work]) -> tuple[float, float]:
        t0 = time.perf_counter()
        pending = eng.run_async(Step((), tuple(prefills)))
        host = time.perf_counter() - t0
        pending.result()
        mx.synchronize()
        return round(host * 1000, 1), round((time.perf_counter() - t0) * 1000, 1)

    out = []
    for start in range(0, total, budget):  # the first request, alone
        n = min(budget, total - start)
        out.append((n, step([Work(0, first[start:start + n], start, base, start + n == total)])))
    print("alone", sum(t for _, (_, t) in out), out, flush=True)

    def round_(tag: str, salt: int, shared: int = shared) -> None:
        seqs = []
        for i in range(7):
            own = ids(total - shared, 100 * salt + i + 2, vocab)
            own_blocks = blocks - shared // bt
            lo = blocks + i * own_blocks  # each round writes the same slots again
            table = base[:shared // bt] + tuple(range(lo, lo + own_blocks))
            seqs.append([10 * salt + i + 1, own, shared, table])
        log, t_all = [], 0.0
        while any(s[2] < total for s in seqs):
            left, works = budget, []
            for s in seqs:
                if s[2] < total and left > 0:
                    n = min(left, total - s[2])
                    w = s[1][s[2] - shared:s[2] - shared + n]
                    works.append(Work(s[0], w, s[2], s[3], s[2] + n == total))
                    s[2] += n
                    left -= n
            host, ms = step(works)
            t_all += ms
            log.append(([f"{len(w.tokens)}@{w.start}" for w in works], host, ms))
        for s in seqs:
            eng.free_state(s[0])
        print(tag, round(t_all, 1), log, flush=True)

    def identity(self, queries, scale, sinks):
        self.batch.attended += 1
        return queries

    round_("cold", 0)
    round_("warm", 1)
    real = attention.PagedView.attend
    attention.PagedView.attend = identity
    try:
        round_("no-attn", 2)
    finally:
        attention.PagedView.attend = real
    round_("warm-again", 3)
    # the worker's idle warmer (engine/warmup.PlanWarmer) over shapes up to this context,
    # then a round at a prefix length no round has used: new shapes, built ahead
    warmer = warmup.PlanWarmer(warmup.plan_shapes(backend.causal_grid(), budget, total + 64,
                                                  limits.warm_plans_most()))
    while warmer.step():
        pass
    print("warmer", warmer.figures(), flush=True)
    round_("cold-after-warmer", 4, shared - 2048 - 512)


def decode_kernels(a) -> None:
    import importlib.util

    import mlx.core as mx
    from plimsoll.engine import Engine, kernels, warm_up

    from lib.engine import code_prompts, decode_rate

    eng = Engine.load(a.model, block_tokens=16, max_blocks=6000)
    eng.warm = warm_up(eng)
    variants = {"current": eng.kernels.decode, "gather": None}
    if a.old:
        spec = importlib.util.spec_from_file_location("paged_cuda_old", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        variants["old"] = kernels.Kernel("paged_decode_cuda_old", "cuda", old.paged_decode,
                                         old.serves)
    print("verdicts", eng.kernels.report(), flush=True)
    for name, k in variants.items():
        if k is not None:
            v = kernels.check(k, mx.bfloat16, 32, [(8, 128, 128)])  # the 4B shape
            print("check", name, v.as_dict(), flush=True)
    prompts = code_prompts(eng.tokenizer, 32)
    for rnd in range(2):
        for name, k in variants.items():
            eng.kernels.decode = k
            for rows in (1, 8, 32):
                r = decode_rate(eng, [p * 4 for p in prompts[:rows]], 128)
                print(f"round {rnd} {name} rows {rows}: {r['tps']:.0f} tok/s, "
                      f"{1000 * rows / r['tps']:.2f} ms/step, cpu {r['cpu_ms_per_step']:.2f}",
                      flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    sub.add_parser("sdpa", help="attention by shape: plan builds vs cached plans")
    for name, what in (("prefill-chunks", "prefill chunks with and without attention"),
                       ("first-use", "first-use compilation and memory"),
                       ("batched-prefill", "batched first chunks off vs on"),
                       ("subagents", "the sub-agent workload at the engine, step by step")):
        sub.add_parser(name, help=what).add_argument("model", help="bench/gpu_model.py's dir")
    dk = sub.add_parser("decode-kernels", help="decode tok/s: the kernel, gather, an old kernel")
    dk.add_argument("model", help="bench/gpu_model.py's dir")
    dk.add_argument("--old", help="an older paged_cuda.py to compare")
    a = p.parse_args(argv)
    {"sdpa": sdpa, "prefill-chunks": prefill_chunks, "first-use": first_use,
     "batched-prefill": batched_prefill, "subagents": subagents,
     "decode-kernels": decode_kernels}[a.probe](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
