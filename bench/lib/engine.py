"""The engine in process, as the benchmarks drive it, and mlx-lm's own generators as anchors.

:func:`decode_rate` is the decode loop every in-process figure uses: each prompt prefilled in
one chunk, then ``new - 1`` batched decode steps pipelined (``run_async`` of step n+1 before
``result()`` of step n, decodes naming ``tokens=None``), block tables handed out in order
(as a fresh pool does) or shuffled (the gather path, as a long-running pool would). Chunked
prefills interleaved with decodes go through :mod:`plimsoll.engine.drive`
(:func:`drive_timed`). :func:`mlx_single` and :func:`mlx_batch` time ``stream_generate`` and
``BatchGenerator`` the same way, first tokens excluded.
"""

from __future__ import annotations

import math
import random
import time

from plimsoll.engine.drive import Seq, plan_step

BLOCK = 16
# prompt lengths of the paged-decode comparison: different lengths, as real batches have
LENGTHS = [48, 120, 200, 300, 400, 500, 80, 250, 160, 350, 90, 220, 60, 270, 180, 330]
CODE = "import os\nclass Foo:\n    def bar(self, x):\n        return x + 1\n"


def code_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts cut from one repeated snippet, of the lengths in :data:`LENGTHS`."""
    base = tokenizer.encode(CODE * 64)
    return [base[i:i + LENGTHS[i % len(LENGTHS)]] for i in range(n)]


def tables(lengths: list[int], new: int, shuffle_seed: int | None = None,
           block: int = BLOCK) -> list[tuple[int, ...]]:
    """One block table per sequence covering ``length + new`` tokens: consecutive ids from 0,
    or the same count of ids shuffled."""
    need = [math.ceil((n + new) / block) for n in lengths]
    ids = list(range(sum(need)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(ids)
    out, at = [], 0
    for n in need:
        out.append(tuple(ids[at:at + n]))
        at += n
    return out


def decode_rate(eng, prompts: list[list[int]], new: int, shuffle_seed: int | None = None, *,
                constraints: list | None = None, pipelined: bool = True,
                keep_tokens: bool = False) -> dict:
    """Prefill every prompt (one chunk each), then ``new - 1`` batched decode steps, pipelined
    or each waited for: decode tok/s, CPU ms of this process per step, the KV bytes allocated
    and written; ``constraints[i]`` constrains sequence i (the engine settles the step before
    a constrained row: its mask needs the last token); ``keep_tokens`` returns every
    sequence's tokens too."""
    from plimsoll.engine.work import Step, Work

    table = tables([len(p) for p in prompts], new, shuffle_seed, eng.block_tokens)
    cons = constraints or [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]

    def take(got: dict[int, int]) -> int:
        for seq, tok in got.items():
            tokens[seq].append(tok)
        return len(got)

    for i, p in enumerate(prompts):
        take(eng.run(Step(prefills=(Work(i, tuple(p), 0, table[i], True, constraint=cons[i]),))))
    t0, c0 = time.perf_counter(), time.process_time()
    pending, count = None, 0
    for k in range(new - 1):
        nxt = eng.run_async(Step(decodes=tuple(
            Work(i, None, len(p) + k, table[i], True, constraint=cons[i])
            for i, p in enumerate(prompts))))
        if not pipelined:
            nxt.result()
        if pending is not None:
            count += take(pending.result())
        pending = nxt
    count += take(pending.result())
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {"tps": count / dt, "cpu_ms_per_step": 1000 * cpu / (new - 1),
           "kv_bytes_allocated": eng.kv_bytes_allocated(),
           "kv_bytes_written": sum(len(p) + new for p in prompts) * eng.facts.kv_bytes_per_token}
    for i in range(len(prompts)):
        eng.free_state(i)
    return out | ({"tokens": tokens} if keep_tokens else {})


def mlx_single(model, tokenizer, prompt: list[int], new: int) -> float:
    """``mlx_lm.stream_generate``'s own generation tok/s for one prompt."""
    from mlx_lm import stream_generate

    last = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=new):
        last = response
    return last.generation_tps


def mlx_batch(model, prompts: list[list[int]], new: int) -> float:
    """``BatchGenerator`` aggregate decode tok/s: from every sequence's first token to the last."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=new, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts, [new] * len(prompts))
    seen: set[int] = set()
    t0, count = None, 0
    while responses := gen.next_generated():
        for r in responses:
            if r.uid not in seen:
                seen.add(r.uid)
                continue
            count += 1
        if t0 is None and len(seen) == len(prompts):
            t0, count = time.perf_counter(), 0
    dt = time.perf_counter() - t0
    gen.close()
    return count / dt


def drive_timed(eng, seqs: list[Seq], chunk: int) -> tuple[float, float, int]:
    """:func:`plimsoll.engine.drive.drive`, synchronously, timing the steps that prefill and
    the decode-only steps apart: (prefill s, decode s, decode-only steps)."""
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
