"""Ollama's API on ``plimsoll serve``'s port, through the official ``ollama`` Python client.

Two real proxies: the embedded default (no policy: the demo model ``demo-tiny``, an API
key) answers list, show, ps, chat and generate streamed and not, ``format`` (a JSON Schema
the answer validates against, and ``"json"``), ``num_ctx`` over the served context (400),
the API key (401) and the model-management routes (refused, never a pretended success),
plus OpenAI's ``models.retrieve`` through the OpenAI SDK. A second proxy serves a policy
with a model admission refuses (503 with ``Retry-After``) and a *tool caller*: the tiny
demo rebuilt so that greedy or sampled, whatever the prompt, it answers one call of
``get_time`` in the template's ``<tool_call>`` markup — a real model run by the real
engine, so the tool call comes back parsed, in Ollama's shape (``arguments`` an object).
``--no-ollama-api`` and the policy's ``ollamaApi: false`` turn ``/api/*`` off (404).
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from test_proxy import Proxy

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

KEY = "s3cret"
HI = [{"role": "user", "content": "What time is it?"}]
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "days", "unit"], "additionalProperties": False}
GET_TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def client(proxy: Proxy, key: str | None = KEY) -> ollama.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return ollama.Client(host=proxy.url, headers=headers, timeout=180)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[Proxy]:
    """``plimsoll serve --api-key KEY`` on the embedded default (built in its own cache)."""
    tmp = tmp_path_factory.mktemp("ollama-demo")
    p = Proxy(["--api-key", KEY], tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "cache")},
              api_key=KEY)
    yield p
    assert not p.stop()


# --- the tool caller ----------------------------------------------------------------------

CALLS = (' {"name": "get_time"}', ' {"name": "now"}', ' {"name": "clock"}')
"""Candidate call bodies: the first whose tokens are all distinct is the one the model
writes (a model that sees only its current token can write each token's successor once)."""


def build_tool_caller(tiny: Path, out: Path) -> str:
    """A copy of the tiny demo whose answer to any chat prompt is one tool call: every layer
    adds nothing to the residual stream (o_proj and down_proj zero), so the logits depend on
    the current token alone, and the untied LM head chains the template's last prompt token
    (the newline after ``assistant``) through ``<tool_call>``, the call's tokens and
    ``</tool_call>`` to end-of-turn; any other token leads to end-of-turn. Returns the name
    of the tool it calls."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    shutil.copytree(tiny, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    newline = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids[-1]
    eos = tok.token_to_id("<|im_end|>")
    for body in CALLS:
        chain = tok.encode(f"<tool_call>{body}</tool_call>", add_special_tokens=False).ids
        if len(set(chain)) == len(chain) and not {newline, eos} & set(chain):
            break
    else:
        raise AssertionError(f"no candidate call has distinct tokens: {CALLS}")
    chain = [newline, *chain, eos]
    weights = mx.load(str(out / "model.safetensors"))
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    other = hidden - 1  # the direction of every token off the chain
    embed = mx.zeros((vocab, hidden)).at[:, other].add(1.0)
    head = mx.zeros((vocab, hidden)).at[eos, other].add(4.0)
    for k, (cur, nxt) in enumerate(itertools.pairwise(chain)):
        embed = embed.at[cur].multiply(0.0).at[cur, k].add(1.0)
        head = head.at[nxt, k].add(4.0)
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    weights.update({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                    "model.norm.weight": mx.ones((hidden,))})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "model.safetensors"
        index.write_text(json.dumps(data))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    (out / "demo-model.json").unlink(missing_ok=True)  # not the demo build any more
    return json.loads(body)["name"]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory) -> Iterator[tuple[Proxy, str, Path]]:
    """``plimsoll serve --policy`` with the tool caller and a model admission refuses."""
    tmp = tmp_path_factory.mktemp("ollama-policy")
    tool = build_tool_caller(tiny_model, tmp / "caller")
    huge = tmp / "huge"  # claims 4 MiB of KV per token: admission refuses it unloaded
    shutil.copytree(tiny_model, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "head_dim": 65536}))
    small = {"context": 1024, "maxTokens": 64}
    policy = tmp / "policy.json"
    policy.write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 2}, "clustered": {"maxLocalLlmGb": 2}},
        "models": {"caller": {"path": str(tmp / "caller"), **small},
                   "huge": {"path": str(huge), **small}}}))
    p = Proxy(["--policy", str(policy)], tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "c")})
    yield p, tool, policy
    assert not p.stop()


# --- the embedded default -------------------------------------------------------------------

def test_list_show_and_ps(demo):
    c = client(demo)
    listed = c.list().models
    assert [m.model for m in listed] == ["demo-tiny:latest"]
    assert listed[0].details.family == "qwen3" and listed[0].size > 0
    assert listed[0].details.parameter_size.endswith("M")
    card = httpx.get(demo.url + "/v1/models", headers=demo.headers).json()["data"][0]
    shown = c.show("demo-tiny")
    assert shown.modelinfo["qwen3.context_length"] == card["context"]  # what is served
    assert shown.modelinfo["qwen3.embedding_length"] == 256
    assert shown.parameters == f"num_ctx {card['context']}"
    assert "<|im_start|>" in shown.template and "tools" in shown.capabilities
    assert c.show("demo-tiny:latest").modelinfo == shown.modelinfo
    c.chat(model="demo-tiny", messages=HI, options={"num_predict": 1})
    (running,) = c.ps().models
    assert running.model == "demo-tiny:latest" and running.context_length == card["context"]
    assert running.size > 0 and running.expires_at is not None


def test_chat_not_streamed_and_streamed_agree(demo):
    c = client(demo)
    opts = {"num_predict": 12, "temperature": 1.0, "seed": 11}
    whole = c.chat(model="demo-tiny", messages=HI, options=opts)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.eval_count <= 12
    assert whole.message.content  # the comparison below compares something
    assert whole.prompt_eval_count > 5 and whole.total_duration >= whole.eval_duration > 0
    assert whole.total_duration >= whole.prompt_eval_duration > 0
    parts = list(c.chat(model="demo-tiny:latest", messages=HI, options=opts, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason
    log = demo.log.read_text()
    assert 'route="POST /api/chat" model=demo-tiny status=200' in log and "completion=" in log


def test_generate_templated_raw_and_load(demo):
    c = client(demo)
    opts = {"num_predict": 6, "temperature": 1.0, "seed": 3}
    one = c.generate(model="demo-tiny", prompt="Say hi", system="Be brief.", options=opts)
    assert one.done and one.eval_count <= 6 and isinstance(one.response, str)
    streamed = list(c.generate(model="demo-tiny", prompt="Say hi", system="Be brief.",
                               options=opts, stream=True))
    assert "".join(p.response for p in streamed) == one.response and streamed[-1].done
    raw = c.generate(model="demo-tiny", prompt="def f(x):", raw=True, options=opts)
    assert raw.prompt_eval_count < one.prompt_eval_count  # no template around it
    load = c.generate(model="demo-tiny")
    assert load.done and load.done_reason == "load" and load.response == ""


def test_format_json_schema_and_json(demo):
    c = client(demo)
    r = c.chat(model="demo-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
               format=SCHEMA, options={"num_predict": 200, "temperature": 0.8, "seed": 5})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    parts = list(c.generate(model="demo-tiny", prompt="A JSON object:", format="json",
                            options={"num_predict": 200, "seed": 2}, stream=True))
    assert isinstance(json.loads("".join(p.response for p in parts)), dict)


def test_num_ctx_is_checked_against_the_served_context(demo):
    c = client(demo)
    context = c.show("demo-tiny").modelinfo["qwen3.context_length"]
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="demo-tiny", messages=HI, options={"num_ctx": context + 1})
    assert e.value.status_code == 400 and f"num_ctx {context + 1}" in e.value.error
    assert f"served with ({context} tokens" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="demo-tiny", messages=HI, options={"num_ctx": 4})
    assert e.value.status_code == 400 and "leaves no room" in e.value.error
    r = httpx.post(demo.url + "/api/chat", headers=demo.headers, timeout=180, json={
        "model": "demo-tiny", "messages": HI, "stream": False,
        "options": {"num_ctx": 40, "num_predict": 1000}})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt_eval_count"]
    assert r.headers["x-plimsoll-max-tokens"] == str(40 - prompt)  # num_ctx bounds the output


def test_the_api_key_is_asked_on_every_route(demo):
    anon = client(demo, key=None)
    for call in (anon.list, anon.ps, lambda: anon.show("demo-tiny"),
                 lambda: anon.chat(model="demo-tiny", messages=HI),
                 lambda: anon.generate(model="demo-tiny", prompt="x"),
                 lambda: anon.pull("demo-tiny")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 401 and "API key" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client(demo, key="wrong").list()
    assert e.value.status_code == 401
    assert httpx.get(demo.url + "/api/version").json()["version"].count(".") == 2


def test_model_management_is_refused_never_faked(demo):
    c = client(demo)
    for call in (lambda: c.pull("llama3.2"), lambda: c.push("demo-tiny"),
                 lambda: c.create("mine", from_="demo-tiny"),
                 lambda: c.copy("demo-tiny", "mine"), lambda: c.delete("demo-tiny"),
                 lambda: c.embed(model="demo-tiny", input="x")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and "not supported here" in e.value.error
    assert [m.model for m in c.list().models] == ["demo-tiny:latest"]  # nothing changed
    for model in ("llama3.2", "demo-tiny:7b"):
        with pytest.raises(ollama.ResponseError) as e:
            c.chat(model=model, messages=HI)
        assert e.value.status_code == 404 and "demo-tiny" in e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            c.show(model)
        assert e.value.status_code == 404


def test_openai_models_retrieve(demo):
    oai = demo.client(api_key=KEY)
    card = oai.models.retrieve("demo-tiny")
    assert card.id == "demo-tiny" and card.model_extra["context"] > 0
    alias = oai.models.retrieve("claude-sonnet-4-5")  # the default rule of client names
    assert alias.id == "claude-sonnet-4-5" and alias.model_extra["root"] == "demo-tiny"
    assert oai.models.retrieve("demo-tiny:latest").model_extra["root"] == "demo-tiny"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("nope")
    err = e.value.body
    assert err["code"] == "model_not_found" and "demo-tiny" in err["message"]
    with pytest.raises(openai.AuthenticationError):
        demo.client(api_key="wrong").models.retrieve("demo-tiny")


def test_metrics_time_ollama_streams(demo):
    """The proxy scans a relayed NDJSON stream for its first token, as it does SSE."""
    before = _ttft_count(demo)
    parts = list(client(demo).chat(model="demo-tiny", messages=HI, stream=True,
                                   options={"num_predict": 4, "temperature": 1.0, "seed": 3}))
    assert any(p.message.content for p in parts)
    assert _ttft_count(demo) == before + 1
    text = httpx.get(demo.url + "/metrics", headers=demo.headers, timeout=30).text
    assert 'plimsoll_requests_total{model="demo-tiny",outcome="ok"}' in text


def _ttft_count(proxy: Proxy) -> float:
    text = httpx.get(proxy.url + "/metrics", headers=proxy.headers, timeout=30).text
    lines = [ln for ln in text.splitlines()
             if ln.startswith('plimsoll_time_to_first_token_seconds_count{model="demo-tiny"}')]
    return float(lines[0].split()[-1]) if lines else 0.0


# --- a policy: a tool caller, a refusal -----------------------------------------------------

def test_a_tool_call_comes_back_in_ollamas_shape(served):
    proxy, tool, _ = served
    c = client(proxy)
    r = c.chat(model="caller", messages=HI, tools=[GET_TIME])
    (call,) = r.message.tool_calls
    assert call.function.name == tool and dict(call.function.arguments) == {}
    assert r.message.content == "" and r.done_reason == "stop"
    parts = list(c.chat(model="caller", messages=HI, tools=[GET_TIME], stream=True))
    calls = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [tc.function.name for tc in calls] == [tool] and parts[-1].done
    follow_up = [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": tool, "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "tool_name": tool, "content": "12:00"}]
    again = c.chat(model="caller", messages=follow_up, tools=[GET_TIME])  # history renders
    assert again.message.tool_calls[0].function.name == tool
    assert again.prompt_eval_count > r.prompt_eval_count


def test_a_model_admission_refuses_is_503_with_retry_after(served):
    proxy, _, _ = served
    with pytest.raises(ollama.ResponseError) as e:
        client(proxy).chat(model="huge", messages=HI)
    assert e.value.status_code == 503 and "huge" in e.value.error
    r = httpx.post(proxy.url + "/api/generate", json={"model": "huge", "prompt": "x"},
                   timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"].isdigit()
    body = r.json()
    assert isinstance(body["error"], str) and body["code"]


@pytest.mark.parametrize("how", ["flag", "policy"])
def test_the_ollama_api_can_be_turned_off(served, tmp_path, how):
    _, _, policy = served
    args = ["--policy", str(policy)]
    if how == "flag":
        args.append("--no-ollama-api")
    else:
        off = tmp_path / "off.json"
        off.write_text(json.dumps({**json.loads(policy.read_text()), "ollamaApi": False}))
        args[1] = str(off)
    p = Proxy(args, tmp_path / "serve.log", {"PLIMSOLL_CACHE": str(tmp_path / "c")})
    try:
        for method, path in [("GET", "/api/tags"), ("POST", "/api/chat"), ("GET", "/api/version"),
                             ("POST", "/api/pull")]:
            r = httpx.request(method, p.url + path, json={"model": "caller"}, timeout=30)
            assert r.status_code == 404 and "no route" in r.json()["error"], (path, r.text)
        assert httpx.get(p.url + "/v1/models/caller", timeout=30).status_code == 200
        assert p.running()["workers"][0]["state"] == "stopped"  # nothing was loaded
    finally:
        assert not p.stop()
