"""The phases of bench/scale.py, run against one started server (see scale.py's docstring).

Each phase takes a :class:`Ctx` and returns a JSON-able dict of raw figures; ratios and
targets are the report's business (scale_report.py). Every request has a deadline; threads
are joined with one; nothing here starts or stops a server.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from harness_server import Sampler, ServerProcess
from harness_workload import (
    agentic_session,
    concurrent_streams,
    local_prompt_counter,
    single_decode,
)
from scale_probe import counter_deltas, get_status, memory_figure
from scale_work import sub_body, timed_stream, user_body


@dataclass
class Ctx:
    label: str
    server: ServerProcess
    model: str | None
    mem: Sampler
    status: Sampler | None
    args: Any
    work: dict
    facts: Any
    ignore_eos: bool
    partial: dict = field(default_factory=dict)  # the running phase's figures so far

    @property
    def url(self) -> str:
        return self.server.base_url

    def say(self, line: str) -> None:
        print(f"[{self.label}] {line}", flush=True)

    def mark(self) -> None:
        self.mem.mark()
        if self.status:
            self.status.mark()

    def peaks(self) -> dict:
        mem = self.mem.window_peaks()
        out = {"rss": mem.get("rss"), "gpu_proc": mem.get("gpu_proc"),
               "gpu_used": mem.get("gpu_used")}
        out["mem_peak"], out["mem_source"] = memory_figure(mem, self.args.mem_source)
        if self.status:
            sp, last = self.status.window_peaks(), self.status.last
            out |= {"mlx_active_peak": sp.get("mlx_active"), "mlx_peak_reported":
                    last.get("mlx_peak"), "kv_bytes_held_peak": sp.get("kv_bytes_held"),
                    "kv_bytes_allocated_peak": sp.get("kv_bytes_allocated"),
                    "kv_bytes_held_end": last.get("kv_bytes_held")}
        return out

    def snapshot(self) -> dict | None:
        return get_status(self.url, self.args.status_path) if self.status else None

    def eos(self, body: dict) -> dict:
        return {**body, "ignore_eos": True} if self.ignore_eos else body


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("text", "times") and
            not k.startswith("t_")}


def agentic(ctx: Ctx) -> dict:
    kvpt, weights = ctx.facts.kv_bytes_per_token, ctx.facts.weights_bytes

    def around(turn: int, send) -> dict:
        ctx.mark()
        result = send()
        record = _strip(result) | {"text": result.get("text", "")}  # the session resends it
        record |= ctx.peaks()
        if record.get("prompt_tokens") is not None:
            record["needed"] = weights + record["prompt_tokens"] * kvpt
            for key in ("mem_peak", "mlx_active_peak"):
                if record.get(key):
                    record[f"{key}_over_needed"] = record[key] / record["needed"]
        if ctx.server.aborted:
            record["error"] = record.get("error") or ctx.server.aborted
        ctx.partial.setdefault("turns", []).append(
            {k: v for k, v in record.items() if k != "text"})  # kept if the run is cut short
        mem = record.get("mem_peak") or 0
        ctx.say(f"agentic turn {turn}: prompt {record.get('prompt_tokens')} cached "
                f"{record.get('cached_tokens')} TTFT {_f(record.get('ttft_s'))} s peak "
                f"{mem / 2**30:.2f} GiB ({record['mem_source']})"
                + (f" ERROR {record['error']}" if record.get("error") else ""))
        return record

    with httpx.Client() as client:
        turns = agentic_session(client, ctx.url, ctx.model, ctx.work["tool_outputs"],
                                ctx.args.agentic_max_tokens, ctx.args.request_timeout, around,
                                local_prompt_counter(ctx.args.model))
    return {"turns": [{k: v for k, v in t.items() if k != "text"} for t in turns]}


def decode(ctx: Ctx) -> dict:
    runs = []
    with httpx.Client() as client:
        for prompt in ctx.work["decode_prompts"]:
            ctx.mark()
            r = single_decode(client, ctx.url, ctx.model, prompt, ctx.args.decode_tokens,
                              ctx.ignore_eos, ctx.args.request_timeout)
            runs.append(_strip(r) | ctx.peaks())
            ctx.say(f"decode: {r.get('completion_tokens')} tokens, {_f(r.get('decode_tps'))} "
                    f"tok/s after the first {r.get('error') or ''}")
    return _median(runs, "decode_tps", "e2e_tps")


def streams(ctx: Ctx, n: int) -> dict:
    runs = []
    for prompts in ctx.work[f"streams{n}"]:
        ctx.mark()
        r = concurrent_streams(ctx.url, ctx.model, prompts, ctx.args.stream_tokens,
                               ctx.args.request_timeout)
        runs.append(r | ctx.peaks())
        ctx.say(f"{n} streams: {r.get('completed')}/{n} done, {_f(r.get('aggregate_tps'))} tok/s "
                f"aggregate {r.get('errors')[:1] or ''}")
    return _median(runs, "aggregate_tps", "aggregate_tps_after_first_token")


def stall(ctx: Ctx) -> dict:
    """``--stall-streams`` streams decode; once each has tokens, the long prompt is sent; each
    stream's longest gap between tokens while the newcomer prefills, and its TTFT."""
    args, n = ctx.args, ctx.args.stall_streams
    stop = threading.Event()
    started = [threading.Event() for _ in range(n)]
    deadline = args.request_timeout
    ctx.mark()
    with ThreadPoolExecutor(n + 1) as pool:
        futures = [pool.submit(timed_stream, ctx.url,
                               ctx.eos(user_body(ctx.model, p, args.stall_stream_tokens)),
                               deadline, stop, started[i], 8)
                   for i, p in enumerate(ctx.work["stall_streams"])]
        t_wait = time.perf_counter()  # until every stream has tokens (or has failed)
        while time.perf_counter() - t_wait < args.request_timeout and not all(
                ev.is_set() or f.done() for ev, f in zip(started, futures, strict=True)):
            time.sleep(0.05)
        warm = all(ev.is_set() for ev in started)
        time.sleep(args.stall_lead_s)  # a steady decode rhythm before the newcomer
        newcomer = timed_stream(ctx.url, user_body(ctx.model, ctx.work["stall_prompt"],
                                                   args.stall_new_tokens), deadline)
        time.sleep(args.stall_tail_s)
        stop.set()
        runs = [f.result(timeout=deadline + 30) for f in futures]
    t_send = newcomer["t_start"]
    t_first = newcomer["times"][0] if newcomer["times"] else newcomer["t_end"]
    per = []
    for r in runs:
        times = r["times"]
        gaps = [(a, b) for a, b in zip(times, times[1:], strict=False)
                if b > t_send and a < t_first]
        before = [b - a for a, b in zip(times, times[1:], strict=False) if b <= t_send]
        ended = times[-1] if times else r["t_end"]
        per.append({
            "tokens": len(times), "error": r["error"], "finish_reason": r["finish_reason"],
            "closed_by_client": r["closed_by_client"],
            "longest_gap_during_prefill_s": max((b - a for a, b in gaps), default=None),
            "median_gap_before_s": statistics.median(before) if before else None,
            "ended_before_newcomer_first_token": ended < t_first,
        })
    longest = [p["longest_gap_during_prefill_s"] for p in per
               if p["longest_gap_during_prefill_s"] is not None]
    out = {"streams_warm_before_newcomer": warm, "newcomer": _strip(newcomer),
           "newcomer_ttft_s": newcomer.get("ttft_s"), "streams": per,
           "longest_gap_s": max(longest) if longest else None,
           "streams_ended_early": sum(p["ended_before_newcomer_first_token"] for p in per)}
    out |= ctx.peaks()
    ctx.say(f"stall: newcomer prompt {newcomer.get('prompt_tokens')} TTFT "
            f"{_f(out['newcomer_ttft_s'])} s, longest gap {_f(out['longest_gap_s'])} s "
            f"{newcomer.get('error') or ''}")
    return out


def subagents(ctx: Ctx) -> dict:
    args, sub = ctx.args, ctx.work["sub"]
    tokens = args.sub_max_tokens

    def one(system: str, task: str, barrier: threading.Barrier | None = None) -> dict:
        if barrier is not None:
            barrier.wait(timeout=60)
        return timed_stream(ctx.url, ctx.eos(sub_body(ctx.model, system, task, tokens)),
                            args.request_timeout)

    def many(system: str, tasks: list[str]) -> list[dict]:
        barrier = threading.Barrier(len(tasks))
        with ThreadPoolExecutor(len(tasks)) as pool:
            return list(pool.map(lambda t: one(system, t, barrier), tasks))

    out = ctx.partial  # filled as it goes: a run cut short keeps the finished parts
    before = ctx.snapshot()
    ctx.mark()
    alone = one(sub["alone"][0], sub["alone"][1][0])
    out["alone"] = _strip(alone) | ctx.peaks()
    ctx.say(f"sub-agents: alone prompt {alone.get('prompt_tokens')} TTFT {_f(alone['ttft_s'])} s")

    system, tasks = sub["staggered"]
    ctx.mark()
    s0 = one(system, tasks[0])
    before_s = ctx.snapshot()
    rest = many(system, tasks[1:])
    ttfts = [r["ttft_s"] for r in rest if r.get("ttft_s") is not None]
    out["staggered"] = {
        "first": _strip(s0), "rest": [_strip(r) for r in rest],
        "first_ttft_s": s0.get("ttft_s"),
        "rest_ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "rest_ttft_max_s": max(ttfts) if ttfts else None,
        "errors": [r["error"] for r in [s0, *rest] if r.get("error")],
        "status_deltas_rest": counter_deltas(before_s, ctx.snapshot())} | ctx.peaks()
    ctx.say(f"sub-agents staggered: first {_f(s0.get('ttft_s'))} s, other "
            f"{len(rest)} median {_f(out['staggered']['rest_ttft_median_s'])} s max "
            f"{_f(out['staggered']['rest_ttft_max_s'])} s")

    system, tasks = sub["together"]
    before_t = ctx.snapshot()
    ctx.mark()
    together = many(system, tasks)
    ttfts = [r["ttft_s"] for r in together if r.get("ttft_s") is not None]
    out["together"] = {
        "requests": [_strip(r) for r in together],
        "ttft_max_s": max(ttfts) if ttfts else None,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "errors": [r["error"] for r in together if r.get("error")],
        "status_deltas": counter_deltas(before_t, ctx.snapshot())} | ctx.peaks()
    out["status_deltas_phase"] = counter_deltas(before, ctx.snapshot())
    out["shared_prefix_tokens"] = shared_prefix_tokens(ctx, system, tasks)
    ctx.say(f"sub-agents together: slowest TTFT {_f(out['together']['ttft_max_s'])} s, KV held "
            f"peak {_gib(out['together'].get('kv_bytes_held_peak'))}, memory peak "
            f"{_gib(out['together'].get('mem_peak'))}")
    return out


def shared_prefix_tokens(ctx: Ctx, system: str, tasks: list[str]) -> int | None:
    """Tokens the rendered prompts of two sub-agents have in common (the model's template)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(ctx.args.model))
        ids = [tok.apply_chat_template(sub_body(None, system, t, 1)["messages"], tools=
                                       sub_body(None, system, t, 1)["tools"],
                                       add_generation_prompt=True, tokenize=False)
               for t in tasks[:2]]
        a, b = (tok.encode(x, add_special_tokens=False) for x in ids)
    except Exception:  # the figure is a nicety; the phase's timings stand without it
        return None
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _median(runs: list[dict], *keys: str) -> dict:
    out = dict(runs[0])
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[f"{key}_runs"] = values
        out[key] = statistics.median(values) if values else None
    return out


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _gib(x: float | None) -> str:
    return "-" if not x else f"{x / 2**30:.2f} GiB"


PHASES = {"agentic": agentic, "decode": decode, "stall": stall, "subagents": subagents}


def run_phase(ctx: Ctx, name: str) -> dict:
    if name.startswith("streams"):
        return streams(ctx, int(name.removeprefix("streams")))
    return PHASES[name](ctx)
