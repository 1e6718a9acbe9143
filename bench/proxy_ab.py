"""Two versions of the proxy side by side, same moment, same load: ``plimsoll serve`` from
two source trees (``--tree-a``, ``--tree-b``: directories put first on PYTHONPATH), each
with its own worker for the same tiny demo model (policy entry "c" of ``bench/proxy.py``:
context 2048, concurrency 32).

On a shared 2-core box a run's latencies move with the neighbours' load by more than the
proxy costs; two sequential runs compare loads as much as code. Here the two proxies are up
together and measured in alternating bursts (the order flips every round): ``--serial``
non-streamed requests (max_tokens 1) one after another, then ``--in-flight`` (32)
non-streamed requests released together, then 32 streams (max_tokens 64) released together.
Figures per tree: latency p50/p99 (serial, and 32 in flight), time to first chunk and
per-stream mean gap with 32 streams, and each proxy's CPU time (all its threads, psutil)
per request and per streamed token chunk — the cost on the path, less blurred by load —
and per second while both stand idle with their workers ready (``--idle-s`` a round: the
background sampling every request competes with for the GIL).

Run (from the repo root): ``python bench/proxy_ab.py --tree-a /path/to/old/python
--tree-b python``. Traffic goes only to 127.0.0.1; each proxy is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from lib import report
from lib.proxy_streams import burst
from lib.report import spread
from lib.servers import OPENBLAS
from proxy import Proxy, timed_request, write_policy

MODEL = "c"


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _rounds(proxies: dict[str, Proxy], rounds: int, serial: int, n: int, tokens: int,
                  timeout: float, idle_s: float = 0.0) -> dict:
    # idle connections dropped before the server's 5 s keep-alive closes them (no request
    # sent on a connection being closed)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8,
                          keepalive_expiry=4.0)
    clients = {k: httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
               for k in proxies}
    keys = ("serial", "in_flight", "ttft", "mean_gap")
    ms: dict[str, dict[str, list[float]]] = {k: {q: [] for q in keys} for k in proxies}
    cpu = {k: {"serial": 0.0, "in_flight": 0.0, "streams": 0.0, "chunks": 0, "idle": 0.0}
           for k in proxies}
    try:
        for k, p in proxies.items():
            await burst(clients[k], p.url, MODEL, n, False, 1, timeout)  # n warm connections
        for i in range(rounds):
            for k in (("a", "b") if i % 2 == 0 else ("b", "a")):
                url, pid, c = proxies[k].url, proxies[k].proc.pid, clients[k]
                c0 = _cpu_s(pid)
                for _ in range(serial):
                    ms[k]["serial"] += await burst(c, url, MODEL, 1, False, 1, timeout)
                c1 = _cpu_s(pid)
                ms[k]["in_flight"] += await burst(c, url, MODEL, n, False, 1, timeout)
                c2 = _cpu_s(pid)
                streams = await burst(c, url, MODEL, n, True, tokens, timeout)
                c3 = _cpu_s(pid)
                for s in streams:
                    if s["error"] or len(s["times"]) < 2:
                        raise RuntimeError(f"tree {k}: {s['error'] or 'too few chunks'}")
                    arr = s["times"]
                    ms[k]["ttft"].append((arr[0] - s["t_start"]) * 1000)
                    ms[k]["mean_gap"].append((arr[-1] - arr[0]) * 1000 / (len(arr) - 1))
                    cpu[k]["chunks"] += len(arr)
                cpu[k]["serial"] += c1 - c0
                cpu[k]["in_flight"] += c2 - c1
                cpu[k]["streams"] += c3 - c2
            if idle_s > 0:  # both proxies idle over the same window, their workers ready
                before = {k: _cpu_s(p.proc.pid) for k, p in proxies.items()}
                await asyncio.sleep(idle_s)
                for k, p in proxies.items():
                    cpu[k]["idle"] += _cpu_s(p.proc.pid) - before[k]
    finally:
        for c in clients.values():
            await c.aclose()
    out = {}
    for k in proxies:
        out[k] = {q: spread(v) for q, v in ms[k].items()}
        out[k]["cpu_ms_per_serial_request"] = 1000 * cpu[k]["serial"] / (serial * rounds)
        out[k]["cpu_ms_per_in_flight_request"] = 1000 * cpu[k]["in_flight"] / (n * rounds)
        out[k]["cpu_ms_per_chunk"] = 1000 * cpu[k]["streams"] / max(cpu[k]["chunks"], 1)
        if idle_s > 0:
            out[k]["cpu_ms_per_idle_s"] = 1000 * cpu[k]["idle"] / (idle_s * rounds)
    return out


def markdown(res: dict) -> str:
    a, b = res["trees"]["a"], res["trees"]["b"]
    r = res["figures"]

    def row(name: str, q: str, key: str = "p50") -> list[str]:
        x, y = r["a"][q][key], r["b"][q][key]
        return [name, f"{x:.3f} ms", f"{y:.3f} ms", f"{y - x:+.3f} ms"]

    def cpu(name: str, key: str) -> list[str]:
        x, y = r["a"][key], r["b"][key]
        return [name, f"{x:.3f} ms", f"{y:.3f} ms", f"{(y - x) / x:+.0%}"]

    n = res["in_flight"]
    return "\n".join([
        "# Proxy A/B: two source trees side by side", "",
        (f"Run {res['started_utc']} → {res['ended_utc']}, load average at start "
         f"{res['loadavg_start']}, at end {res['loadavg_end']} (1/5/15 min, "
         f"{res['host']['cpus']} CPUs). A = `{a}`, B = `{b}`."), "",
        "Command:", "", "```sh", res["command"], "```", "",
        (f"{res['rounds']} rounds, order alternating; per round and tree: {res['serial']} serial "
         f"requests, {n} requests released together, {n} streams of "
         f"{res['stream_tokens']} tokens released together."), "",
        *report.table(["figure", "A", "B", "B − A"], [
            row("serial request, p50", "serial"), row("serial request, p99", "serial", "p99"),
            row(f"{n} in flight: request p50", "in_flight"),
            row(f"{n} in flight: request p99", "in_flight", "p99"),
            row(f"{n} streams: time to first chunk p50", "ttft"),
            row(f"{n} streams: per-stream mean gap p50", "mean_gap"),
            cpu("proxy CPU per serial request", "cpu_ms_per_serial_request"),
            cpu(f"proxy CPU per request, {n} in flight", "cpu_ms_per_in_flight_request"),
            cpu("proxy CPU per streamed token chunk", "cpu_ms_per_chunk"),
            *([cpu("proxy CPU per second, idle, its worker ready", "cpu_ms_per_idle_s")]
              if "cpu_ms_per_idle_s" in r["a"] else [])]), "",
        "## Host", "", report.host_line(res["host"]), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree-a", required=True, type=Path)
    ap.add_argument("--tree-b", required=True, type=Path)
    ap.add_argument("--models-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "plimsoll-bench-proxy-models")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--serial", type=int, default=20)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds a round both proxies "
                    "stay idle, their workers ready, for their background CPU (0: skip)")
    report.output_args(ap, "proxy-ab")
    args = ap.parse_args(argv)

    from plimsoll.demo.model import build_demo_model

    trees = {"a": str(args.tree_a.resolve()), "b": str(args.tree_b.resolve())}
    res: dict = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "loadavg_start": report.loadavg(), "host": report.host_facts(),
                 "command": report.command(), "trees": trees, "rounds": args.rounds,
                 "serial": args.serial, "in_flight": args.in_flight,
                 "stream_tokens": args.stream_tokens}
    a = build_demo_model(args.models_dir / "tiny-a", preset="tiny", seed=0)
    b = build_demo_model(args.models_dir / "tiny-b", preset="tiny", seed=1)
    proxies: dict[str, Proxy] = {}
    with tempfile.TemporaryDirectory(prefix="plimsoll-bench-proxy-ab-") as td:
        try:
            for k, tree in trees.items():
                tmp = Path(td) / k
                tmp.mkdir()
                env = {key: v for key, v in os.environ.items()
                       if key.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
                env.update(LD_PRELOAD=OPENBLAS, PLIMSOLL_CACHE=str(tmp / "cache"),
                           PYTHONPATH=tree)
                proxies[k] = Proxy(write_policy(tmp, a, b), tmp / "serve.log", env,
                                   args.ready_timeout)
            for p in proxies.values():
                with httpx.Client(timeout=args.request_timeout, trust_env=False) as client:
                    timed_request(client, p.url, MODEL)  # loads c
            res["figures"] = asyncio.run(_rounds(proxies, args.rounds, args.serial,
                                                 args.in_flight, args.stream_tokens,
                                                 args.request_timeout, args.idle_s))
        finally:
            for p in proxies.values():
                left = p.stop()
                if left:
                    print(f"workers outlived a proxy: {left}", file=sys.stderr)
    res["loadavg_end"] = res["host"]["loadavg_end"] = report.loadavg()
    res["ended_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.write(res, args.out_dir, args.name or report.default_name("proxy-ab"), markdown)
    print(json.dumps({k: {q: v.get("p50") if isinstance(v, dict) else v
                          for q, v in f.items()} for k, f in res["figures"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
