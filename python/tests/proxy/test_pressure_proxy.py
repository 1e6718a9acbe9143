"""The memory-pressure tripwire, for real: ``plimsoll serve`` with demo-model workers.

The proxy's pressure probe reads a PSI file this test writes in the kernel's own format
(``PLIMSOLL_PSI_PATH``), so pressure comes and goes on cue while everything else is real:
the proxy process, its workers (their pids checked with psutil), the HTTP answers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from test_proxy import MSG, Proxy, chat, wait_for

FX = Path(__file__).parents[1] / "fixtures" / "pressure"
CLEAR_AFTER_S = 2


class Psi:
    """The file the proxy reads as /proc/pressure/memory (replaced atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.set("psi_calm.txt")

    def set(self, fixture: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text((FX / fixture).read_text())
        tmp.replace(self.path)


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory) -> Iterator[tuple[Proxy, Psi]]:
    tmp = tmp_path_factory.mktemp("pressure-proxy")
    small = {"context": 4096, "maxTokens": 2048, "defaultMaxTokens": 256}
    (tmp / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 1}, "clustered": {"maxLocalLlmGb": 1}},
        "pressure": {"pollS": 0.2, "clearAfterS": CLEAR_AFTER_S},
        "models": {"a": {"path": str(tiny_model), **small},
                   "b": {"path": str(tiny_model), **small}},
    }))
    (tmp / "token").write_text("admin-secret\n")
    psi = Psi(tmp / "psi")
    (tmp / "vmstat").write_text((FX / "vmstat_t0.txt").read_text())  # no swap-outs
    p = Proxy(["--policy", str(tmp / "policy.json"), "--admin-token-file", str(tmp / "token"),
               "--idle-ttl", "0"], tmp / "serve.log",
              {"PLIMSOLL_CACHE": str(tmp / "cache"), "PLIMSOLL_PSI_PATH": str(psi.path),
               "PLIMSOLL_VMSTAT_PATH": str(tmp / "vmstat")})
    yield p, psi
    left = p.stop()
    assert not left, f"workers outlived the proxy: {left}"


def post(proxy: Proxy, model: str, **kw) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", timeout=180,
                      json={"model": model, "messages": MSG, "max_tokens": 2, **kw})


def level(proxy: Proxy) -> str:
    return proxy.running()["pressure"]["level"]


def assert_pressure_refusal(r: httpx.Response, *says: str) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "memory_pressure", err
    assert r.headers["retry-after"] == str(CLEAR_AFTER_S)
    assert "under memory pressure" in err["message"] and err["pressure"]["reasons"]
    for s in says:
        assert s in err["message"], err["message"]


def calm_down(proxy: Proxy, psi: Psi, mark: int) -> dict:
    """Write a calm reading; wait (bounded) for admission to reopen; return the clear event."""
    psi.set("psi_calm.txt")
    wait_for(lambda: level(proxy) == "normal", 60, "the tripwire to clear")
    return next(e for e in proxy.events(mark) if e["kind"] == "pressure-clear")


def test_an_in_flight_stream_survives_a_warn_and_new_requests_get_a_reasoned_503(setup):
    proxy, psi = setup
    assert chat(proxy.client(), "a").model == "a"
    pid = proxy.worker("a")["pid"]
    mark = proxy.last_seq()
    stream = proxy.client().chat.completions.create(
        model="a", messages=MSG, max_tokens=400, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)  # the stream is in flight
    psi.set("psi_warn.txt")  # some avg10=14.73: above the warn line only
    wait_for(lambda: level(proxy) == "warn", 60, "the tripwire to warn")
    assert_pressure_refusal(post(proxy, "a"), "a request for model 'a' refused",
                            "some avg10=14.73", "pressure.someAvg10Warn")
    rest = list(chunks)  # ...while the one already admitted runs to its end
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in rest)
    assert proxy.worker("a")["pid"] == pid and psutil.pid_exists(pid)  # warn never unloads
    clear = calm_down(proxy, psi, mark)
    assert clear["detail"]["calm_for_s"] >= CLEAR_AFTER_S
    assert chat(proxy.client(), "a").model == "a"
    kinds = [e["kind"] for e in proxy.events(mark)]
    assert "pressure-warn" in kinds and "pressure-unload" not in kinds
    assert "exit" not in kinds and "crash" not in kinds


def test_critical_cancels_the_queued_load_unloads_idle_workers_and_recovers(setup):
    proxy, psi = setup
    assert chat(proxy.client(), "a").model == "a"
    a_pid = proxy.worker("a")["pid"]
    mark = proxy.last_seq()
    queued: list[httpx.Response] = []
    for _attempt in range(3):  # b must still be loading when the tripwire sees the pressure
        queued.clear()
        httpx.post(proxy.url + "/unload/b", timeout=120).raise_for_status()
        t = threading.Thread(target=lambda: queued.append(post(proxy, "b")))
        t.start()
        wait_for(lambda: proxy.worker("b")["waiting"] == 1 or queued, 60, "b's request to queue")
        if not queued:
            psi.set("psi_critical.txt")  # some avg10=60.00, full avg10=18.40
        t.join(180)
        if queued and queued[0].status_code == 503:
            break
        calm_down(proxy, psi, mark)  # b loaded first: lost the race, try again
    else:
        pytest.fail("b loaded before the tripwire saw the pressure, three times in a row")
    assert len(queued) == 1
    assert_pressure_refusal(queued[0], "the request waiting for model 'b' to load was "
                            "cancelled", "some avg10=60.00", "pressure.someAvg10Critical")
    assert_pressure_refusal(post(proxy, "a"), "a request for model 'a' refused")

    # Idle workers are unloaded, least recently used first, each exit verified.
    wait_for(lambda: all(proxy.worker(m)["state"] == "stopped" for m in "ab"), 120,
             "the tripwire to unload a and b")
    ev = proxy.events(mark)
    unloads = [e for e in ev if e["kind"] == "pressure-unload"]
    assert unloads[0]["model"] == "a" and unloads[0]["detail"]["pid"] == a_pid
    assert unloads[0]["detail"]["inflight"] == 0
    pids = {e["model"]: e["detail"]["pid"] for e in unloads}
    assert not psutil.pid_exists(a_pid)
    exits = {e["model"]: e for e in ev if e["kind"] == "exit"}
    for m, pid in pids.items():
        assert exits[m]["detail"]["pid"] == pid and exits[m]["detail"]["expected"] is True
        assert not psutil.pid_exists(pid)
    assert not [e for e in ev if e["kind"] == "crash"]
    cancelled = [e for e in ev if e["kind"] == "pressure-cancel"]
    assert [e["model"] for e in cancelled] == ["b"]

    status = proxy.running()["pressure"]
    assert status["level"] == "critical" and not status["admitting"]
    assert status["reading"]["some_avg10"] == 60.0 and status["unloads"] >= 1
    metrics = httpx.get(proxy.url + "/metrics", timeout=30).text
    assert "plimsoll_tripwire_level 2.0" in metrics
    assert "plimsoll_tripwire_admitting 0.0" in metrics
    assert 'plimsoll_pressure_unloads_total{model="a"} 1.0' in metrics
    assert 'plimsoll_pressure_cancelled_total{model="b"} 1.0' in metrics
    assert 'plimsoll_refusals_total{model="a",reason="memory_pressure"}' in metrics

    clear = calm_down(proxy, psi, mark)
    assert clear["detail"]["calm_for_s"] >= CLEAR_AFTER_S
    reply = chat(proxy.client(), "a")  # loads again and is served normally
    assert reply.model == "a" and reply.choices[0].message.content is not None
    assert proxy.worker("a")["pid"] != a_pid and proxy.running()["pressure"]["admitting"]


def test_critical_unloads_the_idle_worker_first_and_lets_the_busy_ones_stream_finish(setup):
    proxy, psi = setup
    client = proxy.client()
    chat(client, "b")
    chat(client, "a")
    pids = {m: proxy.worker(m)["pid"] for m in "ab"}
    mark = proxy.last_seq()
    stream = client.chat.completions.create(
        model="a", messages=MSG, max_tokens=600, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)  # a is busy; b is idle and was used before a
    psi.set("psi_critical.txt")
    rest = list(chunks)  # the admitted stream runs to its own end: nothing is cut
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in rest)
    wait_for(lambda: all(proxy.worker(m)["state"] == "stopped" for m in "ab"), 120,
             "the tripwire to unload b, then a")
    ev = proxy.events(mark)
    assert [e["model"] for e in ev if e["kind"] == "pressure-unload"] == ["b", "a"]
    for e in (e for e in ev if e["kind"] == "exit"):
        assert e["detail"]["cut_requests"] == 0 and e["detail"]["expected"] is True
        assert e["detail"]["pid"] == pids[e["model"]]
    assert not any(psutil.pid_exists(p) for p in pids.values())
    calm_down(proxy, psi, mark)
    assert chat(client, "b").model == "b"
