"""Constrained decoding through a real worker (random weights, the official SDKs).

A random-weight model writes noise; under a constraint every answer must validate against
its JSON Schema (jsonschema), and a forced tool choice must come back as a parsed tool call
whose arguments match the tool's parameters, on the OpenAI and the Anthropic routes.
Schemas bound their strings and numbers so a greedy random model cannot write forever.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from conftest import Worker

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "unit": {"enum": ["celsius", "fahrenheit"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["city", "days", "unit", "tags", "ok"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time.",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"enum": ["utc", "cet"]}},
                                               "required": ["tz"],
                                               "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = Worker(tiny_model, default_max_tokens=200)
    yield w
    w.stop()


def oai(w: Worker):
    return openai.OpenAI(base_url=w.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_unconstrained_noise_is_not_json(worker):
    """The control: the same request without a constraint does not validate."""
    r = oai(worker).chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                            temperature=0)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_output_validates(worker, temperature):
    r = oai(worker).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=temperature, seed=7,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_streamed(worker):
    stream = oai(worker).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": SCHEMA}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(worker):
    r = oai(worker).chat.completions.create(model="tiny", messages=ASK, max_tokens=400,
                                            temperature=0,
                                            response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a free object may run to max_tokens; what was written is still its beginning
        assert text.startswith("{")


def test_bad_schema_is_a_400(worker):
    with pytest.raises(openai.BadRequestError) as e:
        oai(worker).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=20,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "response_format.json_schema.schema" in str(e.value)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_openai_forced_tool_call(worker, choice):
    r = oai(worker).chat.completions.create(model="tiny", messages=ASK, max_tokens=200,
                                            temperature=0, tools=TOOLS, tool_choice=choice)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0].function
    if isinstance(choice, dict):
        assert call.name == "get_time"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use(worker, choice):
    c = anthropic.Anthropic(base_url=worker.url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msg = c.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=tools,
                            tool_choice=choice, extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1
    if choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    schema = {t["name"]: t["input_schema"] for t in tools}[uses[0].name]
    jsonschema.validate(uses[0].input, schema)


def test_constraint_ends_the_sequence(worker):
    """A finished grammar stops the sequence (no token is generated past it) and frees it."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "w", "schema": SCHEMA}}}
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert r["usage"]["completion_tokens"] < 200
    worker.wait_idle()


def test_constrained_and_free_requests_batched_together(worker):
    """Constrained rows are masked inside a batched decode step; a free row beside them is
    untouched (it still writes noise) and every constrained answer validates."""
    import concurrent.futures as cf

    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}

    def one(i: int):
        extra = {"response_format": fmt} if i % 2 == 0 else {}
        return i, oai(worker).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=120, temperature=0.7, seed=i, **extra)

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for i, r in results:
        text = r.choices[0].message.content
        if i % 2 == 0:
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert r.usage.completion_tokens > 0
    worker.wait_idle()
