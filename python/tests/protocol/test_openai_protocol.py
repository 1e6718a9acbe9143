"""The OpenAI protocol layer, with a real tokenizer from a tiny demo model.

Requests are parsed from raw bytes; prompts are rendered through the demo model's own
(Qwen-style) chat template; the assembler is fed the ids the tokenizer produces for a
text, one at a time, as the engine would; and every response object is validated with
the official ``openai`` package's own pydantic types.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

openai_types = pytest.importorskip("openai.types")
tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.protocol import (  # noqa: E402
    MAX_BODY_BYTES,
    SSE_DONE,
    Assembled,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    ResponseMeta,
    TextAssembler,
    TextDelta,
    ToolCallDelta,
    check_body_size,
    check_model,
    context_overflow,
    context_overflow_message,
    delta_chunks,
    error_body,
    final_chunks,
    first_chunks,
    models_list,
    parse_request,
    render_chat,
    render_completion,
    response,
    sse,
    usage,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    model_dir = build_demo_model(tmp_path_factory.mktemp("tiny"), preset="tiny")
    return tokenizer_utils.load(Path(model_dir))


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields) -> ChatCompletionRequest:
    req = parse_request("chat", body(**{"messages": USER, **fields}))
    assert isinstance(req, ChatCompletionRequest), req
    return req


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(assembler: TextAssembler, tokens: list[int]) -> list:
    deltas = []
    for t in tokens:
        deltas += assembler.feed(t)
    return deltas + assembler.close()


def streamed_text(deltas) -> str:
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


# --- parsing ------------------------------------------------------------------------------

def test_chat_request_accepts_the_usual_fields_and_normalises_them():
    req = chat(model="tiny", messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                          {"type": "text", "text": "brief."}]},
        *USER,
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        max_completion_tokens=64, temperature=0.2, top_p=0.9, seed=7, stop="END", stream=True,
        stream_options={"include_usage": True}, tools=[WEATHER], tool_choice="auto",
        user="me", n=1, presence_penalty=0, frequency_penalty=0.0, parallel_tool_calls=True,
        response_format={"type": "text"}, logprobs=False)
    assert req.max_output_tokens == 64 and req.stop == ["END"] and req.include_usage
    assert req.messages[0].text == "Be brief." and req.tool_choice.mode == "auto"
    assert req.active_tools == [WEATHER]
    assert chat(temperature=None, stop=None).temperature == 1.0  # null means absent
    assert chat(logit_bias=None).n == 1  # ... even for a field we do not know
    assert (req.top_k, req.min_p) == (0, 0.0)  # the extensions, off when absent
    assert (chat(top_k=40, min_p=0.05).top_k, chat(min_p=0.05).min_p) == (40, 0.05)
    assert chat(top_k=-1).top_k == 0  # vLLM's "off"


def test_tool_choice_forms():
    assert chat(tools=[WEATHER], tool_choice="none").active_tools is None
    named = chat(tools=[WEATHER, {"type": "function", "function": {"name": "other"}}],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [t["function"]["name"] for t in named.active_tools] == ["get_weather"]


BAD_CHAT = [
    (b'{"messages": [', None, "not valid JSON"),
    (b'{"messages": "\xff"}', None, "not valid UTF-8"),
    (b"", None, "empty"),
    (b"[1, 2]", None, "must be a JSON object"),
    (body(messages=USER, temperature=float("nan")), None, "NaN"),
    (body(messages=USER, frobnicate=1), "frobnicate", "Unknown field 'frobnicate'"),
    (body(messages=[{**USER[0], "colour": "red"}]), "messages[0].colour", "Unknown field"),
    (body(messages=USER, n=2), "n", "send n=1"),
    (body(messages=USER, max_tokens=-5), "max_tokens", "greater than or equal to 1"),
    (body(messages=USER, max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (body(messages=USER, max_tokens=10**12), "max_tokens", "less than or equal to"),
    (body(messages=USER, max_tokens="5"), "max_tokens", "valid integer"),
    (body(messages=USER, max_tokens=5.0), "max_tokens", "valid integer"),
    (body(messages=USER, max_tokens=5, max_completion_tokens=6), "max_completion_tokens",
     "send only one"),
    (body(messages=USER, temperature=True), "temperature", "valid number"),
    (body(messages=USER, temperature=2.5), "temperature", "less than or equal to 2"),
    (body(messages=USER, top_p=0), "top_p", "greater than 0"),
    (body(messages=USER, top_k=-2), "top_k", "greater than or equal to -1"),
    (body(messages=USER, top_k=4.0), "top_k", "valid integer"),
    (body(messages=USER, min_p=1.5), "min_p", "less than or equal to 1"),
    (body(messages=USER, stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (body(messages=USER, stop=7), "stop", "list of up to 4 strings"),
    (body(messages=USER, stream="yes"), "stream", "valid boolean"),
    (body(messages=USER, logprobs=True), "logprobs", "send false"),
    (body(messages=USER, presence_penalty=0.5), "presence_penalty", "send 0"),
    (body(messages=USER, response_format={"type": "json_schema"}), "response_format",
     "send json_schema"),
    (body(messages=USER, response_format={"type": "xml"}), "response_format.type",
     "'json_schema'"),
    (body(messages=[]), "messages", "at least 1 item"),
    (body(model="x"), "messages", "Missing required field"),
    (body(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role", "'user'"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content", "'image_url' is not supported"),
    (body(messages=[{"role": "user"}]), "messages[0]", "needs content"),
    (body(messages=[{"role": "tool", "content": "x"}]), "messages[0]", "tool_call_id"),
    (body(messages=USER, tools=[{"type": "custom", "custom": {"name": "x"}}]),
     "tools[0].type", "'function'"),
    (body(messages=USER, tool_choice="required"), "tool_choice", "needs tools"),
    (body(messages=USER, tools=[WEATHER], tool_choice={"type": "function",
                                                       "function": {"name": "nope"}}),
     "tool_choice", "not in tools"),
    (body(messages=USER, tool_choice="sometimes"), "tool_choice", '"auto", "none"'),
]


@pytest.mark.parametrize(("raw", "param", "says"), BAD_CHAT)
def test_bad_chat_requests_are_400s_naming_the_field(raw, param, says):
    err = parse_request("chat", raw)
    assert isinstance(err, ProtocolError), err
    assert err.status == 400 and err.param == param and says in err.message, err
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == "invalid_request_error"


def test_completion_request_forms():
    def parse(**fields):
        return parse_request("completion", body(**fields))

    assert parse(prompt="Hello").prompt == "Hello"
    assert parse(prompt=["Hello"]).prompt == "Hello"
    assert parse(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert parse(prompt=[[4, 5]], max_tokens=3, stop=["x"]).prompt == [4, 5]
    for fields, param, says in [
        ({"prompt": ["a", "b"]}, "prompt", "2 prompts"),
        ({"prompt": [[1], [2]]}, "prompt", "2 prompts"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"prompt": [True]}, "prompt", "token ids"),
        ({"prompt": "a", "echo": True}, "echo", "echo is not supported"),
        ({"prompt": "a", "best_of": 3}, "best_of", "best_of=1"),
        ({"prompt": "a", "n": 2}, "n", "send n=1"),
        ({"prompt": "a", "messages": USER}, "messages", "Unknown field"),
        ({}, "prompt", "Missing required field"),
    ]:
        err = parse(**fields)
        assert isinstance(err, ProtocolError) and err.param == param and says in err.message, err


def test_body_size_limit():
    assert check_body_size(None) is None and check_body_size("1024") is None
    too_big = check_body_size(MAX_BODY_BYTES + 1)
    assert too_big.status == 413 and str(MAX_BODY_BYTES) in too_big.message
    assert check_body_size(str(MAX_BODY_BYTES + 1)).status == 413
    assert check_body_size("lots").status == 400
    huge = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    assert parse_request("completion", huge).status == 413


# --- rendering ----------------------------------------------------------------------------

def test_render_chat_without_tools(tok):
    text = tok.decode(render_chat(tok, chat()))
    assert "What is the weather in Paris?" in text
    assert text.endswith("<|im_start|>assistant\n") and "<tools>" not in text


def test_render_chat_with_tools_lists_the_schema_and_past_calls(tok):
    req = chat(tools=[WEATHER], messages=[*USER, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    text = tok.decode(render_chat(tok, req))
    assert "<tools>" in text and json.dumps(WEATHER) in text
    assert '"arguments": {"city": "Oslo"}' in text  # a dict for the template, not a string
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert "<tools>" not in tok.decode(render_chat(tok, chat(tools=[WEATHER],
                                                            tool_choice="none")))


def test_render_chat_template_failure_is_a_400(tok):
    class Refusing:
        has_chat_template = True

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate")

    with pytest.raises(ProtocolError) as e:
        render_chat(Refusing(), chat())
    assert e.value.status == 400 and "roles must alternate" in e.value.message


def test_render_completion(tok):
    assert render_completion(tok, parse_request("completion", body(prompt="def f():"))) \
        == tok.encode("def f():")
    assert render_completion(tok, CompletionRequest(prompt=[5, 6])) == [5, 6]
    for prompt, says in [([len(tok)], "outside this model's vocabulary"), ("", "empty")]:
        with pytest.raises(ProtocolError) as e:
            render_completion(tok, CompletionRequest(prompt=prompt))
        assert e.value.param == "prompt" and says in e.value.message


# --- the assembler ------------------------------------------------------------------------

def test_plain_text_until_eos(tok):
    text = "def add(a, b):\n    return a + b\n"
    eos = next(iter(tok.eos_token_ids))
    a = TextAssembler(tok)
    deltas = run(a, [*ids(tok, text), eos, *ids(tok, "ignored")])
    out = a.result()
    assert out == Assembled(text, [], "stop", len(ids(tok, text)) + 1)
    assert streamed_text(deltas) == text and len(deltas) > 3


def test_ignore_eos_counts_the_eos_hides_it_and_goes_on_to_max_tokens(tok):
    eos = next(iter(tok.eos_token_ids))
    first, then = ids(tok, "a = 1\n"), ids(tok, "b = 2\n")
    assert chat(ignore_eos=True).ignore_eos and not chat().ignore_eos
    a = TextAssembler(tok, max_tokens=len(first) + 1 + len(then), ignore_eos=True)
    deltas = run(a, [*first, eos, *then, *ids(tok, "never seen")])
    out = a.result()
    assert out.text == streamed_text(deltas) == "a = 1\nb = 2\n"
    assert out.finish_reason == "length" and out.completion_tokens == len(first) + 1 + len(then)
    stops = TextAssembler(tok, max_tokens=100)  # without it the EOS ends the answer
    run(stops, [*first, eos, *then])
    assert stops.result().text == "a = 1\n" and stops.result().finish_reason == "stop"


def test_stop_string_split_across_tokens_is_held_back_and_trimmed(tok):
    tokens = ids(tok, "x = 1  # STOPHERE then more")
    pieces = [tok.decode([t]) for t in tokens]
    assert "STOPHERE" not in pieces  # the stop string really spans several tokens
    a = TextAssembler(tok, stop=["STOPHERE", "never"])
    seen = ""
    for t in tokens:
        seen += streamed_text(a.feed(t))
        assert "ST" not in seen  # a possible stop prefix is never emitted
        if a.done:
            break
    out = a.result()
    assert out.text == "x = 1  # " == seen and out.finish_reason == "stop"
    assert out.completion_tokens == pieces.index("E") + 1  # the token completing the stop
    assert a.feed(tokens[0]) == [] and a.result() == out


def test_a_prefix_that_never_completes_is_released(tok):
    text = "# ST then STOPPED"
    a = TextAssembler(tok, stop=["STOPHERE"])
    deltas = run(a, ids(tok, text))
    assert streamed_text(deltas) == a.result().text == text
    assert a.result().finish_reason == "length"


def test_max_tokens_ends_with_length(tok):
    tokens = ids(tok, "for i in range(10): print(i)")
    a = TextAssembler(tok, max_tokens=4)
    deltas = []
    for t in tokens[:4]:
        deltas += a.feed(t)
    assert a.done and a.result().finish_reason == "length"
    assert a.result().completion_tokens == 4
    assert streamed_text(deltas) == a.result().text == tok.decode(tokens[:4])


def test_generated_tool_call_becomes_tool_calls(tok):
    eos = next(iter(tok.eos_token_ids))
    a = TextAssembler(tok, tools=[WEATHER], max_tokens=200)
    deltas = run(a, [*ids(tok, CALL), eos])
    out = a.result()
    assert out.finish_reason == "tool_calls" and out.text == "" and out.content is None
    [call] = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert deltas == [ToolCallDelta(0, call)]


def test_text_then_two_tool_calls(tok):
    eos = next(iter(tok.eos_token_ids))
    second = CALL.replace("Paris", "Oslo")
    a = TextAssembler(tok, tools=[WEATHER])
    deltas = run(a, [*ids(tok, f"Let me check.\n{CALL}\n{second}\n"), eos])
    out = a.result()
    assert out.text == "Let me check." == streamed_text(deltas)
    assert [d.index for d in deltas if isinstance(d, ToolCallDelta)] == [0, 1]
    assert [json.loads(c["function"]["arguments"])["city"] for c in out.tool_calls] == \
        ["Paris", "Oslo"]
    assert out.finish_reason == "tool_calls"


def test_tool_markup_is_text_without_tools_or_when_it_does_not_parse(tok):
    a = TextAssembler(tok)  # no tools in the request: nothing is parsed
    run(a, ids(tok, CALL))
    assert a.result().text == CALL and a.result().tool_calls == []
    broken = "Well, \n<tool_call>{not json}</tool_call> sorry"
    b = TextAssembler(tok, tools=[WEATHER])
    deltas = run(b, ids(tok, broken))
    assert b.result().text == broken == streamed_text(deltas) and not b.result().tool_calls


def test_truncated_tool_call_at_length(tok):
    a = TextAssembler(tok, tools=[WEATHER], max_tokens=8)
    deltas = run(a, ids(tok, CALL))
    out = a.result()
    assert out.finish_reason == "length" and not out.tool_calls
    assert out.text.startswith("<tool_call>") and out.text == streamed_text(deltas)


def test_each_assembler_detokenizes_on_its_own(tok):
    one, two = TextAssembler(tok), TextAssembler(tok)
    a_ids, b_ids = ids(tok, "import os\nimport sys\n"), ids(tok, "héllo wörld ✓ 日本")
    for i in range(max(len(a_ids), len(b_ids))):  # interleaved, as in a batched step
        if i < len(a_ids):
            one.feed(a_ids[i])
        if i < len(b_ids):
            two.feed(b_ids[i])
    one.close()
    two.close()
    assert one.result().text == "import os\nimport sys\n"
    assert two.result().text == "héllo wörld ✓ 日本"


FRAGMENTS = ["def f(x):", "\n", "  ", " return", " x", "END", "EN", "é✓", CALL, "<tool_call>",
             "</tool_call>", "{\"a\": 1}", "S"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12), st.booleans(), st.booleans())
@example(["<tool_call>", "END", CALL], True, True)  # a stop inside markup that is not a call
def test_streamed_deltas_always_concatenate_to_the_final_text(tok, parts, with_stop, with_tools):
    text = "".join(parts)
    a = TextAssembler(tok, stop=["END"] if with_stop else [], tools=[WEATHER] if with_tools
                      else None)
    deltas = run(a, ids(tok, text))
    out = a.result()
    assert streamed_text(deltas) == out.text
    assert [d.call for d in deltas if isinstance(d, ToolCallDelta)] == out.tool_calls
    if with_stop:
        assert "END" not in out.text
    if not with_stop and not with_tools:
        assert out.text == text  # leading spaces too (mlx-lm's detokenizer alone drops one)


# --- responses, validated by the openai package -------------------------------------------

def assemble(tok, text: str, tools=None) -> tuple[list, Assembled]:
    a = TextAssembler(tok, tools=tools)
    deltas = run(a, [*ids(tok, text), next(iter(tok.eos_token_ids))])
    return deltas, a.result()


def test_chat_completion_objects_validate(tok):
    meta = ResponseMeta.new("chat", "tiny")
    _, text_out = assemble(tok, "Hello there")
    plain = ChatCompletion.model_validate(response(meta, text_out, usage(12, 3, 8)))
    assert plain.id.startswith("chatcmpl-") and plain.model == "tiny"
    assert plain.choices[0].message.content == "Hello there"
    assert plain.usage.total_tokens == 15 and plain.usage.prompt_tokens_details.cached_tokens == 8

    _, call_out = assemble(tok, CALL, tools=[WEATHER])
    called = ChatCompletion.model_validate(response(meta, call_out, usage(12, 30)))
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_chat_stream_chunks_validate_and_reassemble(tok):
    meta = ResponseMeta.new("chat", "tiny")
    deltas, out = assemble(tok, f"Checking.\n{CALL}", tools=[WEATHER])
    chunks = [*first_chunks(meta), *delta_chunks(meta, deltas),
              *final_chunks(meta, out, usage(40, out.completion_tokens))]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert {p.id for p in parsed} == {meta.id}
    content = "".join(p.choices[0].delta.content or "" for p in parsed if p.choices)
    calls = [tc for p in parsed if p.choices for tc in p.choices[0].delta.tool_calls or []]
    assert content == out.text == "Checking."
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert parsed[-2].choices[0].finish_reason == "tool_calls"
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == out.completion_tokens
    assert final_chunks(meta, out)[-1]["choices"]  # no usage chunk unless asked

    state = ChatCompletionStreamState(input_tools=[WEATHER])  # the SDK's own accumulator
    for p in parsed:
        state.handle_chunk(p)
    final = state.get_final_completion()
    assert final.choices[0].message.content == "Checking."
    [call] = final.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.usage.completion_tokens == out.completion_tokens


def test_completion_objects_validate(tok):
    meta = ResponseMeta.new("completion", "tiny", created=1700000000)
    deltas, out = assemble(tok, "return 42")
    whole = Completion.model_validate(response(meta, out, usage(3, 4)))
    assert whole.id.startswith("cmpl-") and whole.choices[0].text == "return 42"
    assert whole.created == 1700000000 and whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = [*first_chunks(meta), *delta_chunks(meta, deltas),
              *final_chunks(meta, out, usage(3, 4))]
    # The API streams finish_reason null until the last chunk; the SDK's type does not allow
    # None (it builds stream chunks without validating), so check the rest with a stand-in.
    for c in chunks[:-2]:
        Completion.model_validate({**c, "choices": [{**c["choices"][0], "finish_reason": "stop"}]})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "return 42"
    assert Completion.model_validate(chunks[-2]).choices[0].finish_reason == "stop"
    assert Completion.model_validate(chunks[-1]).usage.total_tokens == 7


def test_sse_models_and_errors():
    event = sse({"a": "é"})
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[6:]) == {"a": "é"} and SSE_DONE == b"data: [DONE]\n\n"
    listing = models_list(["tiny"], created=5)
    assert listing["object"] == "list"
    assert Model.model_validate(listing["data"][0]).id == "tiny"
    assert error_body(503, "pool exhausted: asked 9 blocks, 2 free", code="pool_exhausted") == {
        "error": {"message": "pool exhausted: asked 9 blocks, 2 free", "type": "server_error",
                  "param": None, "code": "pool_exhausted"}}
    assert ProtocolError(429, "queue full").type == "rate_limit_error"
    missing = check_model("gpt-4", "tiny")
    assert missing.status == 404 and missing.type == "not_found_error" and missing.param == "model"
    assert check_model(None, "tiny") is None and check_model("tiny", "tiny") is None


def test_context_overflow_names_the_five_figures():
    message = context_overflow_message(40960, 8192, 7000, 2048)
    for figure in ("40960", "8192", "7000", "2048", "9048"):
        assert figure in message
    assert "max_tokens to at most 1192" in message
    assert context_overflow(40960, 8192, 7000, 1192) is None
    err = context_overflow(40960, 8192, 7000, 2048)
    assert err.status == 400 and err.param == "max_tokens" and err.message == message
    alone = context_overflow(None, 8192, 9000, 16, prompt_param="prompt")
    assert alone.param == "prompt" and "shorten it by at least 809" in alone.message
    assert "unknown" in alone.message


def test_protocol_does_not_import_mlx():
    code = ("import sys, plimsoll.protocol; "
            "sys.exit(any(m.split('.')[0] in ('mlx', 'mlx_lm') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_stop_string_inside_an_unclosed_tool_call_still_stops(tok):
    # found by hypothesis: parts=['<tool_call>', 'END'] with stop END and tools on
    a = TextAssembler(tok, stop=["END"], tools=[WEATHER])
    deltas = run(a, ids(tok, "<tool_call>END"))
    out = a.result()
    assert "END" not in out.text and streamed_text(deltas) == out.text
