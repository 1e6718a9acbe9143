"""The swapping proxy, for real: ``plimsoll serve`` over demo-model workers on 127.0.0.1.

Models "a" and "b" are two tiny demo models (different seeds) whose admitted footprints
(context 32768, concurrency 4, the prefill transient at 32k counted for the layers a paced
step holds: ~660 MiB each) cannot share the 1 GiB standalone envelope but can share the
2 GiB clustered one; "c" is small
(context 4096) and may stay co-resident; "huge" claims a 4 MiB/token KV cache in its
config and cannot hold one sequence, so admission refuses it before anything is loaded.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from serve_process import Served, worker_headers

MSG = [{"role": "user", "content": "hello there"}]


class Proxy(Served):
    """``plimsoll serve`` (started as :class:`serve_process.Served`) and its admin routes."""

    def __init__(self, args: list[str], log: Path, env_extra: dict[str, str] | None = None,
                 api_key: str | None = None):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(args, log, env_extra)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=180, **kw)

    def running(self) -> dict:
        return httpx.get(self.url + "/running", headers=self.headers, timeout=30).json()

    def events(self, since: int = 0) -> list[dict]:
        return [e for e in self.running()["events"] if e["seq"] > since]

    def last_seq(self) -> int:
        ev = self.running()["events"]
        return ev[-1]["seq"] if ev else 0

    def worker(self, model: str) -> dict:
        return next(w for w in self.running()["workers"] if w["model"] == model)

    def unload(self) -> None:
        httpx.post(self.url + "/unload", timeout=120).raise_for_status()

    def stop(self) -> list[int]:
        """SIGTERM the proxy; returns the pids of workers it left behind (must be none)."""
        try:
            pids = [w["pid"] for w in self.running()["workers"] if w.get("pid")]
        finally:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def chat(client: openai.OpenAI, model: str, max_tokens: int = 4):
    return client.chat.completions.create(model=model, messages=MSG, max_tokens=max_tokens)


def started_at(pid: int) -> float:
    """A process's start as wall time, to ~10 ms (psutil's create_time rounds boot time to
    whole seconds, so it is read relative to the uptime instead)."""
    start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - start / os.sysconf("SC_CLK_TCK"))


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := pred()):
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory) -> dict[str, Path]:
    from plimsoll.demo.model import build_demo_model

    root = tmp_path_factory.mktemp("proxy-models")
    b = build_demo_model(root / "tiny-b", preset="tiny", seed=1)
    huge = root / "huge"
    shutil.copytree(tiny_model, huge)
    cfg = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**cfg, "head_dim": 65536}))
    return {"a": tiny_model, "b": b, "huge": huge}


@pytest.fixture(scope="module")
def proxy(models, tmp_path_factory) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("proxy")
    big = {"context": 32768, "maxTokens": 1024, "concurrency": 4}
    (tmp / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 1}, "clustered": {"maxLocalLlmGb": 2}},
        "models": {"a": {"path": str(models["a"]), **big},
                   "b": {"path": str(models["b"]), **big},
                   "c": {"path": str(models["a"]), "context": 4096, "maxTokens": 256},
                   "huge": {"path": str(models["huge"]), "context": 4096, "maxTokens": 256}},
    }))
    (tmp / "token").write_text("admin-secret\n")
    p = Proxy(["--policy", str(tmp / "policy.json"), "--admin-token-file", str(tmp / "token"),
               "--swap-hold", "1.5", "--max-waiting", "3", "--idle-ttl", "c=2"],
              tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "cache")})
    yield p
    left = p.stop()
    assert not left, f"workers outlived the proxy: {left}"


def test_routes_unknown_model_and_lists_every_model(proxy):
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "nope", "messages": MSG})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "a, b, c, huge" in err["message"]
    cards = {m.id: m for m in proxy.client().models.list().data}
    assert set(cards) == {"a", "b", "c", "huge"}
    assert cards["a"].model_extra["context"] == 32768 and not cards["a"].model_extra["loaded"]
    assert cards["huge"].model_extra["admission"] == "refuse"
    assert httpx.get(proxy.url + "/health").json()["mode"] == "standalone"


def test_an_over_budget_model_gets_503_with_the_reasons(proxy):
    with pytest.raises(openai.APIStatusError) as exc:
        chat(proxy.client(), "huge")
    assert exc.value.status_code == 503
    err = exc.value.body
    assert err["code"] == "admission_refused"
    assert "does not fit" in err["message"] and "envelope" in err["message"]
    assert err["admission"]["budget_bytes"] == 1024 * 1024 * 1024
    assert proxy.worker("huge")["state"] == "stopped"  # nothing was spawned


def test_a_then_b_swaps_with_verified_release_before_the_spawn(proxy):
    proxy.unload()
    client = proxy.client()
    assert chat(client, "a").choices[0].message.content is not None
    a_pid = proxy.worker("a")["pid"]
    mark = proxy.last_seq()
    assert chat(client, "b").model == "b"
    b = proxy.worker("b")
    assert b["state"] == "ready" and proxy.worker("a")["state"] == "stopped"
    assert b["admitted"]["footprint_bytes"] * 2 > 1024 * 1024 * 1024  # cannot share
    ev = proxy.events(mark)
    kinds = [(e["kind"], e["model"]) for e in ev]
    seq = {k: i for i, k in enumerate(kinds)}
    assert (seq[("evict", "a")] < seq[("exit", "a")] < seq[("release-verified", "a")]
            < seq[("spawn", "b")] < seq[("ready", "b")])
    exit_a = next(e for e in ev if e["kind"] == "exit" and e["model"] == "a")
    verified = next(e for e in ev if e["kind"] == "release-verified" and e["model"] == "a")
    assert exit_a["detail"]["pid"] == a_pid and not psutil.pid_exists(a_pid)
    assert verified["detail"]["in_use_bytes"] <= verified["detail"]["target_bytes"]
    # B's process was created after A's memory was verified released (clock ticks: 10 ms)
    assert started_at(b["pid"]) >= verified["t"] - 0.03
    assert exit_a["t"] <= verified["t"]


def test_streaming_passes_through_chunk_by_chunk(proxy):
    client = proxy.client()
    t0 = time.monotonic()
    arrivals = []
    stream = client.chat.completions.create(model="b", messages=MSG, max_tokens=200,
                                            temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - t0)
    assert len(arrivals) >= 20
    # the first tokens reached the client long before the last: nothing was buffered
    assert arrivals[-1] - arrivals[0] > 0.2
    assert arrivals[0] < arrivals[-1] / 2


def test_kill_9_mid_stream_is_a_reasoned_error_and_the_next_request_restarts(proxy):
    client = proxy.client()
    chat(client, "b")
    pid = proxy.worker("b")["pid"]
    stream = client.chat.completions.create(model="b", messages=MSG, max_tokens=1000,
                                            temperature=0, stream=True)
    got = 0
    with pytest.raises(openai.APIError) as exc:
        for _chunk in stream:
            got += 1
            if got == 5:
                os.kill(pid, signal.SIGKILL)
    assert 5 <= got < 1000
    assert f"pid {pid}" in exc.value.message and "signal 9" in exc.value.message
    wait_for(lambda: proxy.worker("b")["state"] == "stopped", 10, "the crash to be noticed")
    kinds = [(e["kind"], e["model"]) for e in proxy.events()]
    assert ("crash", "b") in kinds
    assert chat(client, "b").model == "b"
    assert proxy.worker("b")["pid"] != pid


def test_a_client_that_leaves_mid_stream_cancels_its_request_on_the_worker(proxy):
    """The proxy closes the half-read answer's connection; the worker sees its client go and
    frees the request (its status, read directly with the worker's secret)."""
    chat(proxy.client(), "b")
    w = proxy.worker("b")
    status = lambda: httpx.get(w["url"] + "/v1/plimsoll/status",  # noqa: E731
                               headers=worker_headers(w["pid"]), timeout=10).json()
    cancelled = status()["counters"].get("cancelled", 0)
    body = {"model": "b", "messages": MSG, "max_tokens": 1000, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as h, h.stream(
            "POST", proxy.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert status()["running"] == 1
    wait_for(lambda: status()["running"] == 0, 10, "the worker to end the left request")
    assert status()["counters"].get("cancelled", 0) == cancelled + 1
    wait_for(lambda: proxy.worker("b")["inflight"] == 0, 10, "the proxy's lease released")


def test_a_small_model_stays_co_resident_and_is_unloaded_when_idle(proxy):
    client = proxy.client()
    chat(client, "b")
    mark = proxy.last_seq()
    chat(client, "c")  # fits beside b: nothing is evicted
    assert proxy.worker("b")["state"] == "ready"
    assert not [e for e in proxy.events(mark) if e["kind"] == "evict"]
    wait_for(lambda: proxy.worker("c")["state"] == "stopped", 15, "c's idle unload (TTL 2 s)")
    kinds = [(e["kind"], e["model"]) for e in proxy.events(mark)]
    assert kinds.index(("idle-unload", "c")) < kinds.index(("exit", "c"))
    wait_for(lambda: ("release-verified", "c") in [(e["kind"], e["model"])
                                                   for e in proxy.events(mark)], 15,
             "c's release to be verified")
    assert proxy.worker("b")["state"] == "ready"  # b has the default TTL


def test_waiting_requests_are_bounded_with_429_and_retry_after(proxy):
    chat(proxy.client(), "b")  # b loaded (and held 1.5 s): "a" must wait for a swap
    results: list[httpx.Response] = []

    def one():
        results.append(httpx.post(proxy.url + "/v1/chat/completions", timeout=180,
                                  json={"model": "a", "messages": MSG, "max_tokens": 2}))

    threads = [threading.Thread(target=one) for _ in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(429) >= 3 and codes.count(200) >= 3, codes
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["code"] == "queue_full"


def test_two_clients_alternating_two_models_do_not_thrash(proxy):
    proxy.unload()
    mark = proxy.last_seq()
    errors: list[Exception] = []
    done: list[str] = []

    def client_loop(model: str):
        client = proxy.client()
        for _ in range(5):
            try:
                chat(client, model, max_tokens=2)
                done.append(model)
            except Exception as err:
                errors.append(err)

    threads = [threading.Thread(target=client_loop, args=(m,)) for m in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(done) == ["a"] * 5 + ["b"] * 5
    events = proxy.events(mark)
    spawns = [e["model"] for e in events if e["kind"] == "spawn"]
    # Each load is for a request that waits for it: never more loads than requests, and a
    # model is never reloaded while the other one did not run in between. How many swaps
    # the hold saves depends on how long a request takes against --swap-hold (on a loaded
    # box a swap outlasts the 1.5 s hold, so each request may swap): not asserted here.
    assert 1 <= len(spawns) <= len(done), spawns
    assert all(a != b for a, b in itertools.pairwise(spawns)), spawns


def test_admin_mode_needs_the_token_and_a_downshift_evicts_before_answering(proxy):
    url = proxy.url + "/admin/mode"
    auth = {"Authorization": "Bearer admin-secret"}
    assert httpx.post(url, json={"mode": "clustered"}).status_code == 401
    assert httpx.post(url, json={"mode": "clustered"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url).status_code == 401
    assert httpx.post(url, json={"mode": "tiny"}, headers=auth).status_code == 400
    assert httpx.post(url, content=b"{", headers=auth).status_code == 400
    up = httpx.post(url, json={"mode": "clustered"}, headers=auth, timeout=120)
    assert up.status_code == 200 and up.json()["mode"] == "clustered"
    assert httpx.get(url, headers=auth).json() == {"mode": "clustered"}
    client = proxy.client()
    chat(client, "a")
    chat(client, "b")  # both fit the 2 GiB clustered envelope
    assert {proxy.worker(m)["state"] for m in ("a", "b")} == {"ready"}
    mark = proxy.last_seq()
    down = httpx.post(url, json={"mode": "standalone"}, headers=auth, timeout=120)
    body = down.json()
    assert down.status_code == 200, body
    assert body["mode"] == "standalone" and body["fits"] is True
    assert body["envelope_bytes"] == 1024 * 1024 * 1024
    assert body["in_use_bytes"] <= body["envelope_bytes"]
    assert body["workers"] == ["b"]  # a was least recently used
    kinds = [(e["kind"], e["model"]) for e in proxy.events(mark)]
    assert (kinds.index(("evict", "a")) < kinds.index(("exit", "a"))
            < kinds.index(("release-verified", "a")) < kinds.index(("mode-change", None)))
    events = httpx.get(proxy.url + "/admin/events", headers=auth).json()["events"]
    assert events[-1]["kind"] == "mode-change"


def test_serve_with_no_policy_answers_a_chat_on_a_fresh_cache(tmp_path):
    cache = tmp_path / "cache"
    p = Proxy(["--api-key", "k3y"], tmp_path / "serve.log", {"PLIMSOLL_CACHE": str(cache)},
              api_key="k3y")
    try:
        assert "Preparing the demo model" in p.log.read_text()
        with pytest.raises(openai.AuthenticationError):
            chat(p.client(api_key="wrong"), "demo-tiny")
        reply = chat(p.client(api_key="k3y"), "demo-tiny")
        assert reply.model == "demo-tiny" and reply.choices[0].message.content is not None
        token = cache / "admin-token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert str(token) in p.log.read_text()
        assert httpx.get(p.url + "/running").status_code == 401
        assert p.running()["workers"][0]["state"] == "ready"
    finally:
        left = p.stop()
    assert not left


def test_the_anthropic_client_works_through_the_proxy(proxy):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=proxy.url, api_key="none", max_retries=0, timeout=180)
    greedy = {"temperature": 0}
    msg = client.messages.create(model="c", max_tokens=4, extra_body=greedy,
                                 messages=[{"role": "user", "content": "hello"}])
    assert msg.role == "assistant" and msg.usage.output_tokens <= 4
    with client.messages.stream(model="c", max_tokens=4, extra_body=greedy,
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        text = "".join(stream.text_stream)
    assert text == "".join(b.text for b in msg.content if b.type == "text")  # greedy, same
    n = client.messages.count_tokens(model="c", messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens > 0


def test_the_responses_api_works_through_the_proxy(proxy):
    c = proxy.client()
    r = c.responses.create(model="c", input="hello", max_output_tokens=4, temperature=0)
    assert r.model == "c" and r.output[0].type == "message" and r.usage.output_tokens <= 4
    events = list(c.responses.create(model="c", input="hello", max_output_tokens=4,
                                     temperature=0, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == r.output_text  # greedy, relayed unchanged
    follow = c.responses.create(model="c", input="and then?", previous_response_id=r.id,
                                max_output_tokens=2)
    assert follow.usage.input_tokens > r.usage.input_tokens
