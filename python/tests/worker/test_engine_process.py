"""The worker as two processes, for real: the engine process (mlx, pool, scheduler) killed
mid-stream ends every open request with its protocol's error (OpenAI, Anthropic, Responses,
Ollama; a 503 when not streamed) and the next request starts it again; the API process maps
no mlx; an API process killed takes its engine along."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import Worker

CHAT = {"model": "tiny", "max_tokens": 2000, "ignore_eos": True, "stream": True,
        "messages": [{"role": "user", "content": "tell me everything"}]}
MESSAGES = {"model": "tiny", "max_tokens": 2000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "tell me everything, slowly"}]}
RESPONSES = {"model": "tiny", "max_output_tokens": 2000, "stream": True, "temperature": 0,
             "input": "tell me everything, at length"}
OLLAMA = {"model": "tiny", "messages": [{"role": "user", "content": "everything, please"}],
          "options": {"num_predict": 2000, "temperature": 0}}


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = Worker(tiny_model)
    yield w
    w.stop()


def maps_mlx(pid: int) -> bool:
    """Whether ``pid`` has MLX's native library mapped (importing mlx.core maps it)."""
    return "libmlx" in Path(f"/proc/{pid}/maps").read_text()


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_the_api_process_runs_no_mlx_and_the_engine_process_does(worker):
    status = worker.status()
    assert status["pid"] == worker.proc.pid and status["engine_pid"] != status["pid"]
    assert psutil.Process(status["engine_pid"]).ppid() == worker.proc.pid
    assert not maps_mlx(status["pid"])
    assert maps_mlx(status["engine_pid"])
    # the figures of both processes reach the report: the API's resident set is counted
    engine_rss = psutil.Process(status["engine_pid"]).memory_info().rss
    assert status["rss_bytes"] > engine_rss * 0.9 and status["mlx"]["active_bytes"] > 0


class Stream(threading.Thread):
    """A streamed request read line by line; ``ready`` is set after its first few events."""

    def __init__(self, url: str, body: dict, kind: str) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.kind = url, body, kind
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.status: int | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", self.url,
                                                          json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                    if len(self.lines) >= 12:
                        self.ready.set()
        except httpx.HTTPError as err:  # the API process killed under it
            self.error = err
        finally:
            self.ready.set()


def test_a_killed_engine_ends_every_open_stream_with_an_error_and_the_next_request_restarts_it(
        worker):
    worker.wait_idle()
    before = worker.status()
    engine = before["engine_pid"]
    chat = Stream(worker.url + "/v1/chat/completions", CHAT, "openai")
    messages = Stream(worker.url + "/v1/messages", MESSAGES, "anthropic")
    responses = Stream(worker.url + "/v1/responses", RESPONSES, "responses")
    ollama = Stream(worker.url + "/api/chat", OLLAMA, "ollama")
    streams = (chat, messages, responses, ollama)
    for s in streams:
        s.start()
    for s in streams:
        assert s.ready.wait(60)
    plain: dict = {}
    waiting = threading.Thread(target=lambda: plain.setdefault("r", httpx.post(
        worker.url + "/v1/chat/completions", timeout=120,
        json={**CHAT, "stream": False})), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 30
    while worker.status()["running"] < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(engine, signal.SIGKILL)
    for t in (*streams, waiting):
        t.join(60)
        assert not t.is_alive()
    for s in streams:
        assert s.status == 200 and s.error is None, (s.kind, s.status, s.error)

    # OpenAI: an error object, then [DONE]; no finish chunk
    assert chat.lines[-1] == "data: [DONE]", chat.lines[-3:]
    data = [json.loads(x.removeprefix("data: ")) for x in chat.lines
            if x.startswith("data: {")]
    err = data[-1]["error"]
    assert err["code"] == "engine_lost" and f"pid {engine}" in err["message"], err
    assert "SIGKILL" in err["message"]
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in data)
    # Anthropic: an error event, no message_stop
    events = [x.removeprefix("event: ") for x in messages.lines if x.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events, events[-4:]
    body = json.loads(messages.lines[messages.lines.index("event: error") + 1]
                      .removeprefix("data: "))
    assert body["type"] == "error" and f"pid {engine}" in body["error"]["message"], body
    # Responses: response.failed with the code; Ollama: an error line, no done object
    events = [x.removeprefix("event: ") for x in responses.lines if x.startswith("event: ")]
    assert events[-1] == "response.failed" and "response.completed" not in events, events[-3:]
    failed = json.loads(responses.lines[-1].removeprefix("data: "))
    assert failed["response"]["error"]["code"] == "engine_lost", failed
    lines = [json.loads(x) for x in ollama.lines]
    assert not any(x.get("done") for x in lines) and lines[-1]["code"] == "engine_lost", lines[-2:]
    assert f"pid {engine}" in lines[-1]["error"]
    # not streamed: a 503 with the reason
    r = plain["r"]
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["code"] == "engine_lost"

    assert wait_gone(engine, 10)
    down = worker.status()
    assert down["ready"] is False and "SIGKILL" in down["engine_down"]
    assert httpx.get(worker.url + "/health", timeout=10).status_code == 503
    # the next request starts a new engine process and is served
    ok = httpx.post(worker.url + "/v1/chat/completions", timeout=120,
                    json={**CHAT, "stream": False, "max_tokens": 8})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    after = worker.wait_idle()
    assert after["ready"] is True and after["engine_pid"] not in (engine, before["pid"])
    assert after["pid"] == before["pid"] and "engine_down" not in after
    assert after["pool"]["total"] == before["pool"]["total"]
    assert httpx.get(worker.url + "/health", timeout=10).json() == {"status": "ok"}


def test_an_api_process_killed_takes_its_engine_process_along(tiny_model, tmp_path):
    w = Worker(tiny_model, log=tmp_path / "worker.log")
    try:
        status = w.status()
        stream = Stream(w.url + "/v1/chat/completions", CHAT, "openai")
        stream.start()
        assert stream.ready.wait(60)
        os.kill(status["pid"], signal.SIGKILL)
        w.proc.wait(10)
        stream.join(30)
        assert stream.error is not None  # the stream was cut: no error event from a dead API
        assert wait_gone(status["engine_pid"], 15), "the engine outlived its API process"
    finally:
        w.stop()
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


def test_the_api_process_loads_the_tokenizer_without_mlx_where_none_is_handed_over(tiny_model):
    """The fallback for a tokenizer the engine cannot pickle: loaded in the API process from
    the model directory with the engine's EOS ids, as mlx-lm loads it, and still no mlx."""
    from mlx_lm.utils import load_tokenizer

    code = ("import json, sys\n"
            "from plimsoll.worker import tokenizer as T\n"
            f"t = T.from_engine(None, {str(tiny_model)!r}, [2])\n"
            "d = t.detokenizer\n"
            "ids = t.encode('hello world, again')\n"
            "print(json.dumps({'mlx': sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'),"
            " 'ids': ids, 'eos': sorted(t.eos_token_ids), 'detok': type(d).__name__,"
            " 'chat': t.apply_chat_template([{'role': 'user', 'content': 'hi'}],"
            " add_generation_prompt=True)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = load_tokenizer(tiny_model)
    assert got["mlx"] == []
    assert got["ids"] == want.encode("hello world, again")
    assert got["eos"] == sorted(want.eos_token_ids)
    assert got["detok"] == type(want.detokenizer).__name__
    assert got["chat"] == want.apply_chat_template([{"role": "user", "content": "hi"}],
                                                   add_generation_prompt=True)
