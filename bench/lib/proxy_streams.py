"""The proxy's added time with 32 requests in flight: the same worker, direct and through
``plimsoll serve``, in interleaved rounds (``bench/proxy.py``'s concurrent phase).

Each round, for each target in turn (the order alternates every round): ``n`` non-streamed
chat requests (max_tokens 1) released together, then ``n`` streamed ones (max_tokens
``tokens``) released together, each on its own kept-alive connection of one asyncio client
per target (opened in a warm-up burst, so no round pays a connection). Per request: latency;
per stream: time to first token chunk, the gaps between token chunks, the mean gap
((last − first) ÷ (chunks − 1)) and the whole stream. The proxy's CPU time (all its threads,
psutil) over its bursts, divided by its requests and its token chunks, is the cost that the
2-core box's load does not blur as much as latencies.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import psutil

from .report import spread
from .workloads import async_stream

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]


def _body(model: str, max_tokens: int) -> dict:
    return {"model": model, "messages": MSG, "max_tokens": max_tokens, "temperature": 0}


async def _request(client: httpx.AsyncClient, url: str, body: dict, go: asyncio.Event) -> float:
    await go.wait()
    t0 = time.perf_counter()
    r = await client.post(url + CHAT, json={**body, "stream": False})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    if not r.json().get("choices"):
        raise RuntimeError(f"no choices from {url}: {r.text[:300]}")
    return dt * 1000


async def _released(coros: list) -> list:
    """Start every coroutine, then release them together (each waits on ``go``)."""
    tasks = [asyncio.create_task(c) for c in coros]
    await asyncio.sleep(0.05)
    return tasks


async def burst(client: httpx.AsyncClient, url: str, model: str, n: int, stream: bool,
                 tokens: int, timeout_s: float) -> list:
    """``n`` requests released together on ``client``: latencies (ms), or stream records."""
    go = asyncio.Event()
    if stream:
        coros = [async_stream(client, url + CHAT, _body(model, tokens), go, timeout_s)
                 for _ in range(n)]
    else:
        coros = [_request(client, url, _body(model, 1), go) for _ in range(n)]
    tasks = await _released(coros)
    go.set()
    return list(await asyncio.gather(*tasks))


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _run(targets: dict[str, str], headers: dict[str, dict[str, str]], model: str,
               proxy_pid: int, n: int, rounds: int, tokens: int, timeout_s: float) -> dict:
    # idle connections dropped before the server's 5 s keep-alive closes them (no request
    # sent on a connection being closed)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8,
                          keepalive_expiry=4.0)
    clients = {k: httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers.get(k),
                                    trust_env=False) for k in targets}
    lat: dict[str, list[float]] = {k: [] for k in targets}
    ttft: dict[str, list[float]] = {k: [] for k in targets}
    gaps: dict[str, list[float]] = {k: [] for k in targets}
    mean_gap: dict[str, list[float]] = {k: [] for k in targets}
    total: dict[str, list[float]] = {k: [] for k in targets}
    errors: list[str] = []
    cpu = {"requests": 0.0, "streams": 0.0, "n_requests": 0, "n_chunks": 0}
    try:
        for k, url in targets.items():  # warm: n connections each, kept alive
            await burst(clients[k], url, model, n, False, 1, timeout_s)
        for i in range(rounds):
            for k in (("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")):
                c0 = _cpu_s(proxy_pid)
                lat[k] += await burst(clients[k], targets[k], model, n, False, 1, timeout_s)
                c1 = _cpu_s(proxy_pid)
                streams = await burst(clients[k], targets[k], model, n, True, tokens,
                                       timeout_s)
                c2 = _cpu_s(proxy_pid)
                chunks = 0
                for s in streams:
                    if s["error"] or not s["times"]:
                        errors.append(f"{k}: {s['error'] or 'no token chunks'}")
                        continue
                    arr = [(t - s["t_start"]) * 1000 for t in s["times"]]
                    chunks += len(arr)
                    ttft[k].append(arr[0])
                    total[k].append((s["t_end"] - s["t_start"]) * 1000)
                    gaps[k].extend(b - a for a, b in itertools.pairwise(arr))
                    if len(arr) > 1:
                        mean_gap[k].append((arr[-1] - arr[0]) / (len(arr) - 1))
                if k == "proxy":
                    cpu["requests"] += c1 - c0
                    cpu["streams"] += c2 - c1
                    cpu["n_requests"] += n
                    cpu["n_chunks"] += chunks
    finally:
        for c in clients.values():
            await c.aclose()

    def figure(d: dict[str, list[float]]) -> dict:
        q = {k: spread(v) for k, v in d.items()}
        added = ({p: q["proxy"][p] - q["direct"][p] for p in ("p50", "p99")}
                 if q["proxy"]["n"] and q["direct"]["n"] else None)
        return {"ms": q, "added_ms": added}

    return {
        "in_flight": n, "rounds": rounds, "stream_max_tokens": tokens,
        "request": figure(lat), "stream_ttft": figure(ttft), "chunk_gap": figure(gaps),
        "stream_mean_gap": figure(mean_gap), "stream_total": figure(total),
        "proxy_cpu_ms_per_request": (1000 * cpu["requests"] / cpu["n_requests"]
                                     if cpu["n_requests"] else None),
        "proxy_cpu_ms_per_chunk": (1000 * cpu["streams"] / cpu["n_chunks"]
                                   if cpu["n_chunks"] else None),
        "errors": errors[:10], "n_errors": len(errors),
    }


def concurrent_phase(targets: dict[str, str], headers: dict[str, dict[str, str]], model: str,
                     proxy_pid: int, *, n: int = 32, rounds: int = 6, tokens: int = 64,
                     timeout_s: float = 120.0) -> dict:
    """The module docstring's measurement; ``targets`` maps "direct" and "proxy" to URLs."""
    return asyncio.run(_run(targets, headers, model, proxy_pid, n, rounds, tokens, timeout_s))
