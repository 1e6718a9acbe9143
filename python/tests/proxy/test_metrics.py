"""Prometheus ``/metrics`` on a real proxy, parsed with prometheus-client's own parser.

Models "a" and "b" are the tiny demo model with a large context (~373 MiB admitted each):
they cannot share the 512 MiB standalone envelope, so a request to "b" after "a" is a swap.
"huge" claims a 4 MiB/token KV cache and is refused by admission before anything loads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import MSG, Proxy, chat

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def proxy(tiny_model, tmp_path_factory) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("metrics")
    huge = tmp / "huge"
    shutil.copytree(tiny_model, huge)
    cfg = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**cfg, "head_dim": 65536}))
    big = {"context": 32768, "maxTokens": 1024, "concurrency": 4}
    (tmp / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        # a reserve whose compute part holds a prefill chunk at the whole 32k context
        "transientReserve": 0.2,
        "modes": {"standalone": {"maxLocalLlmGb": 0.5}, "clustered": {"maxLocalLlmGb": 1}},
        "models": {"a": {"path": str(tiny_model), **big}, "b": {"path": str(tiny_model), **big},
                   "huge": {"path": str(huge), "context": 4096, "maxTokens": 256}},
    }))
    (tmp / "token").write_text("admin-secret\n")
    p = Proxy(["--policy", str(tmp / "policy.json"), "--admin-token-file", str(tmp / "token"),
               "--swap-hold", "0"], tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "cache")})
    yield p
    assert not p.stop()


def scrape(proxy: Proxy) -> dict[tuple[str, tuple], float]:
    r = httpx.get(proxy.url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(samples, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_host_mode_and_workers_before_any_request(proxy):
    m = scrape(proxy)
    assert get(m, "plimsoll_host_budget_bytes") == 512 * MIB
    assert get(m, "plimsoll_host_os_floor_bytes") == 4 * 1024 * MIB
    assert get(m, "plimsoll_host_ceiling_bytes") > 0
    assert get(m, "plimsoll_host_total_ram_bytes") >= get(m, "plimsoll_host_ceiling_bytes")
    assert 0 < get(m, "plimsoll_host_envelope_bytes") <= 512 * MIB
    assert get(m, "plimsoll_mode", mode="standalone") == 1
    assert get(m, "plimsoll_mode", mode="clustered") == 0
    assert get(m, "plimsoll_pressure_level") in (-1, 0, 1, 2)
    assert get(m, "plimsoll_worker_state", model="a", state="stopped") == 1
    assert get(m, "plimsoll_requests_total", model="a", outcome="ok") == 0
    assert get(m, "plimsoll_loads_total", model="a") == 0
    assert get(m, "plimsoll_queue_length", model="a", where="proxy") == 0
    assert get(m, "plimsoll_trips_total", model="a") == 0


def test_requests_pool_limits_and_latency(proxy):
    client = proxy.client()
    assert chat(client, "a").model == "a"
    stream = client.chat.completions.create(model="a", messages=MSG, max_tokens=16,
                                            temperature=0, stream=True)
    assert sum(1 for _ in stream) > 0
    m = scrape(proxy)
    assert get(m, "plimsoll_requests_total", model="a", outcome="ok") == 2
    assert get(m, "plimsoll_worker_state", model="a", state="ready") == 1
    assert get(m, "plimsoll_loads_total", model="a") == 1
    assert get(m, "plimsoll_load_duration_seconds_count", model="a") == 1
    assert get(m, "plimsoll_time_to_first_token_seconds_count", model="a") == 1
    assert get(m, "plimsoll_tokens_per_second_count", model="a") >= 1
    status = proxy.worker("a")["memory"]
    pool = status["pool"]
    assert get(m, "plimsoll_pool_blocks", model="a", state="total") == pool["total"]
    parts = [get(m, "plimsoll_pool_blocks", model="a", state=s)
             for s in ("used", "cached", "free")]
    assert sum(parts) == pool["total"]
    assert get(m, "plimsoll_pool_blocks", model="a", state="cached") > 0  # prefix retained
    admitted = proxy.worker("a")["admitted"]
    assert get(m, "plimsoll_admitted_footprint_bytes", model="a") == admitted["footprint_bytes"]
    u = admitted["gpu_memory_utilization"]
    assert get(m, "plimsoll_gpu_memory_utilization", model="a") == pytest.approx(u)
    ceiling = get(m, "plimsoll_worker_ceiling_bytes", model="a")
    assert get(m, "plimsoll_allocation_limit_bytes", model="a") == pytest.approx(
        u * ceiling, rel=1e-3)
    trip = get(m, "plimsoll_trip_bytes", model="a")
    assert admitted["footprint_bytes"] < trip
    assert get(m, "plimsoll_mlx_active_bytes", model="a") > 0
    assert get(m, "plimsoll_worker_rss_bytes", model="a") > 0
    assert get(m, "plimsoll_worker_tripped", model="a") == 0
    assert get(m, "plimsoll_queue_length", model="a", where="worker") == 0


def test_refusals_by_reason_and_swaps(proxy):
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                   json={"model": "huge", "messages": MSG, "max_tokens": 4})
    assert r.status_code == 503
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                   json={"model": "a", "messages": MSG, "max_tokens": (1 << 20) + 1})
    assert r.status_code == 400  # over the sanity cap (below it max_tokens is clamped)
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "nope", "messages": MSG})
    assert r.status_code == 404
    assert chat(proxy.client(), "b").model == "b"  # evicts "a"
    m = scrape(proxy)
    assert get(m, "plimsoll_refusals_total", model="huge", reason="admission_refused") == 1
    assert get(m, "plimsoll_requests_total", model="huge", outcome="refused") == 1
    assert get(m, "plimsoll_load_refusals_total", model="huge") == 1
    assert get(m, "plimsoll_requests_total", model="a", outcome="invalid") == 1
    assert get(m, "plimsoll_requests_total", model="-", outcome="invalid") == 1
    assert get(m, "plimsoll_swaps_total", model="b") == 1
    assert get(m, "plimsoll_swap_duration_seconds_count", model="b") == 1
    assert get(m, "plimsoll_swap_duration_seconds_sum", model="b") > 0
    assert get(m, "plimsoll_evictions_total", model="a") == 1
    assert get(m, "plimsoll_worker_state", model="a", state="stopped") == 1
    assert get(m, "plimsoll_pool_blocks", model="a", state="total") is None  # gone with it
    assert get(m, "plimsoll_pool_blocks", model="b", state="total") > 0
