"""Bad input, field by field, on the conversation routes: a real worker and a real proxy,
hypothesis-generated values in every tolerated field and at every path of a rich request.

- **Tolerated fields** (:data:`plimsoll.protocol.tolerated.TOLERATED`): each, on the object
  its scope names, with any JSON value, is dropped and the request served (200) — whatever
  the value, as the real APIs accept it; each tolerated Responses tool type is left out.
- **Every path** of a rich ``/v1/responses``, ``/v1/messages``, ``count_tokens`` and
  ``/v1/chat/completions`` request (system, tools, tool calls and results, reasoning and
  output items): replaced by any JSON value, deleted, wrapped in a list, given an unknown
  sibling, or made 50,000 arrays deep — served, or a 4xx whose body says why in the route's
  protocol; never a 5xx.

At the end both servers are alive and idle, and neither logged a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import Served, tiny_policy

from plimsoll.protocol.tolerated import TOLERATED

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
ARGS = json.dumps({"path": "a"})
MESSAGES = {
    "model": MODEL, "max_tokens": 2, "temperature": 0, "stream": False,
    "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "read a"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "reading"},
            {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "A"}]},
            {"type": "text", "text": "thanks"}]}],
    "tools": [{"name": "read", "description": "read a file", "input_schema": SCHEMA}],
    "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}, "output_config": {},
}
COUNT = {k: v for k, v in MESSAGES.items()
         if k not in ("max_tokens", "temperature", "stream", "output_config")}
CHAT = {
    "model": MODEL, "max_tokens": 2, "temperature": 0, "stream": False,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "read a"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "read", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "A"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]}],
    "tools": [{"type": "function", "function": {"name": "read", "description": "read a file",
                                                "parameters": SCHEMA}}],
}
RESPONSES = {
    "model": MODEL, "max_output_tokens": 2, "temperature": 0, "stream": False, "store": False,
    "instructions": "be brief",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "read a"}]},
        {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "A"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                              "text": "done"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "thanks"}]}],
    "tools": [{"type": "function", "name": "read", "description": "read a file",
               "parameters": SCHEMA}],
    "text": {"format": {"type": "text"}},
}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OLLAMA_CHAT = {"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "hi"}],
               "options": {"num_predict": 2, "temperature": 0}}
RICH = {"/v1/messages": MESSAGES, "/v1/messages/count_tokens": COUNT,
        "/v1/chat/completions": CHAT, "/v1/responses": RESPONSES}
#: scope → (route, the request, the path of the object the scope names)
SCOPES: dict[str, tuple[str, dict[str, Any], tuple]] = {
    "anthropic.request": ("/v1/messages", MESSAGES, ()),
    "anthropic.system": ("/v1/messages", MESSAGES, ("system", 0)),
    "anthropic.text": ("/v1/messages", MESSAGES, ("messages", 0, "content", 0)),
    "anthropic.tool_use": ("/v1/messages", MESSAGES, ("messages", 1, "content", 1)),
    "anthropic.tool_result": ("/v1/messages", MESSAGES, ("messages", 2, "content", 0)),
    "anthropic.tool": ("/v1/messages", MESSAGES, ("tools", 0)),
    "anthropic.tool_choice": ("/v1/messages", MESSAGES, ("tool_choice",)),
    "anthropic.output_config": ("/v1/messages", MESSAGES, ("output_config",)),
    "anthropic.thinking": ("/v1/messages", MESSAGES, ("thinking",)),
    "openai.chat": ("/v1/chat/completions", CHAT, ()),
    "openai.completion": ("/v1/completions", COMPLETION, ()),
    "openai.message": ("/v1/chat/completions", CHAT, ("messages", 2)),
    "openai.stream_options": ("/v1/chat/completions",
                              {**CHAT, "stream": True, "stream_options": {}},
                              ("stream_options",)),
    "openai.function": ("/v1/chat/completions", CHAT, ("tools", 0, "function")),
    "openai.responses": ("/v1/responses", RESPONSES, ()),
    "openai.responses.text": ("/v1/responses", RESPONSES, ("text",)),
    "openai.responses.message": ("/v1/responses", RESPONSES, ("input", 0)),
    "openai.responses.content": ("/v1/responses", RESPONSES, ("input", 3, "content", 0)),
    "ollama.request": ("/api/chat", OLLAMA_CHAT, ()),
    "ollama.options": ("/api/chat", OLLAMA_CHAT, ("options",)),
    "ollama.show": ("/api/show", {"model": MODEL}, ()),  # the proxy's route (PROXY_ONLY)
}
#: routes only the proxy serves (every model's catalogue): a worker target goes there too
PROXY_ONLY = ("/api/show",)
TOOL_TYPES = "openai.responses.tool_type"
FIELD_SCOPES = sorted(set(TOLERATED) - {TOOL_TYPES})
TOLERATED_FIELDS = [(scope, field) for scope in FIELD_SCOPES for field in TOLERATED[scope]]
DEEP = 50_000

FIELDS = settings(max_examples=4, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
PATHS = settings(FIELDS, max_examples=60)
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                           max_leaves=8)
targets = st.sampled_from(["worker", "proxy"])


def test_every_scope_of_the_table_has_a_place_here():
    """A scope added to the table without a place in this file's requests fails here."""
    assert set(FIELD_SCOPES) == set(SCOPES)


# --- the servers ------------------------------------------------------------------------

class Servers:
    def __init__(self, worker: Worker, proxy: Served) -> None:
        self.worker, self.proxy = worker, proxy
        self.client = httpx.Client(timeout=120)

    def post(self, target: str, path: str, **kw) -> httpx.Response:
        worker = target == "worker" and path not in PROXY_ONLY
        base = self.worker.url if worker else self.proxy.url
        return self.client.post(base + path, **kw)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("bad-fields")
    worker = Worker(tiny_model, log=tmp / "worker.log", context=1024, max_tokens=8,
                    default_max_tokens=4, max_cache_blocks=512, max_num_seqs=4)
    try:
        proxy = Served(["--policy", str(tiny_policy(tmp / "policy.json", tiny_model,
                                                     maxTokens=8, defaultMaxTokens=4))],
                       tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "cache")})
    except BaseException:
        worker.stop()
        raise
    s = Servers(worker, proxy)
    try:
        yield s
    finally:
        s.client.close()
        proxy.stop()
        worker.stop()


# --- what every answer must look like ---------------------------------------------------

def served(r: httpx.Response, path: str) -> None:
    assert r.status_code == 200, f"{r.status_code} on {path}: {r.text[:500]}"
    if r.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in r.text and "event: error" not in r.text, r.text[-500:]
    else:
        assert isinstance(r.json(), dict)


def refused(r: httpx.Response, path: str) -> None:
    """A 4xx whose body says why, in the route's error shape."""
    assert 400 <= r.status_code < 500, f"{r.status_code} on {path}: {r.text[:500]}"
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body.get("type") == "error", body
    err = body["error"]
    assert isinstance(err["message"], str) and len(err["message"]) > 10, body
    assert isinstance(err["type"], str) and err["type"], body


def served_or_refused(r: httpx.Response, path: str) -> None:
    (served if r.status_code == 200 else refused)(r, path)


def at(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def replace(obj: Any, path: tuple, fn) -> Any:
    """``obj`` with the item at ``path`` replaced by ``fn(item)`` (a copy; ``fn`` may return
    ``DELETE`` to drop it)."""
    if not path:
        return fn(obj)
    head, rest = path[0], path[1:]
    if isinstance(obj, list):
        out = [replace(x, rest, fn) if i == head else x for i, x in enumerate(obj)]
        return [x for x in out if x is not DELETE]
    out = {k: replace(v, rest, fn) if k == head else v for k, v in obj.items()}
    return {k: v for k, v in out.items() if v is not DELETE}


DELETE = object()


def all_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``obj`` (dict keys and list indices), the root excluded."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(
        obj, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += all_paths(value, (*prefix, key))
    return out


PATH_CASES = [(route, p) for route, body in RICH.items() for p in all_paths(body)]


# --- the tests ----------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "route"), [(t, r) for t in ("worker", "proxy")
                                               for r in (*RICH, "/v1/completions")])
def test_the_rich_requests_are_served(servers, target, route):
    served(servers.post(target, route, json=RICH.get(route, COMPLETION)), route)


@pytest.mark.parametrize(("scope", "field"), TOLERATED_FIELDS,
                         ids=[f"{s}.{f}" for s, f in TOLERATED_FIELDS])
@FIELDS
@given(target=targets, value=JSON_VALUES)
def test_a_tolerated_field_with_any_value_is_dropped_and_served(servers, scope, field,
                                                                target, value):
    route, body, where = SCOPES[scope]
    assert isinstance(at(body, where), dict)
    sent = replace(body, where, lambda obj: {**obj, field: value})
    served(servers.post(target, route, json=sent), route)


@pytest.mark.parametrize("kind", sorted(TOLERATED[TOOL_TYPES]))
@FIELDS
@given(target=targets, extra=st.dictionaries(st.text(min_size=1, max_size=8), JSON_VALUES,
                                             max_size=3))
def test_a_hosted_tool_type_with_any_fields_is_left_out(servers, kind, target, extra):
    tool = {**{k: v for k, v in extra.items() if k != "type"}, "type": kind}
    sent = {**RESPONSES, "tools": [*RESPONSES["tools"], tool]}
    served(servers.post(target, "/v1/responses", json=sent), "/v1/responses")


OPS = st.sampled_from(["value", "delete", "wrap", "sibling"])


@pytest.mark.parametrize("route", list(RICH))
@PATHS
@given(target=targets, data=st.data())
def test_any_change_at_any_path_is_served_or_refused_never_a_5xx(servers, route, target,
                                                                  data):
    path = data.draw(st.sampled_from([p for r, p in PATH_CASES if r == route]))
    op = data.draw(OPS)
    if op == "value":
        value = data.draw(JSON_VALUES)
        sent = replace(RICH[route], path, lambda _old: value)
    elif op == "delete":
        sent = replace(RICH[route], path, lambda _old: DELETE)
    elif op == "wrap":
        sent = replace(RICH[route], path, lambda old: [old])
    else:  # an unknown field beside the one at ``path`` (on its parent object)
        name = data.draw(st.text(min_size=1, max_size=10))
        parent = path[:-1]
        if not isinstance(at(RICH[route], parent), dict) or name in at(RICH[route], parent):
            return
        sent = replace(RICH[route], parent, lambda obj: {**obj, name: data.draw(JSON_VALUES)})
    served_or_refused(servers.post(target, route, json=sent), route)


@pytest.mark.parametrize("route", list(RICH))
@settings(FIELDS, max_examples=10)
@given(target=targets, data=st.data())
def test_a_field_nested_past_any_sane_depth_is_a_400(servers, route, target, data):
    path = data.draw(st.sampled_from([p for r, p in PATH_CASES if r == route]))
    marker = "\x00deep\x00"
    raw = json.dumps(replace(RICH[route], path, lambda _old: marker)).encode()
    raw = raw.replace(json.dumps(marker).encode(), b"[" * DEEP + b"]" * DEEP)
    r = servers.post(target, route, content=raw, headers={"content-type": "application/json"})
    refused(r, route)
    assert r.status_code == 400


def test_zz_both_alive_idle_and_no_traceback(servers):
    """Runs last in this file: the sum of everything above."""
    assert servers.worker.proc.poll() is None and servers.proxy.proc.poll() is None
    idle = servers.worker.wait_idle()
    assert idle["running"] == 0 and idle["waiting"] == 0
    logs = [servers.proxy.log.read_text(), (servers.proxy.log.parent / "worker.log").read_text()]
    for log in logs:
        assert "Traceback" not in log and "Exception" not in log, log[-3000:]
