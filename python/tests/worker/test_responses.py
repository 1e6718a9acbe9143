"""The OpenAI Responses API on a real worker, through the official ``openai`` client.

``client.responses.create`` streamed and not, a function-tool round trip (the call forced by
``tool_choice: "required"``: random weights do not call tools on their own), follow-ups by
``previous_response_id`` and by replaying the whole input, ``text.format`` validated with
jsonschema, Codex CLI's extra fields, and the bounded store. Every streamed event is parsed
by the SDK's own types (it refuses an event whose shape it does not know).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from conftest import Worker

from plimsoll.protocol.responses_events import ResponseStore

openai = pytest.importorskip("openai")

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
          "parameters": CITY, "strict": True}]
LONG = "hello there, how are you today? " * 6


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = Worker(tiny_model, default_max_tokens=64)
    yield w
    w.stop()


def client(w: Worker):
    return openai.OpenAI(base_url=w.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_create_and_stream_agree(worker):
    c = client(worker)
    r = c.responses.create(model="tiny", input=LONG, max_output_tokens=10, temperature=0,
                           instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.instructions == "Be brief."
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert 0 < r.usage.output_tokens <= 10 and r.usage.input_tokens > 40

    events = list(c.responses.create(model="tiny", input=LONG, max_output_tokens=10,
                                     temperature=0, instructions="Be brief.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text  # greedy: the same answer, streamed
    final = events[-1].response
    assert final.output_text == streamed and final.usage.output_tokens == r.usage.output_tokens


def test_function_tool_round_trip(worker):
    c = client(worker)
    first = c.responses.create(model="tiny", input="What is the weather in Paris?",
                               tools=TOOLS, tool_choice="required", temperature=0,
                               max_output_tokens=100)
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    answer = [{"type": "function_call_output", "call_id": calls[0].call_id,
               "output": '{"temperature": 21}'}]

    follow = c.responses.create(model="tiny", previous_response_id=first.id, input=answer,
                                tools=TOOLS, max_output_tokens=8, temperature=0)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens  # the history was prepended
    assert follow.usage.input_tokens_details.cached_tokens > 0  # and its prefix reused

    # the same conversation replayed in full (Codex's way, store: false) renders the same
    replay = [{"type": "message", "role": "user",
               "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments}, *answer]
    again = c.responses.create(model="tiny", input=replay, tools=TOOLS, max_output_tokens=8,
                               temperature=0, store=False)
    assert again.usage.input_tokens == follow.usage.input_tokens
    assert again.output_text == follow.output_text


def test_streamed_forced_call_events(worker):
    events = list(client(worker).responses.create(
        model="tiny", input="weather?", tools=TOOLS, tool_choice={"type": "function",
                                                                  "name": "get_weather"},
        temperature=0, max_output_tokens=100, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), CITY)
    item = [e.item for e in events if e.type == "response.output_item.done"][-1]
    assert item.type == "function_call" and item.arguments == done.arguments


def test_text_format_json_schema_validates_and_the_stream_helper_finishes(worker):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema,
                      "strict": True}}
    with client(worker).responses.stream(model="tiny", input="a number", text=fmt,
                                         temperature=0, max_output_tokens=64) as s:
        final = s.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), schema)


def test_missing_previous_response_is_a_404(worker):
    with pytest.raises(openai.NotFoundError) as e:
        client(worker).responses.create(model="tiny", input="x",
                                        previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id"


def test_store_false_is_not_kept(worker):
    c = client(worker)
    r = c.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="tiny", input="x", previous_response_id=r.id)


def test_codex_shaped_body_is_accepted(worker):
    """The fields Codex CLI sends (recorded from codex exec 0.171.0), streamed."""
    body = {"model": "tiny", "instructions": None, "stream": True, "store": False,
            "tool_choice": "auto", "parallel_tool_calls": False,
            "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
            "prompt_cache_key": "01a23096", "client_metadata": {"session_id": "x"},
            "text": {"verbosity": "low"},
            "tools": [TOOLS[0], {"type": "web_search", "external_web_access": False},
                      {"type": "namespace", "name": "multi_agent_v1", "tools": []}],
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "say hi"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [],
                       "encrypted_content": "opaque"}],
            "max_output_tokens": 6}
    with httpx.stream("POST", worker.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    kinds = [ln.removeprefix("event: ") for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln.removeprefix("data: ")) for ln in lines if ln.startswith("data: ")]
    assert kinds == [d["type"] for d in data]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert [t["name"] for t in data[-1]["response"]["tools"]] == ["get_weather"]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "tools": [{"type": "local_magic"}]}, "tools"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": 5}}}}, "text.format.schema"),
])
def test_bad_bodies_are_400s_that_name_the_field(worker, body, param):
    r = httpx.post(worker.url + "/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") + \
        err["message"], err


@pytest.mark.pure
def test_store_is_bounded_lru():
    store = ResponseStore(cap=2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [])
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    with pytest.raises(ValueError):
        ResponseStore(cap=0)


@pytest.mark.pure
def test_store_is_bounded_in_bytes():
    store = ResponseStore(cap=100, max_bytes=400)
    big = [{"role": "user", "content": "x" * 120}]
    assert store.put("a", big) and store.put("b", big)
    assert store.put("c", big)  # three would be ~450 bytes: the oldest goes
    assert store.get("a") is None and store.get("b") and store.get("c")
    assert store.bytes <= 400
    assert not store.put("huge", [{"role": "user", "content": "x" * 400}])
    assert store.get("huge") is None and store.get("c")


@pytest.mark.pure
def test_instructions_and_opening_developer_messages_become_one_system_message():
    from plimsoll.protocol import responses_request as R

    req = R.ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": "You are Codex."},
        {"role": "system", "content": [{"type": "input_text", "text": "Sandbox: off."}]},
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]})
    chat = R.to_chat(req, [])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert chat.messages[0].text == "Be brief.\n\nYou are Codex.\n\nSandbox: off."
    assert chat.messages[2].tool_calls[0].id == "c1" and chat.messages[3].text == "done"
    kept = R.conversation(req, [])
    assert [m["role"] for m in kept] == ["developer", "system", "user", "assistant", "tool"]
