"""Serving side by side: plimsoll against mlx_lm.server over HTTP, the same requests, one run.

Servers come from command templates: the anchor, ``mlx_lm.server`` with its defaults, and the
candidate, ``plimsoll launch`` (``--kv auto,q8,q4`` runs one plimsoll per KV format instead:
``plimsoll-auto``, ``plimsoll-q8``, ``plimsoll-q4``). Phases (``--phases``, in that order):

- ``agentic``: a growing tool-calling session (``--turns`` × ``--tool-tokens``); per turn
  prompt/cached tokens, TTFT, peak memory (sampled: the GPU's on a GPU, RSS of the process tree
  otherwise; plimsoll's own MLX figures from its status too) ÷ (weights + one KV copy);
- ``decode``: one stream, tok/s after the first token, and its fraction of the bandwidth
  limit: copy bandwidth (measured here, ``--copy-gib``) ÷ (weights + KV read per token);
- ``streamsN`` (N in ``--streams``): N requests released together, ``--stream-tokens`` each,
  prompts of 96–544 tokens; aggregate tok/s;
- ``stall``: ``--stall-streams`` streams decode, then a ``--stall-prompt-tokens`` prompt
  arrives: each stream's longest gap between tokens during its prefill, the newcomer's TTFT;
- ``subagents``: ``--sub-agents`` requests sharing a ``--sub-prefix-tokens`` system prompt and
  tools, each with a ``--sub-task-tokens`` task: one alone (its own prefix), staggered (one,
  then the rest together), all at once; KV held, prefill counters, cached tokens; first a
  warm-up request of that size (``--no-sub-warm``: none), reported apart.

Servers are started per phase group (a fresh one for each phase in ``--fresh-phases`` and for
each different candidate template) on a free 127.0.0.1 port, in their own process group, and
stopped (SIGTERM, then SIGKILL, verified gone) before the next server of that group starts;
``--order`` picks which goes first. The JSON and markdown are rewritten after every server,
so a run cut short keeps what it measured. See bench/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import psutil
from plimsoll.core.model_facts import inspect_model

from lib import phases, report, servers, status
from lib.samplers import Gpu, copy_bandwidth, memory_sampler
from lib.serving_figures import TARGETS, markdown, summarise
from lib.workloads import accepts_ignore_eos, timed_stream, user_body

CANDIDATE = servers.PLIMSOLL_LAUNCH + " --concurrency 8 --context 40960 --max-tokens 2048"
ALL_PHASES = ["agentic", "decode", "streams8", "stall", "subagents", "streams32"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", type=Path, help="the model directory (required unless --render)")
    report.output_args(p, "serving")
    a("--phases", default=",".join(ALL_PHASES),
      help=f"comma-separated, run in this order (default {','.join(ALL_PHASES)})")
    a("--fresh-phases", default="agentic,subagents",
      help="phases that start on a server of their own ('' : consecutive phases share one)")
    a("--order", choices=["anchor-first", "candidate-first"], default="anchor-first")
    a("--only", choices=["anchor", "candidate"], help="run the anchor or the candidate(s) only")
    a("--anchor-cmd", default=servers.MLX_LM_SERVER,
      help="template; placeholders {python} {plimsoll} {model} {host} {port}")
    a("--candidate-cmd", default=CANDIDATE, help="template, as --anchor-cmd")
    a("--candidate-wide-cmd", help="candidate template for streamsN with N > 8 "
      "(e.g. launch … --concurrency 32 --context 4096); default --candidate-cmd")
    a("--candidate-cmd-for", action="append", default=[], metavar="PHASE=TEMPLATE",
      help="candidate template for one phase (repeatable); wins over the two above")
    a("--kv", help="one candidate per KV format, e.g. auto,q8,q4: the candidate's template "
      "+ --kv-dtype KV, labelled plimsoll-KV")
    a("--targets", choices=sorted(TARGETS), default="scale", help="which targets to check")
    # workload
    a("--turns", type=int, default=12)
    a("--tool-tokens", type=int, default=2400, help="tokens of tool output per agentic turn")
    a("--agentic-max-tokens", type=int, default=16)
    a("--warmup-tokens", type=int, default=0, help="prompt tokens of a warm-up request sent "
      "to every fresh server before its phases (0: a 2-token one only)")
    a("--wait-plans", type=float, default=0, metavar="S", help="after the warm-up, wait up "
      "to S seconds for plimsoll's idle attention-plan warmer to finish (its status' "
      "attention_plans; CUDA only; 0: do not wait)")
    a("--decode-tokens", type=int, default=256)
    a("--decode-prompt-tokens", type=int, default=64)
    a("--streams", default="8,32", help="stream counts: phases streamsN")
    a("--stream-tokens", type=int, default=256)
    a("--repeats", type=int, default=1, help="runs of decode and streams (median)")
    a("--stall-streams", type=int, default=4)
    a("--stall-stream-tokens", type=int, default=2048,
      help="max_tokens of the decoding streams (they are closed after the newcomer's TTFT)")
    a("--stall-prompt-tokens", type=int, default=31500)
    a("--stall-new-tokens", type=int, default=8)
    a("--stall-lead-s", type=float, default=1.0, help="decode time before the newcomer")
    a("--stall-tail-s", type=float, default=1.0, help="decode time after its first token")
    a("--sub-agents", type=int, default=8)
    a("--sub-prefix-tokens", type=int, default=16000)
    a("--sub-task-tokens", type=int, default=500)
    a("--sub-max-tokens", type=int, default=32)
    a("--sub-warm", action=argparse.BooleanOptionalAction, default=True,
      help="one sub-agent request on a prefix of its own before the alone one (default on)")
    a("--no-ignore-eos", dest="ignore_eos", action="store_false",
      help="never send ignore_eos (default: sent where the server accepts it)")
    # measurement
    a("--mem-source", choices=["auto", "gpu", "rss"], default="auto",
      help="sampled memory: the GPU's where there is one (auto), or the process tree's RSS")
    a("--copy-gib", type=float, default=4.0, help="array size of the bandwidth probe")
    a("--copy-reps", type=int, default=5)
    a("--preload", default=servers.OPENBLAS, help="LD_PRELOAD for servers ('' for none; "
      "skipped when the file is absent)")
    a("--status-path", default=status.PATH)
    a("--sample-interval", type=float, default=0.1)
    a("--status-interval", type=float, default=0.25)
    a("--ready-timeout", type=float, default=300.0)
    a("--request-timeout", type=float, default=300.0)
    a("--min-available-gib", type=float, default=1.5,
      help="kill a server whose run leaves the host less available memory")
    a("--deadline-s", type=float, help="start no server after this many seconds from the start "
      "(less --min-group-s): the run ends with what it measured")
    a("--min-group-s", type=float, default=45.0)
    a("--log-dir", type=Path, default=report.OUT, help="server logs (default bench/out)")
    a("--note", action="append", default=[], help="a line for the report (repeatable)")
    a("--render", type=Path, metavar="JSON", help="only redo the markdown of an earlier JSON")
    args = p.parse_args(argv)
    if args.model is None and args.render is None:
        p.error("--model is required")
    args.streams = [int(x) for x in str(args.streams).split(",") if x.strip()]
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    args.fresh = {x.strip() for x in args.fresh_phases.split(",") if x.strip()}
    args.kv = [x.strip() for x in args.kv.split(",")] if args.kv else []
    known = {"agentic", "decode", "stall", "subagents", *(f"streams{n}" for n in args.streams)}
    if bad := [x for x in args.phases if x not in known]:
        p.error(f"unknown phase(s) {bad}; choose from {sorted(known)} "
                "(streamsN needs N in --streams)")
    args.phase_cmd = {}
    for item in args.candidate_cmd_for:
        phase, sep, template = item.partition("=")
        if not sep or phase not in known:
            p.error(f"--candidate-cmd-for {item!r}: want PHASE=TEMPLATE, PHASE in {sorted(known)}")
        args.phase_cmd[phase] = template
    return args


def candidate_template(args: argparse.Namespace, phase: str) -> str:
    if phase in args.phase_cmd:
        return args.phase_cmd[phase]
    if phase.startswith("streams") and int(phase[7:]) > 8 and args.candidate_wide_cmd:
        return args.candidate_wide_cmd
    return args.candidate_cmd


def groups(args: argparse.Namespace) -> list[list[str]]:
    """Consecutive phases share a server unless a phase wants a fresh one or the candidate's
    template changes."""
    out: list[list[str]] = []
    for phase in args.phases:
        if (not out or phase in args.fresh or out[-1][0] in args.fresh
                or candidate_template(args, phase) != candidate_template(args, out[-1][0])):
            out.append([phase])
        else:
            out[-1].append(phase)
    return out


def plan(args: argparse.Namespace, phase: str) -> list[tuple[str, str, str | None]]:
    """(label, template, KV format) of every server of a group, in ``--order``."""
    anchor = [("anchor", args.anchor_cmd, None)]
    cand = candidate_template(args, phase)
    cands = ([(f"plimsoll-{kv}", f"{cand} --kv-dtype {kv}", kv) for kv in args.kv]
             or [("candidate", cand, None)])
    both = {"anchor": anchor, "candidate": cands}
    order = ["anchor", "candidate"] if args.order == "anchor-first" else ["candidate", "anchor"]
    return [x for side in order if args.only in (None, side) for x in both[side]]


def run_group(label: str, template: str, group: list[str], args, work, facts,
              gpu: Gpu | None, out: dict) -> dict:
    """Start one server, run the group's phases on it, stop it; figures go into ``out`` as they
    come (a run interrupted by SIGTERM still writes what it had)."""
    server = servers.start(label, template, args.model, preload=args.preload,
                           log_dir=args.log_dir, log_name=f"{label}-{'-'.join(group)}")
    baseline = gpu.total_used() if gpu and gpu.present else None
    out |= {"label": label, "phases": group, "argv": server.argv, "log": str(server.log_path),
            "loadavg_start": os.getloadavg(), "gpu_used_before": baseline, "results": {}}
    t0 = time.perf_counter()
    mem = memory_sampler(server, args.sample_interval, int(args.min_available_gib * 2**30),
                         gpu, baseline).start()
    sampler = raw = None
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        model = servers.served_model(server.base_url, args.model)
        if status.get(server.base_url, args.status_path) is not None:
            sampler, raw = status.sampler(server.base_url, args.status_path,
                                          args.status_interval)
            sampler.start().sample_now()
            out["status_at_ready"] = copy.deepcopy(raw)
        t = time.perf_counter()
        eos = args.ignore_eos and accepts_ignore_eos(server.base_url, model,
                                                     args.request_timeout)
        if work.get("warmup_prompt"):
            warm = timed_stream(server.base_url, user_body(model, work["warmup_prompt"], 4),
                                args.request_timeout)
            out["warmup_long"] = {"ttft_s": warm.get("ttft_s"), "error": warm.get("error"),
                                  "prompt_tokens": warm.get("prompt_tokens")}
        if args.wait_plans and sampler is not None:  # the worker's idle plan warming
            out["attention_plans"] = status.wait_plans(server.base_url, args.status_path,
                                                       args.wait_plans)
            print(f"[{label}] attention plans: {out['attention_plans']}", flush=True)
        out |= {"warmup_s": time.perf_counter() - t, "ignore_eos": eos, "model_id": model}
        print(f"[{label}] ready in {out['ready_s']:.1f} s, warm-up {out['warmup_s']:.1f} s, "
              f"status: {sampler is not None}, ignore_eos: {eos}", flush=True)
        ctx = phases.Ctx(label, server, model, mem, sampler, args, work, facts, eos)
        for phase in group:
            if server.aborted or not server.alive():
                out["results"][phase] = {"error": server.aborted or "server exited"}
                continue
            t = time.perf_counter()
            ctx.partial = out["results"][phase] = {}
            try:
                out["results"][phase] = phases.run_phase(ctx, phase)
            except Exception as err:  # recorded: the other phases still run
                out["results"][phase] = ctx.partial | {"error": f"{type(err).__name__}: {err}"}
                print(f"[{label}] {phase} error: {err}", flush=True)
            out["results"][phase]["phase_s"] = time.perf_counter() - t
        if sampler is not None:
            sampler.sample_now()
            out["status_last"] = copy.deepcopy(raw)
            out["status_fields_last"] = status.figures(raw)
    except Exception as err:  # recorded: the other servers still run
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"[{label}] error: {out['error']}", flush=True)
    finally:
        mem.stop()
        if sampler is not None:
            sampler.stop()
        out["stop"] = server.stop()
        out["aborted"] = server.aborted
        out["peaks"] = mem.overall_peaks()
        out["wall_s"] = time.perf_counter() - t0
        out["loadavg_end"] = os.getloadavg()
        print(f"[{label}] stopped after {out['wall_s']:.0f} s: {out['stop']}", flush=True)
    return out


def write(result: dict, args: argparse.Namespace) -> None:
    result["summary"] = summarise(result)
    result["host_line"] = report.host_line(result["host"])
    report.write(result, args.out_dir, result["name"], markdown)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        result["notes"] = result.get("notes", []) + args.note
        result["name"] = args.name or result["name"]
        args.out_dir = args.render.parent
        write(result, args)
        return 0
    servers.stop_all_on_sigterm()
    args.model = args.model.resolve()
    facts = {kv: inspect_model(args.model, kv_dtype=None if kv in (None, "auto") else kv)
             for kv in {None, *args.kv}}
    t0 = time.perf_counter()
    work = phases.build(args, args.model / "tokenizer.json")
    print(f"workload built in {time.perf_counter() - t0:.1f} s", flush=True)
    gpu = Gpu()
    bandwidth = copy_bandwidth(args.copy_gib, args.copy_reps, servers.server_env(args.preload),
                               120.0)
    print(f"copy bandwidth: {bandwidth}", flush=True)
    order = [label for label, _, _ in plan(args, args.phases[0])]
    result = {
        "name": args.name or report.default_name("serving", "kv-quant" if args.kv else None),
        "command": report.command(), "cwd": os.getcwd(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": report.host_facts(),
        "model": {"dir": str(args.model), **facts[None].model_dump()},
        "kv_bytes_per_token": {label: facts[kv].kv_bytes_per_token
                               for label, _, kv in plan(args, args.phases[0])},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k != "fresh"},
        "notes": args.note, "bandwidth": bandwidth, "order": order, "targets": args.targets,
        "source_sha256": work["source_sha256"], "groups": [],
    }
    baseline, started = psutil.virtual_memory().available, False
    try:
        for group in groups(args):
            record = {"phases": group, "servers": {}}
            result["groups"].append(record)
            for label, template, kv in plan(args, group[0]):
                left = args.deadline_s - (time.perf_counter() - t0) if args.deadline_s else None
                if left is not None and left < args.min_group_s:
                    record["servers"][label] = {"label": label, "phases": group, "results": {},
                                                "error": f"skipped: {left:.0f} s left of "
                                                f"--deadline-s {args.deadline_s:.0f}"}
                    print(f"[{label}] {'+'.join(group)}: skipped ({left:.0f} s left)",
                          flush=True)
                    continue
                if started:  # the last server's memory back first
                    servers.wait_for_memory(baseline - 512 * 1024**2)
                started = True
                record["servers"][label] = {}
                run_group(label, template, group, args, work, facts[kv], gpu,
                          record["servers"][label])
                result["host"]["loadavg_end"] = report.loadavg()
                write(result, args)
    except KeyboardInterrupt:
        result["interrupted"] = f"after {time.perf_counter() - t0:.0f} s"
        print(f"interrupted {result['interrupted']}; writing what was measured", flush=True)
    finally:
        write(result, args)
    ok = not result.get("interrupted") and all(
        not s.get("error") for g in result["groups"] for s in g["servers"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
