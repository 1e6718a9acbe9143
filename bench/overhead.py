"""The serving stack's Python overhead per decode step: engine in process vs worker over HTTP.

On a model so small (``bench/gpu_model.py --shape micro``: 2 layers, hidden 128) that the
model's compute is a fraction of a step, at 1, 8 and 32 concurrent streams × ``--tokens``,
modes (``--modes``, in that order):

- ``engine``: :class:`plimsoll.engine.Engine` in this process, pipelined Steps, block tables as
  a fresh pool hands them out (lowest ids first); no scheduler, no HTTP;
- ``prefill_shapes`` (not in the default modes): prefill ms per prompt, prompts all of one
  length against prompts each of its own (a backend that builds kernels per shape shows it);
- ``scheduler``: the worker's scheduler thread over the engine in this process (its pool, its
  memory probe, pipelining), sinks that only note token times: no HTTP;
  ``scheduler_main`` (not in the default modes): the same loop on the main thread;
  ``scheduler_quiet`` (neither): the memory probe and status snapshot every 10 s, not 50 ms;
  ``engine_shuffled`` (neither): the engine with every table's blocks scattered.
  Every in-process mode also reports steady decode (every stream decoding) per step and the
  engine thread's split: graph building, waiting for tokens, the scheduler's own Python
  (``bench/lib/step_split.py``);
- ``mlx_inproc``: mlx-lm's own generators in process (``stream_generate`` for one stream,
  ``BatchGenerator`` for N), the anchor of mlx_lm.server's own overhead;
- ``plimsoll``: the worker (``plimsoll launch``) over HTTP streaming on 127.0.0.1;
- ``mlx``: ``mlx_lm.server`` (defaults) over HTTP, same requests, same run.

Clients: one asyncio loop in this process, one httpx connection per stream, all released
together, streamed with usage. Figures per mode and stream count (median over ``--rounds``):
aggregate tok/s (first send to last end); decode tok/s after the first tokens; ms per step (the
median stream's time between tokens; in process rows ÷ tok/s); CPU ms per step (user + system
of every thread of the server's process tree over a round, of this process over the engine's
decode loop: far steadier than wall time on a shared box; for plimsoll also its main thread's,
uvicorn's event loop); overhead ms per step = server − its in-process anchor.

For plimsoll the worker's own ``host`` status splits each served decode step (building it,
waiting for the step before, the scheduler's own Python, the pass's message), printed beside
the in-process build; ``--transient-bytes`` gives the in-process engine the worker's
transient budget, so both run a decode step unpaced. ``--py-spy DIR`` records the plimsoll
worker with py-spy (if installed) during its widest phase and puts a per-thread summary in
the JSON. Writes ``--out-dir``/``--name``.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from lib import report, servers, step_split
from lib.engine import BLOCK, decode_rate, mlx_batch, mlx_single
from lib.samplers import engine_pid, sched_ns, start_spy, stop_spy, tree_cpu
from lib.workloads import async_concurrent, user_body, word_prompt

PLIMSOLL = servers.PLIMSOLL_LAUNCH + " --concurrency 32 --context 2048 --max-tokens 512"
MODES = ["engine", "engine_shuffled", "prefill_shapes", "scheduler", "scheduler_main",
         "scheduler_quiet", "mlx_inproc", "plimsoll", "mlx"]


def chat_ids(tokenizer, salt: int, n: int, words: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": word_prompt(salt + i,
                                                                                   words)}],
                                          add_generation_prompt=True) for i in range(n)]


def upper_median(runs: list[float]) -> float:
    return sorted(runs)[len(runs) // 2]


def engine_rounds(args, mode: str = "engine") -> dict:
    """The engine alone: prefill every prompt, then pipelined decode steps (``decode_rate``);
    ``engine_shuffled``: every table's blocks shuffled across the pool (as a long-running
    pool scatters them), so the cost of the block layout shows against ``engine``."""
    import mlx.core as mx
    from plimsoll.engine import Engine

    need = max(args.streams) * (-(-(args.prompt_words * 3 + args.tokens + 64) // BLOCK))
    eng = Engine.load(args.model, block_tokens=BLOCK, max_blocks=need)
    # the worker's transient budget, if given: a decode step that fits it runs unpaced there
    eng.transient_budget = args.transient_bytes  # (None: a heavy step is paced)
    out: dict = {"device": str(mx.default_device()), "transient_bytes": args.transient_bytes}
    prompts = {n: chat_ids(eng.tokenizer, 0, n, args.prompt_words) for n in args.streams}
    decode_rate(eng, prompts[args.streams[0]][:1], args.tokens)  # warm-up
    out["kernels"] = step_split.kernel_verdicts(eng)
    for n in args.streams:
        runs, splits = [], []
        for _ in range(args.rounds):
            clock = step_split.StepClock()
            timed = step_split.TimedEngine(eng, clock, open_on_decode=True)
            w0 = sched_ns(os.getpid())[1]
            runs.append(decode_rate(timed, prompts[n], args.tokens,
                                    7 if mode == "engine_shuffled" else None))
            runs[-1]["wait_ms_per_step"] = (sched_ns(os.getpid())[1] - w0) / 1e6 / args.tokens
            clock.close()
            splits.append(clock.figures())
        tps = upper_median([r["tps"] for r in runs])
        out[str(n)] = {"decode_tps": tps, "runs_tps": sorted(r["tps"] for r in runs),
                       "step_ms": 1000 * n / tps,
                       "cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in runs),
                       "engine_wait_ms_per_step": statistics.median(r["wait_ms_per_step"]
                                                                    for r in runs),
                       "split": step_split.median_split(splits), "split_runs": splits}
        print(f"[{mode}] {n} rows: {tps:.0f} tok/s, {1000 * n / tps:.2f} ms/step", flush=True)
    return out


def mlx_inproc_rounds(args) -> dict:
    import mlx_lm

    model, tok = mlx_lm.load(str(args.model))
    prompts = {n: chat_ids(tok, 0, n, args.prompt_words) for n in args.streams}
    mlx_single(model, tok, prompts[args.streams[0]][0], 8)  # warm-up
    out: dict = {}
    for n in args.streams:
        runs = [mlx_single(model, tok, prompts[n][0], args.tokens) if n == 1 else
                mlx_batch(model, prompts[n], args.tokens) for _ in range(args.rounds)]
        tps = upper_median(runs)
        out[str(n)] = {"decode_tps": tps, "runs_tps": sorted(runs), "step_ms": 1000 * n / tps}
        print(f"[mlx-lm in process] {n} rows: {tps:.0f} tok/s, {1000 * n / tps:.2f} ms/step",
              flush=True)
    return out


def prefill_shapes(args, count: int = 8, base: int = 320, step: int = 37) -> dict:
    """Prefill time per prompt when every prompt has its own length against when all have one
    length, and the distinct lengths once more (each prompt two chunks: tokens 0..n/2, then
    n/2..n attending to the table). The distinct lengths sit around the one length (same work
    on average): a backend that builds kernels per shape shows distinct ≫ again ≈ same."""
    import mlx.core as mx
    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    longest = base + step * count + 64
    lengths = [base + step * (k - count // 2) for k in range(count)]
    eng = Engine.load(args.model, block_tokens=BLOCK,
                      max_blocks=2 * count * (longest // BLOCK + 2))
    vocab = min(eng.tokenizer.vocab_size or 1000, 1000)

    def run(lengths: list[int], salt: int) -> list[float]:
        times, at = [], 0
        for i, n in enumerate(lengths):
            toks = tuple((salt * 7919 + i * 104729 + k * 31) % (vocab - 10) + 5 for k in range(n))
            nb = -(-(n + 1) // BLOCK)
            table = tuple(range(at, at + nb))
            at += nb
            t0, half, seq = time.perf_counter(), n // 2, salt * 1000 + i
            eng.run(Step(prefills=(Work(seq, toks[:half], 0, table, False),)))
            eng.run(Step(prefills=(Work(seq, toks[half:], half, table, True),)))
            times.append(time.perf_counter() - t0)
            eng.free_state(seq)
        return times

    run([base], 1)  # warm-up at the base length
    same, distinct, again = run([base] * count, 2), run(lengths, 3), run(lengths, 4)
    mx.clear_cache()
    out = {"prompts": count, "same_length": base, "distinct_lengths": lengths}
    for key, xs in (("same", same), ("distinct", distinct), ("again", again)):
        out[f"{key}_ms"] = [round(1000 * t, 2) for t in xs]
        out[f"{key}_median_ms"] = 1000 * statistics.median(xs)
    print(f"[prefill shapes] {count} prompts: one length {out['same_median_ms']:.1f} ms each, "
          f"distinct lengths {out['distinct_median_ms']:.1f}, the same distinct lengths again "
          f"{out['again_median_ms']:.1f}", flush=True)
    return out


def scheduler_rounds(args, variant: str = "scheduler") -> dict:
    """The worker's scheduler over the engine in this process, as the worker runs it (its
    memory probe with this process's guard, the pool, pipelined steps), sinks that only
    note each token's time: the scheduler's share of the overhead, without HTTP.

    ``variant`` (each a mode of its own): ``scheduler`` runs the loop on its own thread, as
    the worker does; ``scheduler_main`` runs it on the main thread (the requests come from
    a helper thread), so a thread's own cost shows against ``scheduler``;
    ``scheduler_quiet`` probes memory and publishes the status every 10 s instead of every
    50 ms, so the cost of that periodic work shows."""
    import mlx.core as mx
    import psutil
    from plimsoll.engine import Engine
    from plimsoll.guard.process import SelfGuard, memory_probe_with_guard
    from plimsoll.worker import scheduler as scheduler_module
    from plimsoll.worker import trip
    from plimsoll.worker.events import Finished, GenRequest, SchedulerLimits, Token
    from plimsoll.worker.pool import BlockPool

    total = max(args.streams) * (-(-(args.prompt_words * 3 + args.tokens + 64) // BLOCK)) + 64
    proc, loaded = psutil.Process(), {}
    clock = step_split.StepClock()  # reset every round

    def setup(stack):
        loaded["eng"] = Engine.load(args.model, block_tokens=BLOCK, max_blocks=total)
        return (step_split.TimedEngine(loaded["eng"], clock),
                BlockPool(total=total, block_tokens=BLOCK, cache_cap_blocks=total,
                          extra_key=b"overhead"))

    def probe() -> dict[str, int]:
        return {"mlx_active": mx.get_active_memory(), "rss": proc.memory_info().rss}

    limits = SchedulerLimits(max_num_seqs=max(args.streams), max_queue=256, max_wait_s=600,
                             trip_bytes=1 << 62, max_batch=max(args.streams), prefill_tokens=512)
    cadence = (trip.PROBE_INTERVAL_S, scheduler_module.PUBLISH_INTERVAL_S)
    if variant == "scheduler_quiet":
        trip.PROBE_INTERVAL_S = scheduler_module.PUBLISH_INTERVAL_S = 10.0
    guard = SelfGuard.find()
    sched = step_split.timed_scheduler(scheduler_module.Scheduler, clock)(
        setup, limits, memory_probe_with_guard(probe, guard))

    def one(n: int, salt: int) -> dict:
        done = threading.Semaphore(0)
        times: list[list[float]] = [[] for _ in range(n)]
        clock.reset()
        decoding = [0]  # streams with a first token: the clock's window opens at n

        def sink_for(i: int):
            def sink(ev) -> None:
                if isinstance(ev, Token):
                    times[i].append(time.perf_counter())
                    if len(times[i]) == 1:
                        decoding[0] += 1
                        if decoding[0] == n:
                            clock.open()
                elif isinstance(ev, Finished) or not hasattr(ev, "prompt_tokens"):
                    clock.close()
                    done.release()
            return sink

        prompts = chat_ids(loaded["eng"].tokenizer, salt * 100, n, args.prompt_words)
        t0, c0 = time.perf_counter(), time.process_time()
        for i, p in enumerate(prompts):
            sched.submit(GenRequest(prompt=p, max_tokens=args.tokens, sink=sink_for(i)))
        for _ in range(n):
            done.acquire(timeout=600)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps = sorted((t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1)
        firsts, lasts = [t[0] for t in times if t], [t[-1] for t in times if t]
        got = sum(len(t) for t in times)
        split = clock.figures()
        return {"aggregate_tps": got / wall, "decode_tps": (got - n) / (max(lasts) - min(firsts)),
                "step_ms": 1000 * steps[len(steps) // 2],
                "cpu_ms_per_step": 1000 * cpu / args.tokens,
                "steady_step_ms": split.get("step_ms"),
                "steady_cpu_ms_per_step": split.get("cpu_ms_per_step"), "split": split}

    out: dict = {"loop_thread": "main" if variant == "scheduler_main" else "its own",
                 "probe_interval_s": trip.PROBE_INTERVAL_S,
                 "publish_interval_s": scheduler_module.PUBLISH_INTERVAL_S,
                 "guard": type(guard).__name__ if guard is not None else None}
    failed: list[BaseException] = []
    f = report.num

    def drive() -> None:  # the rounds, from the thread that does not run the loop
        try:
            sched.ready.wait()
            if sched.setup_error is not None:
                raise sched.setup_error
            out["kernels"] = step_split.kernel_verdicts(loaded["eng"])
            one(2, 999)  # warm-up
            for n in args.streams:
                runs = [one(n, r) for r in range(args.rounds)]
                s = out[str(n)] = summarise(runs) | {
                    "split": step_split.median_split([r["split"] for r in runs]),
                    **{k: statistics.median(r[k] for r in runs if r[k] is not None)
                       for k in ("steady_step_ms", "steady_cpu_ms_per_step")
                       if any(r[k] is not None for r in runs)}}
                print(f"[{variant}] {n} streams: {s['decode_tps']:.0f} tok/s decode, "
                      f"{s['step_ms']:.2f} ms/step, CPU {s['cpu_ms_per_step']:.2f} ms/step; "
                      f"steady decode {f(s.get('steady_step_ms'))} ms/step, CPU "
                      f"{f(s.get('steady_cpu_ms_per_step'))}", flush=True)
        except BaseException as err:  # re-raised on the main thread
            failed.append(err)
        finally:
            sched.stop()

    try:
        if variant == "scheduler_main":
            driver = threading.Thread(target=drive, name="bench-driver")
            driver.start()
            sched.run()  # the loop, here, until the driver stops it
            driver.join()
        else:
            sched.start()
            drive()
    finally:
        trip.PROBE_INTERVAL_S, scheduler_module.PUBLISH_INTERVAL_S = cadence
    if failed:
        raise failed[0]
    return out


def http_round(base_url: str, model: str, prompts: list[str], tokens: int,
               timeout_s: float) -> dict:
    r = asyncio.run(async_concurrent(base_url, [user_body(model, p, tokens) for p in prompts],
                                     timeout_s))
    return r | {"decode_tps": r.get("aggregate_tps_after_first_token")}


def host_clock(base_url: str) -> dict | None:
    """A plimsoll worker's ``host`` figures (the engine thread's steady-decode clock), or None
    (another server, or an older worker)."""
    try:
        return httpx.get(base_url + "/v1/plimsoll/status", timeout=10).json().get("host")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def served_split(before: dict | None, after: dict | None) -> dict:
    """Per decode-only pass between two readings of :func:`host_clock`: ms of wall and of the
    engine thread's CPU building the step, waiting for the step before, in the scheduler's
    own Python (the pass less those two; of it the memory probe and the status snapshot)
    and sending the pass's events."""
    if not before or not after or after["steps"] <= before["steps"]:
        return {}
    n = after["steps"] - before["steps"]
    d = {k: (after[k] - before[k]) / n for k in after if k != "steps"}
    out = {"served_steps": n}
    for unit in ("ms", "cpu_ms"):
        out |= {f"served_{p}_{unit}": d.get(f"{p}_{unit}")
                for p in ("build", "wait", "probe", "publish", "flush")}
        out[f"served_scheduler_{unit}"] = (d[f"iterate_{unit}"] - d[f"build_{unit}"]
                                           - d[f"wait_{unit}"])
    return out


SERVED_PARTS = ("build", "wait", "scheduler", "probe", "publish", "flush")
SERVED_SPLIT = tuple(f"served_{p}_{u}" for p in SERVED_PARTS for u in ("ms", "cpu_ms"))


def run_server(label: str, template: str, args, prompts: dict[int, list[list[str]]]) -> dict:
    server = servers.start(label, template, args.model, preload=args.preload,
                           log_dir=args.log_dir)
    out: dict = {"argv": server.argv, "loadavg_start": os.getloadavg()}
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        model = servers.served_model(server.base_url, args.model)
        for _ in range(2):  # warm-up: mlx_lm.server loads lazily; both compile their kernels
            http_round(server.base_url, model, ["warm up " * 8] * 2, 16, 120)
        for n in args.streams:
            spy = None
            if args.py_spy and label == "plimsoll" and n == max(args.streams):
                spy = start_spy(server, args.py_spy, f"{label}-{n}")
            # an unmeasured round at this width first: kernels for n rows get built (JIT on
            # the GPU) outside the figures, for both servers alike
            http_round(server.base_url, model, [word_prompt(90_000 + i, args.prompt_words)
                                                for i in range(n)], 16, args.request_timeout)
            runs, epid = [], engine_pid(server)
            for r in range(args.rounds):
                c0, l0 = tree_cpu(server)
                e0 = sched_ns(epid) if epid else None
                h0 = host_clock(server.base_url) if label == "plimsoll" else None
                runs.append(http_round(server.base_url, model, prompts[n][r], args.tokens,
                                       args.request_timeout))
                c1, l1 = tree_cpu(server)
                runs[-1] |= served_split(h0, h0 and host_clock(server.base_url))
                runs[-1] |= {"cpu_ms_per_step": 1000 * (c1 - c0) / args.tokens,
                             "loop_cpu_ms_per_step": 1000 * (l1 - l0) / args.tokens}
                if e0 is not None:  # the engine process's threads: on a core, and queued
                    e1 = sched_ns(epid)
                    runs[-1] |= {"engine_cpu_ms_per_step": (e1[0] - e0[0]) / 1e6 / args.tokens,
                                 "engine_wait_ms_per_step": (e1[1] - e0[1]) / 1e6 / args.tokens}
            if spy is not None:
                out[f"py_spy_{n}"] = stop_spy(spy)
            s = out[str(n)] = summarise(runs)
            print(f"[{label}] {n} streams: {s.get('aggregate_tps') or 0:.0f} tok/s aggregate, "
                  f"{s.get('step_ms') or 0:.2f} ms/step, min tokens {s.get('tokens_each_min')} "
                  f"{s.get('errors') or ''}", flush=True)
    except Exception as err:  # recorded: the other server still runs
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"[{label}] error: {out['error']}", flush=True)
    finally:
        out["stop"] = server.stop()
        out["loadavg_end"] = os.getloadavg()
    return out


def summarise(runs: list[dict]) -> dict:
    keep = ("aggregate_tps", "decode_tps", "step_ms", "steady_step_ms", "ttft_max_s",
            "cpu_ms_per_step", "loop_cpu_ms_per_step", "engine_cpu_ms_per_step",
            "engine_wait_ms_per_step", *SERVED_SPLIT)
    out = report.medians(runs, *keep)
    return {k: out[k] for k in keep} | {
        "tokens_each_min": min((r.get("tokens_each_min") or 0) for r in runs),
        "completed": min(r.get("completed", 0) for r in runs),
        "errors": [e for r in runs for e in r.get("errors", [])][:3], "runs": runs}


RATIOS = (("plimsoll_over_mlx_aggregate", "plimsoll", "mlx", "aggregate_tps"),
          ("plimsoll_over_mlx_decode", "plimsoll", "mlx", "decode_tps"),
          ("plimsoll_over_engine_decode", "plimsoll", "engine", "decode_tps"),
          ("mlx_over_mlx_inproc_decode", "mlx", "mlx_inproc", "decode_tps"),
          ("engine_over_mlx_inproc", "engine", "mlx_inproc", "decode_tps"))


def ratios(result: dict, streams: list[int]) -> dict:
    out = {}
    for n in streams:
        got = {k: result.get(k, {}).get(str(n), {}) for k in
               ("engine", "mlx_inproc", "plimsoll", "mlx")}
        row = {name: got[a][key] / got[b][key] for name, a, b, key in RATIOS
               if got[a].get(key) and got[b].get(key)}
        for name, a, b in (("plimsoll_overhead_ms", "plimsoll", "engine"),
                           ("mlx_overhead_ms", "mlx", "mlx_inproc")):
            if got[a].get("step_ms") and got[b].get("step_ms"):
                row[name] = got[a]["step_ms"] - got[b]["step_ms"]
        if got["plimsoll"].get("steady_step_ms") and got["engine"].get("step_ms"):
            row["plimsoll_steady_over_engine_step"] = (got["plimsoll"]["steady_step_ms"]
                                                       / got["engine"]["step_ms"])
        out[str(n)] = row
    return out


def markdown(result: dict) -> str:
    f, streams = report.num, result["streams"]

    def at(mode: str, n: int) -> dict:
        return result.get(mode, {}).get(str(n), {})

    lines = [f"# Serving overhead per decode step: {result['name']}", "",
             f"Command: `{result['command']}`", "",
             f"Model {result['model']}; {result['machine']}; {result['tokens']} tokens a stream, "
             f"{result['rounds']} rounds (medians). {report.host_line(result['host'])}", "",
             "In process (no HTTP): decode tok/s (ms per step)", ""]
    lines += report.table(
        ["streams", "plimsoll engine", "plimsoll scheduler + engine",
         "mlx-lm (stream_generate / BatchGenerator)", "engine CPU ms/step",
         "scheduler + engine CPU ms/step"],
        [[n, *(f"{f(at(m, n).get('decode_tps'), '.0f')} ({f(at(m, n).get('step_ms'), '.2f')})"
               for m in ("engine", "scheduler", "mlx_inproc")),
          f(at("engine", n).get("cpu_ms_per_step"), ".2f"),
          f(at("scheduler", n).get("cpu_ms_per_step"), ".2f")] for n in streams])
    lines += step_split.split_table(result)
    lines += ["", "Over HTTP (streamed, one connection a stream): aggregate tok/s (first send "
              "to last end), decode tok/s after the first tokens, ms per step (median stream's "
              "time between tokens; in brackets steady: only while every stream decodes, no "
              "prompt prefilled beside it)", ""]
    rows = []
    for n in streams:
        p, m, r = at("plimsoll", n), at("mlx", n), result["ratios"].get(str(n), {})
        rows.append([n, f(p.get("aggregate_tps"), ".0f"), f(p.get("decode_tps"), ".0f"),
                     f"{f(p.get('step_ms'), '.2f')} ({f(p.get('steady_step_ms'), '.2f')})",
                     f(r.get("plimsoll_steady_over_engine_step"), ".3f"),
                     f(m.get("aggregate_tps"), ".0f"), f(m.get("decode_tps"), ".0f"),
                     f"{f(m.get('step_ms'), '.2f')} ({f(m.get('steady_step_ms'), '.2f')})",
                     *(f(r.get(k), ".2f") for k in ("plimsoll_over_mlx_aggregate",
                                                    "plimsoll_over_mlx_decode",
                                                    "plimsoll_overhead_ms", "mlx_overhead_ms")),
                     f"{f(p.get('cpu_ms_per_step'), '.2f')} "
                     f"({f(p.get('loop_cpu_ms_per_step'), '.2f')})",
                     f(m.get("cpu_ms_per_step"), ".2f")])
    lines += report.table(
        ["streams", "plimsoll agg", "plimsoll decode", "plimsoll ms/step (steady)",
         "plimsoll steady ÷ its engine's step", "mlx_lm.server agg", "mlx decode",
         "mlx ms/step (steady)", "plimsoll ÷ mlx agg", "plimsoll ÷ mlx decode",
         "plimsoll overhead ms/step (vs its engine)", "mlx overhead ms/step (vs mlx-lm)",
         "plimsoll CPU ms/step (its HTTP loop's)", "mlx CPU ms/step"], rows)
    if any(at("plimsoll", n).get("engine_wait_ms_per_step") is not None for n in streams):
        lines += ["", "The engine's threads per step (Linux schedstat): on a core, and runnable "
                  "but queued behind another process (the client, the API process: a box "
                  "with fewer cores than busy processes)", ""]
        lines += report.table(
            ["streams", "in process: queued ms", "served: engine process on-CPU ms",
             "served: queued ms"],
            [[n, f(at("engine", n).get("engine_wait_ms_per_step"), ".2f"),
              f(at("plimsoll", n).get("engine_cpu_ms_per_step"), ".2f"),
              f(at("plimsoll", n).get("engine_wait_ms_per_step"), ".2f")] for n in streams])
    if any(at("plimsoll", n).get("served_build_ms") is not None for n in streams):
        lines += ["", "Served: the engine thread per step of decode rows only (the worker's "
                  "`host` status), wall ms (its CPU ms), beside the engine's build in "
                  "process: build = `run_async`, wait = the step before's tokens, scheduler = "
                  "the rest of the pass (of it: probe = the memory lines, publish = the "
                  "status snapshot, each on its cadence), flush = the pass's events sent", ""]
        lines += report.table(
            ["streams", "in process: build", "served: build", "wait", "scheduler", "probe",
             "publish", "flush", "served − in-process build"],
            [[n, f"{f(eb := at('engine', n).get('split', {}).get('build_ms'), '.2f')} "
                 f"({f(at('engine', n).get('split', {}).get('build_cpu_ms'), '.2f')})",
              *(f"{f(at('plimsoll', n).get(f'served_{p}_ms'), '.2f')} "
                f"({f(at('plimsoll', n).get(f'served_{p}_cpu_ms'), '.2f')})"
                for p in SERVED_PARTS),
              f((at("plimsoll", n).get("served_build_ms") or 0) - eb if eb else None, ".2f")]
             for n in streams])
    if ps := result.get("prefill_shapes"):
        lines += ["", (f"Prefill in process, {ps['prompts']} prompts in two chunks each: all "
                       f"{ps['same_length']} tokens {ps['same_median_ms']:.1f} ms a prompt; each "
                       f"its own length ({ps['distinct_lengths'][0]}–"
                       f"{ps['distinct_lengths'][-1]}) {ps['distinct_median_ms']:.1f} ms a "
                       f"prompt, those lengths again {ps['again_median_ms']:.1f} ms (medians).")]
    for label in ("plimsoll", "mlx"):
        if not (s := result.get(label)):
            continue
        ttft = ", ".join(f"{n}: {f(at(label, n).get('ttft_max_s'), '.2f')}" for n in streams)
        short = ", ".join(f"{n}: {at(label, n).get('tokens_each_min')}" for n in streams)
        lines += ["", f"{label}: slowest TTFT s {ttft}", "",
                  f"{label}: fewest tokens in one stream {short}"
                  + (f"; error {s['error']}" if s.get("error") else "")]
        lines += [f"{label}: py-spy record of the widest phase: {spy['raw']} (per-thread "
                  "summary in the JSON)" for key, spy in s.items()
                  if key.startswith("py_spy") and spy]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--modes", default="engine,scheduler,mlx_inproc,plimsoll,mlx",
                    help=f"which of {', '.join(MODES)} to run, in this order")
    ap.add_argument("--plimsoll-cmd", default=PLIMSOLL)
    ap.add_argument("--mlx-cmd", default=servers.MLX_LM_SERVER)
    ap.add_argument("--preload", default=servers.OPENBLAS)
    report.output_args(ap, "overhead")
    ap.add_argument("--transient-bytes", type=int, default=None,
                    help="the in-process engine's transient budget, as a worker's status "
                         "reports it (transient_bytes): a decode step that fits runs unpaced "
                         "there as in the worker; default none (heavy steps paced)")
    ap.add_argument("--py-spy", type=Path, default=None, help="record the worker into this dir")
    ap.add_argument("--log-dir", type=Path, default=report.OUT,
                    help="server logs (default bench/out, ignored by git)")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    args = ap.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        ap.error(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import mlx.core as mx

    result: dict = {"name": args.name or report.default_name("overhead"),
                    "model": str(args.model), "tokens": args.tokens, "rounds": args.rounds,
                    "streams": args.streams, "command": report.command(),
                    "machine": f"{os.cpu_count()} CPUs, {mx.default_device()}",
                    "host": report.host_facts()}
    prompts = {n: [[word_prompt(r * 100 + i, args.prompt_words) for i in range(n)]
                   for r in range(args.rounds)] for n in args.streams}
    runners = {"engine": engine_rounds, "prefill_shapes": prefill_shapes,
               "mlx_inproc": mlx_inproc_rounds}
    for mode in args.modes:
        if mode in runners:
            result[mode] = runners[mode](args)
        elif mode.startswith("scheduler"):
            result[mode] = scheduler_rounds(args, mode)
        elif mode == "engine_shuffled":
            result[mode] = engine_rounds(args, mode)
        else:
            template = args.plimsoll_cmd if mode == "plimsoll" else args.mlx_cmd
            result[mode] = run_server(mode, template, args, prompts)
    result["ratios"] = ratios(result, args.streams)
    result["host"]["loadavg_end"] = report.loadavg()
    report.write(result, args.out_dir, result["name"], markdown)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
