"""Bad input over real HTTP: a real worker and a real proxy, hypothesis-generated requests.

One ``plimsoll worker`` (the tiny demo model, context 512, output reservation ≤ 8, no
prefix cache so its pool has one exact baseline) and one ``plimsoll serve`` proxy in front
of the same model receive malformed bytes, wrong types for every field, impossible
``max_tokens``, prompts over the context, unknown models, wrong content types, bodies over
the cap and headers past uvicorn's limits, on the OpenAI, the Anthropic and Ollama's routes.

The contract checked on every answer: a 4xx whose body says why, in the route's protocol
(OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", "error": {...}}``, Ollama's
``{"error": "..."}``) — never a 5xx; only a request that happens to be valid may be served
(200), and any such request is cheap (≤ 8 output tokens). At the end both processes are
alive, nothing runs or waits, the worker's pool is back at its baseline and nobody logged a
traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Worker
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_proxy import Proxy

MODEL = "tiny"
KEY = "k3y"  # the proxy's API key; the worker ignores it
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT, MAX_TOKENS = 512, 8
BODY_CAP = 8 * 1024 * 1024
MSG = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": MSG, "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": MSG, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": MSG},
    "/v1/responses": {"model": MODEL, "max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
}
ROUTES = list(BASES)
FIELDS: dict[str, list[tuple]] = {
    "/v1/chat/completions": [
        ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
        ("messages", 0, "name"), ("messages", 0, "tool_calls"), ("model",), ("max_tokens",),
        ("max_completion_tokens",), ("temperature",), ("top_p",), ("seed",), ("stop",),
        ("stream",), ("stream_options",), ("n",), ("tools",), ("tool_choice",),
        ("response_format",), ("logprobs",), ("top_logprobs",), ("presence_penalty",),
        ("user",), ("parallel_tool_calls",)],
    "/v1/completions": [
        ("prompt",), ("model",), ("max_tokens",), ("temperature",), ("top_p",), ("seed",),
        ("stop",), ("stream",), ("echo",), ("logprobs",), ("best_of",), ("suffix",), ("n",)],
    "/v1/messages": [
        ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
        ("model",), ("max_tokens",), ("system",), ("stop_sequences",), ("temperature",),
        ("top_p",), ("top_k",), ("stream",), ("tools",), ("tool_choice",), ("thinking",),
        ("metadata",)],
    "/v1/messages/count_tokens": [
        ("messages",), ("messages", 0, "content"), ("model",), ("system",), ("tools",),
        ("tool_choice",), ("thinking",)],
    "/v1/responses": [
        ("input",), ("input", 0), ("input", 0, "role"), ("input", 0, "content"),
        ("input", 0, "type"), ("model",), ("instructions",), ("max_output_tokens",),
        ("temperature",), ("top_p",), ("stream",), ("tools",), ("tool_choice",), ("text",),
        ("previous_response_id",), ("store",), ("reasoning",), ("include",), ("metadata",)],
}
HTTP = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                           max_leaves=8)


# --- the servers ------------------------------------------------------------------------------

class Servers:
    """The worker, the proxy and one client; ``url(target)`` is either server's base URL."""

    def __init__(self, worker: Worker, proxy: Proxy, baseline: dict[str, Any],
                 worker_log: Path) -> None:
        self.worker, self.proxy, self.baseline = worker, proxy, baseline
        self.worker_log = worker_log
        self.client = httpx.Client(timeout=120, headers=AUTH)

    def url(self, target: str) -> str:
        return self.worker.url if target == "worker" else self.proxy.url

    def post(self, target: str, path: str, **kw) -> httpx.Response:
        return self.client.post(self.url(target) + path, **kw)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("bad-input")
    worker = Worker(tiny_model, log=tmp / "worker.log", context=CONTEXT,
                    max_tokens=MAX_TOKENS, default_max_tokens=4, max_cache_blocks=512,
                    cache_memory_mb=0, max_num_seqs=4)
    huge = tmp / "huge"  # claims 4 MiB of KV per token: admission refuses it unloaded
    shutil.copytree(tiny_model, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "head_dim": 65536}))
    broken = tmp / "broken"  # a download that lost its config.json
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").unlink()
    untokenized = tmp / "untokenized"  # weights and config, but no tokenizer
    shutil.copytree(tiny_model, untokenized)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (untokenized / name).unlink()
    small = {"context": CONTEXT, "maxTokens": MAX_TOKENS}
    (tmp / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 1}, "clustered": {"maxLocalLlmGb": 1}},
        "models": {MODEL: {"path": str(tiny_model), "context": CONTEXT,
                           "maxTokens": MAX_TOKENS, "concurrency": 2},
                   "huge": {"path": str(huge), **small},
                   "broken": {"path": str(broken), **small},
                   "untokenized": {"path": str(untokenized), **small},
                   "long": {"path": str(tiny_model), "context": 2048, "maxTokens": 1024}}}))
    (tmp / "token").write_text("admin-secret\n")
    try:
        proxy = Proxy(["--policy", str(tmp / "policy.json"), "--admin-token-file",
                       str(tmp / "token"), "--api-key", KEY], tmp / "serve.log",
                      {"PLIMSOLL_CACHE": str(tmp / "cache")}, api_key=KEY)
    except BaseException:
        worker.stop()
        raise
    s = Servers(worker, proxy, worker.wait_idle(), tmp / "worker.log")
    try:
        yield s
    finally:
        s.client.close()
        left = proxy.stop()
        worker.stop()
        assert not left, f"workers outlived the proxy: {left}"


# --- what every refusal must look like --------------------------------------------------------

def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def assert_refused(r: httpx.Response, path: str, *statuses: int) -> dict[str, Any]:
    """A 4xx (one of ``statuses`` when given) with a reason, in the route's error shape."""
    assert r.status_code < 500, f"{r.status_code} on {path}: {r.text[:500]}"
    assert r.status_code >= 400, f"{r.status_code} on {path}: {r.text[:300]}"
    if statuses:
        assert r.status_code in statuses, f"{r.status_code} on {path}: {r.text[:500]}"
    body = r.json()
    if is_anthropic(path):
        assert body.get("type") == "error", body
    err = body["error"]
    assert isinstance(err["message"], str) and len(err["message"]) > 10, body
    assert isinstance(err["type"], str) and err["type"], body
    return err


def assert_served_or_refused(r: httpx.Response, path: str) -> None:
    """A valid request may be served; anything else is a reasoned 4xx."""
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert "error" not in r.text.split("\n", 2)[0], r.text[:300]
        else:
            assert isinstance(r.json(), dict)
        return
    assert_refused(r, path, 400, 404)


def mutate(obj: Any, path: tuple, value: Any) -> Any:
    """``obj`` with the item at ``path`` replaced by ``value`` (parents created as needed)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, list) and isinstance(head, int) and head < len(obj):
        return [mutate(x, rest, value) if i == head else x for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        return {**obj, head: mutate(obj.get(head), rest, value)}
    return value


targets = st.sampled_from(["worker", "proxy"])
routes = st.sampled_from(ROUTES)


# --- malformed bodies -------------------------------------------------------------------------

def _invalid_utf8(data: bytes) -> bytes:
    body = json.dumps({"model": MODEL, "messages": MSG, "prompt": "x"}).encode()
    cut = len(data) % len(body)
    return body[:cut] + b"\xff" + data + body[cut:]


malformed = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=40).map(_invalid_utf8),
    st.text(max_size=200).map(str.encode),
    st.sampled_from([b"", b" ", b"\n\t", b"null", b"1", b'"x"', b"[]", b"[{}]", b"true",
                     b"{", b'{"model": ', b"{'model': 'tiny'}", b"NaN", b'{"max_tokens": NaN}',
                     b'{"max_tokens": Infinity}', b"\xef\xbb\xbf", b"\x00" * 16]),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 200_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(4000, 20_000).map(lambda n: b'{"max_tokens": ' + b"9" * n + b"}"),
    JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
)


@HTTP
@given(target=targets, path=routes, body=malformed)
@example(target="proxy", path="/v1/messages", body=b"[" * 100_000)
@example(target="worker", path="/v1/completions", body=b'{"prompt": "\\ud800"}')
def test_malformed_bodies_are_400_with_a_reason(servers, target, path, body):
    r = servers.post(target, path, content=body, headers={"content-type": "application/json"})
    assert_refused(r, path, 400, 404)  # 404: a parseable object naming no served model


@HTTP
@given(target=targets, path=routes, data=st.data())
def test_lone_surrogates_anywhere_are_400_not_a_tokenizer_crash(servers, target, path, data):
    field = data.draw(st.sampled_from([p for p in FIELDS[path]
                                       if p[-1] in ("content", "prompt", "system", "user")]
                                      or [("messages", 0, "content")]))
    text = data.draw(st.text(max_size=5)) + "\ud800" + data.draw(st.text(max_size=5))
    raw = json.dumps(mutate(BASES[path], field, text)).encode()  # ensure_ascii: "\ud800"
    err = assert_refused(servers.post(target, path, content=raw), path, 400)
    assert "surrogate" in err["message"]


# --- wrong types, for every field -------------------------------------------------------------

@settings(HTTP, max_examples=120)
@given(target=targets, path=routes, data=st.data())
def test_any_value_in_any_field_is_served_or_refused_with_a_reason(servers, target, path,
                                                                   data):
    field = data.draw(st.sampled_from(FIELDS[path]))
    value = data.draw(JSON_VALUES)
    r = servers.post(target, path, json=mutate(BASES[path], field, value))
    assert_served_or_refused(r, path)


WRONG_MAX_TOKENS = st.one_of(
    st.integers(max_value=0), st.integers(min_value=(1 << 20) + 1, max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.text(max_size=6),
    st.lists(st.integers(1, 4), max_size=2), st.dictionaries(st.text(max_size=3), st.none(),
                                                             max_size=1),
)


@HTTP
@given(target=targets, path=routes, value=WRONG_MAX_TOKENS)
@example(target="worker", path="/v1/chat/completions", value=10**30)
@example(target="proxy", path="/v1/messages", value=-1)
@example(target="worker", path="/v1/completions", value=2.0)
@example(target="proxy", path="/v1/chat/completions", value=True)
def test_huge_negative_zero_float_bool_max_tokens_are_400(servers, target, path, value):
    r = servers.post(target, path, json={**BASES[path], "max_tokens": value})
    err = assert_refused(r, path, 400)
    assert "max_tokens" in err["message"], err


@HTTP
@given(target=targets, path=st.sampled_from(ROUTES[:3]), value=st.integers(MAX_TOKENS + 1, 1 << 20))
@example(target="proxy", path="/v1/messages", value=32000)
def test_max_tokens_over_the_limit_is_clamped_and_reported(servers, target, path, value):
    r = servers.post(target, path, json={**BASES[path], "max_tokens": value})
    assert r.status_code == 200, r.text[:300]
    assert r.headers["x-plimsoll-max-tokens"] == str(MAX_TOKENS)


@HTTP
@given(target=targets, path=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                             "/v1/messages"]),
       prompt_tokens=st.integers(CONTEXT, 4 * CONTEXT), as_ids=st.booleans())
def test_prompts_over_the_context_are_400_naming_the_figures(servers, target, path,
                                                             prompt_tokens, as_ids):
    if path == "/v1/completions" and as_ids:
        body = {**BASES[path], "prompt": [5] * prompt_tokens}
    else:
        words = " ".join(["hello"] * prompt_tokens)  # ≥ 1 token per word
        body = mutate(BASES[path], ("prompt",) if path == "/v1/completions"
                      else ("messages", 0, "content"), words)
    err = assert_refused(servers.post(target, path, json=body), path, 400)
    assert f"allows {CONTEXT}" in err["message"] and "configured total context" in err["message"]


@HTTP
@given(target=targets, path=routes, model=st.text(min_size=1, max_size=40).filter(
    lambda m: m != MODEL))
@example(target="proxy", path="/v1/chat/completions", model="nope")
@example(target="worker", path="/v1/messages", model=" tiny")
def test_unknown_models_are_404_naming_the_served_ones(servers, target, path, model):
    r = servers.post(target, path, json={**BASES[path], "model": model})
    err = assert_refused(r, path, 404)
    assert MODEL in err["message"], err


@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_a_non_string_model_is_400(servers, target):
    for path in ROUTES:
        r = servers.post(target, path, json={**BASES[path], "model": ["tiny"]})
        assert "model" in assert_refused(r, path, 400)["message"]


@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_streamed_bad_requests_are_plain_400_json_not_a_broken_stream(servers, target):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        r = servers.post(target, path, json={**BASES[path], "stream": True, "max_tokens": 0})
        assert r.headers["content-type"].startswith("application/json")
        assert_refused(r, path, 400)


@pytest.mark.parametrize(("model", "words"), [
    ("huge", "huge"), ("broken", "config.json"), ("untokenized", "has no tokenizer")])
def test_the_proxys_own_refusals_speak_the_routes_protocol(servers, model, words):
    """Refusals the proxy makes itself — admission's 503 for a model that cannot fit, a
    model directory that cannot be read or served: Anthropic's shape and error type on
    /v1/messages*, OpenAI's elsewhere; both carry the reason and the machine code."""
    for path in ROUTES:
        r = servers.post("proxy", path, json={**BASES[path], "model": model})
        assert r.status_code == 503, r.text
        body = r.json()
        err = body["error"]
        assert words in err["message"] and err["code"], body
        if is_anthropic(path):
            assert body["type"] == "error" and err["type"] == "overloaded_error", body
            assert "param" not in err, body
        else:
            assert "type" not in body and err["type"] == "server_error", body
    if model == "untokenized":  # refused before any worker was spawned for it
        running = servers.client.get(servers.proxy.url + "/running").json()
        spawned = [e for e in running["events"]
                   if e.get("model") == "untokenized" and e.get("kind") == "spawn"]
        assert spawned == [], spawned


def test_a_worker_lost_mid_stream_on_messages_ends_in_an_anthropic_error_event(servers):
    """The proxy's mid-stream error on /v1/messages is Anthropic's ``event: error`` (the SDK
    raises it), with the reason; the OpenAI routes' ``data: {"error"}`` + ``[DONE]`` is
    covered in test_proxy.py."""
    body = {"model": "long", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 1000, "temperature": 0, "stream": True}
    events: list[str] = []
    pid = None
    with servers.client.stream("POST", servers.proxy.url + "/v1/messages", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
                if events.count("content_block_delta") == 5:
                    pid = next(w["pid"] for w in servers.proxy.running()["workers"]
                               if w["model"] == "long")
                    os.kill(pid, signal.SIGKILL)
            elif line.startswith("data: ") and events and events[-1] == "error":
                error = json.loads(line.removeprefix("data: "))
    assert pid is not None and events[-1] == "error", events[-5:]
    assert "message_stop" not in events
    assert error["type"] == "error" and error["error"]["type"] == "api_error", error
    assert f"pid {pid}" in error["error"]["message"] and error["error"]["code"] == "worker_lost"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"x-api-key": "wrong"}, {"Authorization": "k3y"}])
def test_a_missing_or_wrong_api_key_is_401_in_the_routes_protocol(servers, headers):
    for path in ROUTES:
        r = httpx.post(servers.proxy.url + path, json=BASES[path], headers=headers, timeout=30)
        err = assert_refused(r, path, 401)
        assert "API key" in err["message"] and err["code"] == "unauthorized", err
        assert err["type"] == "authentication_error"
    assert httpx.post(servers.proxy.url + "/v1/messages/count_tokens", json=BASES[
        "/v1/messages/count_tokens"], headers={"x-api-key": KEY}, timeout=60).status_code == 200


def test_unknown_paths_and_wrong_methods(servers):
    """The proxy and the worker name what exists, in the path's protocol (JSON, never
    Starlette's plain text)."""
    c = servers.client
    for path, method, status in [("/v1/nope", "POST", 404), ("/v1/chat/completions", "GET", 405),
                                 ("/v1/messages", "GET", 405), ("/v1/messages/x", "POST", 404),
                                 ("/v1/models", "POST", 405), ("/" + "a" * 5000, "GET", 404)]:
        r = c.request(method, servers.proxy.url + path)
        err = assert_refused(r, path, status)
        assert (path[:40] in err["message"] if status == 404 else "POST" in err["message"]
                or "GET" in err["message"]), err
        r = c.request(method, servers.worker.url + path)
        err = assert_refused(r, path, status)
        assert err["code"] in {"unknown_route", "method_not_allowed"}, err


def test_admin_mode_refuses_any_other_body_with_400(servers):
    """The watcher's endpoint, with the admin token: any body but {"mode": ...} is a 400
    (deep nesting and an oversized body included), and the mode does not change."""
    url = servers.proxy.url + "/admin/mode"
    admin = {"Authorization": "Bearer admin-secret"}
    for body in [b"", b"x", b"[]", b'{"mode": 5}', b'{"mode": "x"}', b"[" * 100_000,
                 b'{"mode": "clustered", "x": 1}', b" " * (BODY_CAP + 1)]:
        r = httpx.post(url, content=body, headers=admin, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_mode", r.text
    assert httpx.get(url, headers=admin, timeout=30).json()["mode"] == "standalone"


# --- content types, sizes, headers ------------------------------------------------------------

@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_content_types(servers, target):
    """The body decides, not the header: ``curl -d`` sends a form content type with JSON,
    so JSON under any content type is served; a form or multipart body is a 400."""
    for path in ROUTES:
        body = {**BASES[path], "max_tokens": 1} if "max_tokens" in BASES[path] else BASES[path]
        r = servers.post(target, path, content=json.dumps(body),
                         headers={"content-type": "text/plain"})
        assert r.status_code == 200, r.text
        r = servers.post(target, path, data={"model": MODEL, "prompt": "hi"})
        assert "not valid JSON" in assert_refused(r, path, 400)["message"]
        r = servers.post(target, path, files={"f": ("a.json", b"{}")})
        assert_refused(r, path, 400)


@pytest.mark.parametrize("target", ["worker", "proxy"])
@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_over_the_cap_are_413(servers, target, chunked):
    size = BODY_CAP + 1024 * 1024

    def chunks():
        for _ in range(size // (1 << 20)):
            yield b" " * (1 << 20)

    for path in ROUTES:
        with httpx.Client(timeout=120, headers=AUTH) as c:  # the server may close it
            try:
                r = c.post(servers.url(target) + path,
                           content=chunks() if chunked else b" " * size)
            except httpx.TransportError:
                # The server answered and closed while the rest was still being sent; that
                # is allowed for a chunked body (it cannot be drained without reading it).
                assert chunked
                continue
        err = assert_refused(r, path, 413)
        assert str(BODY_CAP) in err["message"]


@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_enormous_or_many_headers_are_refused_or_closed_never_a_5xx(servers, target):
    cases = [{"x-big": "a" * 20_000}, {"x-big": "a" * (1 << 20)},
             [(f"x-h{i}", "v" * 16) for i in range(500)]]  # 10,000: see RAW_REQUESTS
    for headers in cases:
        with httpx.Client(timeout=60, headers=AUTH) as c:
            try:
                r = c.post(servers.url(target) + "/v1/completions", headers=headers,
                           json={"model": MODEL})
            except httpx.TransportError:
                continue  # the connection was closed: refused, and nothing was served
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])


H = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k3y\r\n"
RAW_REQUESTS = [  # each answered (or closed) without the client having to close first
    b"GARBAGE\r\n\r\n",
    H + b"Content-Length: abc\r\n\r\n{}",
    H + b"Content-Length: -1\r\n\r\n{}",
    H + b"Content-Length: 99999999999\r\n\r\n{}",
    H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    H + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}\r\n",
    H + b"x" * 100_000 + b"\r\n\r\n",
    b"POST /v1/\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    # 10,000 headers (raw: httpx itself takes seconds to send that many)
    H + b"Content-Length: 2\r\n"
    + b"".join(b"x-h%d: vvvvvvvvvvvvvvvv\r\n" % i for i in range(10_000)) + b"\r\n{}",
]
CUT_SHORT = [  # the client closes its side before the body it announced is complete
    H + b"Content-Length: 100\r\n\r\n{\"model\": ",
    H + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n",
]


def _exchange(port: int, raw: bytes, half_close: bool) -> bytes | None:
    """Send ``raw``; the server's first bytes, or None when it reset the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(raw)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            return s.recv(200)
        except OSError:
            return None


@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_broken_http_framing_is_a_400_or_a_close(servers, target):
    port = int(servers.url(target).rsplit(":", 1)[1])
    for raw, half_close in [(r, False) for r in RAW_REQUESTS] + [(r, True) for r in CUT_SHORT]:
        reply = _exchange(port, raw, half_close)
        if reply:  # else closed or reset: never served
            status = int(reply.split(b" ", 2)[1])
            assert 400 <= status < 500, (raw[:60], reply)


# --- Ollama's routes (/api/*): the same contract, in Ollama's {"error": "..."} ------------------

OLLAMA_BASES: dict[str, dict[str, Any]] = {
    "/api/chat": {"model": MODEL, "messages": MSG, "stream": False,
                  "options": {"num_predict": 2}},
    "/api/generate": {"model": MODEL, "prompt": "hi", "stream": False,
                      "options": {"num_predict": 2}},
    "/api/show": {"model": MODEL},
}
OLLAMA_FIELDS: dict[str, list[tuple]] = {
    "/api/chat": [
        ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
        ("messages", 0, "images"), ("messages", 0, "tool_calls"), ("messages", 0, "tool_name"),
        ("messages", 0, "thinking"), ("model",), ("stream",), ("format",), ("tools",),
        ("think",), ("keep_alive",), ("logprobs",), ("options",), ("options", "num_predict"),
        ("options", "num_ctx"), ("options", "temperature"), ("options", "top_p"),
        ("options", "top_k"), ("options", "seed"), ("options", "stop"),
        ("options", "repeat_penalty"), ("options", "num_gpu")],
    "/api/generate": [
        ("prompt",), ("model",), ("system",), ("raw",), ("suffix",), ("template",),
        ("context",), ("images",), ("stream",), ("format",), ("think",), ("options",),
        ("options", "num_predict"), ("options", "num_ctx"), ("options", "stop")],
    "/api/show": [("model",), ("name",), ("verbose",)],
}
OLLAMA_ROUTES = list(OLLAMA_BASES)
OLLAMA_MANAGEMENT = [("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
                     ("POST", "/api/copy"), ("DELETE", "/api/delete"),
                     ("POST", "/api/blobs/sha256:00"), ("POST", "/api/embed")]


def ollama_target(data: Any, path: str) -> str:
    """The worker serves generation only; the listings are the proxy's."""
    return data.draw(targets) if path != "/api/show" else "proxy"


def assert_ollama_refused(r: httpx.Response, path: str, *statuses: int) -> str:
    """A 4xx (one of ``statuses`` when given) whose body is Ollama's ``{"error": "..."}``."""
    assert 400 <= r.status_code < 500, f"{r.status_code} on {path}: {r.text[:500]}"
    if statuses:
        assert r.status_code in statuses, f"{r.status_code} on {path}: {r.text[:500]}"
    body = r.json()
    assert isinstance(body["error"], str) and len(body["error"]) > 10, body
    return body["error"]


def assert_ollama_served_or_refused(r: httpx.Response, path: str) -> None:
    if r.status_code == 200:
        for line in r.text.splitlines():  # one object, or an NDJSON stream
            assert "error" not in json.loads(line), r.text[:300]
        return
    assert_ollama_refused(r, path, 400, 404)


@HTTP
@given(path=st.sampled_from(OLLAMA_ROUTES), body=malformed, data=st.data())
def test_ollama_malformed_bodies_are_400_with_a_reason(servers, path, body, data):
    r = servers.post(ollama_target(data, path), path, content=body,
                     headers={"content-type": "application/json"})
    assert_ollama_refused(r, path, 400, 404)


@settings(HTTP, max_examples=120)
@given(path=st.sampled_from(OLLAMA_ROUTES), data=st.data())
def test_ollama_any_value_in_any_field_is_served_or_refused(servers, path, data):
    field = data.draw(st.sampled_from(OLLAMA_FIELDS[path]))
    body = mutate(OLLAMA_BASES[path], field, data.draw(JSON_VALUES))
    assert_ollama_served_or_refused(servers.post(ollama_target(data, path), path, json=body),
                                    path)


@HTTP
@given(path=st.sampled_from(OLLAMA_ROUTES), data=st.data())
def test_ollama_lone_surrogates_are_400(servers, path, data):
    field = {"/api/chat": ("messages", 0, "content"), "/api/generate": ("prompt",),
             "/api/show": ("model",)}[path]
    raw = json.dumps(mutate(OLLAMA_BASES[path], field, "a\ud800")).encode()
    err = assert_ollama_refused(servers.post(ollama_target(data, path), path, content=raw),
                                path, 400)
    assert "surrogate" in err


@HTTP
@given(path=st.sampled_from(OLLAMA_ROUTES), model=st.text(min_size=1, max_size=40).filter(
    lambda m: m not in (MODEL, f"{MODEL}:latest")), data=st.data())
def test_ollama_unknown_models_are_404_naming_the_served_ones(servers, path, model, data):
    r = servers.post(ollama_target(data, path), path, json={**OLLAMA_BASES[path], "model": model})
    assert MODEL in assert_ollama_refused(r, path, 404)


@HTTP
@given(body=malformed | JSON_VALUES.map(lambda v: json.dumps(v).encode()),
       route=st.sampled_from(OLLAMA_MANAGEMENT))
def test_ollama_model_management_is_400_whatever_the_body(servers, body, route):
    method, path = route
    r = servers.client.request(method, servers.proxy.url + path, content=body)
    assert "not supported here" in assert_ollama_refused(r, path, 400)


def test_ollama_a_worker_lost_mid_stream_ends_in_an_error_line(servers):
    """The proxy's mid-stream error on an NDJSON stream is one ``{"error"}`` line (which the
    ollama client raises), with the reason; no ``done`` object follows."""
    body = {"model": "long", "messages": [{"role": "user", "content": "hello there"}],
            "options": {"num_predict": 1000, "temperature": 0}}
    objects: list[dict[str, Any]] = []
    pid = None
    with servers.client.stream("POST", servers.proxy.url + "/api/chat", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        for line in r.iter_lines():
            objects.append(json.loads(line))
            if len(objects) == 5:
                pid = next(w["pid"] for w in servers.proxy.running()["workers"]
                           if w["model"] == "long")
                os.kill(pid, signal.SIGKILL)
    assert pid is not None and not any(o.get("done") for o in objects), objects[-3:]
    last = objects[-1]
    assert f"pid {pid}" in last["error"] and last["code"] == "worker_lost", last


@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_ollama_a_format_that_is_no_json_schema_is_400(servers, target):
    for path in ("/api/chat", "/api/generate"):
        for fmt in ({"type": 5}, {"properties": []}, {"$ref": "#/nowhere"}):
            r = servers.post(target, path, json={**OLLAMA_BASES[path], "format": fmt})
            err = assert_ollama_refused(r, path, 400)
            assert "format" in err or "schema" in err, err


@pytest.mark.parametrize("target", ["worker", "proxy"])
def test_ollama_streamed_bad_requests_are_plain_400_json(servers, target):
    for path in ("/api/chat", "/api/generate"):
        body = {**OLLAMA_BASES[path], "stream": True, "options": {"num_ctx": 10**9}}
        r = servers.post(target, path, json=body)
        assert r.headers["content-type"].startswith("application/json")
        assert "num_ctx" in assert_ollama_refused(r, path, 400)


# --- afterwards: alive, idle, pool at baseline, no traceback ----------------------------------

def test_zz_everything_is_alive_idle_and_back_at_baseline(servers):
    """Runs last in this file (pytest keeps file order): the sum of everything above."""
    w, p = servers.worker, servers.proxy
    assert w.proc.poll() is None and p.proc.poll() is None
    now = w.wait_idle()
    base = servers.baseline
    assert now["pool"] == base["pool"], (now["pool"], base["pool"])
    assert now["running"] == 0 and now["waiting"] == 0 and now["kv_bytes_held"] == 0
    assert not now["tripped"]
    assert not any(k.startswith("refused_") for k in now["counters"]), now["counters"]
    running = p.running()
    assert not any(x["waiting"] for x in running["workers"]), running["workers"]
    for served in running["workers"]:  # every worker the proxy still runs holds no blocks
        if served.get("pid") is not None:
            pool = served["memory"]["pool"]
            assert pool["used"] == 0, (served["model"], pool)
    for log in (Path(p.log).read_text(), servers.worker_log.read_text()):
        assert "Traceback" not in log and "Exception" not in log, log[-3000:]
