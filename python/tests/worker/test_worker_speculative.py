"""Speculative decoding by prompt lookup, for real: two workers on the tiny demo model, one
plain and one with ``--prompt-lookup 3``, answer greedy requests token for token the same
(alone and four at once, through the HTTP API); a seeded sampled request speculates and draws
the same alone as batched; the speculating one reports what it proposed and accepted (status,
access log); a hybrid model refuses to speculate and says why."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from conftest import Worker
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.worker.ngram import History, prompt_lookup
from plimsoll.worker.speculate import RETRY_STEPS, Drafter

PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
           "def main(): return main() def main(): return",
           "hello there, how are you today?",
           "one two three four one two three four one two"]


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec") / "worker.log"
    plain = Worker(tiny_model)
    spec = Worker(tiny_model, log=log, prompt_lookup=3, num_draft_tokens=3)
    yield plain, spec, log
    plain.stop()
    spec.stop()


def complete(w: Worker, prompt: str, n: int = 24, **sampling) -> str:
    r = httpx.post(w.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **sampling})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == n or body["choices"][0]["finish_reason"] == "stop"
    return body["choices"][0]["text"]


def test_greedy_output_is_the_same_with_prompt_lookup(pair):
    plain, spec, log = pair
    for prompt in PROMPTS:  # alone
        assert complete(spec, prompt) == complete(plain, prompt), prompt
    want = [complete(plain, p, 40) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(5) as ex:  # four at once, and a sampled one
        seeded = ex.submit(complete, spec, PROMPTS[3], 24, temperature=0.8, top_k=3, seed=5)
        got = list(ex.map(lambda p: complete(spec, p, 40), PROMPTS))
    assert got == want
    proposed = spec.wait_idle()["speculative"]["proposed"]
    # a seeded sampled request speculates too, and draws the same alone as batched
    assert complete(spec, PROMPTS[3], 24, temperature=0.8, top_k=3, seed=5) == seeded.result()
    assert spec.wait_idle()["speculative"]["proposed"] > proposed
    st = spec.wait_idle()["speculative"]
    assert st["enabled"] is True
    assert st["proposed"] > 0 and 0 < st["accepted"] <= st["proposed"]
    # greedy steps were planned ahead of the verifying step in flight on the real engine
    # (the outputs above are still the plain worker's), and some of them stood
    assert st["ahead"] > st["ahead_void"] >= 0, st
    # ... drafted on the device from the step in flight (engine/chain.py): every plain
    # full-attention engine chains an unseeded sequence's verifying steps
    assert 0 < st["chained"] <= st["ahead"], st
    # an unseeded sampled request is chained too (its drafts' verdicts by the rejection
    # rule; a low temperature keeps its output on the loop lookup finds)
    complete(spec, PROMPTS[0], 32, temperature=0.05)
    assert spec.wait_idle()["speculative"]["chained"] > st["chained"]
    assert st["by_proposer"]["prompt_lookup"]["accepted"] == st["accepted"]
    assert 0 < st["acceptance_rate"] <= 1 and st["accepted_per_step"] > 0
    assert "speculative" not in plain.status()
    lines = [ln for ln in log.read_text().splitlines() if "access " in ln and "drafted=" in ln]
    assert lines and all("accepted=" in ln for ln in lines)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def constrained(w: Worker) -> str:
    r = httpx.post(w.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": "a number, a number, a number"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chained_streams_beside_a_long_prompt_being_prefilled(pair):
    """Steps that hold chained Works and prompt chunks: the step before is read before such a
    step is submitted (tokens out before heavy work), which moves ``written`` back under a
    chained step planned on it; the outputs stay the plain worker's."""
    plain, spec, _ = pair
    long_prompt = " ".join(f"word{i % 97} and more" for i in range(500))  # several chunks
    want = [complete(plain, p, 48) for p in PROMPTS[:2]] + [complete(plain, long_prompt, 16)]
    before = spec.wait_idle()["speculative"]["chained"]
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        streams = [ex.submit(complete, spec, p, 48) for p in PROMPTS[:2]]
        time.sleep(0.2)  # the two are decoding when the long prompt arrives
        late = ex.submit(complete, spec, long_prompt, 16)
        got = [f.result() for f in streams] + [late.result()]
    assert got == want
    assert spec.wait_idle()["speculative"]["chained"] > before


def test_a_constrained_request_decodes_plainly_beside_speculating_ones(pair):
    plain, spec, _ = pair
    want = constrained(plain)
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        greedy = [ex.submit(complete, spec, p, 40) for p in PROMPTS[:2]]
        got = ex.submit(constrained, spec)
        assert got.result() == want
        assert [g.result() for g in greedy] == [complete(plain, p, 40) for p in PROMPTS[:2]]
    json.loads(want)  # the grammar held


@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft_model"])
def test_a_hybrid_model_refuses_to_speculate(family_dir, proposer):
    """Recurrent state cannot roll back by length: neither proposer is used, the status
    says why, and requests are served plainly."""
    how = ({"prompt_lookup": 3} if proposer == "prompt_lookup"
           else {"draft_model": family_dir("qwen3")})
    w = Worker(family_dir("qwen3_next"), **how)
    try:
        st = w.status()["speculative"]
        assert st["enabled"] is False and "RecurrentState" in st["reason"]
        r = httpx.post(w.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "a b a b a b", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        w.stop()


def test_prompt_lookup_matches_the_longest_recent_ngram():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3], 3, 2) == (9, 1)
    assert prompt_lookup([1, 2, 3, 4, 7, 3], 3, 3) == (4, 7, 3)  # n = 1
    assert prompt_lookup([5, 1, 2, 6, 1, 2, 7, 2], 3, 1) == (7,)  # the latest [2]
    assert prompt_lookup([5, 6, 7], 3, 3) == ()
    assert prompt_lookup([4, 4, 4, 4, 4, 4], 3, 3) == (4, 4, 4)  # not the overlapping match
    assert prompt_lookup([1, 2, 9, 1, 2], 2, 3) == (9, 1, 2)
    assert prompt_lookup([1, 2, 1, 2], 2, 0) == ()


def spec_lookup(seq: list[int], longest: int, k: int) -> tuple[int, ...]:
    """The rule as the docstring states it, by brute force."""
    if k <= 0 or len(seq) < 2:
        return ()
    for n in range(min(longest, len(seq) - 1), 0, -1):
        places = [i for i in range(len(seq) - n) if seq[i:i + n] == seq[len(seq) - n:]]
        whole = [i for i in places if i + n + k <= len(seq)]
        if places:
            i = (whole or places)[-1]
            return tuple(seq[i + n:i + n + k])
    return ()


@pytest.mark.pure
@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 4), st.integers(0, 5),
       st.integers(0, 60))
def test_the_vectorized_lookup_is_the_scan_and_its_history_follows_the_tokens(
        seq, longest, k, cut):
    assert prompt_lookup(seq, longest, k) == spec_lookup(seq, longest, k)
    history = History()
    for size in (cut, len(seq), cut // 2, len(seq)):  # grown, then a shorter list: rebuilt
        part = seq[:size]
        assert history.of(part).tolist() == part
        assert prompt_lookup(history.of(part), longest, k) == spec_lookup(part, longest, k)
    other = [x + 1 for x in seq]  # a different list of the same length: rebuilt too
    assert history.of(other).tolist() == other


def test_draft_length_adapts_to_acceptance():
    d = Drafter(3, 3)
    toks = [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.propose(7, toks, 10) == (3, 1, 2)
    d.started(7, 7, 3)
    assert d.settle(7, 2) == (7, 3)  # two of three right: drafting pays, the length stays
    assert len(d.propose(7, toks, 10)) == 3
    d.started(7, 7, 3)
    d.settle(7, 3)
    assert len(d.propose(7, toks, 10)) == 3  # (at most already)
    for _ in range(3):
        d.started(7, 7, 3)
        d.settle(7, 0)  # none accepted, three times: no longer worth a verifying step
    # down to 0: plain decoding, a retry every RETRY_STEPS steps
    d.tick()
    assert not d.wants(7) and d.propose(7, toks, 10) == ()
    for _ in range(RETRY_STEPS - 2):  # every step counts towards the retry, drafting or not
        d.tick()
        assert not d.wants(7)
    d.tick()
    assert d.wants(7) and d.clock == RETRY_STEPS and d.propose(7, toks, 10) == (3,)
    d.started(7, 7, 1)
    assert d.wants(7)  # its drafts in flight: its next step waits for them, at any length
    d.settle(7, 0)
    assert not d.wants(7)
    assert d.figures.proposed == 16 and d.figures.accepted == 5
    d.forget(7)
    d.tick()  # step 17: not a retry step
    assert d.length(7) == 1  # under half accepted so far: a new sequence starts short
    assert d.propose(8, toks, 1) == (3,)  # never past the request's room


def test_the_policy_entry_and_flags_reach_the_worker_argv():
    from pathlib import Path

    from plimsoll.core.policy import ModelEntry
    from plimsoll.core.worker_config import WorkerConfig, worker_flags

    entry = ModelEntry.model_validate({"path": "/m", "context": 8192, "promptLookup": 2,
                                       "numDraftTokens": 5})
    assert (entry.prompt_lookup, entry.num_draft_tokens) == (2, 5)
    cfg = WorkerConfig(model_dir=Path("/m"), model_name="m", max_cache_blocks=8,
                       gpu_memory_utilization=0.5, max_num_seqs=1, context=64, max_tokens=16,
                       default_max_tokens=16, ceiling_bytes=1, total_ram_bytes=1,
                       prompt_lookup=2, num_draft_tokens=5)
    flags = worker_flags(cfg)
    assert flags[flags.index("--prompt-lookup") + 1] == "2"
    assert flags[flags.index("--num-draft-tokens") + 1] == "5"


def test_metrics_carry_the_acceptance_per_model():
    from conftest import gauge_text

    d = Drafter(3, 3)
    d.started(1, 10, 3)
    d.settle(1, 2)
    text = gauge_text({"m": {"speculative": d.report()},
                       "n": {"speculative": Drafter(3, 3, "no rollback").report()}})
    assert 'plimsoll_speculative_accepted{model="m"} 2.0' in text
    assert 'plimsoll_speculative_acceptance_rate{model="m"} 0.6667' in text
    assert 'plimsoll_speculative_accepted_per_step{model="m"} 2.0' in text
    assert 'plimsoll_speculative_verify_cost{model="m"} 2.0' in text  # nothing timed yet
    assert 'plimsoll_speculative_draft_cost{model="m"} 2.0' in text
    assert 'model="n"' not in "\n".join(x for x in text.splitlines() if "speculative" in x)
