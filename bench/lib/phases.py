"""The serving phases, run against one started server (bench/serving.py's docstring says what
each measures), and the requests they send, built once so every server gets the same bytes.

Each phase takes a :class:`Ctx` and returns a JSON-able dict of raw figures; ratios and
targets are :mod:`lib.serving_figures`'s business. Every request has a deadline; threads are
joined with one; nothing here starts or stops a server.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lib import access, status
from lib.report import medians
from lib.samplers import Sampler, memory_figure
from lib.servers import ServerProcess
from lib.workloads import (
    STREAM_PROMPT_TOKENS,
    SourceText,
    concurrent_streams,
    single_decode,
    timed_stream,
    user_body,
)

SYSTEM = ("You are a coding agent working in a Python repository. You read files with the "
          "`read_file` tool and answer in one short sentence.")
TASK = ("Review the command-line parsing code in this repository: read the relevant files "
        "section by section and tell me which functions handle option prefixes.")
SUB_SYSTEM = ("You are a sub-agent of a coding agent. The repository's code is below; answer "
              "your task in a few sentences, calling tools when you need more.\n\n")


def _tool(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(props)[:1],
                       "properties": {k: {"type": "string", "description": v}
                                      for k, v in props.items()}}}}


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a range of lines of a file in the repository.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string"},
        "lines": {"type": "string", "description": "first-last, 1-based, inclusive"}}}}}]
SUB_TOOLS = [*TOOLS,
             _tool("grep", "Search the repository for a regular expression.",
                   pattern="a Python regular expression", path="a folder to search"),
             _tool("list_dir", "List a folder of the repository.", path="the folder"),
             _tool("edit_file", "Replace one exact string in a file.", path="the file",
                   old="the text to replace", new="its replacement"),
             _tool("run_tests", "Run the test suite, or one test.", target="a pytest node id")]


def build(args, tokenizer_json: Path) -> dict:
    """Every prompt of the phases asked for, text taken in phase order; raises ValueError if
    the text runs out."""
    src = SourceText(tokenizer_json)
    phases = set(args.phases)
    work: dict = {"source_sha256": src.digest}
    if args.warmup_tokens:  # a longer first request: kernels for long prefills get built
        work["warmup_prompt"] = "Warm-up. Read this code:\n" + src.take(args.warmup_tokens)
    if "agentic" in phases:
        work["tool_outputs"] = [src.take_file(args.tool_tokens) for _ in range(args.turns)]
    if "decode" in phases:  # a fresh prompt each repeat: no prefix cache hit between them
        work["decode_prompts"] = ["Continue this file:\n" + src.take(args.decode_prompt_tokens)
                                  for _ in range(args.repeats)]
    for n in args.streams:
        if f"streams{n}" in phases:
            work[f"streams{n}"] = [[f"Stream {i}. Explain this code:\n" + src.take(
                STREAM_PROMPT_TOKENS[i % len(STREAM_PROMPT_TOKENS)]) for i in range(n)]
                for _ in range(args.repeats)]
    if "stall" in phases:
        work["stall_streams"] = [f"Stream {i}. Rewrite this code:\n" + src.take(128)
                                 for i in range(args.stall_streams)]
        work["stall_prompt"] = "Summarise this code:\n" + src.take(args.stall_prompt_tokens)
    if "subagents" in phases:
        def prefix() -> str:
            return SUB_SYSTEM + src.take(args.sub_prefix_tokens)

        def tasks(n: int, tag: str) -> list[str]:
            return [f"Sub-task {tag}{i}: find the bug in this code and explain it.\n"
                    + src.take(args.sub_task_tokens) for i in range(n)]

        n = args.sub_agents
        work["sub"] = {"warm": (prefix(), tasks(1, "w")), "alone": (prefix(), tasks(1, "a")),
                       "staggered": (prefix(), tasks(n, "s")),
                       "together": (prefix(), tasks(n, "t"))}
    return work


def sub_body(model: str | None, system: str, task: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
            "tools": SUB_TOOLS, "max_tokens": max_tokens, "temperature": 0.0}
    return body if model is None else {"model": model, **body}


@dataclass
class Ctx:
    """One started server and what its phases need."""

    label: str
    server: ServerProcess
    model: str | None
    mem: Sampler
    status: Sampler | None
    args: Any
    work: dict
    facts: Any  # model_facts of the model at this server's KV format
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
                    "kv_bytes_live_peak": sp.get("kv_bytes_live"),
                    "kv_bytes_allocated_peak": sp.get("kv_bytes_allocated"),
                    "kv_bytes_held_end": last.get("kv_bytes_held")}
        return out

    def snapshot(self) -> dict | None:
        return status.get(self.url, self.args.status_path) if self.status else None

    def eos(self, body: dict) -> dict:
        return {**body, "ignore_eos": True} if self.ignore_eos else body


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("text", "times") and
            not k.startswith("t_")}


def local_prompt_counter(model_dir: Path) -> Callable[[dict], int]:
    """Prompt tokens of a request body, rendered with the model's own chat template (for a
    server that reports no ``usage``)."""

    def count(body: dict) -> int:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        text = tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                       add_generation_prompt=True, tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    return count


def agentic(ctx: Ctx) -> dict:
    """The growing conversation, one turn per tool output. Each turn resends everything so far
    plus one more exchange: an assistant message (the server's previous reply, with the
    ``read_file`` call an agent would have made) and the tool's answer to that call."""
    kvpt, weights = ctx.facts.kv_bytes_per_token, ctx.facts.weights_bytes
    count = local_prompt_counter(ctx.args.model)
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": TASK}]
    turns, reply = ctx.partial.setdefault("turns", []), None  # kept if the run is cut short
    with httpx.Client() as client:
        for turn, (arguments, output) in enumerate(ctx.work["tool_outputs"], 1):
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps(arguments)}}
            messages += [{"role": "assistant", "content": reply or None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": output}]
            body = {"messages": list(messages), "max_tokens": ctx.args.agentic_max_tokens,
                    "temperature": 0.0, "tools": TOOLS}
            body = body if ctx.model is None else {"model": ctx.model, **body}
            ctx.mark()
            result = timed_stream(ctx.url, body, ctx.args.request_timeout, client=client)
            record = _strip(result) | {"turn": turn} | ctx.peaks()
            if record.get("prompt_tokens") is None and not record.get("error"):
                record["prompt_tokens"] = count(body)  # the server sent no usage
                record["prompt_tokens_source"] = "local tokenizer"
            if record.get("prompt_tokens") is not None:
                record["needed"] = weights + record["prompt_tokens"] * kvpt
                for key in ("mem_peak", "mlx_active_peak"):
                    if record.get(key):
                        record[f"{key}_over_needed"] = record[key] / record["needed"]
            if ctx.server.aborted:
                record["error"] = record.get("error") or ctx.server.aborted
            turns.append(record)
            ctx.say(f"agentic turn {turn}: prompt {record.get('prompt_tokens')} cached "
                    f"{record.get('cached_tokens')} TTFT {_f(record.get('ttft_s'))} s peak "
                    f"{_gib(record.get('mem_peak'))} ({record['mem_source']})"
                    + (f" ERROR {record['error']}" if record.get("error") else ""))
            if record.get("error"):
                break
            reply = result["text"]
    return {"turns": turns}


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
    return medians(runs, "decode_tps", "e2e_tps")


def streams(ctx: Ctx, n: int) -> dict:
    runs = []
    for prompts in ctx.work[f"streams{n}"]:
        ctx.mark()
        r = concurrent_streams(ctx.url, [user_body(ctx.model, p, ctx.args.stream_tokens)
                                         for p in prompts], ctx.args.request_timeout)
        runs.append(r | ctx.peaks())
        ctx.say(f"{n} streams: {r.get('completed')}/{n} done, {_f(r.get('aggregate_tps'))} tok/s "
                f"aggregate {r.get('errors')[:1] or ''}")
    return medians(runs, "aggregate_tps", "aggregate_tps_after_first_token")


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
                               deadline, stop=stop, started=started[i], started_after=8)
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
        gaps = [b - a for a, b in itertools.pairwise(times) if b > t_send and a < t_first]
        before = [b - a for a, b in itertools.pairwise(times) if b <= t_send]
        ended = times[-1] if times else r["t_end"]
        per.append({
            "tokens": len(times), "error": r["error"], "finish_reason": r["finish_reason"],
            "closed_by_client": r["closed_by_client"],
            "longest_gap_during_prefill_s": max(gaps, default=None),
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
    """One sub-agent alone (its own prefix), staggered (one, then the rest together on another
    shared prefix), all together (a third): TTFTs, KV held, cached tokens, status counters.
    With ``--sub-warm`` (the default) one more such request first, on a prefix of its own: the
    server's first prompt of this size pays first-use costs (on MLX's CUDA backend its
    chunks ran ~2 × slower than the next prompt's, bench/results/serving-h100-2026-12-05m),
    which would make the alone request the ratios divide by unlike the ones they compare."""
    args, sub = ctx.args, ctx.work["sub"]

    def one(system: str, task: str, barrier: threading.Barrier | None = None) -> dict:
        # the client made before the release: making one holds the GIL for tens of ms, so
        # eight made at once would have spread the requests' sending over ~0.3 s of TTFT
        with httpx.Client() as client:
            if barrier is not None:
                barrier.wait(timeout=60)
            return timed_stream(ctx.url, ctx.eos(sub_body(ctx.model, system, task,
                                                          args.sub_max_tokens)),
                                args.request_timeout, client=client)

    def many(system: str, tasks: list[str]) -> list[dict]:
        barrier = threading.Barrier(len(tasks))
        with ThreadPoolExecutor(len(tasks)) as pool:
            return list(pool.map(lambda t: one(system, t, barrier), tasks))

    out = ctx.partial  # filled as it goes: a run cut short keeps the finished parts
    # the server's own TTFTs (its access lines) beside the client's; mlx_lm.server has none
    log = ctx.server.log_path if ctx.status is not None else None
    if args.sub_warm:  # a first prompt of this size pays the server's first-use costs
        n = access.count(log)
        warm = one(sub["warm"][0], sub["warm"][1][0])
        out["warm"] = _strip(warm) | {"server_ttft_s": access.ttfts(log, n, 1)}
        ctx.say(f"sub-agents: warm-up prompt {warm.get('prompt_tokens')} TTFT "
                f"{_f(warm.get('ttft_s'))} s (not a figure of the ratios)")
    before = ctx.snapshot()
    ctx.mark()
    n = access.count(log)
    alone = one(sub["alone"][0], sub["alone"][1][0])
    out["alone"] = _strip(alone) | ctx.peaks() | {"server_ttft_s": access.ttfts(log, n, 1)}
    ctx.say(f"sub-agents: alone prompt {alone.get('prompt_tokens')} TTFT {_f(alone['ttft_s'])} s")

    system, tasks = sub["staggered"]
    ctx.mark()
    n = access.count(log)
    s0 = one(system, tasks[0])
    server_first = access.ttfts(log, n, 1)
    before_s = ctx.snapshot()
    n = access.count(log)
    rest = many(system, tasks[1:])
    server_rest = access.ttfts(log, n, len(rest))
    ttfts = [r["ttft_s"] for r in rest if r.get("ttft_s") is not None]
    out["staggered"] = {
        "first": _strip(s0), "rest": [_strip(r) for r in rest],
        "first_ttft_s": s0.get("ttft_s"),
        "rest_ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "rest_ttft_max_s": max(ttfts) if ttfts else None,
        "server_first_ttft_s": server_first, "server_rest_ttft_s": server_rest,
        "errors": [r["error"] for r in [s0, *rest] if r.get("error")],
        "status_deltas_rest": status.counter_deltas(before_s, ctx.snapshot())} | ctx.peaks()
    ctx.say(f"sub-agents staggered: first {_f(s0.get('ttft_s'))} s, other "
            f"{len(rest)} median {_f(out['staggered']['rest_ttft_median_s'])} s max "
            f"{_f(out['staggered']['rest_ttft_max_s'])} s")

    system, tasks = sub["together"]
    before_t = ctx.snapshot()
    ctx.mark()
    n = access.count(log)
    together = many(system, tasks)
    ttfts = [r["ttft_s"] for r in together if r.get("ttft_s") is not None]
    out["together"] = {
        "requests": [_strip(r) for r in together],
        "server_ttft_s": access.ttfts(log, n, len(together)),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "errors": [r["error"] for r in together if r.get("error")],
        "status_deltas": status.counter_deltas(before_t, ctx.snapshot())} | ctx.peaks()
    out["status_deltas_phase"] = status.counter_deltas(before, ctx.snapshot())
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
        texts = [tok.apply_chat_template(sub_body(None, system, t, 1)["messages"],
                                         tools=SUB_TOOLS, add_generation_prompt=True,
                                         tokenize=False) for t in tasks[:2]]
        a, b = (tok.encode(x, add_special_tokens=False) for x in texts)
    except Exception:  # a nicety: the phase's timings stand without it
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _gib(x: float | None) -> str:
    return "-" if not x else f"{x / 2**30:.2f} GiB"


PHASES = {"agentic": agentic, "decode": decode, "stall": stall, "subagents": subagents}


def run_phase(ctx: Ctx, name: str) -> dict:
    if name.startswith("streams"):
        return streams(ctx, int(name.removeprefix("streams")))
    return PHASES[name](ctx)
