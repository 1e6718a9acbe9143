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
  ``Engine.batch_prefill`` off and on, alternating.

MODEL is bench/gpu_model.py's (``python3 bench/gpu_model.py /tmp/m``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

from lib.samplers import Gpu

VOCAB = 150000


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 104729) % VOCAB + 10 for i in range(n))


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    sub.add_parser("sdpa", help="attention by shape: plan builds vs cached plans")
    for name, what in (("prefill-chunks", "prefill chunks with and without attention"),
                       ("first-use", "first-use compilation and memory"),
                       ("batched-prefill", "batched first chunks off vs on")):
        sub.add_parser(name, help=what).add_argument("model", help="bench/gpu_model.py's dir")
    a = p.parse_args(argv)
    {"sdpa": sdpa, "prefill-chunks": prefill_chunks, "first-use": first_use,
     "batched-prefill": batched_prefill}[a.probe](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
