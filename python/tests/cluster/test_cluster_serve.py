"""Clustered serving for real: ``plimsoll cluster serve`` with two ranks on 127.0.0.1.

Rank 0 answers the worker's own HTTP API over MLX's ring backend; the answers are
compared with a single-process ``plimsoll worker`` on the same tiny model (greedy, so the
text must be identical), several requests run at once (each in its own slot), and the
failure paths are exercised on real processes: a rank killed mid-stream, a refused load.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import Worker, free_port, worker_env
from test_cluster_ring import gone, ring_ok  # noqa: F401  (the fixture skips without a ring)

READY_TIMEOUT_S = 120.0


class ClusterServe:
    """A real ``plimsoll cluster serve`` process; its ready line gives the URL and rank pids."""

    def __init__(self, model: Path, *ranks: str, extra: list[str] | None = None,
                 wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "plimsoll.cli", "cluster", "serve", str(model),
                "--port", str(self.port), "--model-name", "tiny", "--concurrency", "2",
                "--context", "1024", "--max-tokens", "512", "--min-context", "1024"]
        for r in ranks:
            argv += ["--rank", r]
        self.proc = subprocess.Popen(argv + (extra or []), env=worker_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict | None = None
        if wait:
            self.wait_ready()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"cluster serve exited {self.proc.wait(10)}: "
                                   f"{self.proc.stderr.read()[-3000:]}")
            event = json.loads(line)
            if event.get("event") == "ready":
                self.ready = event
                return event
        raise RuntimeError("cluster serve not ready in time")

    @property
    def pids(self) -> list[int]:
        return self.ready["pids"]

    def status(self) -> dict:
        return httpx.get(self.url + "/v1/plimsoll/status", timeout=10).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def rank_processes(port: int) -> list[int]:
    """Pids of rank processes started for ``port`` (their argv carries --serve-port)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"plimsoll.cluster.rank" in argv and str(port).encode() in argv \
                and not gone(int(entry.name)):
            found.append(int(entry.name))
    return found


def rank_cgroups(pids: list[int]) -> list:
    """The memory cgroup binding each rank, or [] where the runner could not make any."""
    from plimsoll.guard import cgroups

    if cgroups.unavailable_reason() is not None:
        return []
    return [cgroups.own(pid) for pid in pids]


@pytest.fixture(scope="module")
def cluster(ring_ok, tiny_model):  # noqa: F811
    c = ClusterServe(tiny_model, "4", "4")
    groups = rank_cgroups(c.pids)
    yield c
    assert c.stop() == 0  # SIGTERM: every rank shut down cleanly
    assert all(gone(pid) for pid in c.pids)
    assert not any(g.path.exists() for g in groups if g is not None)  # cgroups removed


@pytest.fixture(scope="module")
def single(tiny_model):
    w = Worker(tiny_model)
    yield w
    w.stop()


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(url: str, body: dict, on_chunk=None) -> tuple[str, list[dict]]:
    """Stream a chat completion; the text and every event (errors included)."""
    text, events = [], []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    text.append(piece)
                    if on_chunk is not None:
                        on_chunk(len(text))
    return "".join(text), events


def chat(content: str, max_tokens: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}


def test_rank_0_answers_what_a_single_worker_answers(cluster, single):
    for prompt in ("def main():", "hello world, this is a test"):
        two, one = complete(cluster.url, prompt, 24), complete(single.url, prompt, 24)
        assert two["choices"][0]["text"] == one["choices"][0]["text"]
        assert two["usage"] == one["usage"]
    body = chat("what is a plimsoll line?", 20)
    a = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60).json()
    b = httpx.post(single.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    # the same API around it: models, health, the Anthropic route
    assert httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok"}
    m = httpx.post(cluster.url + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert m.status_code == 200 and m.json()["usage"]["output_tokens"] == 8


def test_status_reports_every_rank(cluster):
    s = cluster.status()
    c = s["cluster"]
    assert c["world_size"] == 2 and c["decision"]["action"] == "commit"
    assert [r["layers"] for r in c["ranks"]] == [[0, 2], [2, 4]]
    assert [r["pid"] for r in c["ranks"]] == cluster.pids
    for r in c["ranks"]:
        assert r["loaded_bytes"] == r["weights_bytes"] > 0
        assert 0 < r["footprint_bytes"] < r["allocation_limit_bytes"] <= r["ceiling_bytes"]
        assert r["memory_limit_applied_bytes"] == r["allocation_limit_bytes"]
    # each rank in its own memory cgroup: its admitted footprint + the guard's margin
    from plimsoll.guard.process import guard_limit

    groups = rank_cgroups(cluster.pids)
    if groups:
        assert len({g.path for g in groups}) == 2
        assert [g.limit() for g in groups] == [guard_limit(r["footprint_bytes"])
                                              for r in c["ranks"]]
        assert s["cgroup"] is not None  # rank 0's scheduler watches its soft line
        # the ring's pool is the smallest any rank was admitted with; concurrency as committed
    assert s["pool"]["total"] == min(r["pool_blocks"] for r in c["ranks"])
    assert s["max_num_seqs"] == c["decision"]["concurrency"] == 2
    assert s["context"]["configured"] == c["decision"]["context"] == 1024


def test_two_requests_at_once_each_get_their_solo_answer(cluster):
    # the long one has room for the short one's start under load (a busy 2-core box)
    long_body, short_body = chat("tell me a long story", 400), chat("and a short one", 24)
    solo_long, _ = stream_text(cluster.url, long_body)
    solo_short, _ = stream_text(cluster.url, short_body)
    order: list[str] = []
    lock = threading.Lock()
    results: dict[str, str] = {}
    started = threading.Event()

    def run_short() -> None:
        results["short"], _ = stream_text(cluster.url, short_body)
        with lock:
            order.append("short done")

    def on_long_chunk(n: int) -> None:
        if n == 1:
            started.set()

    helper = threading.Thread(target=lambda: started.wait(60) and run_short())
    helper.start()
    results["long"], _ = stream_text(cluster.url, long_body, on_long_chunk)
    with lock:
        order.append("long done")
    helper.join(60)
    assert results == {"long": solo_long, "short": solo_short}
    # the short request started after the long one and finished first: they interleaved
    assert order == ["short done", "long done"]
    counters = cluster.status()["counters"]
    assert counters["admitted"] >= 4


def test_a_prompt_over_the_committed_context_is_a_400_and_max_tokens_over_it_is_clamped(
        cluster):
    """Issue 16's contract: a prompt alone over the context is a 400 with the figures;
    ``max_tokens`` past what the context leaves is clamped to it and reported."""
    r = httpx.post(cluster.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "word " * 1100, "max_tokens": 16})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "configured total context: 1024 tokens" in err["message"]
    r = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "word " * 900, "max_tokens": 300, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    applied = int(r.headers["x-plimsoll-max-tokens"])
    assert applied == 1024 - usage["prompt_tokens"] < 300  # what the context leaves
    assert usage["completion_tokens"] <= applied
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 1024


def test_killing_rank_1_mid_stream_tears_every_rank_down(ring_ok, tiny_model):  # noqa: F811
    c = ClusterServe(tiny_model, "4", "4")
    try:
        killed = []

        def kill_rank_1(n: int) -> None:
            if n == 5 and not killed:
                os.kill(c.pids[1], signal.SIGKILL)
                killed.append(n)

        text, events = stream_text(c.url, chat("go on", 500), kill_rank_1)
        code = c.proc.wait(30)
        stderr = c.proc.stderr.read()
    finally:
        c.stop()
    assert killed and text  # tokens came through before the kill
    errors = [e["error"] for e in events if "error" in e]
    assert errors, f"no error event in the stream: {events[-3:]}"
    assert "torn down" in errors[0]["message"] and "lost a peer" in errors[0]["message"]
    assert code == 4  # a rank failed; every rank torn down
    assert "rank(s) [1]" in stderr and "signal 9" in stderr
    assert all(gone(pid) for pid in c.pids)
    assert rank_processes(c.port) == []


def test_a_refused_load_exits_3_with_every_ranks_reasons(ring_ok, tiny_model):  # noqa: F811
    c = ClusterServe(tiny_model, "4", str(1 / 1024), wait=False)
    try:
        code = c.proc.wait(120)
    finally:
        c.stop()
    stderr = c.proc.stderr.read()
    assert code == 3
    assert "refused by rank(s) [1]" in stderr
    assert "rank 0:" in stderr and "rank 1:" in stderr
    assert rank_processes(c.port) == []


def test_the_proxy_serves_a_sharded_model_and_restarts_it_after_a_rank_dies(
        ring_ok, tiny_model, tmp_path):  # noqa: F811
    from serve_process import worker_headers
    from test_proxy import Proxy, wait_for

    (tmp_path / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 1}, "clustered": {"maxLocalLlmGb": 2}},
        "models": {"big": {"path": str(tiny_model), "context": 2048, "maxTokens": 256,
                           "concurrency": 2, "sharded": True}}}))
    p = Proxy(["--policy", str(tmp_path / "policy.json"), "--mode", "clustered",
               "--cluster-rank", "4", "--cluster-rank", "4"], tmp_path / "serve.log",
              {"PLIMSOLL_CACHE": str(tmp_path / "cache")})
    # ignore_eos: a random-weight model, sampled, may end at EOS before 8 tokens
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "ignore_eos": True}
    rank_pids: list[int] = []
    try:
        r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        first = p.worker("big")
        status = httpx.get(first["url"] + "/v1/plimsoll/status", timeout=10,
                           headers=worker_headers(first["pid"])).json()  # its secret
        ranks = status["cluster"]["ranks"]
        assert [x["layers"] for x in ranks] == [[0, 2], [2, 4]]  # one worker, two ranks
        assert status["context"]["configured"] == 2048 and status["max_num_seqs"] == 2
        rank_pids += [x["pid"] for x in ranks]
        os.kill(rank_pids[1], signal.SIGKILL)
        crashed = wait_for(lambda: (w := p.worker("big"))["state"] == "stopped"
                           and w.get("last_exit") and w, 60, "the crash to be noticed")
        assert crashed["last_exit"]["pid"] == first["pid"]
        assert "exit status 4" in crashed["last_exit"]["exit"]  # a rank failed: torn down
        assert any(e["kind"] == "crash" and e["model"] == "big" for e in p.events())
        assert all(gone(pid) for pid in rank_pids)
        again = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=180)
        assert again.status_code == 200, again.text
        second = p.worker("big")
        assert second["state"] == "ready" and second["pid"] != first["pid"]
        status = httpx.get(second["url"] + "/v1/plimsoll/status", timeout=10,
                           headers=worker_headers(second["pid"])).json()
        rank_pids += [x["pid"] for x in status["cluster"]["ranks"]]
    finally:
        left = p.stop()
    assert not left, f"workers outlived the proxy: {left}"
    assert all(gone(pid) for pid in rank_pids)


def test_under_mlx_launch_rank_0_serves_http(ring_ok, tiny_model):  # noqa: F811
    """The multi-host recipe of the README, on one host: ``mlx.launch --backend ring`` starts
    the rank module on every "host"; rank 0 serves the worker API on --serve-port; SIGTERM
    to rank 0 shuts the ring down (every rank exits 0)."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    port = free_port()
    figures = [{"ceiling_bytes": 4 << 30, "total_ram_bytes": 4 << 30}] * 2
    argv = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1,127.0.0.1",
            "--starting-port", str(free_port()), "--", sys.executable, "-m",
            "plimsoll.cluster.rank", "--model", str(tiny_model), "--figures-by-rank",
            json.dumps(figures), "--serve-port", str(port), "--model-name", "tiny",
            "--concurrency", "2", "--context", "1024", "--max-tokens", "256"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=worker_env(),
                            start_new_session=True)
    events: list[dict] = []

    def read() -> None:
        for line in proc.stdout:  # mlx.launch relays every rank's output through one pipe
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any(e.get("event") == "serving" for e in events):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 8,
                             "ignore_eos": True})  # sampled: EOS may come before 8 tokens
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        status = httpx.get(url + "/v1/plimsoll/status", timeout=10).json()
        assert status["prompt_pieces"]["enabled"] is True, status["prompt_pieces"]
        pids = [x["pid"] for x in status["cluster"]["ranks"]]
        os.kill(pids[0], signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started, nothing else
            proc.wait(10)
    reader.join(10)
    assert all(gone(pid) for pid in pids)
    assert proc.stderr.read().count("exited with code") == 0  # both ranks exited 0
