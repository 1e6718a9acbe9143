"""Serving benchmark, by hand: the same workload against an anchor server and a candidate.

The anchor is ``mlx_lm.server``; the candidate is plimsoll's worker (through ``plimsoll
launch`` by default). Each server is a command template, started on a free 127.0.0.1 port
with OpenBLAS preloaded, measured, then stopped (process group, verified gone) before the
next starts, so the two never share the machine. Phases, per server:

1. agentic session: ``--turns`` turns, each resending the whole conversation plus a
   ``read_file`` tool call and its answer, about ``--tool-tokens`` tokens of
   standard-library source; ``--max-tokens`` 16,
   temperature 0, streamed. Per turn: prompt/cached tokens (server ``usage``), TTFT, total
   time, peak RSS of the server's process tree (sampled every 50 ms), and, where the server
   has ``GET /v1/plimsoll/status``, MLX active memory and ``kv_bytes_held``. "Needed" is
   weights + one KV copy of the session (prompt tokens × kv_bytes_per_token).
2. single-stream decode: one request for ``--decode-tokens`` new tokens; tokens/s after TTFT.
3. concurrency: ``--streams`` requests at once, ``--stream-tokens`` each; aggregate tokens/s.

Writes bench/results/worker-<preset>.{json,md}; see bench/README.md. Example::

    python bench/agentic.py --model /work/bench-models/qwen3-0.6b --only anchor
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import psutil
from harness_report import markdown, summarise
from harness_server import (
    HOST,
    ServerProcess,
    free_port,
    has_status,
    render,
    rss_sampler,
    served_model,
    server_env,
    status_sampler,
)
from harness_workload import (
    SourceText,
    agentic_session,
    concurrent_streams,
    local_prompt_counter,
    single_decode,
)
from plimsoll.core.model_facts import inspect_model

HERE = Path(__file__).resolve().parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
ANCHOR = "{python} -m mlx_lm server --model {model} --host {host} --port {port}"
CANDIDATE = ("{plimsoll} launch {model} --host {host} --port {port} --concurrency 8 "
             "--context 8192 --max-tokens 256")
STREAM_PROMPT_TOKENS = [96, 160, 224, 288, 352, 416, 480, 544]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/work/bench-models/qwen3-0.6b"))
    p.add_argument("--preset", help="name in the output file (default: from demo-model.json)")
    p.add_argument("--anchor-cmd", default=ANCHOR,
                   help="template; placeholders {python} {plimsoll} {model} {host} {port}")
    p.add_argument("--candidate-cmd", default=CANDIDATE, help="template, as --anchor-cmd")
    p.add_argument("--only", choices=["anchor", "candidate"], help="run one server only")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--tool-tokens", type=int, default=470)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos with the decode request")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of the decode and concurrency phases (median reported)")
    p.add_argument("--preload", default=OPENBLAS, help="LD_PRELOAD for the servers ('' for none)")
    p.add_argument("--status-path", default="/v1/plimsoll/status")
    p.add_argument("--sample-interval", type=float, default=0.05)
    p.add_argument("--status-interval", type=float, default=0.25)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--min-available-gib", type=float, default=1.5,
                   help="kill a server whose run leaves the host less available memory")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--log-dir", type=Path, default=HERE / "out")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="only redo the summary and markdown of an earlier run's JSON")
    return p.parse_args(argv)


def build_workload(args: argparse.Namespace) -> dict:
    source = SourceText(args.model / "tokenizer.json")
    tool_outputs = [source.take_file(args.tool_tokens) for _ in range(args.turns)]
    # A fresh prompt for every repeat, so a prefix cache cannot make a later repeat cheaper.
    decode_prompts = ["Continue this file:\n" + source.take(64) for _ in range(args.repeats)]
    stream_prompt_sets = [[f"Stream {i}. Explain this code:\n"
                           + source.take(STREAM_PROMPT_TOKENS[i % len(STREAM_PROMPT_TOKENS)])
                           for i in range(args.streams)] for _ in range(args.repeats)]
    return {"tool_outputs": tool_outputs, "decode_prompts": decode_prompts,
            "stream_prompt_sets": stream_prompt_sets, "source_sha256": source.digest}


def wait_for_memory(target: int, timeout_s: float = 60.0) -> int:
    """After a server stops, wait until available memory is back near ``target``."""
    deadline = time.monotonic() + timeout_s
    while (avail := psutil.virtual_memory().available) < target and time.monotonic() < deadline:
        time.sleep(1.0)
    return avail


def run_server(label: str, template: str, args: argparse.Namespace, work: dict,
               facts) -> dict:
    port = free_port()
    values = {"python": sys.executable, "model": str(args.model), "host": HOST,
              "port": str(port), "plimsoll": shutil.which("plimsoll")
              or str(Path(sys.executable).with_name("plimsoll"))}
    argv = shlex.split(render(template, values))
    server = ServerProcess(label, argv, server_env(args.preload, strict=True), port,
                           args.log_dir / f"{label}-{port}.log")
    out: dict = {"label": label, "template": template, "argv": argv, "port": port,
                 "log": str(server.log_path), "loadavg_start": os.getloadavg(),
                 "host_available_start": psutil.virtual_memory().available}
    print(f"[{label}] starting: {shlex.join(argv)}", flush=True)
    server.start()
    rss = rss_sampler(server, args.sample_interval,
                      int(args.min_available_gib * 1024**3)).start()
    status = raw_status = None
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        out["rss_after_load"] = rss.window_peaks().get("rss")
        out["status_supported"] = has_status(server.base_url, args.status_path)
        if out["status_supported"]:
            status, raw_status = status_sampler(server.base_url, args.status_path,
                                                args.status_interval)
            status.start().sample_now()
            out["status_at_ready"] = copy.deepcopy(raw_status)
        print(f"[{label}] ready in {out['ready_s']:.1f} s, RSS "
              f"{out['rss_after_load'] / 1e9:.2f} GB, status endpoint: "
              f"{out['status_supported']}", flush=True)
        measure_phases(server, rss, status, args, work, facts, out)
        if raw_status is not None:
            status.sample_now()
            out["status_last"] = copy.deepcopy(raw_status)
    except Exception as err:  # record and move on: the other server still runs
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"[{label}] error: {out['error']}", flush=True)
    finally:
        rss.stop()
        if status is not None:
            status.stop()
        out["stop"] = server.stop()
        out["aborted"] = server.aborted
        out["peaks"] = rss.overall_peaks()
        out["loadavg_end"] = os.getloadavg()
        print(f"[{label}] stopped: {out['stop']}", flush=True)
    return out


def measure_phases(server: ServerProcess, rss, status, args, work: dict, facts,
                   out: dict) -> None:
    model = out["model_id"] = served_model(server.base_url, args.model)
    timeout = args.request_timeout

    def around(turn: int, send) -> dict:
        rss.mark()
        if status:
            status.mark()
        result = send()
        peaks = rss.window_peaks()
        speaks = status.window_peaks() if status else {}
        last = status.last if status else {}
        record = {k: v for k, v in result.items() if not k.startswith("t_")}
        record["peak_rss"] = peaks.get("rss")
        record["procs"] = peaks.get("procs")
        record["mlx_active_peak"] = speaks.get("mlx_active")
        record["mlx_active_end"] = last.get("mlx_active")
        record["mlx_peak_reported"] = last.get("mlx_peak")
        record["kv_bytes_held_peak"] = speaks.get("kv_bytes_held")
        record["kv_bytes_held_end"] = last.get("kv_bytes_held")
        record["status_rss_peak"] = speaks.get("rss_reported")
        if record.get("prompt_tokens") is not None:
            record["needed"] = facts.weights_bytes + record["prompt_tokens"] * \
                facts.kv_bytes_per_token
            if record["peak_rss"]:
                record["rss_over_needed"] = record["peak_rss"] / record["needed"]
        if server.aborted:
            record["error"] = record.get("error") or server.aborted
        print(f"[{server.label}] turn {turn}: prompt {record.get('prompt_tokens')} cached "
              f"{record.get('cached_tokens')} TTFT {record.get('ttft_s')} peak RSS "
              f"{(record['peak_rss'] or 0) / 1e9:.2f} GB"
              + (f" ERROR {record['error']}" if record.get("error") else ""), flush=True)
        return record

    with httpx.Client() as client:
        t = time.perf_counter()
        warm = single_decode(client, server.base_url, model, "Say hello.", 4, False, timeout)
        out["warmup"] = {"s": time.perf_counter() - t, "error": warm.get("error"),
                         "rss_after": rss.window_peaks().get("rss")}  # lazy loaders load here
        out["session"] = agentic_session(client, server.base_url, model, work["tool_outputs"],
                                         args.max_tokens, timeout, around,
                                         local_prompt_counter(args.model))
        out["session_peak_rss"] = max((r["peak_rss"] or 0) for r in out["session"])
        if server.aborted or not server.alive():
            return
        out["decode"] = repeated(rss, [
            lambda p=p: single_decode(client, server.base_url, model, p, args.decode_tokens,
                                      args.ignore_eos, timeout)
            for p in work["decode_prompts"]], "decode_tps", "e2e_tps")
        print(f"[{server.label}] decode: {out['decode'].get('completion_tokens')} tokens, "
              f"{out['decode']['decode_tps_runs']} tok/s {out['decode'].get('error') or ''}",
              flush=True)
    if server.aborted or not server.alive():
        return
    out["concurrent"] = repeated(rss, [
        lambda ps=ps: concurrent_streams(server.base_url, model, ps, args.stream_tokens, timeout)
        for ps in work["stream_prompt_sets"]], "aggregate_tps")
    print(f"[{server.label}] {args.streams} streams: "
          f"{out['concurrent']['aggregate_tps_runs']} tok/s aggregate", flush=True)


def repeated(rss, runs: list, *keys: str) -> dict:
    """Run each callable in turn; the first run's details, and for each of ``keys`` every
    run's value and their median."""
    rss.mark()
    results = [run() for run in runs]
    out = {k: v for k, v in results[0].items() if k != "text" and not k.startswith("t_")}
    for key in keys:
        values = [r[key] for r in results if r.get(key) is not None]
        out[f"{key}_runs"] = values
        out[key] = statistics.median(values) if values else None
    out["peak_rss"] = rss.window_peaks().get("rss")
    return out


def write(result: dict, out_dir: Path) -> Path:
    result["summary"] = summarise(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"worker-{result['model']['preset']}"
    (base.parent / f"{base.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (base.parent / f"{base.name}.md").write_text(markdown(result))
    print(f"wrote {base}.json and {base}.md")
    return base


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        write(json.loads(args.render.read_text()), args.render.parent)
        return 0
    args.model = args.model.resolve()
    facts = inspect_model(args.model)
    meta_file = args.model / "demo-model.json"
    preset = args.preset or (json.loads(meta_file.read_text()).get("preset")
                             if meta_file.exists() else args.model.name)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    work = build_workload(args)
    plan = [("anchor", args.anchor_cmd), ("candidate", args.candidate_cmd)]
    plan = [(label, cmd) for label, cmd in plan if args.only in (None, label)]
    servers: dict[str, dict] = {}
    baseline = psutil.virtual_memory().available
    for label, template in plan:
        if servers:
            wait_for_memory(baseline - 512 * 1024**2)
        servers[label] = run_server(label, template, args, work, facts)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "started": started,
        "host": {"cpus": os.cpu_count(), "total_ram": psutil.virtual_memory().total,
                 "python": sys.version.split()[0], "mlx": version("mlx"),
                 "mlx_lm": version("mlx-lm"), "ld_preload": args.preload},
        "model": {"dir": str(args.model), "preset": preset, **facts.model_dump()},
        "workload": {"turns": args.turns, "tool_tokens": args.tool_tokens,
                     "max_tokens": args.max_tokens, "decode_tokens": args.decode_tokens,
                     "ignore_eos": args.ignore_eos, "streams": args.streams,
                     "stream_tokens": args.stream_tokens, "repeats": args.repeats,
                     "source_sha256": work["source_sha256"]},
        "servers": servers,
    }
    write(result, args.out_dir)
    return 0 if all(not s.get("error") for s in servers.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
