"""The serving stack's Python overhead per decode step: engine in process vs worker over HTTP.

By hand, not a test (issue 14's throughput gap: the engine kernel path matches mlx-lm's
BatchGenerator in process, yet the worker over HTTP lost half of it on the H200). On a model
so small (``bench/gpu_model.py --shape micro``: 2 layers, hidden 128) that the model's compute
is a fraction of a step, this measures at 1, 8 and 32 concurrent streams × ``--tokens``:

- ``engine``: :class:`plimsoll.engine.Engine` in this process, pipelined Steps (as
  bench/engine_paged.py: ``run_async`` of step n+1 before ``result()`` of step n), block
  tables as a fresh pool hands them out (lowest ids first); no scheduler, no HTTP;
- ``plimsoll``: the worker (``plimsoll launch`` by default) over HTTP streaming on 127.0.0.1;
- ``prefill_shapes`` (not in the default modes): prefill ms per prompt, prompts all of one
  length against prompts each of its own (a backend that builds kernels per shape shows it);
- ``scheduler``: the worker's scheduler thread over the engine in this process (its pool,
  its memory probe, pipelining), sinks that only note token times: no HTTP;
- ``mlx_inproc``: mlx-lm's own generators in process (``stream_generate`` for one stream,
  ``BatchGenerator`` for N), the anchor of mlx_lm.server's own overhead;
- ``mlx``: ``mlx_lm.server`` (defaults) over HTTP, same requests, same run.

Clients: one asyncio loop in this process, one httpx connection per stream, all released
together, chat completions streamed with ``stream_options.include_usage``. Figures per
server and stream count (median over ``--rounds``):

- ``aggregate_tps``: completion tokens ÷ wall time from the first send to the last end;
- ``decode_tps``: tokens after each stream's first ÷ (last token − earliest first token);
- ``step_ms``: the median stream's time between tokens, (last − first) ÷ (tokens − 1) — the
  server's decode step as a client sees it; the engine's is rows ÷ its tok/s;
- ``cpu_ms_per_step``: CPU time (every thread, user + system) per step — of the server's
  process tree over a whole round (prefill and HTTP included), of this process over the
  engine's decode loop; far less sensitive to a busy machine than wall time; for plimsoll
  also its main thread's alone (``loop_cpu_ms_per_step``: uvicorn's event loop);
- ``overhead_ms``: server ``step_ms`` − in-process ``step_ms`` (plimsoll's worker against its
  engine, mlx_lm.server against mlx-lm's generators): what the serving stack adds per step
  (scheduler, event delivery, SSE, HTTP).

``--py-spy DIR`` also records the plimsoll worker with py-spy (if it is installed: every
thread, raw stacks in DIR) during its widest phase, and puts a per-thread summary (share of
samples of each thread, the heaviest frames inclusive) in the JSON, for where the time goes. Results: ``--out-dir``/``--name``.{json,md}. Typical CPU run (OpenBLAS preloaded)::

    python bench/gpu_model.py /tmp/perf/micro --shape micro --dtype float32 --tokenizer-vocab 4096
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 PYTHONPATH=python \\
      python bench/overhead.py --model /tmp/perf/micro --name overhead-cpu

On the GPU (after bench/gpu_run.sh built the model): ``PHASES=overhead bash bench/gpu_run.sh``
runs it on the Qwen3-4B-shaped model (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness_server import HOST, ServerProcess, free_port, render

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge", "boxing", "matches", "near", "the", "old", "river",
         "bank", "and", "count", "their", "golden", "coins"]
PLIMSOLL = ("{python} -m plimsoll.cli launch {model} --host {host} --port {port} "
            "--concurrency 32 --context 2048 --max-tokens 512")
MLX = "{python} -m mlx_lm server --model {model} --host {host} --port {port}"
BLOCK = 16


def prompt_text(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" ({i})"


# --- the engine, in process ------------------------------------------------------------------
def engine_rounds(model: Path, streams: list[int], tokens: int, rounds: int,
                  words: int) -> dict:
    import mlx.core as mx
    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    prompts_by_n: dict[int, list[list[int]]] = {}
    out: dict = {}
    need = max(streams) * (-(-(words * 3 + tokens + 64) // BLOCK))
    eng = Engine.load(model, block_tokens=BLOCK, max_blocks=need)
    out["device"] = str(mx.default_device())
    tok = eng.tokenizer
    for n in streams:
        prompts_by_n[n] = [tok.apply_chat_template(
            [{"role": "user", "content": prompt_text(i, words)}], add_generation_prompt=True)
            for i in range(n)]

    def one(prompts: list[list[int]]) -> float:
        tables, at = [], 0
        for p in prompts:  # consecutive ids, as a fresh pool's heap hands them out
            nb = -(-(len(p) + tokens) // BLOCK)
            tables.append(tuple(range(at, at + nb)))
            at += nb
        for i, p in enumerate(prompts):
            eng.run(Step(prefills=(Work(i, tuple(p), 0, tables[i], True),)))
        t0, c0 = time.perf_counter(), time.process_time()
        pending, count = None, 0
        for k in range(tokens - 1):
            nxt = eng.run_async(Step(decodes=tuple(
                Work(i, None, len(p) + k, tables[i], True) for i, p in enumerate(prompts))))
            if pending is not None:
                count += len(pending.result())
            pending = nxt
        count += len(pending.result())
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        for i in range(len(prompts)):
            eng.free_state(i)
        cpu_ms[len(prompts)].append(1000 * cpu / (tokens - 1))
        return count / dt

    cpu_ms: dict[int, list[float]] = {n: [] for n in streams}
    one(prompts_by_n[streams[0]][:1])  # warm-up
    for n in streams:
        runs = sorted(one(prompts_by_n[n]) for _ in range(rounds))
        tps = runs[len(runs) // 2]
        out[str(n)] = {"decode_tps": tps, "runs_tps": runs, "step_ms": 1000 * n / tps,
                       "cpu_ms_per_step": statistics.median(cpu_ms[n])}
        print(f"[engine] {n} rows: {tps:.0f} tok/s, {1000 * n / tps:.2f} ms/step", flush=True)
    return out


def mlx_inproc_rounds(model: Path, streams: list[int], tokens: int, rounds: int,
                      words: int) -> dict:
    """mlx-lm's own generators in process: ``stream_generate`` (its generation_tps) for one
    stream, ``BatchGenerator`` for N (bench/engine_paged.py's timing)."""
    import types

    import mlx_lm
    from engine_paged import mlx_batch, mlx_single

    model_, tok = mlx_lm.load(str(model))
    holder = types.SimpleNamespace(model=model_, tokenizer=tok)
    prompts = {n: [tok.apply_chat_template([{"role": "user", "content": prompt_text(i, words)}],
                                           add_generation_prompt=True) for i in range(n)]
               for n in streams}
    mlx_single(holder, prompts[streams[0]][0], 8)  # warm-up
    out: dict = {}
    for n in streams:
        fn = (lambda n=n: mlx_single(holder, prompts[n][0], tokens)) if n == 1 else \
            (lambda n=n: mlx_batch(holder, prompts[n], tokens))
        runs = sorted(fn() for _ in range(rounds))
        tps = runs[len(runs) // 2]
        out[str(n)] = {"decode_tps": tps, "runs_tps": runs, "step_ms": 1000 * n / tps}
        print(f"[mlx-lm in process] {n} rows: {tps:.0f} tok/s, {1000 * n / tps:.2f} ms/step",
              flush=True)
    return out


def prefill_shapes(model: Path, count: int = 8, base: int = 320, step: int = 37) -> dict:
    """Prefill time per prompt when every prompt has its own length against when all have
    one length, and the distinct lengths once more (in process, each prompt two chunks:
    tokens 0..n/2 then n/2..n, the second attending to the table). The distinct lengths sit
    around the one length (same work on average). A backend that builds kernels or graphs
    per shape shows it as distinct ≫ distinct again ≈ same."""
    import mlx.core as mx
    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    longest = base + step * count + 64
    lengths = [base + step * (k - count // 2) for k in range(count)]
    eng = Engine.load(model, block_tokens=BLOCK, max_blocks=2 * count * (longest // BLOCK + 2))
    vocab = min(eng.tokenizer.vocab_size or 1000, 1000)

    def run(lengths: list[int], salt: int) -> list[float]:
        times, at = [], 0
        for i, n in enumerate(lengths):
            toks = tuple((salt * 7919 + i * 104729 + k * 31) % (vocab - 10) + 5 for k in range(n))
            nb = -(-(n + 1) // BLOCK)
            table = tuple(range(at, at + nb))
            at += nb
            t0 = time.perf_counter()
            half = n // 2
            eng.run(Step(prefills=(Work(salt * 1000 + i, toks[:half], 0, table, False),)))
            eng.run(Step(prefills=(Work(salt * 1000 + i, toks[half:], half, table, True),)))
            times.append(time.perf_counter() - t0)
            eng.free_state(salt * 1000 + i)
        return times

    run([base], 1)  # warm-up at the base length
    same = run([base] * count, 2)
    distinct = run(lengths, 3)
    again = run(lengths, 4)
    mx.clear_cache()
    out = {"prompts": count, "same_length": base, "distinct_lengths": lengths,
           "same_ms": [round(1000 * t, 2) for t in same],
           "distinct_ms": [round(1000 * t, 2) for t in distinct],
           "again_ms": [round(1000 * t, 2) for t in again],
           "same_median_ms": 1000 * statistics.median(same),
           "distinct_median_ms": 1000 * statistics.median(distinct),
           "again_median_ms": 1000 * statistics.median(again)}
    print(f"[prefill shapes] {count} prompts: one length {out['same_median_ms']:.1f} ms each, "
          f"distinct lengths {out['distinct_median_ms']:.1f}, the same distinct lengths again "
          f"{out['again_median_ms']:.1f}", flush=True)
    return out


def scheduler_rounds(model: Path, streams: list[int], tokens: int, rounds: int,
                     words: int) -> dict:
    """The worker's scheduler thread over the engine in this process, as the worker runs it
    (its memory probe with this process's guard, the pool, pipelined steps), sinks that only
    note each token's time: the scheduler's share of the overhead, without HTTP."""
    import threading

    import mlx.core as mx
    import psutil
    from plimsoll.engine import Engine
    from plimsoll.guard.process import SelfGuard, memory_probe_with_guard
    from plimsoll.worker.events import Finished, GenRequest, SchedulerLimits, Token
    from plimsoll.worker.pool import BlockPool
    from plimsoll.worker.scheduler import Scheduler

    total = max(streams) * (-(-(words * 3 + tokens + 64) // BLOCK)) + 64
    proc = psutil.Process()
    loaded: dict = {}

    def setup(stack):
        eng = Engine.load(model, block_tokens=BLOCK, max_blocks=total)
        loaded["eng"] = eng
        pool = BlockPool(total=total, block_tokens=BLOCK, cache_cap_blocks=total,
                         extra_key=b"overhead")
        return eng, pool

    def probe() -> dict[str, int]:
        return {"mlx_active": mx.get_active_memory(), "rss": proc.memory_info().rss}

    limits = SchedulerLimits(max_num_seqs=max(streams), max_queue=256, max_wait_s=600,
                             trip_bytes=1 << 62, max_batch=max(streams), prefill_tokens=512)
    sched = Scheduler(setup, limits, memory_probe_with_guard(probe, SelfGuard.find()))
    sched.start()
    sched.ready.wait()
    if sched.setup_error is not None:
        raise sched.setup_error
    tok = loaded["eng"].tokenizer

    def one(n: int, salt: int) -> dict:
        done = threading.Semaphore(0)
        times: list[list[float]] = [[] for _ in range(n)]

        def sink_for(i: int):
            def sink(ev) -> None:
                if isinstance(ev, Token):
                    times[i].append(time.perf_counter())
                elif isinstance(ev, Finished) or not hasattr(ev, "prompt_tokens"):
                    done.release()
            return sink

        prompts = [tok.apply_chat_template(
            [{"role": "user", "content": prompt_text(salt * 100 + i, words)}],
            add_generation_prompt=True) for i in range(n)]
        t0, c0 = time.perf_counter(), time.process_time()
        for i, p in enumerate(prompts):
            sched.submit(GenRequest(prompt=p, max_tokens=tokens, sink=sink_for(i)))
        for _ in range(n):
            done.acquire(timeout=600)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps = sorted((t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1)
        firsts, lasts = [t[0] for t in times if t], [t[-1] for t in times if t]
        got = sum(len(t) for t in times)
        return {"aggregate_tps": got / wall,
                "decode_tps": (got - n) / (max(lasts) - min(firsts)),
                "step_ms": 1000 * steps[len(steps) // 2], "cpu_ms_per_step": 1000 * cpu / tokens}

    out: dict = {}
    try:
        one(2, 999)  # warm-up
        for n in streams:
            out[str(n)] = summarise([one(n, r) for r in range(rounds)])
            s_ = out[str(n)]
            print(f"[scheduler] {n} streams: {s_['decode_tps']:.0f} tok/s decode, "
                  f"{s_['step_ms']:.2f} ms/step, CPU {s_['cpu_ms_per_step']:.2f} ms/step",
                  flush=True)
    finally:
        sched.stop()
    return out


# --- a server over HTTP ------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, url: str, body: dict, go: asyncio.Event,
                     timeout_s: float) -> dict:
    await go.wait()
    t0 = time.perf_counter()
    times: list[float] = []
    usage, error = None, None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        times.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        error = f"{type(err).__name__}: {err}"
    tokens = (usage or {}).get("completion_tokens") or len(times)
    return {"t0": t0, "t_end": time.perf_counter(), "first": times[0] if times else None,
            "last": times[-1] if times else None, "tokens": tokens, "chunks": len(times),
            "error": error}


async def concurrent(base: str, model_id: str, prompts: list[str], tokens: int,
                     timeout_s: float) -> dict:
    go = asyncio.Event()
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = [asyncio.create_task(stream_one(
            client, base + "/v1/chat/completions",
            {"model": model_id, "messages": [{"role": "user", "content": p}],
             "max_tokens": tokens, "temperature": 0.0, "stream": True,
             "stream_options": {"include_usage": True}}, go, timeout_s)) for p in prompts]
        await asyncio.sleep(0.05)
        go.set()
        got = await asyncio.gather(*tasks)
    ok = [g for g in got if not g["error"] and g["first"] is not None]
    out = {"streams": len(prompts), "completed": len(ok),
           "errors": [g["error"] for g in got if g["error"]][:3]}
    if not ok:
        return out
    total = sum(g["tokens"] for g in ok)
    wall = max(g["t_end"] for g in ok) - min(g["t0"] for g in ok)
    span = max(g["last"] for g in ok) - min(g["first"] for g in ok)
    steps = sorted((g["last"] - g["first"]) / (g["tokens"] - 1) for g in ok if g["tokens"] > 1)
    out |= {"completion_tokens": total, "tokens_each_min": min(g["tokens"] for g in ok),
            "aggregate_tps": total / wall, "decode_tps": (total - len(ok)) / span if span else None,
            "step_ms": 1000 * steps[len(steps) // 2] if steps else None,
            "ttft_max_s": max(g["first"] - g["t0"] for g in ok)}
    return out


def served_model(base: str, model_dir: Path) -> str:
    """The id to send: the server's only model, else the directory (mlx_lm.server's
    /v1/models fails without a hub cache directory; it serves its --model by path)."""
    try:
        ids = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return ids[0] if len(ids) == 1 else str(model_dir)


def run_server(label: str, template: str, args, prompts: dict[int, list[list[str]]]) -> dict:
    port = free_port()
    values = {"python": sys.executable, "model": str(args.model), "host": HOST, "port": str(port)}
    argv = shlex.split(render(template, values))
    env = dict(os.environ)
    if args.preload and Path(args.preload).exists():
        env["LD_PRELOAD"] = args.preload
    server = ServerProcess(label, argv, env, port, args.log_dir / f"{label}-{port}.log")
    out: dict = {"argv": argv, "loadavg_start": os.getloadavg()}
    print(f"[{label}] starting {shlex.join(argv)}", flush=True)
    server.start()
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        model_id = served_model(server.base_url, args.model)
        for _ in range(2):  # warm-up: mlx_lm.server loads lazily; both compile their kernels
            asyncio.run(concurrent(server.base_url, model_id, ["warm up " * 8] * 2, 16, 120))
        for n in args.streams:
            spy = None
            if args.py_spy and label == "plimsoll" and n == max(args.streams):
                spy = start_spy(server, args.py_spy, f"{label}-{n}")
            # an unmeasured round at this width first: kernels for n rows get built (JIT on
            # the GPU) outside the figures, for both servers alike
            warm = [prompt_text(90_000 + i, args.prompt_words) for i in range(n)]
            asyncio.run(concurrent(server.base_url, model_id, warm, 16, args.request_timeout))
            runs = []
            for r in range(args.rounds):
                c0, l0 = tree_cpu(server)
                runs.append(asyncio.run(concurrent(server.base_url, model_id, prompts[n][r],
                                                   args.tokens, args.request_timeout)))
                c1, l1 = tree_cpu(server)
                runs[-1]["cpu_ms_per_step"] = 1000 * (c1 - c0) / args.tokens
                runs[-1]["loop_cpu_ms_per_step"] = 1000 * (l1 - l0) / args.tokens
            if spy is not None:
                out[f"py_spy_{n}"] = stop_spy(spy)
            out[str(n)] = summarise(runs)
            s = out[str(n)]
            print(f"[{label}] {n} streams: {s.get('aggregate_tps', 0):.0f} tok/s aggregate, "
                  f"{s.get('step_ms') or 0:.2f} ms/step, min tokens {s.get('tokens_each_min')} "
                  f"{s.get('errors') or ''}", flush=True)
    except Exception as err:  # noqa: BLE001  (recorded: the other server still runs)
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"[{label}] error: {out['error']}", flush=True)
    finally:
        out["stop"] = server.stop()
        out["loadavg_end"] = os.getloadavg()
    return out


def tree_cpu(server: ServerProcess) -> tuple[float, float]:
    """CPU seconds (user + system) the server's process tree has used so far, and those of
    the serving process's main thread (the HTTP event loop: uvicorn runs it there)."""
    import psutil

    server.remember_tree()
    total, loop, busiest = 0.0, 0.0, -1.0
    for p in server._known.values():  # the serving process: the busiest of the tree
        try:
            t = p.cpu_times()
            if t.user + t.system > busiest:
                busiest = t.user + t.system
                loop = sum(th.user_time + th.system_time for th in p.threads()
                           if th.id == p.pid)
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total, loop


def summarise(runs: list[dict]) -> dict:
    def med(key: str):
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"aggregate_tps": med("aggregate_tps"), "decode_tps": med("decode_tps"),
            "step_ms": med("step_ms"), "ttft_max_s": med("ttft_max_s"),
            "cpu_ms_per_step": med("cpu_ms_per_step"),
            "loop_cpu_ms_per_step": med("loop_cpu_ms_per_step"),
            "tokens_each_min": min((r.get("tokens_each_min") or 0) for r in runs),
            "completed": min(r.get("completed", 0) for r in runs),
            "errors": [e for r in runs for e in r.get("errors", [])][:3], "runs": runs}


def start_spy(server: ServerProcess, out_dir: Path, name: str):
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("[py-spy] not installed: no profile", flush=True)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    server.remember_tree()
    pid = max(server._known)  # the worker: the newest process of the tree (launch's child)
    path = out_dir / f"{name}.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--threads", "--rate", "250",
                             "--format", "raw", "--nonblocking", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc, path


def stop_spy(spy) -> dict:
    proc, path = spy
    proc.send_signal(2)
    proc.wait(timeout=30)
    return {"raw": str(path), "threads": spy_summary(path)} if path.exists() else {}


def spy_summary(path: Path, top: int = 40) -> dict:
    """Per thread: its share of all samples and its heaviest frames (inclusive, % of the
    thread's samples). Idle time in ``select``/``wait`` shows as such."""
    import collections
    import re

    threads: collections.Counter[str] = collections.Counter()
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n_ = line.rsplit(" ", 1)
        frames, n = stack.split(";"), int(n_)
        name = re.sub(r"thread \(\d+\): ?", "", frames[0]) or "unnamed"
        name = "AnyIO worker" if name.startswith("AnyIO") else name
        threads[name] += n
        for f in dict.fromkeys(re.sub(r":\d+\)", ")", f) for f in frames[1:]):
            incl[name][f] += n
    total = sum(threads.values()) or 1
    return {name: {"share": n / total,
                   "frames": {f: round(v / n, 3) for f, v in incl[name].most_common(top)}}
            for name, n in threads.most_common()}


# --- report ------------------------------------------------------------------------------------
def ratios(result: dict, streams: list[int]) -> dict:
    out = {}
    got = {k: result.get(k, {}) for k in ("engine", "mlx_inproc", "plimsoll", "mlx")}
    for n in streams:
        e, mi, p, m = (got[k].get(str(n), {}) for k in ("engine", "mlx_inproc", "plimsoll",
                                                         "mlx"))
        row = {}
        for name, a, b, key in (("plimsoll_over_mlx_aggregate", p, m, "aggregate_tps"),
                                ("plimsoll_over_mlx_decode", p, m, "decode_tps"),
                                ("plimsoll_over_engine_decode", p, e, "decode_tps"),
                                ("mlx_over_mlx_inproc_decode", m, mi, "decode_tps"),
                                ("engine_over_mlx_inproc", e, mi, "decode_tps")):
            if a.get(key) and b.get(key):
                row[name] = a[key] / b[key]
        for name, a, b in (("plimsoll_overhead_ms", p, e), ("mlx_overhead_ms", m, mi)):
            if a.get("step_ms") and b.get("step_ms"):
                row[name] = a["step_ms"] - b["step_ms"]
        out[str(n)] = row
    return out


def markdown(result: dict, streams: list[int]) -> str:
    def f(x, fmt="{:.0f}"):
        return "–" if x is None else fmt.format(x)

    lines = [f"# Serving overhead per decode step: {result['name']}", "",
             f"Command: `{result['command']}`", "",
             (f"Model {result['model']}; {result['machine']}; mlx {result['mlx_version']}, "
              f"mlx_lm {result['mlx_lm_version']}; {result['tokens']} tokens a stream, "
              f"{result['rounds']} rounds (medians); load average at start "
              f"{result['loadavg_start']}, at end {result.get('loadavg_end')}."), "",
             "In process (no HTTP): decode tok/s (ms per step)", "",
             ("| streams | plimsoll engine | plimsoll scheduler + engine | mlx-lm "
              "(stream_generate / BatchGenerator) | engine CPU ms/step | scheduler + engine "
              "CPU ms/step |"),
             "|---|---|---|---|---|---|"]
    for n in streams:
        e = result.get("engine", {}).get(str(n), {})
        mi = result.get("mlx_inproc", {}).get(str(n), {})
        sc = result.get("scheduler", {}).get(str(n), {})
        lines.append(f"| {n} | {f(e.get('decode_tps'))} ({f(e.get('step_ms'), '{:.2f}')}) | "
                     f"{f(sc.get('decode_tps'))} ({f(sc.get('step_ms'), '{:.2f}')}) | "
                     f"{f(mi.get('decode_tps'))} ({f(mi.get('step_ms'), '{:.2f}')}) | "
                     f"{f(e.get('cpu_ms_per_step'), '{:.2f}')} | "
                     f"{f(sc.get('cpu_ms_per_step'), '{:.2f}')} |")
    lines += ["", ("Over HTTP (streamed, one connection a stream): aggregate tok/s (first "
                   "send to last end), decode tok/s after the first tokens, ms per step (median "
                   "stream's time between tokens)"), "",
              ("| streams | plimsoll agg | plimsoll decode | plimsoll ms/step | mlx_lm.server agg "
               "| mlx decode | mlx ms/step | plimsoll ÷ mlx agg | plimsoll ÷ mlx decode | "
               "plimsoll overhead ms/step (vs its engine) | mlx overhead ms/step (vs mlx-lm) | "
               "plimsoll CPU ms/step (its HTTP loop's) | mlx CPU ms/step |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in streams:
        p = result.get("plimsoll", {}).get(str(n), {})
        m = result.get("mlx", {}).get(str(n), {})
        r = result["ratios"].get(str(n), {})
        lines.append(
            f"| {n} | {f(p.get('aggregate_tps'))} | {f(p.get('decode_tps'))} | "
            f"{f(p.get('step_ms'), '{:.2f}')} | {f(m.get('aggregate_tps'))} | "
            f"{f(m.get('decode_tps'))} | {f(m.get('step_ms'), '{:.2f}')} | "
            f"{f(r.get('plimsoll_over_mlx_aggregate'), '{:.2f}')} | "
            f"{f(r.get('plimsoll_over_mlx_decode'), '{:.2f}')} | "
            f"{f(r.get('plimsoll_overhead_ms'), '{:.2f}')} | "
            f"{f(r.get('mlx_overhead_ms'), '{:.2f}')} | "
            f"{f(p.get('cpu_ms_per_step'), '{:.2f}')} "
            f"({f(p.get('loop_cpu_ms_per_step'), '{:.2f}')}) | "
            f"{f(m.get('cpu_ms_per_step'), '{:.2f}')} |")
    if ps := result.get("prefill_shapes"):
        lines += ["", (f"Prefill in process, {ps['prompts']} prompts in two chunks each: all "
                       f"{ps['same_length']} tokens {ps['same_median_ms']:.1f} ms a prompt; each "
                       f"its own length ({ps['distinct_lengths'][0]}–"
                       f"{ps['distinct_lengths'][-1]}) {ps['distinct_median_ms']:.1f} ms a "
                       f"prompt, those lengths again {ps['again_median_ms']:.1f} ms (medians).")]
    for label in ("plimsoll", "mlx"):
        s = result.get(label)
        if not s:
            continue
        ttft = [f"{n}: {f(s.get(str(n), {}).get('ttft_max_s'), '{:.2f}')}" for n in streams]
        lines += ["", f"{label}: slowest TTFT s {', '.join(ttft)}"]
        short = [f"{n}: {s.get(str(n), {}).get('tokens_each_min')}" for n in streams]
        lines += ["", (f"{label}: fewest tokens in one stream {', '.join(short)}"
                       + (f"; error {s['error']}" if s.get("error") else ""))]
        for key, spy in s.items():
            if key.startswith("py_spy") and spy:
                lines.append(f"{label}: py-spy record of the widest phase: {spy['raw']} "
                             "(per-thread summary in the JSON)")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--modes", default="engine,scheduler,mlx_inproc,plimsoll,mlx",
                    help="which of engine, prefill_shapes, scheduler, mlx_inproc, plimsoll, "
                         "mlx to run, in this order")
    ap.add_argument("--plimsoll-cmd", default=PLIMSOLL)
    ap.add_argument("--mlx-cmd", default=MLX)
    ap.add_argument("--preload",
                    default="/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="overhead-cpu")
    ap.add_argument("--py-spy", type=Path, default=None, help="record the worker into this dir")
    ap.add_argument("--log-dir", type=Path, default=Path(__file__).parent / "out",
                    help="server logs (default bench/out, ignored by git)")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    args = ap.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import mlx.core as mx
    import mlx_lm

    result: dict = {"name": args.name, "model": str(args.model), "tokens": args.tokens,
                    "rounds": args.rounds, "streams": args.streams,
                    "command": shlex.join([Path(sys.executable).name, *sys.argv]),
                    "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} "
                               f"CPUs, {mx.default_device()}",
                    "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    prompts = {n: [[prompt_text(r * 100 + i, args.prompt_words) for i in range(n)]
                   for r in range(args.rounds)] for n in args.streams}
    for mode in args.modes:
        if mode == "engine":
            result["engine"] = engine_rounds(args.model, args.streams, args.tokens, args.rounds,
                                             args.prompt_words)
        elif mode == "prefill_shapes":
            result["prefill_shapes"] = prefill_shapes(args.model)
        elif mode == "scheduler":
            result["scheduler"] = scheduler_rounds(args.model, args.streams, args.tokens,
                                                   args.rounds, args.prompt_words)
        elif mode == "mlx_inproc":
            result["mlx_inproc"] = mlx_inproc_rounds(args.model, args.streams, args.tokens,
                                                     args.rounds, args.prompt_words)
        elif mode in ("plimsoll", "mlx"):
            template = args.plimsoll_cmd if mode == "plimsoll" else args.mlx_cmd
            result[mode] = run_server(mode, template, args, prompts)
        else:
            raise SystemExit(f"unknown mode {mode!r}: engine, prefill_shapes, scheduler, "
                             "mlx_inproc, plimsoll or mlx")
    result["ratios"] = ratios(result, args.streams)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / f"{args.name}.md").write_text(markdown(result, args.streams))
    print(markdown(result, args.streams))
    return 0


if __name__ == "__main__":
    sys.exit(main())
