"""Coding clients through ``plimsoll serve``: model aliases and the default rule for client
model names, the clamp's header relayed, the access log, ``Retry-After`` on every refusal
under a burst, and SIGTERM mid-stream at the proxy."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import anthropic
import httpx
import pytest
from test_proxy import Proxy

HI = [{"role": "user", "content": "hello there"}]


def policy(tmp, tiny_model, **extra) -> str:
    path = tmp / "policy.json"
    path.write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 4}, "clustered": {"maxLocalLlmGb": 4}},
        "models": {"m": {"path": str(tiny_model), "context": 4096, "maxTokens": 64,
                         "concurrency": 2},
                   "n": {"path": str(tiny_model), "context": 4096, "maxTokens": 64}},
        **extra}))
    return str(path)


@pytest.fixture(scope="module")
def proxy(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients-proxy")
    p = Proxy(["--policy", policy(tmp, tiny_model, aliases={"my-*": "n"}, defaultModel="m"),
               "--max-waiting", "2"], tmp / "serve.log",
              {"PLIMSOLL_CACHE": str(tmp / "cache")})
    yield p
    assert not p.stop()


def test_client_model_names_are_served_by_the_default_model_and_aliases(proxy):
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0, timeout=180)
    msg = client.messages.create(model="claude-haiku-4-5-20251001", max_tokens=32000,
                                 messages=HI)
    assert msg.model == "m" and msg.usage.output_tokens <= 64
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=180, json={
        "model": "my-favourite", "messages": HI, "max_tokens": 32000})
    assert r.status_code == 200 and r.json()["model"] == "n"
    assert r.headers["x-plimsoll-max-tokens"] == "64"  # the worker's clamp, relayed
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "llama-3", "messages": HI})
    assert r.status_code == 404 and "aliases" in r.json()["error"]["message"]
    log = proxy.log.read_text()
    assert 'route="POST /v1/messages" model=m status=200' in log
    assert "reservation=64" in log and "completion=" in log


def test_retry_after_on_every_refusal_at_the_proxy_under_a_burst(proxy):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as c:
            await c.post(proxy.url + "/unload")
            return await asyncio.gather(*(c.post(proxy.url + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hog " * 30}],
                "max_tokens": 64, "stream": i % 2 == 0}) for i in range(30)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code in (429, 503)]
    assert refused and all(r.status_code in (200, 429, 503) for r in responses)
    for r in refused:
        assert r.headers.get("retry-after", "").isdigit(), (r.status_code, r.text)


def test_sigterm_mid_stream_at_the_proxy(tiny_model, tmp_path):
    p = Proxy(["--policy", policy(tmp_path, tiny_model), "--drain-timeout", "1"],
              tmp_path / "serve.log", {"PLIMSOLL_CACHE": str(tmp_path / "cache")})
    lines: list[str] = []
    t = time.monotonic()
    with httpx.stream("POST", p.url + "/v1/chat/completions", timeout=180, json={
            "model": "m", "messages": HI, "stream": True, "max_tokens": 64 * 30}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 4:
                p.proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][5:])
    assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length")
    assert p.proc.wait(60) == 0
    assert time.monotonic() - t < 60
    assert "Traceback" not in p.log.read_text()
