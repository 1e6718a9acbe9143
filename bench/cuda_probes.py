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
  timed (host build, total) with its groups (tokens @ start) and MLX's peak above the
  memory active before it. Rounds: ``cold`` (new shapes),
  ``warm`` (the same shapes, new tokens), ``warm-one-by-one`` (each group writing a layer's
  pool in turn, as before ``mixers.write_once``), ``no-attn`` (attention replaced by the identity:
  what the rest of the step costs). Run again with ``MLX_CUDA_USE_CUDNN_SDPA=0``;
  ``--gather-ab``: after ``cold``, rounds with the pools' CUDA gather (engine/pool_cuda.py)
  and with MLX's, alternating, instead;
- ``decode-kernels MODEL [--old FILE]``: decode tok/s at the engine at 1, 8 and 32 rows with
  the decode kernel in use, with the gather path (no kernel), and with an older
  ``paged_cuda`` module (FILE, e.g. ``git show REV:python/plimsoll/engine/paged_cuda.py``),
  alternating, plus each one's start-time check (kernel vs reference ms).

- ``agentic-memory MODEL``: an agentic session at the engine (12 turns, each ~2.6k new prompt
  tokens in 2048-token chunks at the cached prefix, then 16 pipelined decode steps), once per
  ``--windows`` value (the layers a long chunk keeps in flight, ``Engine.prefill_window``; 0:
  unpaced), each on a fresh engine at ``--cache-mib`` of MLX buffer cache: per turn MLX's
  peak and active ÷ needed (weights + one KV copy of the session), the peak above the turn's
  start, the cache, NVML above the reading before load, the prefill and decode times.

- ``pool-writes MODEL [--tokens N --steps K]``: one sequence of N tokens decoding K pipelined
  steps with its pools written in place (engine/pool_cuda.py) and by MLX's scatter,
  alternating: the tokens (must be equal), ms a step, MLX's peak above active per step.

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
    print("kernels", [(v["name"], v["used"], v["reason"]) for v in eng.kernels.report()],
          flush=True)
    import json
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    first = ids(total, 1, vocab)
    blocks = -(-(total + 64) // bt)
    base = tuple(range(blocks))

    def step(prefills: list[Work]) -> tuple[float, float]:
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        pending = eng.run_async(Step((), tuple(prefills)))
        host = time.perf_counter() - t0
        pending.result()
        mx.synchronize()
        peaks.append((mx.get_peak_memory() - before) / 2 ** 30)
        return round(host * 1000, 1), round((time.perf_counter() - t0) * 1000, 1)

    peaks: list[float] = []

    out = []
    for start in range(0, total, budget):  # the first request, alone
        n = min(budget, total - start)
        out.append((n, step([Work(0, first[start:start + n], start, base, start + n == total)])))
    print("alone", sum(t for _, (_, t) in out), out, flush=True)
    peaks.clear()

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
        print(tag, round(t_all, 1), log, f"peak above active, GiB, max {max(peaks):.2f}",
              [round(p, 2) for p in peaks], flush=True)
        peaks.clear()

    def identity(self, queries, scale, sinks):
        self.batch.attended += 1
        return queries

    round_("cold", 0)
    if a.gather_ab:  # the pools' CUDA gather (engine/pool_cuda.py) against MLX's, alternating
        fast = [p.fast_gather for p in eng._pools]
        for salt, mode in enumerate(("kernel", "mlx") * 2, start=6):
            for p, g in zip(eng._pools, fast, strict=True):
                p.fast_gather = g if mode == "kernel" else None
            round_(f"warm-{mode}-gather", salt)
        return
    round_("warm", 1)
    from plimsoll.engine import mixers
    once = mixers.write_once
    mixers.write_once = lambda *_: False  # the layer's groups write one by one (fenced)
    try:
        round_("warm-one-by-one", 5)
    finally:
        mixers.write_once = once
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


def agentic_memory(a) -> None:
    import gc
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from plimsoll.engine import Engine, warm_up
    from plimsoll.engine.work import Step, Work

    gpu = Gpu()
    gib = 2 ** 30
    bt, budget, first, per_turn, turns, decodes = 16, 2048, 2719, 2590, a.turns, 16
    total = first + per_turn * (turns - 1) + decodes * turns + 64
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    prompt = ids(total, 3, vocab)
    table = tuple(range(-(-total // bt)))
    before = gpu.total_used() or 0
    rows = []
    for window in [int(w) for w in a.windows.split(",")]:
        eng = Engine.load(a.model, block_tokens=bt, max_blocks=len(table) + 8)
        eng.warm = warm_up(eng)
        eng.prefill_window = window
        mx.set_cache_limit(a.cache_mib << 20)
        mx.clear_cache()
        mx.synchronize()
        weights = sum(v.nbytes for _, v in tree_flatten(eng.model.parameters()))
        print(f"window {window}: loaded, active {weights / gib:.2f} GiB, nvml above before "
              f"{((gpu.total_used() or 0) - before) / gib:.2f} GiB", flush=True)
        pos = 0
        for turn in range(turns):
            end = first + turn * (per_turn + decodes)
            mx.synchronize()
            start_active = mx.get_active_memory()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            pending = None
            while pos < end:
                n = min(budget, end - pos)
                pending = eng.run_async(Step((), (Work(0, prompt[pos:pos + n], pos, table,
                                                       pos + n == end),)))
                pos += n
            pending.result()
            mx.synchronize()
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            pending = None
            for _ in range(decodes):
                nxt = eng.run_async(Step((Work(0, None, pos, table, True),)))
                pos += 1
                if pending is not None:
                    pending.result()
                pending = nxt
            pending.result()
            mx.synchronize()
            decode_ms = (time.perf_counter() - t0) * 1000 / decodes
            needed = weights + pos * eng.facts.kv_bytes_per_token
            row = {"window": window, "turn": turn + 1, "tokens": pos,
                   "peak_over_needed": round(mx.get_peak_memory() / needed, 3),
                   "active_over_needed": round(mx.get_active_memory() / needed, 3),
                   "transient_gib": round((mx.get_peak_memory() - start_active) / gib, 3),
                   "pool_gib": round(eng.kv_bytes_allocated() / gib, 3),
                   "cache_gib": round(mx.get_cache_memory() / gib, 3),
                   "nvml_over_needed": round(((gpu.total_used() or 0) - before) / needed, 3),
                   "prefill_s": round(prefill_s, 3), "decode_ms": round(decode_ms, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        eng.free_state(0)
        del eng, pending
        gc.collect()
        mx.clear_cache()
    print("summary", flush=True)
    for window in sorted({r["window"] for r in rows}):
        mine = [r for r in rows if r["window"] == window]
        print(f"window {window}: peak/needed max {max(r['peak_over_needed'] for r in mine)}, "
              f"transient max {max(r['transient_gib'] for r in mine)} GiB, nvml/needed max "
              f"{max(r['nvml_over_needed'] for r in mine)}, prefill s sum "
              f"{sum(r['prefill_s'] for r in mine):.2f}, decode ms "
              f"{sum(r['decode_ms'] for r in mine) / len(mine):.2f}", flush=True)


def pool_writes(a) -> None:
    """One sequence at ``--tokens`` decoding, pipelined, with the pools written in place
    (engine/pool_cuda.py) and by MLX's scatter: tokens, ms a step, MLX's peak above the
    memory active before the decodes, per step and at most."""
    import json

    import mlx.core as mx
    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    bt, n, budget = 16, a.tokens, 2048
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    eng = Engine.load(a.model, block_tokens=bt, max_blocks=n // bt + 64)
    print("kernels", eng.kernels.report(), flush=True)
    writer = eng._pools[0].inplace
    prompt, table = ids(n, 5, vocab), tuple(range(n // bt + 64))
    results = {}
    for mode in ("in-place", "scatter", "in-place"):
        for p in eng._pools:
            p.inplace = writer if mode == "in-place" else None
        for start in range(0, n, budget):
            chunk = prompt[start:start + budget]
            eng.run(Step((), (Work(0, chunk, start, table, start + len(chunk) == n),)))
        mx.synchronize()
        before = mx.get_active_memory()
        peaks, toks, pending, t0 = [], [], None, time.perf_counter()
        for k in range(a.steps):
            mx.reset_peak_memory()
            nxt = eng.run_async(Step((Work(0, None, n + k, table, True),)))
            if pending is not None:
                toks.append(pending.result()[0])
                peaks.append((mx.get_peak_memory() - before) / 2 ** 30)
            pending = nxt
        toks.append(pending.result()[0])
        ms = (time.perf_counter() - t0) * 1000 / a.steps
        eng.free_state(0)
        results.setdefault(mode, toks)
        print(mode, f"ms/step {ms:.2f}", f"peak above active max {max(peaks):.2f} GiB",
              [round(p, 2) for p in peaks[:48]], flush=True)
    print("same tokens:", results["in-place"] == results["scatter"], flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    sub.add_parser("sdpa", help="attention by shape: plan builds vs cached plans")
    for name, what in (("prefill-chunks", "prefill chunks with and without attention"),
                       ("first-use", "first-use compilation and memory"),
                       ("batched-prefill", "batched first chunks off vs on"),
                       ("subagents", "the sub-agent workload at the engine, step by step")):
        one = sub.add_parser(name, help=what)
        one.add_argument("model", help="bench/gpu_model.py's dir")
        if name == "subagents":
            one.add_argument("--gather-ab", action="store_true",
                             help="only: the pools' CUDA gather against MLX's, alternating")
    am = sub.add_parser("agentic-memory", help="an agentic session's memory, paced and not")
    am.add_argument("model", help="bench/gpu_model.py's dir")
    am.add_argument("--windows", default="0,1,2,4", help="Engine.prefill_window values")
    am.add_argument("--cache-mib", type=int, default=256, help="MLX buffer cache cap, MiB")
    am.add_argument("--turns", type=int, default=12)
    dk = sub.add_parser("decode-kernels", help="decode tok/s: the kernel, gather, an old kernel")
    dk.add_argument("model", help="bench/gpu_model.py's dir")
    dk.add_argument("--old", help="an older paged_cuda.py to compare")
    pw = sub.add_parser("pool-writes", help="one long sequence's decode: in-place vs scatter")
    pw.add_argument("model", help="bench/gpu_model.py's dir")
    pw.add_argument("--tokens", type=int, default=28000)
    pw.add_argument("--steps", type=int, default=96)
    a = p.parse_args(argv)
    {"sdpa": sdpa, "prefill-chunks": prefill_chunks, "first-use": first_use,
     "batched-prefill": batched_prefill, "subagents": subagents,
     "decode-kernels": decode_kernels, "agentic-memory": agentic_memory,
     "pool-writes": pool_writes}[a.probe](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
