"""The Anthropic Messages protocol layer, with a real tokenizer from a tiny demo model.

Requests are parsed from raw bytes; prompts are rendered through the demo model's own
(Qwen-style) chat template; the assembler is fed the ids the tokenizer produces for a
text, as the engine would; messages and stream events are validated with the official
``anthropic`` package's own pydantic types, and streams are re-assembled by its own
accumulator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")

from anthropic._streaming import SSEDecoder  # noqa: E402
from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from anthropic.types import (  # noqa: E402
    Message,
    MessageTokensCount,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
)
from anthropic.types.shared import ErrorResponse  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.protocol import MAX_BODY_BYTES, ProtocolError, TextDelta, ToolCallDelta  # noqa: E402
from plimsoll.protocol import anthropic as A  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
EVENT_TYPES = {"message_start": RawMessageStartEvent, "message_delta": RawMessageDeltaEvent,
               "message_stop": RawMessageStopEvent,
               "content_block_start": RawContentBlockStartEvent,
               "content_block_delta": RawContentBlockDeltaEvent,
               "content_block_stop": RawContentBlockStopEvent}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    model_dir = build_demo_model(tmp_path_factory.mktemp("tiny"), preset="tiny")
    return tokenizer_utils.load(Path(model_dir))


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 64, "messages": USER, **fields}).encode()


def parsed(**fields) -> A.MessagesRequest:
    req = A.parse_messages(body(**fields))
    assert isinstance(req, A.MessagesRequest), req
    return req


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(assembler, tokens: list[int]) -> list:
    deltas = []
    for t in tokens:
        deltas += assembler.feed(t)
    return deltas + assembler.close()


# --- parsing ------------------------------------------------------------------------------

def test_request_accepts_the_documented_fields_and_normalises_them():
    req = parsed(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use metric."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Checking.", "citations": None},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "Thanks."}]}],
        stop_sequences=["END"], temperature=0, top_p=0.9, top_k=40, stream=True,
        tools=[WEATHER | {"cache_control": {"type": "ephemeral"}}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        metadata={"user_id": "u1"}, thinking={"type": "disabled"},
        cache_control={"type": "ephemeral"}, service_tier="auto",
        output_config={"effort": "low"})
    assert req.system_text == "Be brief.\n\nUse metric."
    assert [b.type for b in req.messages[1].content] == ["text", "tool_use"]  # thinking dropped
    assert req.messages[0].content[0].text == "Weather in Paris?"
    assert req.stop_sequences == ["END"] and req.temperature == 0 and req.stream
    assert req.top_k == 40
    assert req.active_tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": WEATHER["input_schema"]}}]
    assert parsed(system="Be brief.").system_text == "Be brief."
    assert parsed(temperature=None).temperature == 1.0  # null means absent
    assert parsed(thinking={"type": "adaptive"}).thinking.type == "adaptive"


def test_tool_choice_selects_the_rendered_tools():
    other = WEATHER | {"name": "get_time"}
    assert len(parsed(tools=[WEATHER, other]).active_tools) == 2
    assert len(parsed(tools=[WEATHER, other], tool_choice={"type": "any"}).active_tools) == 2
    named = parsed(tools=[WEATHER, other], tool_choice={"type": "tool", "name": "get_time"})
    assert [t["function"]["name"] for t in named.active_tools] == ["get_time"]
    assert parsed(tools=[WEATHER], tool_choice={"type": "none"}).active_tools is None
    assert parsed().active_tools is None


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"max_tokens": None}, "max_tokens", "Missing required field"),
    ({"model": None}, "model", "Missing required field"),
    ({"messages": []}, "messages", "at least 1"),
    ({"foo": 1}, "foo", "Unknown field 'foo'"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ({"stop_sequences": [""]}, "stop_sequences", "must not be empty"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences", "at most 16"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "only system"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                   {"role": "user", "content": "x"}]}, "messages[0]", "text blocks only"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content", "images are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages[0].content", "text, tool_use or tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "Missing required field"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}]},
     "messages[0].content[0].input", "Missing required field"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0]", "belong in assistant messages"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]}, "messages[0]", "belong in user"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content", "'image' is not supported"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "Missing required field"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]",
     "server tool"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice",
     "not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice", "send name"),
    ({"tool_choice": {"type": "required"}}, "tool_choice.type", "'auto'"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type", "'enabled'"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format", "no constrained decoding"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers", "Unknown field"),
    ({"tools": [WEATHER | {"future_flag": 1}]}, "tools[0].future_flag", "Unknown field"),
])
def test_bad_requests_are_400s_naming_the_field(fields, param, says):
    err = A.parse_messages(body(**fields))
    assert isinstance(err, ProtocolError) and err.status == 400, err
    assert err.param == param and says in err.message, err
    shaped = ErrorResponse.model_validate(A.error_body(err.status, err.message))
    assert shaped.type == "error" and shaped.error.type == "invalid_request_error"
    assert shaped.error.message == err.message


def test_bodies_that_are_not_json_objects():
    for raw, says in [(b"{not json", "not valid JSON"), (b"[]", "JSON object"),
                      (b"", "empty"), (b"\xff", "UTF-8")]:
        err = A.parse_messages(raw)
        assert err.status == 400 and says in err.message
    huge = A.parse_messages(b" " * (MAX_BODY_BYTES + 1))
    assert huge.status == 413
    assert A.error_body(huge.status, huge.message)["error"]["type"] == "request_too_large"


def test_count_tokens_request_takes_the_prompt_fields_only():
    req = A.parse_count_tokens(json.dumps({"model": "tiny", "messages": USER, "system": "x",
                                           "tools": [WEATHER]}).encode())
    assert isinstance(req, A.CountTokensRequest) and req.system_text == "x"
    err = A.parse_count_tokens(body())  # max_tokens is not a count_tokens field
    assert err.status == 400 and err.param == "max_tokens" and "Unknown field" in err.message
    assert MessageTokensCount.model_validate(A.count_tokens_body(12)).input_tokens == 12


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (404, "not_found_error"), (429, "rate_limit_error"),
    (500, "api_error"), (503, "overloaded_error"), (529, "overloaded_error"),
    (504, "timeout_error"), (422, "invalid_request_error"), (502, "api_error")])
def test_error_shapes_validate(status, kind):
    body_ = A.error_body(status, "pool exhausted: retry")
    assert body_ == {"type": "error", "error": {"type": kind, "message": "pool exhausted: retry"}}
    assert ErrorResponse.model_validate(body_).error.type == kind


# --- the prompt ---------------------------------------------------------------------------

def test_conversion_to_template_messages():
    req = parsed(system="Be brief.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no station"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    assert A.template_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
        {"role": "user", "content": "And tomorrow?"}]


def test_render_matches_the_openai_path(tok):
    from plimsoll.protocol import parse_request, render_chat

    req = parsed(system="Be brief.", tools=[WEATHER])
    openai_req = parse_request("chat", json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, *USER], "tools": [
        {"type": "function", "function": {"name": WEATHER["name"],
                                          "description": WEATHER["description"],
                                          "parameters": WEATHER["input_schema"]}}]}).encode())
    assert A.render_messages(tok, req) == render_chat(tok, openai_req)
    text = tok.decode(A.render_messages(tok, req))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n")


def test_render_tool_round_trip(tok):
    req = parsed(tools=[WEATHER], messages=[
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                  "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny, 21 C"}]}])
    text = tok.decode(A.render_messages(tok, req))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_a_final_assistant_turn_is_continued(tok):
    req = parsed(messages=[*USER, {"role": "assistant", "content": "It is"}])
    text = tok.decode(A.render_messages(tok, req))
    assert text.endswith("<|im_start|>assistant\nIt is")


def test_template_failure_is_a_400(tok):
    class Broken:
        has_chat_template = True

        def apply_chat_template(self, *a, **k):
            raise ValueError("roles must alternate")

    with pytest.raises(ProtocolError) as e:
        A.render_messages(Broken(), parsed())
    assert e.value.status == 400 and "roles must alternate" in e.value.message

    class Plain:
        has_chat_template = False

    with pytest.raises(ProtocolError) as e:
        A.render_messages(Plain(), parsed())
    assert "no chat template" in e.value.message


# --- the output ---------------------------------------------------------------------------

def finish(tok, text: str, *, stop=(), tools=None, max_tokens=200, eos=True):
    a = A.AnthropicAssembler(tok, stop=list(stop), max_tokens=max_tokens, tools=tools)
    tokens = ids(tok, text) + ([next(iter(tok.eos_token_ids))] if eos else [])
    deltas = run(a, tokens)
    return a, deltas


def non_streamed(a, deltas, meta=None, usage=None) -> dict:
    blocks = A.BlockStream()
    blocks.feed(deltas)
    result = a.result()
    return A.message(meta or A.MessageMeta.new("tiny"), blocks.blocks,
                     A.stop_reason(result, a.stop_sequence), a.stop_sequence,
                     usage or A.usage(20, result.completion_tokens, 8))


def streamed(a, deltas, meta, usage) -> list[dict]:
    blocks = A.BlockStream()
    result = a.result()
    return [*A.message_start(meta, A.usage(20, 0, 8)), *blocks.feed(deltas[:1]),
            *blocks.feed(deltas[1:]),
            *A.message_end(blocks, A.stop_reason(result, a.stop_sequence), a.stop_sequence,
                           usage)]


def test_text_message_validates(tok):
    a, deltas = finish(tok, "Hello there")
    msg = Message.model_validate(non_streamed(a, deltas))
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "tiny" and [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello there"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == 12 and msg.usage.cache_read_input_tokens == 8
    assert msg.usage.output_tokens == a.completion_tokens


def test_stop_sequence_and_max_tokens(tok):
    a, deltas = finish(tok, "one two END three", stop=["three", "END"])
    msg = Message.model_validate(non_streamed(a, deltas))
    assert msg.content[0].text == "one two "
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"
    b, deltas = finish(tok, "one two three four five six", max_tokens=3, eos=False)
    msg = Message.model_validate(non_streamed(b, deltas))
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 3
    c, deltas = finish(tok, "", stop=["END"])  # EOS first: an empty answer
    msg = Message.model_validate(non_streamed(c, deltas))
    assert msg.content == [] and msg.stop_reason == "end_turn"


def test_generated_tool_call_becomes_a_tool_use_block(tok):
    tools = parsed(tools=[WEATHER]).active_tools
    a, deltas = finish(tok, f"Let me check.\n{CALL}", tools=tools)
    assert [type(d) for d in deltas] == [TextDelta] * (len(deltas) - 1) + [ToolCallDelta]
    msg = Message.model_validate(non_streamed(a, deltas))
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me check."
    use = msg.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    assert msg.stop_reason == "tool_use"
    assert use.id == A.tool_use_id(deltas[-1].call["id"])  # stream and message agree


def test_tool_use_block_keeps_arguments_that_are_not_an_object():
    block = A.tool_use_block({"id": "call_x", "function": {"name": "f", "arguments": "[1"}})
    assert block == {"type": "tool_use", "id": "toolu_x", "name": "f",
                     "input": {"arguments": "[1"}}


def test_stream_events_in_order_validate_and_reassemble(tok):
    tools = parsed(tools=[WEATHER]).active_tools
    a, deltas = finish(tok, f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}",
                       tools=tools)
    meta = A.MessageMeta.new("tiny")
    final_usage = A.usage(20, a.completion_tokens, 8)
    events = streamed(a, deltas, meta, final_usage)
    runs = [(e["type"], e.get("index")) for e in events]
    runs = [r for i, r in enumerate(runs) if i == 0 or r != runs[i - 1]]  # text: one per token
    assert runs == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]

    # framed as SSE and decoded by the SDK's own decoder
    wire = b"".join(A.sse_event(e) for e in events)
    decoded = list(SSEDecoder().iter_bytes(iter([wire])))
    assert [s.event for s in decoded] == [e["type"] for e in events]
    assert [s.json() for s in decoded] == events

    snapshot, bufs = None, {}
    for e in events:
        if e["type"] == "ping":
            continue
        event = EVENT_TYPES[e["type"]].model_validate(e)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot.id == meta.id and snapshot.stop_reason == "tool_use"
    assert [b.type for b in snapshot.content] == ["text", "tool_use", "tool_use"]
    assert snapshot.content[0].text == "Let me check."
    assert [b.input["city"] for b in snapshot.content[1:]] == ["Paris", "Oslo"]
    assert snapshot.usage.output_tokens == a.completion_tokens
    assert snapshot.usage.cache_read_input_tokens == 8
    whole = Message.model_validate(non_streamed(a, deltas, meta, final_usage))
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == \
        [b.model_dump(exclude_none=True) for b in whole.content]  # stream == message


def test_text_after_a_tool_call_opens_a_new_block():
    blocks = A.BlockStream()
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    events = blocks.feed([TextDelta("a"), TextDelta("b"), ToolCallDelta(0, call),
                          TextDelta("c")]) + blocks.close()
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2)]
    assert blocks.blocks == [{"type": "text", "text": "ab"},
                             {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
                             {"type": "text", "text": "c"}]
    assert blocks.close() == []


def test_sse_event_framing():
    assert A.sse_event({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    err = A.sse_event(A.error_body(503, "é"))
    assert err.startswith(b"event: error\ndata: ") and "é".encode() in err


def test_protocol_does_not_import_mlx():
    import subprocess
    import sys

    code = ("import sys, plimsoll.protocol.anthropic; "
            "sys.exit(any(m.split('.')[0] in ('mlx', 'mlx_lm') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
