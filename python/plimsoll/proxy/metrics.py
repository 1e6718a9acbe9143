"""Prometheus ``/metrics`` for the proxy, and the live figures the dashboard reads.

One :class:`Observer` per proxy. It has three sources:

- **live state, read at scrape time** — the host probe (ceiling, total RAM, in-use,
  pressure, page-outs), the policy's budgets, the supervisor's workers and queues, and each
  running worker's ``GET /v1/plimsoll/status`` (pool blocks, MLX memory, RSS, limits,
  trip). A custom collector turns the last poll into gauges; ``/metrics`` polls first.
- **the request path** — :func:`.metrics_edge.observed` wraps the proxy's generate
  endpoint and counts each request by outcome and refusal reason, and times its first
  token and its decode rate (from the relayed SSE events, or a non-streamed answer's ``usage``).
- **the event log** — :class:`ObservedEventLog` sees every supervisor event as it is
  recorded: loads, swaps (a load that evicted another model) and their durations from the
  first eviction or spawn to ``ready``, evictions, crashes, mode changes.

Counters kept by a worker (its trips) reset when the worker restarts; the observer adds
each ended incarnation's last figure to a per-model base, so the exposed counter only
grows. A background sampler polls every ``sample_s`` and keeps the dashboard's timeline
(bounded: ``history_s / sample_s`` points).

The gauges built from a poll are :mod:`.gauges`; the HTTP edge (``GET /metrics`` and the
:func:`~.metrics_edge.observed` wrapper) is :mod:`.metrics_edge`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric

from plimsoll.core.policy import Policy
from plimsoll.core.units import gib_to_bytes

from .events import Event, EventLog
from .gauges import Poll, gauges
from .state import State

log = logging.getLogger("plimsoll.proxy")

STATUS_TIMEOUT_S = 2.0
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
SWAP_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
RECENT_REFUSALS = 50
# codes a worker may send as an SSE error after the stream began that are controlled refusals
MIDSTREAM_REFUSALS = {"memory_trip", "pool_exhausted", "queue_full", "queue_timeout",
                      "prefill_busy", "batch_full", "worker_stopping"}


def outcome_of(status: int) -> str:
    """ok | refused (429, 503: a controlled no) | cancelled (499) | invalid | failed."""
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "refused"
    if status == 499:
        return "cancelled"
    return "invalid" if status < 500 else "failed"


def error_code(body: Any) -> tuple[str, str]:
    """(code, message) of an OpenAI-, Anthropic- or Ollama-shaped error body."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, str):  # Ollama's {"error": "...", "code": ...}
        return str(body.get("code") or "unknown"), err
    if not isinstance(err, dict):
        return "unknown", ""
    code = err.get("code") or err.get("type") or "unknown"
    return str(code), str(err.get("message") or "")


class ObservedEventLog(EventLog):
    """The supervisor's event log, telling the observer about each event as it happens."""

    def __init__(self, on_record: Callable[[Event], None], cap: int = 2000) -> None:
        super().__init__(cap)
        self._on_record = on_record

    def record(self, kind: str, model: str | None = None, **detail: Any) -> Event:
        ev = super().record(kind, model, **detail)
        try:
            self._on_record(ev)
        except Exception:  # metrics must never break a transition
            log.exception("metrics: event %s not counted", kind)
        return ev


class Observer:
    def __init__(self, policy: Policy, *, sample_s: float = 1.0, history_s: float = 600.0):
        self.policy = policy
        self.sample_s = sample_s
        self.events = ObservedEventLog(self.on_event)
        self.registry = CollectorRegistry(auto_describe=True)
        models = sorted(policy.models)
        r = self.registry
        self.requests = Counter("plimsoll_requests", "Requests through the proxy by outcome "
                                "(ok, refused, cancelled, invalid, failed).",
                                ["model", "outcome"], registry=r)
        self.refusals = Counter("plimsoll_refusals", "Refused requests (429/503) by reason "
                                "(the error code).", ["model", "reason"], registry=r)
        self.errors = Counter("plimsoll_errors", "Invalid or failed requests by reason.",
                              ["model", "reason"], registry=r)
        self.ttft = Histogram("plimsoll_time_to_first_token_seconds", "From the request's "
                              "arrival at the proxy to its first generated token (streamed "
                              "requests; includes any model load).", ["model"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.rate = Histogram("plimsoll_tokens_per_second", "Generated tokens per second per "
                              "request (streamed: decode rate after the first token; "
                              "non-streamed: over the whole request).", ["model"],
                              buckets=RATE_BUCKETS, registry=r)
        self.loads = Counter("plimsoll_loads", "Workers brought up (spawned and ready).",
                             ["model"], registry=r)
        self.swaps = Counter("plimsoll_swaps", "Loads that evicted another model first.",
                             ["model"], registry=r)
        self.load_s = Histogram("plimsoll_load_duration_seconds", "From the first eviction "
                                "(or the spawn) to ready, every load.", ["model"],
                                buckets=SWAP_BUCKETS, registry=r)
        self.swap_s = Histogram("plimsoll_swap_duration_seconds", "From the first eviction "
                                "to the new worker ready, swaps only.", ["model"],
                                buckets=SWAP_BUCKETS, registry=r)
        self.evictions = Counter("plimsoll_evictions", "Workers evicted (to load another "
                                 "model or to fit a mode's envelope).", ["model"], registry=r)
        self.crashes = Counter("plimsoll_worker_crashes", "Workers that exited on their own.",
                               ["model"], registry=r)
        self.load_refusals = Counter("plimsoll_load_refusals", "Loads refused by admission.",
                                     ["model"], registry=r)
        self.mode_changes = Counter("plimsoll_mode_changes", "Mode changes applied.",
                                    ["mode"], registry=r)
        self.pressure_trips = Counter("plimsoll_pressure_trips", "Times the memory-pressure "
                                      "tripwire rose to a level (warn, critical).", ["level"],
                                      registry=r)
        self.pressure_unloads = Counter("plimsoll_pressure_unloads", "Workers unloaded by the "
                                        "memory-pressure tripwire.", ["model"], registry=r)
        self.pressure_cancelled = Counter("plimsoll_pressure_cancelled", "Requests waiting "
                                          "for a load, cancelled by the memory-pressure "
                                          "tripwire.", ["model"], registry=r)
        for m in models:
            self.requests.labels(m, "ok")
            for c in (self.loads, self.swaps, self.evictions, self.crashes, self.load_refusals,
                      self.pressure_unloads, self.pressure_cancelled):
                c.labels(m)
            self.ttft.labels(m)
            self.rate.labels(m)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_REFUSALS)
        self.timeline: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(2, int(history_s / sample_s)))
        self.last = Poll()
        self._bringing: dict[str, tuple[float, bool]] = {}  # model → (start, evicted)
        self._trips: dict[str, dict[str, int]] = {}  # model → {"pid", "last", "base"}
        self._sup: Any = None
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    # --- lifecycle ------------------------------------------------------------------------
    def start(self, sup: Any, client: httpx.AsyncClient) -> None:
        self._sup, self._client = sup, client
        self._task = asyncio.create_task(self._sampler(), name="metrics-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sampler(self) -> None:
        while True:
            try:
                self.sample(await self.poll())
            except Exception:
                log.exception("metrics: sample failed; retrying")
            await asyncio.sleep(self.sample_s)

    # --- the event log --------------------------------------------------------------------
    def on_event(self, ev: Event) -> None:
        m, d = ev.model, ev.detail
        if ev.kind == "evict" and m is not None:
            self.evictions.labels(m).inc()
            target = d.get("for_model")
            if target is not None and target not in self._bringing:
                self._bringing[target] = (ev.mono, True)
        elif ev.kind == "spawn" and m is not None:
            self._bringing.setdefault(m, (ev.mono, False))
        elif ev.kind == "ready" and m is not None:
            start, evicted = self._bringing.pop(m, (ev.mono, False))
            self.loads.labels(m).inc()
            self.load_s.labels(m).observe(ev.mono - start)
            if evicted:
                self.swaps.labels(m).inc()
                self.swap_s.labels(m).observe(ev.mono - start)
        elif ev.kind in ("spawn-failed", "refused") and m is not None:
            self._bringing.pop(m, None)
            if ev.kind == "refused":
                self.load_refusals.labels(m).inc()
        elif ev.kind == "crash" and m is not None:
            self.crashes.labels(m).inc()
        elif ev.kind == "mode-change":
            self.mode_changes.labels(str(d.get("new"))).inc()
        elif ev.kind in ("pressure-warn", "pressure-critical"):
            self.pressure_trips.labels(ev.kind.removeprefix("pressure-")).inc()
        elif ev.kind == "pressure-unload" and m is not None:
            self.pressure_unloads.labels(m).inc()
        elif ev.kind == "pressure-cancel" and m is not None:
            self.pressure_cancelled.labels(m).inc()

    # --- the request path -----------------------------------------------------------------
    def finished(self, model: str, status: int, body: Any, *, tokens: int | None = None,
                 ttft_s: float | None = None, rate: float | None = None) -> None:
        outcome = outcome_of(status)
        self.requests.labels(model, outcome).inc()
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
        if rate is not None:
            self.rate.labels(model).observe(rate)
        if outcome in ("ok", "cancelled"):
            return
        code, message = error_code(body)
        (self.refusals if outcome == "refused" else self.errors).labels(model, code).inc()
        if outcome != "refused":  # the dashboard's table lists what its refused counts count
            return
        self.recent.append({"t": time.time(), "model": model, "status": status,
                            "outcome": outcome, "reason": code, "message": message[:1000]})

    # --- live state -----------------------------------------------------------------------
    async def poll(self) -> Poll:
        """Read the host, the supervisor and every running worker's status, now."""
        sup, client = self._sup, self._client
        if sup is None or client is None:
            return self.last
        figures = sup.figures()
        snap = await asyncio.to_thread(sup._snapshot)  # the supervisor's own probe
        host = {
            "platform": snap.platform, "total_ram_bytes": snap.total_ram_bytes,
            "ceiling_bytes": figures.ceiling_bytes, "ceiling_source": snap.ceiling_source,
            "budget_bytes": figures.budget_bytes, "envelope_bytes": sup.envelope(figures),
            "os_floor_bytes": gib_to_bytes(self.policy.os_floor_gb),
            "declared_total_ram_bytes": gib_to_bytes(self.policy.total_ram_gb),
            "budgets": {m: self.policy.budget_bytes(m) for m in ("standalone", "clustered")},
            "in_use_bytes": snap.in_use_bytes, "pressure": snap.pressure,
            "pressure_detail": snap.pressure_detail, "page_outs": snap.page_outs,
            "mode": sup.mode, "source": figures.source,
        }
        workers = {}
        for name, w in sup.workers.items():
            snapw = w.snapshot()
            snapw["waiting_for_load"] = sup.waiting[name]
            workers[name] = snapw
        live = [(n, w.current) for n, w in sup.workers.items()
                if w.state is State.READY and w.current is not None]
        got = await asyncio.gather(*(self._status(client, inc.url, inc.headers)
                                     for _n, inc in live))
        status = {}
        for (name, inc), st in zip(live, got, strict=True):
            if st is not None and st.get("pid") == inc.pid:
                status[name] = st
                self._count_trips(name, inc.pid, st)
        pressure = getattr(sup, "pressure", None)
        tripwire = pressure.snapshot() if pressure is not None else {}
        self.last = Poll(time.time(), host, workers, status, tripwire)
        return self.last

    @staticmethod
    async def _status(client: httpx.AsyncClient, url: str, headers: dict[str, str]
                      ) -> dict[str, Any] | None:
        try:
            r = await client.get(url + "/v1/plimsoll/status", headers=headers,
                                 timeout=STATUS_TIMEOUT_S)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _count_trips(self, model: str, pid: int, st: dict[str, Any]) -> None:
        now = int((st.get("counters") or {}).get("trips", 0))
        acc = self._trips.setdefault(model, {"pid": pid, "last": 0, "base": 0})
        if acc["pid"] != pid:  # a new incarnation: the old one's count is kept
            acc.update(pid=pid, base=acc["base"] + acc["last"], last=0)
        acc["last"] = max(acc["last"], now)

    def trips(self, model: str) -> int:
        acc = self._trips.get(model)
        return acc["base"] + acc["last"] if acc else 0

    def usage(self, p: Poll) -> dict[str, int]:
        """What the workers use now, stacked: weights, live KV, prefix cache, other."""
        weights = kv = cached = rss = footprint = 0
        for name, st in p.status.items():
            adm = p.workers.get(name, {}).get("admitted", {})
            weights += int(adm.get("weights_bytes", 0)) + int(adm.get("draft_weights_bytes", 0))
            footprint += int(adm.get("footprint_bytes", 0))
            pool, bb = st.get("pool") or {}, int(st.get("block_bytes", 0))
            kv += int(pool.get("used", 0)) * bb
            cached += int(pool.get("cached", 0)) * bb
            rss += int(st.get("rss_bytes", 0))
        other = max(0, rss - weights - kv - cached)
        return {"weights_bytes": weights, "live_kv_bytes": kv, "prefix_cache_bytes": cached,
                "other_bytes": other, "workers_rss_bytes": rss,
                "admitted_footprint_bytes": footprint}

    def sample(self, p: Poll) -> None:
        if not p.host:
            return
        self.timeline.append({"t": round(p.t, 3), "host_in_use_bytes": p.host["in_use_bytes"],
                              "budget_bytes": p.host["budget_bytes"],
                              "envelope_bytes": p.host["envelope_bytes"], **self.usage(p)})

    # --- the exposition -------------------------------------------------------------------
    def collect(self) -> list[Metric]:
        """The gauges of the last poll (called by the registry at scrape time)."""
        return gauges(self.last, self.trips)

    def exposition(self) -> bytes:
        return generate_latest(_Both(self.registry, self))


class _Both:
    """The registry's counters and histograms, then the live gauges."""

    def __init__(self, registry: CollectorRegistry, observer: Observer) -> None:
        self.registry, self.observer = registry, observer

    def collect(self):
        yield from self.registry.collect()
        yield from self.observer.collect()


