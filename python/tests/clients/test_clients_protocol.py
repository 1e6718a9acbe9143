"""The pure parts of serving coding clients: the tolerated-field table, max_tokens clamping,
reasoning splitting, system messages inside ``messages``, model aliases, ``--model`` from the
local Hugging Face cache, and the README's policy example."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.core import aliases
from plimsoll.core.policy import PolicyError, parse_policy
from plimsoll.launch.model_source import ModelNotFound, model_name, resolve_model_dir
from plimsoll.protocol import ProtocolError, parse_request
from plimsoll.protocol import anthropic as A
from plimsoll.protocol import tolerated as T
from plimsoll.protocol.reasoning import Markers, ReasoningSplit
from plimsoll.protocol.reservation import Reservation, reserve

pytestmark = pytest.mark.pure

README = Path(__file__).resolve().parents[3] / "README.md"
HI = [{"role": "user", "content": "hi"}]


def messages_body(**extra) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 8, "messages": HI, **extra}).encode()


# --- the table ---------------------------------------------------------------------------

def test_every_table_entry_has_a_reason_and_a_model_that_uses_its_scope():
    from plimsoll.protocol import requests as R
    from plimsoll.protocol import responses_request as RR
    from plimsoll.protocol.anthropic import request as AR
    from plimsoll.protocol.ollama import request as OR

    scopes = {m.tolerated_scope for mod in (R, RR, AR, OR) for m in vars(mod).values()
              if isinstance(m, type) and getattr(m, "tolerated_scope", None)}
    assert set(T.TOLERATED) == scopes | {RR.TOOL_TYPES}
    for scope, fields in T.TOLERATED.items():
        for name, reason in fields.items():
            assert len(reason) > 20, (scope, name)


def test_tolerated_fields_are_dropped_and_logged_once(caplog):
    T._logged.clear()
    with caplog.at_level(logging.INFO, "plimsoll.protocol"):
        for _ in range(2):
            req = parse_request("chat", json.dumps({
                "messages": HI, "store": True, "reasoning_effort": "high", "user": "u",
                "metadata": {"a": "b"}, "prediction": {"type": "content", "content": "x"},
                "parallel_tool_calls": False,
                "stream_options": {"include_usage": True, "include_obfuscation": True}}
            ).encode())
            assert not isinstance(req, ProtocolError), req
    said = [r.getMessage() for r in caplog.records]
    assert sum("'store'" in m for m in said) == 1 and sum("'prediction'" in m for m in said) == 1


def test_claude_code_fields_are_accepted_everywhere_they_appear():
    body = messages_body(
        context_management={"edits": [{"type": "clear_thinking_20251015"}]},
        metadata={"user_id": "x"}, service_tier="auto", cache_control={"type": "ephemeral"},
        output_config={"effort": "high"}, thinking={"type": "adaptive", "display": "omitted"},
        system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        tools=[{"name": "T", "input_schema": {"type": "object"}, "defer_loading": True,
                "cache_control": {"type": "ephemeral"}, "strict": True,
                "eager_input_streaming": True, "input_examples": [{}]}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                "cache_control": {"type": "ephemeral"}}]},
                  {"role": "system", "content": "# Environment"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                     "name": "T", "input": {},
                                                     "caller": {"type": "direct"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": "ok", "toolset_name": "x"}]}])
    req = A.parse_messages(body)
    assert isinstance(req, A.MessagesRequest), req


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 2048},
                                      {"type": "disabled"}, {"type": "adaptive"}])
def test_every_thinking_type_is_accepted(thinking):
    assert isinstance(A.parse_messages(messages_body(thinking=thinking)), A.MessagesRequest)


# --- system messages inside messages --------------------------------------------------------

class Tok:
    """A chat template that, like many, takes a system message only first."""

    has_chat_template = True

    def apply_chat_template(self, messages, tools=None, tokenize=True, **kw):
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("System message must be at the beginning.")
        self.seen = messages
        return [1, 2, 3]


def test_system_messages_are_placed_as_the_template_allows():
    req = A.parse_messages(messages_body(system="top", messages=[
        {"role": "system", "content": "lead"}, {"role": "user", "content": "u1"},
        {"role": "system", "content": "env"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u2"}]))
    in_place = A.template_messages(req)
    assert [m["role"] for m in in_place] == ["system", "user", "system", "assistant", "user"]
    assert in_place[0]["content"] == "top\n\nlead"
    tok = Tok()
    assert A.render_messages(tok, req) == [1, 2, 3]
    assert [m["role"] for m in tok.seen] == ["system", "user", "assistant", "user"]
    assert tok.seen[3]["content"] == "env\n\nu2"  # folded into the next user turn


# --- the reservation -----------------------------------------------------------------------

@given(asked=st.one_of(st.none(), st.integers(1, 100_000)), limit=st.integers(1, 5000),
       context=st.integers(2, 20_000), prompt=st.integers(1, 25_000))
def test_the_clamp_never_exceeds_the_limit_or_the_context(asked, limit, context, prompt):
    got = reserve(asked, default=min(512, limit), limit=limit, context=context,
                  prompt_tokens=prompt, native_max=None)
    if prompt >= context:
        assert isinstance(got, ProtocolError) and got.param == "messages"
        assert "configured total context" in got.message
        return
    assert isinstance(got, Reservation)
    assert 1 <= got.max_tokens <= min(limit, context - prompt)
    wanted = asked if asked is not None else min(512, limit)
    assert got.max_tokens == min(wanted, limit, context - prompt)


def test_refuse_keeps_both_400s():
    over = reserve(65, default=16, limit=64, context=1000, prompt_tokens=10, native_max=None,
                   over_limit="refuse")
    assert isinstance(over, ProtocolError) and over.code == "max_tokens_too_large"
    ctx = reserve(64, default=16, limit=64, context=70, prompt_tokens=10, native_max=None,
                  over_limit="refuse")
    assert isinstance(ctx, ProtocolError) and ctx.code == "context_length_exceeded"


# --- reasoning -------------------------------------------------------------------------------

@given(st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", " b\n",
                                 "think", ">"]), max_size=30), st.data())
def test_reasoning_pieces_reassemble_the_text_without_markers(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    split = ReasoningSplit(Markers("<think>", "</think>"))
    pieces = [p for c in chunks for p in split.feed(c)] + split.flush()
    whole = ReasoningSplit(Markers("<think>", "</think>"))
    expected = whole.feed(text) + whole.flush()

    def joined(ps):
        return ("".join(t for r, t in ps if r), "".join(t for r, t in ps if not r))

    assert joined(pieces) == joined(expected)


def test_reasoning_and_answer_are_told_apart():
    split = ReasoningSplit(Markers("<think>", "</think>"))
    out = split.feed("<think>\nLet me") + split.feed(" see.</th") + split.feed("ink>\n\nHi!")
    out += split.flush()
    assert "".join(t for r, t in out if r) == "Let me see."
    assert "".join(t for r, t in out if not r) == "Hi!"
    opened = ReasoningSplit(Markers("<think>", "</think>", reasoning_first=True))
    out = opened.feed("hmm</think>ok") + opened.flush()
    assert out == [(True, "hmm"), (False, "ok")]


# --- aliases, policy ----------------------------------------------------------------------

def base_policy(**extra) -> dict:
    return {"schemaVersion": 1, "host": "h", "totalRamGb": 32, "osFloorGb": 8,
            "modes": {"standalone": {"maxLocalLlmGb": 16}},
            "models": {"a": {"path": "/m/a", "context": 8192},
                       "b": {"path": "/m/b", "context": 8192}}, **extra}


def test_aliases_then_the_default_rule_for_client_names():
    pol = parse_policy(base_policy(aliases={"sonnet*": "b"}, defaultModel="a"))
    assert pol.modes.clustered == pol.modes.standalone  # left out: the standalone budget
    assert aliases.resolve("a", pol) == "a"
    assert aliases.resolve("sonnet-4", pol) == "b"
    assert aliases.resolve("claude-haiku-4-5", pol) == "a"
    assert aliases.resolve("gpt-5-codex", pol) == "a"
    assert aliases.resolve("llama", pol) is None
    two = parse_policy(base_policy())
    assert aliases.resolve("claude-x", two) is None  # two models, no defaultModel: no guess
    with pytest.raises(PolicyError, match=r"aliases\.x"):
        parse_policy(base_policy(aliases={"x": "nope"}))


def test_the_readme_policy_example_passes_the_check():
    blocks = re.findall(r"```json\n(.*?)```", README.read_text(), re.S)
    policies = [json.loads(b) for b in blocks if '"schemaVersion"' in b]
    assert policies
    for data in policies:
        parse_policy(data, "README")


# --- --model ORG/NAME from the local cache ---------------------------------------------------

def test_a_repo_id_resolves_from_the_local_hugging_face_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    repo = hub / "models--acme--Tiny-4bit"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir("acme/Tiny-4bit") == snap
    assert model_name("acme/Tiny-4bit", snap) == "Tiny-4bit"
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        resolve_model_dir("acme/Absent")
    with pytest.raises(ModelNotFound, match="no such directory"):
        resolve_model_dir(str(tmp_path / "nope" / "x" / "y"))
