"""A/B of the batched first chunks (engine/batched_prefill.py) in process on the GPU: N prompts of
115-575 tokens arrive together, a scheduler-like loop (2048 prompt tokens a step beside every
running decode, pipelined) runs them to 128 tokens each, with Engine.batch_prefill off and on,
alternating. Results in bench/results/batched-prefill-h200.md.

    python3 bench/gpu_model.py /tmp/m && python3 bench/batched_prefill_ab.py /tmp/m
"""
import sys, time, math, random
import mlx.core as mx
from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work
eng = Engine.load(sys.argv[1], block_tokens=16, max_blocks=6000)
eng.warm = __import__("plimsoll.engine.warmup", fromlist=["x"]).warm_up(eng)
rng = random.Random(0)
def run(n, flag, new=128, budget=2048, salt=0):
    eng.batch_prefill = flag
    lens = [rng.randint(115, 575) for _ in range(n)]
    prompts = [tuple((salt * 7919 + i * 104729 + j * 31) % 150000 + 10 for j in range(L)) for i, L in enumerate(lens)]
    tables, at = [], 0
    for L in lens:
        k = math.ceil((L + new) / 16); tables.append(tuple(range(at, at + k))); at += k
    written = [0] * n; out = [[] for _ in range(n)]; t0 = time.perf_counter(); first = [None] * n
    pending = None; inflight = [0] * n
    while True:
        dec = tuple(Work(i, None, lens[i] + len(out[i]) + inflight[i] - 1, tables[i], True)
                    for i in range(n) if written[i] == lens[i] and (out[i] or inflight[i]) and len(out[i]) + inflight[i] < new)
        pre, b = [], budget
        for i in range(n):
            if written[i] < lens[i] and b > 0:
                take = min(b, lens[i] - written[i]); b -= take
                pre.append(Work(i, prompts[i][written[i]:written[i] + take], written[i], tables[i], written[i] + take == lens[i]))
        if not dec and not pre and pending is None: break
        step = Step(dec, tuple(pre)) if (dec or pre) else None
        nxt = eng.run_async(step) if step else None
        for w in dec: inflight[w.seq_id] += 1
        for w in pre:
            written[w.seq_id] += len(w.tokens)
            if w.sample: inflight[w.seq_id] += 1
        if pending is not None:
            for sid, tok in pending[0].result().items():
                out[sid].append(tok); inflight[sid] -= 1
                if first[sid] is None: first[sid] = time.perf_counter() - t0
        pending = (nxt,) if nxt else None
    dt = time.perf_counter() - t0
    for i in range(n): eng.free_state(i)
    return f"n={n} batch_prefill={flag}: ttft max {max(first):.2f} mean {sum(first)/n:.2f}; total {dt:.2f}s; agg {n*new/dt:.0f} tok/s"
for salt, (n, flag) in enumerate([(8, False), (8, True), (32, False), (32, True), (32, False), (32, True), (8, False), (8, True)]):
    print(run(n, flag, salt=salt), flush=True)
