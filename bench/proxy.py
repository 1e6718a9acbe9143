"""What the swapping proxy costs: ``plimsoll serve`` against its own worker, same run.

Builds (or reuses) two tiny demo models "a" and "b" (seeds 0 and 1)
and a policy in which they cannot be co-resident (context 32768, concurrency 4: ~305 MiB
admitted each, standalone envelope 0.5 GiB — as in python/tests/proxy/test_proxy.py), then runs
``R`` rounds (default 5). Each round starts a fresh ``python -m plimsoll.cli serve`` on a free
127.0.0.1 port (own process group, OpenBLAS preloaded, ``--swap-hold 0 --idle-ttl 0``) and:

1. **cold load** — the first request of that proxy, for "b" with nothing loaded: time from
   sending a streamed chat request (max_tokens 1) to its first content chunk;
2. (round 0 only) **overhead**: one warm-up request, the worker's URL from ``GET /running``,
   then, interleaved (order alternating every iteration), N (200) non-streamed chat
   requests (max_tokens 1) direct to the worker and through the proxy — per-request latency;
   then S (20) streamed requests (max_tokens 64) each way — gaps between
   consecutive content chunks as the client sees them, and time to first chunk;
3. (round 0 only) **32 in flight** (``--in-flight``): a third policy entry "c" (model b's
   directory, context 2048, concurrency 32) is loaded, then ``--concurrent-rounds`` interleaved
   rounds of 32 non-streamed requests released together and 32 streams released together,
   direct and through the proxy (:mod:`lib.proxy_streams`), with the proxy's CPU time per
   request and per token chunk;
4. **swap** — a request for "a" (loads it, evicting "b"), then the same timed request for
   "b": unload of a + verified release + load of b + first token. The proxy's events
   (evict/exit/release-verified/spawn/ready) give the breakdown.

It then stops the proxy (SIGTERM to its pid, wait; SIGKILL to that pid after 60 s; any
worker pid it left behind is reported and SIGTERMed by pid). Figures: p50/p99 each way and
the added p50/p99 (proxy − direct; for chunk gaps the difference of the quantiles of two
unpaired distributions), the median swap and cold times over the rounds and their ratio.
Targets: added p50 per request ≤ 1 ms (serial, and with 32 in flight); swap/cold ≤ 1.2.

Direct requests carry the worker's secret (a worker answers only its launcher,
:mod:`plimsoll.web.worker_secret`): the bench reads it from the environment of the worker
process its own proxy started (``/proc/PID/environ``, same user), and sends it only there.

Writes ``--out-dir``/``--name``.{json,md}. Run (from the repo root): ``python bench/proxy.py``.
Every request has a timeout, every wait a deadline; traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from lib import report
from lib.proxy_streams import concurrent_phase
from lib.report import spread
from lib.servers import HOST, OPENBLAS, free_port
from lib.workloads import timed_stream

MSG = [{"role": "user", "content": "hello there"}]


class Proxy:
    """A real ``plimsoll serve``; ``stop()`` is safe to call more than once."""

    def __init__(self, policy: Path, log: Path, env: dict[str, str], ready_timeout: float):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [sys.executable, "-m", "plimsoll.cli", "serve", "--policy", str(policy),
                    "--host", HOST, "--port", str(self.port), "--swap-hold", "0",
                    "--idle-ttl", "0", "--admin-token-file", str(policy.parent / "token")]
        self.log = log
        self.http = httpx.Client(timeout=60, trust_env=False)
        self.worker_pids: set[int] = set()
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{log.read_text()}")
            try:
                if self.http.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve not up in time:\n" + log.read_text()[-4000:])
            time.sleep(0.1)

    def running(self) -> dict:
        r = self.http.get(self.url + "/running", timeout=30)
        r.raise_for_status()
        out = r.json()
        self.worker_pids |= {w["pid"] for w in out["workers"] if w.get("pid")}
        return out

    def worker(self, model: str) -> dict:
        return next(w for w in self.running()["workers"] if w["model"] == model)

    def last_seq(self) -> int:
        ev = self.running()["events"]
        return ev[-1]["seq"] if ev else 0

    def stop(self) -> list[int]:
        """SIGTERM to the proxy's pid, wait; returns worker pids still alive afterwards."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            self.running()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # this pid only
                self.proc.wait(30)
        self.http.close()
        left = []
        for pid in sorted(self.worker_pids):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b"plimsoll" in cmdline and stat != "Z":
                left.append(pid)
                os.kill(pid, signal.SIGTERM)  # by pid: a worker this run's proxy spawned
        return left


def worker_headers(pid: int) -> dict[str, str]:
    """The header the worker process ``pid`` requires (its secret), from its environment."""
    from plimsoll.web.worker_secret import HEADER, SECRET_ENV

    prefix = SECRET_ENV.encode() + b"="
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(prefix):
            return {HEADER: item[len(prefix):].decode()}
    return {}


def ready_worker(proxy: Proxy, model: str) -> dict:
    worker = proxy.worker(model)
    if worker.get("state") != "ready" or not worker.get("url"):
        raise RuntimeError(f"worker for {model} not ready: {worker}")
    if not worker["url"].startswith(f"http://{HOST}:"):
        raise RuntimeError(f"worker URL is not on {HOST}: {worker['url']}")
    return worker


def chat_body(model: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": MSG, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    return body


def timed_request(client: httpx.Client, url: str, model: str) -> float:
    """One non-streamed chat completion (max_tokens 1); seconds."""
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=chat_body(model, 1, False))
    dt = time.perf_counter() - t0
    r.raise_for_status()
    if not r.json().get("choices"):
        raise RuntimeError(f"no choices from {url}: {r.text[:300]}")
    return dt


def streamed(client: httpx.Client, url: str, model: str, max_tokens: int,
             deadline_s: float) -> tuple[float, list[float]]:
    """A streamed chat completion; (seconds to the first token chunk, chunk arrival times
    relative to the send)."""
    r = timed_stream(url, chat_body(model, max_tokens, True), deadline_s, client=client)
    if r["error"]:
        raise RuntimeError(f"{url}: {r['error']}")
    if not r["times"]:
        raise RuntimeError(f"no content chunks from {url}")
    arrivals = [t - r["t_start"] for t in r["times"]]
    return arrivals[0], arrivals


def first_token(client: httpx.Client, url: str, model: str, deadline_s: float) -> float:
    return streamed(client, url, model, 1, deadline_s)[0]


def swap_breakdown(events: list[dict], out_model: str, in_model: str) -> dict:
    """Wall-clock stages of a swap from the proxy's events (seconds from the eviction)."""
    t = {}
    for e in events:
        key = (e["kind"], e["model"])
        if key in {("evict", out_model), ("exit", out_model), ("release-verified", out_model),
                   ("spawn", in_model), ("ready", in_model)} and key not in t:
            t[key] = e["t"]
    if ("evict", out_model) not in t:
        return {"kinds": [(e["kind"], e["model"]) for e in events]}
    t0 = t[("evict", out_model)]
    return {f"{k}:{m}": round(v - t0, 4) for (k, m), v in t.items()}


def overhead_phase(proxy: Proxy, model: str, n: int, s: int, stream_tokens: int,
                   timeout: float) -> dict:
    worker = ready_worker(proxy, model)
    wurl = worker["url"]
    targets = {"direct": wurl, "proxy": proxy.url}
    headers = {"direct": worker_headers(worker["pid"]), "proxy": {}}
    clients = {k: httpx.Client(timeout=timeout, trust_env=False, headers=headers[k])
               for k in targets}
    try:
        for k, u in targets.items():  # one keep-alive connection each, warmed
            timed_request(clients[k], u, model)
        lat: dict[str, list[float]] = {"direct": [], "proxy": []}
        for i in range(n):
            for k in (("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")):
                lat[k].append(timed_request(clients[k], targets[k], model) * 1000)
        gaps: dict[str, list[float]] = {"direct": [], "proxy": []}
        ttft: dict[str, list[float]] = {"direct": [], "proxy": []}
        chunks: dict[str, list[int]] = {"direct": [], "proxy": []}
        span: dict[str, list[float]] = {"direct": [], "proxy": []}
        for i in range(s):
            for k in (("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")):
                first, arr = streamed(clients[k], targets[k], model, stream_tokens, timeout)
                ttft[k].append(first * 1000)
                gaps[k].extend((b - a) * 1000 for a, b in itertools.pairwise(arr))
                chunks[k].append(len(arr))
                if len(arr) > 1:  # immune to chunks being coalesced on the way
                    span[k].append((arr[-1] - arr[0]) * 1000 / (len(arr) - 1))
    finally:
        for c in clients.values():
            c.close()
    req = {k: spread(v) for k, v in lat.items()}
    gap = {k: spread(v) for k, v in gaps.items()}
    first = {k: spread(v) for k, v in ttft.items()}
    per = {k: spread(v) for k, v in span.items()}
    return {
        "worker_url": wurl, "worker_pid": worker.get("pid"), "n_requests": n,
        "n_streams": s, "stream_max_tokens": stream_tokens,
        "request_ms": req,
        "request_added_ms": {q: req["proxy"][q] - req["direct"][q] for q in ("p50", "p99")},
        "chunk_gap_ms": gap,
        "chunk_gap_added_ms": {q: gap["proxy"][q] - gap["direct"][q] for q in ("p50", "p99")},
        "stream_ttft_ms": first,
        "stream_mean_gap_ms": per,
        "stream_mean_gap_added_ms": {q: per["proxy"][q] - per["direct"][q]
                                     for q in ("p50", "p99")},
        "stream_ttft_added_ms": {q: first["proxy"][q] - first["direct"][q]
                                 for q in ("p50", "p99")},
        "chunks_per_stream": {k: spread([float(x) for x in v]) for k, v in chunks.items()},
        "chunk_gaps_under_1ms": {k: sum(g < 1.0 for g in v) for k, v in gaps.items()},
        "raw_request_ms": lat, "raw_chunk_gap_ms": gaps,
    }


def in_flight_phase(proxy: Proxy, n: int, rounds: int, tokens: int, timeout: float) -> dict:
    """Model "c" loaded (it evicts b), then :func:`lib.proxy_streams.concurrent_phase`."""
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        timed_request(client, proxy.url, "c")
    worker = ready_worker(proxy, "c")
    out = concurrent_phase({"direct": worker["url"], "proxy": proxy.url},
                           {"direct": worker_headers(worker["pid"])}, "c", proxy.proc.pid,
                           n=n, rounds=rounds, tokens=tokens, timeout_s=timeout)
    out["admitted_concurrency"] = (worker.get("admitted") or {}).get("concurrency")
    proxy.http.post(proxy.url + "/unload/c", timeout=60).raise_for_status()  # swaps: a ↔ b
    if out["n_errors"]:
        raise RuntimeError(f"{out['n_errors']} failed streams with {n} in flight: "
                           f"{out['errors'][:3]}")
    return out


def write_policy(tmp: Path, a: Path, b: Path) -> Path:
    big = {"context": 32768, "maxTokens": 1024, "concurrency": 4}
    wide = {"context": 2048, "maxTokens": 256, "concurrency": 32}  # 32 in flight
    policy = tmp / "policy.json"
    policy.write_text(json.dumps({
        "schemaVersion": 1, "host": "bench", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 0.5}, "clustered": {"maxLocalLlmGb": 1}},
        "models": {"a": {"path": str(a), **big}, "b": {"path": str(b), **big},
                   "c": {"path": str(b), **wide}},
    }))
    (tmp / "token").write_text("bench-admin-token\n")
    os.chmod(tmp / "token", 0o600)
    return policy


def fmt(x: float | None, unit: str = "ms", nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}f} {unit}".strip()


def markdown(res: dict) -> str:
    o, sw, c = res.get("overhead") or {}, res["swap"], res.get("in_flight") or {}
    lines = ["# Proxy overhead and swap time", "",
             (f"Run {res['started_utc']} → {res['ended_utc']}. On a shared machine small "
              f"differences are noise: load average at start {res['loadavg_start']}, at end "
              f"{res['loadavg_end']} (1/5/15 min, {res['host']['cpus']} CPUs)."), "",
             "Command:", "", "```sh", res["command"], "```", ""]
    if o:
        def row(name: str, q: dict, added: dict, bold: bool = True) -> list[str]:
            mark = "**" if bold else ""
            return [name, fmt(q["direct"]["p50"]), fmt(q["proxy"]["p50"]),
                    f"{mark}{fmt(added['p50'])}{mark}", fmt(q["direct"]["p99"]),
                    fmt(q["proxy"]["p99"]), fmt(added["p99"])]

        g = o["chunk_gap_ms"]
        lines += [
            (f"## Overhead: same worker, same run, interleaved (tiny demo model \"b\", "
             f"{o['n_requests']} requests and {o['n_streams']} streams each way)"), "",
            *report.table(
                ["measure", "direct p50", "proxy p50", "added p50", "direct p99", "proxy p99",
                 "added p99"],
                [row("chat completion, max_tokens 1 (per request)", o["request_ms"],
                     o["request_added_ms"]),
                 row(f"streamed, max_tokens {o['stream_max_tokens']}: gap between chunks "
                     f"(n = {g['direct']['n']} / {g['proxy']['n']})", g,
                     o["chunk_gap_added_ms"]),
                 row("streamed: per-stream mean gap, (last − first chunk) ÷ (chunks − 1)",
                     o["stream_mean_gap_ms"], o["stream_mean_gap_added_ms"]),
                 row("streamed: time to first chunk", o["stream_ttft_ms"],
                     o["stream_ttft_added_ms"], bold=False)]), "",
            ("Added = proxy − direct of each quantile (for chunk gaps: of two unpaired "
             "distributions). Client: httpx, one keep-alive connection per target. "
             f"Chunks per stream: {o['chunks_per_stream']['direct']['p50']:.0f} direct, "
             f"{o['chunks_per_stream']['proxy']['p50']:.0f} proxy (median); gaps under 1 ms "
             f"(chunks arriving together): {o['chunk_gaps_under_1ms']['direct']} direct, "
             f"{o['chunk_gaps_under_1ms']['proxy']} proxy."), ""]

    if c:
        def crow(name: str, f: dict, bold: bool = False) -> list[str]:
            q, added, mark = f["ms"], f["added_ms"] or {}, "**" if bold else ""
            return [name, fmt(q["direct"].get("p50")), fmt(q["proxy"].get("p50")),
                    f"{mark}{fmt(added.get('p50'))}{mark}", fmt(q["direct"].get("p99")),
                    fmt(q["proxy"].get("p99")), fmt(added.get("p99"))]

        lines += [
            (f"## {c['in_flight']} in flight: same worker (model \"c\", admitted concurrency "
             f"{c['admitted_concurrency']}), {c['rounds']} interleaved rounds"), "",
            *report.table(
                ["measure", "direct p50", "proxy p50", "added p50", "direct p99", "proxy p99",
                 "added p99"],
                [crow(f"chat completion, max_tokens 1, {c['in_flight']} released together "
                      f"(per request, n = {c['request']['ms']['proxy']['n']} each way)",
                      c["request"], bold=True),
                 crow(f"{c['in_flight']} streams, max_tokens {c['stream_max_tokens']}: time "
                      "to first chunk", c["stream_ttft"]),
                 crow("streams: gap between chunks", c["chunk_gap"]),
                 crow("streams: per-stream mean gap", c["stream_mean_gap"], bold=True),
                 crow("streams: whole stream", c["stream_total"])]), "",
            (f"Proxy CPU time (all its threads, background sampling included): "
             f"{fmt(c['proxy_cpu_ms_per_request'])} per non-streamed request, "
             f"{fmt(c['proxy_cpu_ms_per_chunk'])} per streamed token chunk. Client: one "
             f"asyncio httpx client per target, {c['in_flight']} kept-alive connections "
             "each."), ""]

    def col(key: str, i: int) -> float | None:
        xs = sw.get(key) or []
        return xs[i] if i < len(xs) else None

    def med(key: str) -> float | None:
        xs = sw.get(key) or []
        return statistics.median(xs) if xs else None

    cols = ("cold_s", "cold_spawn_to_ready_s", "swap_s", "swap_release_wait_s",
            "swap_spawn_to_ready_s")
    rounds = [[i, *(fmt(col(k, i), "s") for k in cols)]
              for i in range(max(len(sw["cold_s"]), len(sw["swap_s"])))]
    lines += ["## Swap vs cold load (model \"b\", time from the request to its first token)", "",
              *report.table(["round", "cold load of b (fresh proxy, nothing loaded)",
                             "of which spawn → ready",
                             "swap a → b (unload + verified release + load)",
                             "of which exit of a → release verified", "of which spawn → ready"],
                            [*rounds, ["**median**", *(f"**{fmt(med(k), 's')}**" for k in cols)]]),
              ""]
    if sw.get("breakdown"):
        lines += ["Swap stages from the proxy's events (seconds after the eviction decision, "
                  "median over rounds): " + ", ".join(
                      f"{k} {v:.3f}" for k, v in sw["breakdown_median"].items()), ""]
    t = res["targets"]
    lines += ["## Against the targets", "", *report.table(["target", "figure", "met"], [
        ["proxy added p50 per request ≤ 1 ms (serial)", fmt(t["added_p50_ms"]),
         t["added_p50_ok"]],
        ["proxy added p50 per request ≤ 1 ms (32 in flight)",
         fmt(t.get("added_p50_in_flight_ms")), t.get("added_p50_in_flight_ok")],
        ["swap / cold ≤ 1.2", fmt(t["swap_over_cold"], "×"), t["swap_over_cold_ok"]]]), ""]
    if res.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in res["errors"]] + [""]
    lines += ["## Host", "", report.host_line(res["host"]),
              ("Proxy flags: `--swap-hold 0 --idle-ttl 0` (no anti-thrash hold, no idle unload "
               "during the run); policy: a, b context 32768, concurrency 4, standalone "
               "envelope 0.5 GiB (they cannot be co-resident); c (b's weights) context 2048, "
               "concurrency 32, unloaded after its phase."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "plimsoll-bench-proxy-models")
    ap.add_argument("--n", type=int, default=200, help="non-streamed requests each way")
    ap.add_argument("--streams", type=int, default=20, help="streamed requests each way")
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="cold loads and swaps")
    ap.add_argument("--in-flight", type=int, default=32, help="requests in flight at once "
                    "in the concurrent phase (0: skip it)")
    ap.add_argument("--concurrent-rounds", type=int, default=6)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    report.output_args(ap, "proxy")
    args = ap.parse_args(argv)

    from plimsoll.demo.model import build_demo_model

    res: dict = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "loadavg_start": report.loadavg(), "host": report.host_facts(),
                 "command": report.command(), "errors": [],
                 "overhead": None, "in_flight": None}
    a = build_demo_model(args.models_dir / "tiny-a", preset="tiny", seed=0)
    b = build_demo_model(args.models_dir / "tiny-b", preset="tiny", seed=1)
    res["models"] = {"a": str(a), "b": str(b)}
    env = dict(os.environ)
    if os.path.exists(OPENBLAS):  # the CPU box's; a GPU host has none
        env["LD_PRELOAD"] = OPENBLAS
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(k, None)
    cold: list[float] = []
    swap: list[float] = []
    breakdowns: list[dict] = []
    cold_loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="plimsoll-bench-proxy-") as td:
        tmp = Path(td)
        env["PLIMSOLL_CACHE"] = str(tmp / "cache")
        policy = write_policy(tmp, a, b)
        for rnd in range(args.rounds):
            proxy = None
            try:
                proxy = Proxy(policy, tmp / f"serve-{rnd}.log", env, args.ready_timeout)
                client = httpx.Client(timeout=args.request_timeout, trust_env=False)
                try:
                    cold.append(first_token(client, proxy.url, "b", args.request_timeout))
                    ev = {(e["kind"], e["model"]): e["t"] for e in proxy.running()["events"]}
                    if ("spawn", "b") in ev and ("ready", "b") in ev:
                        cold_loads.append(ev[("ready", "b")] - ev[("spawn", "b")])
                    if rnd == 0:
                        timed_request(client, proxy.url, "b")  # warm
                        res["overhead"] = overhead_phase(proxy, "b", args.n, args.streams,
                                                         args.stream_tokens,
                                                         args.request_timeout)
                        if args.in_flight:
                            res["in_flight"] = in_flight_phase(
                                proxy, args.in_flight, args.concurrent_rounds,
                                args.stream_tokens, args.request_timeout)
                    timed_request(client, proxy.url, "a")  # a in, b out
                    if proxy.worker("b")["state"] != "stopped":
                        raise RuntimeError("b still loaded beside a: the policy lets them "
                                           "share the envelope")
                    mark = proxy.last_seq()
                    swap.append(first_token(client, proxy.url, "b", args.request_timeout))
                    ev = [e for e in proxy.running()["events"] if e["seq"] > mark]
                    breakdowns.append(swap_breakdown(ev, "a", "b"))
                finally:
                    client.close()
            except Exception as e:
                res["errors"].append(f"round {rnd}: {type(e).__name__}: {e}"[:2000])
            finally:
                if proxy is not None:
                    left = proxy.stop()
                    if left:
                        res["errors"].append(f"round {rnd}: workers outlived the proxy: {left}")
            print(f"round {rnd}: cold {cold[-1:]} swap {swap[-1:]} errors "
                  f"{len(res['errors'])}", flush=True)
    res["loadavg_end"] = res["host"]["loadavg_end"] = report.loadavg()
    res["ended_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cm = statistics.median(cold) if cold else None
    sm = statistics.median(swap) if swap else None
    keys = sorted({k for d in breakdowns for k in d if k != "kinds"})
    res["swap"] = {"cold_s": cold, "swap_s": swap, "cold_median_s": cm, "swap_median_s": sm,
                   "breakdown": breakdowns, "cold_spawn_to_ready_s": cold_loads,
                   "swap_spawn_to_ready_s": [d["ready:b"] - d["spawn:b"] for d in breakdowns
                                             if "ready:b" in d and "spawn:b" in d],
                   "swap_release_wait_s": [d["release-verified:a"] - d["exit:a"]
                                           for d in breakdowns
                                           if "release-verified:a" in d and "exit:a" in d],
                   "breakdown_median": dict(sorted(
                       ((k, statistics.median(d[k] for d in breakdowns if k in d))
                        for k in keys), key=lambda kv: kv[1]))}
    added = res["overhead"]["request_added_ms"]["p50"] if res["overhead"] else None
    ratio = sm / cm if cm and sm else None
    conc = (res["in_flight"] or {}).get("request", {}).get("added_ms") or {}
    res["targets"] = {"added_p50_in_flight_ms": conc.get("p50"),
                      "added_p50_in_flight_ok": conc.get("p50") is not None
                      and conc["p50"] <= 1.0,
                      "added_p50_ms": added,
                      "added_p50_ok": added is not None and added <= 1.0,
                      "swap_over_cold": ratio,
                      "swap_over_cold_ok": ratio is not None and ratio <= 1.2}
    report.write(res, args.out_dir, args.name or report.default_name("proxy"), markdown)
    print(json.dumps({"targets": res["targets"], "errors": res["errors"]}, indent=2))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
