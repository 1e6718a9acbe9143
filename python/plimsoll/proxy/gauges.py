"""The live gauges of ``/metrics``: one poll of the live state in, Prometheus families out.

Pure: :class:`Poll` is what :class:`~.metrics.Observer` last read (host probe, supervisor,
each worker's status, the tripwire); :func:`gauges` turns it into metric families at scrape
time. The counters and histograms of the request path live in :mod:`.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .state import State

PRESSURE_LEVELS = {"unknown": -1, "normal": 0, "warn": 1, "critical": 2}

#: The disk tier's figures per worker (since that worker started; its status' ``disk``).
DISK_GAUGES = (
    ("on", "1 while on, 0 when off (the worker's status says why)."),
    ("hits", "blocks read back instead of prefilled."),
    ("misses", "lookups that found no usable file."),
    ("corrupt", "files that failed their checks (deleted)."),
    ("bytes_read", "bytes read."),
    ("bytes_written", "bytes written."),
    ("files", "files on disk."),
    ("size_bytes", "bytes on disk."),
    ("cap_bytes", "the cap on bytes on disk."),
)


@dataclass
class Poll:
    """One reading of the live state (what the collector and the dashboard show)."""

    t: float = 0.0
    host: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # supervisor's view
    status: dict[str, dict[str, Any]] = field(default_factory=dict)  # each worker's own
    tripwire: dict[str, Any] = field(default_factory=dict)  # the pressure tripwire's state


#: the worker status's ``speculative`` figures exposed (only where it speculates)
SPECULATIVE_GAUGES = (
    ("proposed", "tokens drafted."),
    ("accepted", "drafted tokens the model accepted."),
    ("acceptance_rate", "accepted / proposed."),
    ("accepted_per_step", "accepted tokens per verifying step (a step yields one more)."),
    ("verify_cost", "what a verifying step costs in plain decode steps, as measured while "
                    "serving."),
    ("draft_cost", "what a sequence's drafts cost in the batch as it runs, in tokens they "
                   "must yield a step (its drafts stop where they yield less)."))


def gauges(p: Poll, trip_count: Callable[[str], int]) -> list[Metric]:
    """The gauges of one poll; ``trip_count(model)`` is the trip counter kept across restarts."""
    out: list[Metric] = []

    def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels)
        out.append(g)
        return g

    h = p.host
    if h:
        for key, doc in (("total_ram_bytes", "Physical RAM the probe sees."),
                         ("ceiling_bytes", "The live hard ceiling (wired limit, cgroup)."),
                         ("budget_bytes", "The current mode's maxLocalLlmGb, in bytes."),
                         ("envelope_bytes", "What all workers' footprints must fit."),
                         ("os_floor_bytes", "What must always stay free for the OS."),
                         ("in_use_bytes", "The probe's host in-use figure.")):
            gauge(f"plimsoll_host_{key}", doc).add_metric([], h[key])
        g = gauge("plimsoll_mode", "1 for the current mode.", ["mode"])
        for m in ("standalone", "clustered"):
            g.add_metric([m], 1.0 if h["mode"] == m else 0.0)
        gauge("plimsoll_pressure_level", "Memory pressure: -1 unknown, 0 normal, 1 warn, "
              "2 critical.").add_metric([], PRESSURE_LEVELS.get(h["pressure"], -1))
        pc = CounterMetricFamily("plimsoll_host_page_outs", "Page-outs since boot.")
        pc.add_metric([], h["page_outs"])
        out.append(pc)
    t = p.tripwire
    if t.get("enabled"):
        gauge("plimsoll_tripwire_level", "The memory-pressure tripwire's level as acted on "
              "(with hysteresis): 0 normal, 1 warn (admission closed), 2 critical "
              "(unloading).").add_metric([], PRESSURE_LEVELS[t["level"]])
        gauge("plimsoll_tripwire_admitting", "1 while the tripwire lets new requests and "
              "loads in.").add_metric([], 1.0 if t["admitting"] else 0.0)
        reading = t.get("reading") or {}
        for key, name, doc in (
                ("some_avg10", "psi_some_avg10", "Linux PSI memory some avg10 (%)."),
                ("full_avg10", "psi_full_avg10", "Linux PSI memory full avg10 (%)."),
                ("darwin_level", "darwin_level", "macOS kern.memorystatus_vm_pressure_"
                 "level (1 normal, 2 warn, 4 critical)."),
                ("page_outs_per_s", "page_outs_per_second", "Pages/s leaving RAM for "
                 "disk between the tripwire's last two readings.")):
            if reading.get(key) is not None:
                gauge(f"plimsoll_pressure_{name}", doc).add_metric([], float(reading[key]))
    state = gauge("plimsoll_worker_state", "1 for each worker's state.", ["model", "state"])
    queue = gauge("plimsoll_queue_length", "Requests waiting: for the model to load "
                  "(proxy) or for pool blocks/slots (worker).", ["model", "where"])
    inflight = gauge("plimsoll_inflight_requests", "Requests relayed now.", ["model"])
    for name, w in sorted(p.workers.items()):
        for s in State:
            state.add_metric([name, str(s)], 1.0 if w["state"] == str(s) else 0.0)
        queue.add_metric([name, "proxy"], w.get("waiting_for_load", 0))
        queue.add_metric([name, "worker"], (p.status.get(name) or {}).get("waiting", 0))
        inflight.add_metric([name], w.get("inflight", 0))
    blocks = gauge("plimsoll_pool_blocks", "KV pool blocks by state: used (live KV), cached "
                   "(prefix cache), free; they sum to total.", ["model", "state"])
    per_model = {k: gauge(f"plimsoll_{k}", doc, ["model"]) for k, doc in (
        ("pool_block_bytes", "Bytes per KV block."),
        ("running_requests", "Sequences decoding in the worker."),
        ("mlx_active_bytes", "MLX active memory of the worker."),
        ("mlx_peak_bytes", "MLX peak memory of the worker."),
        ("mlx_cache_bytes", "MLX buffer cache of the worker."),
        ("worker_rss_bytes", "Resident set of the worker process."),
        ("kv_held_bytes", "KV bytes the engine holds."),
        ("worker_ceiling_bytes", "The ceiling the worker was admitted under."),
        ("allocation_limit_bytes", "u × ceiling: the worker's MLX allocation limit."),
        ("trip_bytes", "min(u + offset, 0.99) × total RAM: the emergency clear."),
        ("gpu_memory_utilization", "u, the admitted fraction of the ceiling."),
        ("admitted_footprint_bytes", "weights + reserve + pool, as admitted."),
        ("weights_bytes", "Model weights, as admitted."),
        ("worker_tripped", "1 while the worker is over its trip point."),
        *((f"disk_tier_{k}", f"Disk tier for KV blocks: {doc}") for k, doc in DISK_GAUGES),
        *((f"speculative_{k}", f"Speculative decoding since the worker started: {doc}")
          for k, doc in SPECULATIVE_GAUGES))}
    trips = CounterMetricFamily("plimsoll_trips", "Emergency clears fired by workers "
                                "(kept across restarts).", labels=["model"])
    out.append(trips)
    for name in sorted(p.workers):
        trips.add_metric([name], trip_count(name))
        st = p.status.get(name)
        if st is None:
            continue
        pool, lim = st.get("pool") or {}, st.get("limits") or {}
        mlx, adm = st.get("mlx") or {}, p.workers[name].get("admitted", {})
        for s in ("total", "used", "cached", "free"):
            blocks.add_metric([name, s], pool.get(s, 0))
        for key, value in (
                ("pool_block_bytes", st.get("block_bytes")),
                ("running_requests", st.get("running")),
                ("mlx_active_bytes", mlx.get("active_bytes")),
                ("mlx_peak_bytes", mlx.get("peak_bytes")),
                ("mlx_cache_bytes", mlx.get("cache_bytes")),
                ("worker_rss_bytes", st.get("rss_bytes")),
                ("kv_held_bytes", st.get("kv_bytes_held")),
                ("worker_ceiling_bytes", lim.get("ceiling_bytes")),
                ("allocation_limit_bytes", lim.get("allocation_limit_bytes")),
                ("trip_bytes", lim.get("trip_bytes")),
                ("gpu_memory_utilization", lim.get("gpu_memory_utilization")),
                ("admitted_footprint_bytes", adm.get("footprint_bytes")),
                ("weights_bytes", adm.get("weights_bytes")),
                ("worker_tripped", 1.0 if st.get("tripped") else 0.0)):
            if value is not None:
                per_model[key].add_metric([name], float(value))
        for k, _ in SPECULATIVE_GAUGES if (spec := st.get("speculative") or {}).get(
                "enabled") else ():
            per_model[f"speculative_{k}"].add_metric([name], float(spec.get(k, 0)))
        if disk := st.get("disk"):
            for k, _ in DISK_GAUGES:
                value = (1.0 if disk.get("state") == "on" else 0.0) if k == "on" else disk.get(k)
                if value is not None:
                    per_model[f"disk_tier_{k}"].add_metric([name], float(value))
    return out
