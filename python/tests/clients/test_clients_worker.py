"""What real coding clients send, against a real worker: the openai and anthropic SDKs
through every tolerated field, max_tokens clamping, system messages inside ``messages``,
thinking, the access log, ``Retry-After`` under a burst, and SIGTERM mid-stream."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import Worker

HI = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
A_TOOL = {"name": "Read", "description": "Read a file.", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}}}


@pytest.fixture(scope="module")
def wlog(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("clients-worker") / "worker.log"


@pytest.fixture(scope="module")
def cw(tiny_model, wlog) -> Worker:
    w = Worker(tiny_model, log=wlog, **{"max-tokens": 64, "default-max-tokens": 16,
                                        "context": 2048, "max-queue": 2, "max-num-seqs": 2})
    yield w
    w.stop()


def access_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "plimsoll.access" in line]


def test_openai_sdk_every_tolerated_field_and_the_clamp(cw, wlog):
    client = openai.OpenAI(base_url=cw.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HI, max_tokens=32000, temperature=0, tools=[TOOL],
        reasoning_effort="high", parallel_tool_calls=True, user="u1", store=False,
        metadata={"k": "v"}, prediction={"type": "content", "content": "hello"},
        service_tier="auto", logprobs=False, stream_options=None,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low"})
    assert raw.http_response.status_code == 200
    assert raw.headers["x-plimsoll-max-tokens"] == "64"  # clamped to the worker's limit
    done = raw.parse()
    assert done.usage.completion_tokens <= 64
    if done.usage.completion_tokens == 64:
        assert done.choices[0].finish_reason == "length"
    # streamed, with usage: the same clamp, the header on the stream too
    with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=HI, max_completion_tokens=5000, stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
            temperature=0) as resp:
        assert resp.headers["x-plimsoll-max-tokens"] == "64"
        chunks = list(resp.parse())
    assert chunks[-1].usage.completion_tokens <= 64
    lines = access_lines(wlog)
    ours = [line for line in lines if 'route="POST /v1/chat/completions"' in line
            and "reservation=64" in line and "status=200" in line and "prompt=" in line
            and "ttft_s=" in line]
    assert ours, lines
    # where the time went: parsed, rendered, handed to the scheduler, admitted, first token,
    # in that order
    times = {k: float(v) for k, v in (kv.split("=") for kv in ours[-1].split()
                                      if kv.endswith(tuple("0123456789"))
                                      and kv.split("=")[0].endswith("_s"))}
    assert 0 <= times["parse_s"] <= times["submit_s"] <= times["admit_s"] <= times["ttft_s"]
    # each figure is rounded to the millisecond on its own, so a part may exceed the
    # difference of two others by up to 1.5 ms of rounding
    assert 0 <= times["render_s"] <= times["submit_s"] - times["parse_s"] + 0.0015
    assert "'prediction' (logged once)" in wlog.read_text()


def test_unknown_fields_are_still_refused_by_name(cw):
    r = httpx.post(cw.url + "/v1/chat/completions", json={"messages": HI, "frobnicate": 1})
    assert r.status_code == 400 and "'frobnicate'" in r.json()["error"]["message"]
    r = httpx.post(cw.url + "/v1/messages", json={"model": "tiny", "max_tokens": 5,
                                                  "messages": HI, "frobnicate": 1})
    assert r.status_code == 400 and "'frobnicate'" in r.json()["error"]["message"]


def test_refuse_policy_keeps_the_400(tiny_model, tmp_path):
    w = Worker(tiny_model, log=tmp_path / "w.log",
               **{"max-tokens": 64, "context": 2048, "max-tokens-over-limit": "refuse"})
    try:
        r = httpx.post(w.url + "/v1/chat/completions", json={"messages": HI,
                                                              "max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_too_large"
    finally:
        w.stop()


def test_prompt_alone_over_the_context_stays_a_400_with_the_figures(cw):
    r = httpx.post(cw.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 10})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    for figure in ("model-native maximum context", "configured total context: 2048",
                   "prompt:", "output reservation", "total:"):
        assert figure in msg


def claude_code_body(**extra) -> dict:
    """The shape of Claude Code's first request (recorded from 2.1.332), shortened."""
    return {
        "model": "tiny", "max_tokens": 32000, "stream": True,
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "system": [{"type": "text", "text": "You are Claude Code."},
                   {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x"},
                                         {"type": "text", "text": "say hi"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd /tmp",
                                            "cache_control": {"type": "ephemeral"}}]}],
        "tools": [A_TOOL | {"cache_control": {"type": "ephemeral"}},
                  {"name": "DeferredToolPlaceholder", "description": "d", "input_schema": {
                      "type": "object"}, "defer_loading": True}],
        **extra}


def test_claude_code_shaped_request_streams(cw):
    with httpx.stream("POST", cw.url + "/v1/messages?beta=true", json=claude_code_body(),
                      headers={"anthropic-beta": "context-management-2025-06-27"},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-plimsoll-max-tokens"] == "64"
        events = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"


def test_anthropic_sdk_through_beta_fields_and_thinking(cw):
    client = anthropic.Anthropic(base_url=cw.url, api_key="x", max_retries=0)
    body = claude_code_body()
    kwargs = {k: body[k] for k in ("system", "tools", "metadata")}
    msg = client.beta.messages.create(
        model="tiny", max_tokens=20000, messages=body["messages"], **kwargs,
        thinking={"type": "enabled", "budget_tokens": 1024},
        betas=["context-management-2025-06-27"],
        extra_body={"context_management": body["context_management"],
                    "output_config": {"effort": "low"}, "service_tier": "auto"})
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert msg.usage.output_tokens <= 64
    with client.messages.stream(model="tiny", max_tokens=32000, messages=HI,
                                thinking={"type": "enabled", "budget_tokens": 2048}) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens <= 64
    count = client.messages.count_tokens(model="tiny", messages=body["messages"],
                                         system=body["system"], tools=body["tools"])
    assert count.input_tokens > 10


def test_retry_after_on_every_refusal_under_a_burst(cw):
    """2 running + 2 queued fit; the rest of a bounded burst is refused, always with a hint."""

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [c.post(cw.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hog " * 40}], "max_tokens": 64,
                "stream": i % 2 == 0}) for i in range(40)]
            return await asyncio.gather(*reqs)

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code in (429, 503)]
    assert refused, [r.status_code for r in responses]
    assert all(r.status_code in (200, 429, 503) for r in responses)
    for r in refused:
        assert r.headers.get("retry-after", "").isdigit(), (r.status_code, r.text)
    assert {r.json()["error"]["code"] for r in refused} <= {"queue_full", "pool_exhausted",
                                                           "queue_timeout", "too_many_requests"}


def content(chunk: dict) -> str:
    """The text a chat completion chunk adds ("" for the role, finish or error chunks)."""
    return ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""


def sigterm_mid_stream(url: str, proc: subprocess.Popen, path: str, body: dict
                       ) -> tuple[list[str], float, int]:
    """Start a stream, SIGTERM the server when its first token arrives (an event, not a
    count of lines: keep-alives and opening chunks are not tokens), read to the end.
    Returns the lines, the seconds from the signal to the stream's end, and the exit status."""
    lines: list[str] = []
    signalled = None
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            lines.append(line)
            if (signalled is None and line.startswith("data: {")
                    and content(json.loads(line[5:]))):
                # the time first: a loaded box may run the worker's whole drain between
                # the signal and this process's next instruction
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)
    assert signalled is not None, lines  # the stream had a token to signal on
    return lines, time.monotonic() - signalled, proc.wait(60)


@pytest.mark.parametrize("drain, ends", [(30, "finish"), (0.5, "error")])
def test_sigterm_mid_stream_ends_the_stream_properly(tiny_model, tmp_path, drain, ends):
    """A stream running at SIGTERM finishes within the drain time, or ends with the error
    event once the drain time is up. Deterministic: the signal goes on the first token, and
    ``ignore_eos`` means only ``max_tokens`` ends the answer (a sampled EOS on an early
    token once ended the stream before the signal was ever sent); 64 tokens take far less
    than 30 s on any machine, and 1,500 far more than 0.5 s."""
    log = tmp_path / "worker.log"
    w = Worker(tiny_model, log=log, **{"max-tokens": 1500, "context": 2048,
                                       "drain-timeout": drain})
    max_tokens = 1500 if ends == "error" else 64
    body = {"messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True}
    lines, after_signal, rc = sigterm_mid_stream(w.url, w.proc, "/v1/chat/completions", body)
    data = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]"
    last = data[-1]
    tokens = sum(1 for d in data if content(d))
    if ends == "error":
        assert last["error"]["code"] == "worker_stopping", last
        # the drain, then cut short
        assert after_signal >= drain and tokens < max_tokens, (after_signal, last)
    else:
        assert last["choices"][0]["finish_reason"] == "length", last
    assert rc == 0
    assert "Traceback" not in log.read_text()


def test_a_slow_start_opens_the_stream_early_with_keep_alives(tiny_model, tmp_path):
    """A stream not started at once gets its headers and opening events, then keep-alives
    until its first token — while it waits for admission and while its prompt is prefilled
    — so clients that give up on a silent connection (Node's body timeout: 300 s) keep
    waiting. The prefill is made genuinely slow: ~1,000 prompt tokens in chunks of 16 are
    ~60 engine steps, each longer than the 20 ms keep-alive period on any machine."""
    w = Worker(tiny_model, log=tmp_path / "w.log", extra_env={
        "PLIMSOLL_EARLY_HEADERS_S": "0", "PLIMSOLL_KEEPALIVE_S": "0.02"},
        **{"max-tokens": 64, "context": 4096, "prefill-chunk": 16})
    long = [{"role": "user", "content": "def f(x): return x " * 150}]
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", w.url + "/v1/messages", timeout=120, json={
                "model": "tiny", "max_tokens": 8, "stream": True, "messages": long}) as r:
            assert r.status_code == 200
            seen = [(time.monotonic(), x) for x in r.iter_lines() if x.startswith("event: ")]
        events = [x for _, x in seen]
        assert events[0] == "event: message_start" and events[1] == "event: ping"
        assert events[-1] == "event: message_stop"
        first_block = events.index("event: content_block_start")
        pings = events[:first_block].count("event: ping")
        # Admission is immediate here: all but the first ping came during the prefill.
        assert pings >= 3, (pings, seen[first_block][0] - t0)
        client = anthropic.Anthropic(base_url=w.url, api_key="x", max_retries=0)
        with client.messages.stream(model="tiny", max_tokens=8, messages=long) as s:
            final = s.get_final_message()
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 100
        other = [{"role": "user", "content": "class A: pass " * 150}]  # no cached prefix
        with httpx.stream("POST", w.url + "/v1/chat/completions", timeout=120, json={
                "max_tokens": 8, "stream": True, "messages": other}) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines.count(": keep-alive") >= 3 and lines[-1] == "data: [DONE]"
        third = "import os; " * 150  # the Responses API (Codex) opens early too
        with httpx.stream("POST", w.url + "/v1/responses", timeout=120, json={
                "max_output_tokens": 8, "stream": True, "input": third}) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines[0] == "event: response.created"
        assert lines.count(": keep-alive") >= 3
        assert lines[-2] in ("event: response.completed", "event: response.incomplete")
        oa = openai.OpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        chunks = list(oa.chat.completions.create(model="tiny", messages=long, max_tokens=8,
                                                 stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        w.stop()
