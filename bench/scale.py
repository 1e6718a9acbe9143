"""Scale benchmark, by hand: plimsoll against mlx_lm.server on the figures of issue 14.

Two servers from command templates (as bench/agentic.py): the anchor, ``mlx_lm.server`` with
its defaults, and the candidate, ``plimsoll launch``. Phases (``--phases``):

- ``agentic``: a growing tool-calling session (``--turns`` × ``--tool-tokens``); per turn
  prompt/cached tokens, TTFT, peak memory (sampled: nvidia-smi on a GPU, RSS of the process
  tree otherwise; plimsoll's own MLX figures from its status too) ÷ (weights + one KV copy);
- ``decode``: one stream, tok/s after the first token, and its fraction of the bandwidth
  limit: copy bandwidth (measured here, ``--copy-gib``) ÷ (weights + KV read per token);
- ``streams8``, ``streams32`` (``--streams``): N requests released together, ``--stream-tokens``
  each, prompts of 96–544 tokens; aggregate tok/s;
- ``stall``: ``--stall-streams`` streams decode, then a ``--stall-prompt-tokens`` prompt
  arrives: each stream's longest gap between tokens during its prefill, the newcomer's TTFT;
- ``subagents``: ``--sub-agents`` requests sharing a ``--sub-prefix-tokens`` system prompt and
  tools, each with a ``--sub-task-tokens`` task: one alone (its own prefix), staggered (one,
  then the rest together), all at once; KV held, prefill counters, cached tokens.

Servers are started per phase group (a fresh server for the agentic session, for the
sub-agents and for each different candidate template) on a free 127.0.0.1 port, in their own
process group, and stopped (SIGTERM, then SIGKILL, verified gone) before the other server of
that group starts; ``--order`` picks which goes first. The JSON and markdown are rewritten
after every group, so a run cut short keeps what it measured. See bench/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import signal
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psutil
from harness_server import (
    HOST,
    ServerProcess,
    free_port,
    has_status,
    render,
    served_model,
    server_env,
)
from scale_phases import Ctx, run_phase
from scale_probe import Gpu, copy_bandwidth, memory_sampler, status_sampler
from scale_report import markdown, summarise
from scale_work import accepts_ignore_eos, build, timed_stream, user_body

try:  # the layout of issue 13 moved it; the old home still works before that
    from plimsoll.core.model_facts import inspect_model
except ImportError:  # pragma: no cover
    from plimsoll.model_facts import inspect_model

HERE = Path(__file__).resolve().parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
ANCHOR = "{python} -m mlx_lm server --model {model} --host {host} --port {port}"
CANDIDATE = ("{python} -m plimsoll.cli launch {model} --host {host} --port {port} "
             "--concurrency 8 --context 40960 --max-tokens 2048")
ALL_PHASES = ["agentic", "decode", "streams8", "stall", "subagents", "streams32"]
FRESH = {"agentic", "subagents"}  # phases that start on a server of their own


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", type=Path, help="the model directory (required unless --render)")
    a("--name", required=True, help="output base name: bench/results/NAME.{json,md}")
    a("--phases", default=",".join(ALL_PHASES),
      help=f"comma-separated, run in this order (default {','.join(ALL_PHASES)})")
    a("--order", choices=["anchor-first", "candidate-first"], default="anchor-first")
    a("--only", choices=["anchor", "candidate"], help="run one server only")
    a("--anchor-cmd", default=ANCHOR,
      help="template; placeholders {python} {plimsoll} {model} {host} {port}")
    a("--candidate-cmd", default=CANDIDATE, help="template, as --anchor-cmd")
    a("--candidate-wide-cmd", help="candidate template for streamsN with N > 8 "
      "(e.g. launch … --concurrency 32 --context 4096); default --candidate-cmd")
    a("--candidate-cmd-for", action="append", default=[], metavar="PHASE=TEMPLATE",
      help="candidate template for one phase (repeatable); wins over the two above")
    # workload
    a("--turns", type=int, default=12)
    a("--tool-tokens", type=int, default=2400, help="tokens of tool output per agentic turn")
    a("--agentic-max-tokens", type=int, default=16)
    a("--warmup-tokens", type=int, default=0, help="prompt tokens of a warm-up request sent "
      "to every fresh server before its phases (0: a 2-token one only)")
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
    a("--no-ignore-eos", dest="ignore_eos", action="store_false",
      help="never send ignore_eos (default: sent where the server accepts it)")
    # measurement
    a("--mem-source", choices=["auto", "gpu", "rss"], default="auto",
      help="sampled memory: nvidia-smi where present (auto), or the process tree's RSS")
    a("--copy-gib", type=float, default=4.0, help="array size of the bandwidth probe")
    a("--copy-reps", type=int, default=5)
    a("--preload", default=OPENBLAS, help="LD_PRELOAD for servers ('' for none; "
      "skipped when the file is absent)")
    a("--status-path", default="/v1/plimsoll/status")
    a("--sample-interval", type=float, default=0.1)
    a("--status-interval", type=float, default=0.25)
    a("--ready-timeout", type=float, default=300.0)
    a("--request-timeout", type=float, default=300.0)
    a("--min-available-gib", type=float, default=1.5)
    a("--deadline-s", type=float, help="start no server after this many seconds from the start "
      "(less --min-group-s): the run ends with what it measured")
    a("--min-group-s", type=float, default=45.0)
    a("--out-dir", type=Path, default=HERE / "results")
    a("--log-dir", type=Path, default=HERE / "out")
    a("--note", action="append", default=[], help="a line for the report (repeatable)")
    a("--render", type=Path, metavar="JSON", help="only redo the markdown of an earlier JSON")
    args = p.parse_args(argv)
    if args.model is None and args.render is None:
        p.error("--model is required")
    args.streams = [int(x) for x in str(args.streams).split(",") if x.strip()]
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
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
        if (not out or phase in FRESH or out[-1][0] in FRESH
                or candidate_template(args, phase) != candidate_template(args, out[-1][0])):
            out.append([phase])
        else:
            out[-1].append(phase)
    return out


def run_group(label: str, template: str, phases: list[str], args, work, facts,
              gpu: Gpu | None, out: dict) -> dict:
    """Start one server, run ``phases`` on it, stop it; figures go into ``out`` as they come
    (a run interrupted by SIGTERM still writes what it had)."""
    port = free_port()
    values = {"python": sys.executable, "model": str(args.model), "host": HOST,
              "port": str(port), "plimsoll": shutil.which("plimsoll")
              or f"{sys.executable} -m plimsoll.cli"}
    argv = shlex.split(render(template, values))
    env = server_env(args.preload)
    server = ServerProcess(label, argv, env, port,
                           args.log_dir / f"{label}-{'-'.join(phases)}-{port}.log")
    baseline = gpu.total_used() if gpu and gpu.present else None
    out |= {"label": label, "phases": phases, "argv": argv, "log": str(server.log_path),
            "loadavg_start": os.getloadavg(), "gpu_used_before": baseline, "results": {}}
    print(f"[{label}] {'+'.join(phases)}: starting {shlex.join(argv)}", flush=True)
    t0 = time.perf_counter()
    server.start()
    LIVE.append(server)
    mem = memory_sampler(server, args.sample_interval, int(args.min_available_gib * 2**30),
                         gpu, baseline).start()
    status = None
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        model = served_model(server.base_url, args.model)
        if has_status(server.base_url, args.status_path):
            status, raw = status_sampler(server.base_url, args.status_path,
                                         args.status_interval)
            status.start().sample_now()
            out["status_at_ready"] = copy.deepcopy(raw)
        t = time.perf_counter()
        eos = args.ignore_eos and accepts_ignore_eos(server.base_url, model,
                                                     args.request_timeout)
        if work.get("warmup_prompt"):
            warm = timed_stream(server.base_url, user_body(model, work["warmup_prompt"], 4),
                                args.request_timeout)
            out["warmup_long"] = {"ttft_s": warm.get("ttft_s"), "error": warm.get("error"),
                                  "prompt_tokens": warm.get("prompt_tokens")}
        out |= {"warmup_s": time.perf_counter() - t, "ignore_eos": eos, "model_id": model}
        print(f"[{label}] ready in {out['ready_s']:.1f} s, warm-up {out['warmup_s']:.1f} s, "
              f"status: {status is not None}, ignore_eos: {eos}", flush=True)
        ctx = Ctx(label, server, model, mem, status, args, work, facts, eos)
        for phase in phases:
            if server.aborted or not server.alive():
                out["results"][phase] = {"error": server.aborted or "server exited"}
                continue
            t = time.perf_counter()
            ctx.partial = out["results"][phase] = {}
            try:
                out["results"][phase] = run_phase(ctx, phase)
            except Exception as err:  # record it: the other phases and server still run
                out["results"][phase] = ctx.partial | {"error": f"{type(err).__name__}: {err}"}
                print(f"[{label}] {phase} error: {err}", flush=True)
            out["results"][phase]["phase_s"] = time.perf_counter() - t
        if status is not None:
            status.sample_now()
            out["status_last"] = copy.deepcopy(raw)
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"[{label}] error: {out['error']}", flush=True)
    finally:
        mem.stop()
        if status is not None:
            status.stop()
        out["stop"] = server.stop()
        LIVE.remove(server)
        out["aborted"] = server.aborted
        out["peaks"] = mem.overall_peaks()
        out["wall_s"] = time.perf_counter() - t0
        out["loadavg_end"] = os.getloadavg()
        print(f"[{label}] stopped after {out['wall_s']:.0f} s: {out['stop']}", flush=True)
    return out


def write(result: dict, out_dir: Path, name: str) -> None:
    result["summary"] = summarise(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(result))
    print(f"wrote {out_dir / name}.json and .md", flush=True)


def _version(name: str) -> str | None:
    for dist in (name, f"{name}-cuda-13", f"{name}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        result["notes"] = result.get("notes", []) + args.note
        write(result, args.render.parent, args.name)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # so every server is stopped on the way out
    args.model = args.model.resolve()
    facts = inspect_model(args.model)
    t0 = time.perf_counter()
    work = build(args, args.model / "tokenizer.json")
    print(f"workload built in {time.perf_counter() - t0:.1f} s", flush=True)
    gpu = Gpu()
    bandwidth = copy_bandwidth(args.copy_gib, args.copy_reps, server_env(args.preload), 120.0)
    print(f"copy bandwidth: {bandwidth}", flush=True)
    order = ["anchor", "candidate"] if args.order == "anchor-first" else ["candidate", "anchor"]
    order = [x for x in order if args.only in (None, x)]
    result = {
        "command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"cpus": os.cpu_count(), "total_ram": psutil.virtual_memory().total,
                 "python": sys.version.split()[0], "mlx": _version("mlx"),
                 "mlx_lm": _version("mlx-lm"), "gpu": gpu.present and gpu.source,
                 "ld_preload": server_env(args.preload).get("LD_PRELOAD")},
        "model": {"dir": str(args.model), **facts.model_dump()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "notes": args.note, "bandwidth": bandwidth, "order": order,
        "source_sha256": work["source_sha256"],
        "groups": [],
    }
    try:
        for phases in groups(args):
            group = {"phases": phases, "servers": {}}
            result["groups"].append(group)
            for label in order:
                left = args.deadline_s - (time.perf_counter() - t0) if args.deadline_s else None
                if left is not None and left < args.min_group_s:
                    group["servers"][label] = {"label": label, "phases": phases, "results": {},
                                               "error": f"skipped: {left:.0f} s left of "
                                               f"--deadline-s {args.deadline_s:.0f}"}
                    print(f"[{label}] {'+'.join(phases)}: skipped ({left:.0f} s left)",
                          flush=True)
                    continue
                template = args.anchor_cmd if label == "anchor" else \
                    candidate_template(args, phases[0])
                group["servers"][label] = {}
                run_group(label, template, phases, args, work, facts, gpu,
                          group["servers"][label])
                write(result, args.out_dir, args.name)
    except KeyboardInterrupt:
        result["interrupted"] = f"after {time.perf_counter() - t0:.0f} s"
        print(f"interrupted {result['interrupted']}; writing what was measured", flush=True)
    finally:
        write(result, args.out_dir, args.name)
    ok = not result.get("interrupted") and all(
        not s.get("error") for g in result["groups"] for s in g["servers"].values())
    return 0 if ok else 1


LIVE: list[ServerProcess] = []  # started and not yet stopped


def _interrupt(signum, frame) -> None:
    # Kill the live server first: threads blocked on its requests then fail at once instead
    # of holding the interpreter's exit until their deadlines.
    for server in list(LIVE):
        server.kill_now(f"scale.py got signal {signum}")
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
