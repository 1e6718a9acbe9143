"""Behind ``plimsoll serve --api-key``, nothing in the serving process tree answers without
a key: the proxy wants the API key, each worker the secret its proxy made at spawn (in its
environment, never its command line). Real ``plimsoll serve``, real workers; every
listening socket of the tree is found and tried."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from conftest import Worker
from serve_process import Served, tiny_policy, worker_headers

from plimsoll.web.worker_secret import HEADER, SECRET_ENV

KEY = "k3y-for-the-proxy"
MSG = [{"role": "user", "content": "hello"}]
TRIES = [("POST", "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 1}),
         ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
         ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1}),
         ("POST", "/v1/messages", {"model": "tiny", "messages": MSG, "max_tokens": 1}),
         ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": MSG}),
         ("GET", "/v1/models", None), ("GET", "/v1/plimsoll/status", None),
         ("GET", "/health", None), ("GET", "/running", None), ("GET", "/metrics", None),
         ("GET", "/dashboard.json", None), ("POST", "/unload", None)]


def tree(proc: psutil.Process) -> list[psutil.Process]:
    return [proc, *proc.children(recursive=True)]


def listening(procs: list[psutil.Process]) -> dict[int, tuple[str, int]]:
    """pid → (address, port) of each TCP socket the processes listen on."""
    out = {}
    for p in procs:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out[p.pid] = (c.laddr.ip, c.laddr.port)
    return out


def unix_listening(procs: list[psutil.Process]) -> list[str]:
    return [c.laddr for p in procs for c in p.net_connections(kind="unix")
            if c.status == psutil.CONN_LISTEN and c.laddr]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("secret")
    s = Served(["--policy", str(tiny_policy(tmp / "policy.json", tiny_model)),
                "--api-key", KEY], tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "cache")})
    yield s
    assert s.stop() == 0


def chat_through_the_proxy(served: Served) -> None:
    r = httpx.post(served.url + "/v1/chat/completions", timeout=180,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text  # through the proxy, with the key: served


def test_no_socket_of_the_tree_answers_without_a_key(served):
    auth = {"Authorization": f"Bearer {KEY}"}
    chat_through_the_proxy(served)
    procs = tree(psutil.Process(served.proc.pid))
    sockets = listening(procs)
    assert served.proc.pid in sockets and len(sockets) >= 2, sockets  # the proxy + a worker
    assert unix_listening(procs) == []  # nothing to try there (yet)
    for pid, (ip, port) in sockets.items():
        base = f"http://{ip}:{port}"
        for method, path, body in TRIES:
            if pid == served.proc.pid and path == "/health":
                continue  # the proxy's liveness answer: no model, no data
            got = httpx.request(method, base + path, json=body, timeout=30)
            assert got.status_code in (401, 404, 405), (pid, path, got.status_code, got.text)
            if pid != served.proc.pid:
                assert got.status_code == 401, (path, got.text)
                assert got.json()["error"]["code"] == "worker_secret_required"
        wrong = httpx.get(base + "/running", headers={HEADER: "guess", **auth}, timeout=30)
        if pid != served.proc.pid:
            assert wrong.status_code == 401  # the proxy's key is not the worker's secret


def test_the_secret_is_in_the_environment_never_on_a_command_line(served):
    chat_through_the_proxy(served)
    running = httpx.get(served.url + "/running", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30).json()
    (worker,) = [w for w in running["workers"] if w.get("pid")]
    assert running["workers"][0]["state"] == "ready"
    headers = worker_headers(worker["pid"])
    secret = headers[HEADER]
    assert len(secret) >= 40
    for p in tree(psutil.Process(served.proc.pid)):
        assert not any(secret in arg for arg in p.cmdline()), p.cmdline()
    assert secret not in served.log.read_text()
    assert SECRET_ENV not in psutil.Process(served.proc.pid).environ()  # the proxy's own
    status = httpx.get(worker["url"] + "/v1/plimsoll/status", headers=headers, timeout=30)
    assert status.status_code == 200 and status.json()["pid"] == worker["pid"]
    # the proxy's status and metrics read the worker through its secret
    assert running["workers"][0]["memory"]["pool"]["total"] > 0
    metrics = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30).text
    assert 'plimsoll_worker_rss_bytes{model="tiny"}' in metrics  # read from its status


def test_a_worker_started_without_a_secret_answers_as_before(tiny_model):
    w = Worker(tiny_model)
    try:
        assert httpx.get(w.url + "/v1/plimsoll/status", timeout=30).status_code == 200
    finally:
        w.stop()


class SecretWorker(Worker):
    """A ``plimsoll worker`` given a secret, as a proxy spawns it."""

    SECRET = "s3cret-of-this-worker"

    def __init__(self, model) -> None:
        super().__init__(model, extra_env={SECRET_ENV: self.SECRET})

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/v1/plimsoll/status", headers={HEADER: self.SECRET},
                             timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("worker not ready in time")


def test_a_worker_given_a_secret_wants_it_on_every_route(tiny_model):
    w = SecretWorker(tiny_model)
    try:
        for method, path, body in TRIES:
            got = httpx.request(method, w.url + path, json=body, timeout=30)
            assert got.status_code == 401, (path, got.text)
        anthropic = httpx.post(w.url + "/v1/messages", json={}, timeout=30).json()
        assert anthropic["type"] == "error" and anthropic["error"]["type"] == \
            "authentication_error"
        ok = httpx.post(w.url + "/v1/completions", headers={HEADER: w.SECRET},
                        json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        w.stop()
