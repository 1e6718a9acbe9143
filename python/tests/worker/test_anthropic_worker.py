"""The Anthropic Messages API on a real worker: uvicorn on 127.0.0.1, mlx-lm inference, and
the official ``anthropic`` client, unchanged.

The worker is a real ``plimsoll worker`` process (``conftest.Worker``). A random-weight
model does not call tools;
the ``tool_use`` path is covered at the protocol level (test_anthropic_protocol.py).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import Worker

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
HELLO = [{"role": "user", "content": "hello there"}]
# The current SDK no longer lists sampling parameters; the API still takes them as body fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = Worker(tiny_model, default_max_tokens=256)
    yield w
    w.stop()


def client(w: Worker) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=w.url, api_key="none", max_retries=0, timeout=120)


def test_create_and_stream_agree(worker):
    c = client(worker)
    long_hello = [{"role": "user", "content": "hello there, how are you today? " * 6}]
    msg = c.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY,
                            messages=long_hello)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "tiny" and msg.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in msg.content)
    text = "".join(b.text for b in msg.content)
    assert 0 < msg.usage.output_tokens <= 12
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt > 40

    with c.messages.stream(model="tiny", max_tokens=12, extra_body=GREEDY,
                           messages=long_hello) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text  # greedy: the same answer, streamed
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: a prefix hit


def test_raw_stream_is_anthropic_sse(worker):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True,
            "messages": HELLO}
    with httpx.stream("POST", worker.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert all(f.split("\n")[1].startswith("data: {") for f in frames)
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    if "content_block_start" in names:
        assert names[2] == "content_block_start" and names[-3] == "content_block_stop"


def test_system_and_stop_sequences(worker):
    c = client(worker)
    system = "You are terse."
    base = c.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, system=system,
                             messages=HELLO)
    text = "".join(b.text for b in base.content)
    assert len(text) >= 8, f"the demo model ended early: {text!r}"
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = c.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, system=system,
                            messages=HELLO, stop_sequences=["never-there", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[:text.find(stop)]
    # the system prompt reaches the template, as a string or as (cache_control) text blocks
    with_system = base.usage.input_tokens + base.usage.cache_read_input_tokens
    assert with_system > c.messages.count_tokens(model="tiny", messages=HELLO).input_tokens
    as_blocks = c.messages.count_tokens(model="tiny", messages=HELLO, system=[
        {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])
    assert as_blocks.input_tokens == with_system


def test_count_tokens_matches_the_prompt(worker):
    c = client(worker)
    history = [*HELLO, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}]}]
    counted = c.messages.count_tokens(model="tiny", system="Be brief.", tools=[WEATHER],
                                      messages=history)
    msg = c.messages.create(model="tiny", max_tokens=4, system="Be brief.", tools=[WEATHER],
                            tool_choice={"type": "auto"}, messages=history)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    bare = c.messages.count_tokens(model="tiny", messages=HELLO)
    assert 3 < bare.input_tokens < counted.input_tokens


def test_bad_requests_in_anthropic_shape(worker):
    c = client(worker)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 2},
                          messages=HELLO)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    clamped = c.messages.with_raw_response.create(model="tiny", max_tokens=10**5,
                                                  messages=HELLO)  # over the limit: clamped
    assert clamped.headers["x-plimsoll-max-tokens"] == "512"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=(1 << 20) + 1, messages=HELLO)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-opus-4-1", max_tokens=8, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "'tiny'" in e.value.body["error"]["message"]

    r = httpx.post(worker.url + "/v1/messages", timeout=10,
                   json={"model": "tiny", "max_tokens": 8, "messages": HELLO, "n": 2})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": r.json()["error"]["message"]}}
    assert "Unknown field 'n'" in r.json()["error"]["message"]
    r = httpx.post(worker.url + "/v1/messages", content=b"{nope", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(worker.url + "/v1/messages/count_tokens", timeout=10,
                   json={"model": "tiny", "messages": [{"role": "user", "content": [
                       {"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and "images are not supported" in r.json()["error"]["message"]
    over = httpx.post(worker.url + "/v1/messages", timeout=30,
                      json={"model": "tiny", "max_tokens": 100,
                            "messages": [{"role": "user", "content": "word " * 5000}]})
    assert over.status_code == 400
    assert "configured total context: 4096 tokens" in over.json()["error"]["message"]


def test_disconnect_frees_blocks(worker):
    worker.wait_idle()
    body = {"model": "tiny", "max_tokens": 400, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "go"}]}
    with httpx.Client(timeout=60) as h, h.stream("POST", worker.url + "/v1/messages",
                                                 json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert worker.status()["running"] == 1
    s = worker.wait_idle(timeout=10)
    assert s["counters"].get("cancelled", 0) >= 1


@pytest.fixture(scope="module")
def small_worker(tiny_model):
    # One sequence of the whole context fits; a second concurrent one does not.
    w = Worker(tiny_model, max_cache_blocks=80, context=1024, max_tokens=900,
               default_max_tokens=256, cache_memory_mb=0, max_wait=0.5, max_num_seqs=4)
    yield w
    w.stop()


def test_pool_exhausted_is_503_overloaded_with_retry_after(small_worker):
    w = small_worker
    c = client(w)
    results: dict = {}

    def hog():
        results["hog"] = c.messages.create(model="tiny", max_tokens=900, extra_body=GREEDY,
                                           messages=[{"role": "user", "content": "hog " * 30}])

    thread = threading.Thread(target=hog)
    thread.start()
    deadline = time.monotonic() + 30
    while w.status()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(anthropic.InternalServerError) as e:
        c.messages.create(model="tiny", max_tokens=900, messages=[{"role": "user",
                                                                  "content": "late"}])
    thread.join(120)
    assert e.value.status_code == 503
    assert e.value.response.headers["Retry-After"] == "1"
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "overloaded_error"
    assert "blocks" in e.value.body["error"]["message"]
    assert results["hog"].usage.output_tokens == 900 and results["hog"].stop_reason == \
        "max_tokens"
    w.wait_idle()
    ok = c.messages.create(model="tiny", max_tokens=20, messages=[{"role": "user",
                                                                  "content": "late"}])
    assert ok.usage.output_tokens <= 20
