"""Prompts tokenized piece by piece between added tokens, long pieces cached
(:mod:`plimsoll.worker.prompt_pieces`): the ids are the tokenizer's own on any text, from the
cache too; the cache keeps to its bound; a tokenizer whose pieces are not independent is
refused at the start-time check and tokenizes whole; and through a real worker, prompts that
share a long system prompt reuse its ids (the status counts the hits) with the usage's
prompt tokens unchanged; prompts that arrive together with a new long piece tokenize it once
(the others wait for its ids), in process and through a real worker. Not in the pure tier:
transformers' encoding imports mlx where it is installed (its array checks)."""

from __future__ import annotations

import gc
import json
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from plimsoll.demo import tokenizer as tokenizer_build
from plimsoll.worker import prompt_pieces
from plimsoll.worker.prompt_pieces import PieceEncoder, PromptTokenizer, checked


def fast_tokenizer(tmp_path_factory, tok: Tokenizer, name: str):
    """``tok`` as transformers loads it from a model directory (the chat template too)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp(name)
    tokenizer_build.write_tokenizer_files(out, tok, 4096)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return fast_tokenizer(tmp_path_factory, tokenizer_build.train_tokenizer(512), "demo")


ADDED = list(tokenizer_build.SPECIAL_TOKENS + tokenizer_build.TOOL_TOKENS)
texts = st.lists(st.one_of(st.sampled_from(ADDED),
                           st.text(st.characters(codec="utf-8"), max_size=40),
                           st.sampled_from([" ", "\n", "\n\n", "  ", "\t", "word", "é", "日本"])),
                 max_size=24).map("".join)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_the_ids_are_the_tokenizers_own_on_any_text(demo, text):
    enc, reason = checked(demo)
    assert enc is not None, reason
    want = demo.encode(text, add_special_tokens=False)
    assert enc.encode(text) == want
    assert enc.encode(text) == want  # a second time: the long pieces from the cache


def test_a_shared_prefix_is_tokenized_once_and_its_ids_reused(demo):
    enc, _ = checked(demo)
    system = "You are a careful coding agent. Read the files first. " * 200
    prompts = [demo.apply_chat_template([{"role": "system", "content": system},
                                         {"role": "user", "content": f"task {i}: " * 60}],
                                        tokenize=False, add_generation_prompt=True)
               for i in range(4)]
    for p in prompts:
        assert enc.encode(p) == demo.encode(p, add_special_tokens=False)
    figures = enc.figures()
    assert figures["hits"] == 3  # the system prompt, after the first
    assert figures["misses"] == 5  # it once, and each task
    assert 0 < figures["bytes"] <= figures["cap_bytes"]


def test_the_cache_keeps_to_its_bound(demo, monkeypatch):
    """The figure the cache keeps under its cap, and the bytes it really holds: Python's own
    allocations traced while it fills (the encoder, its pieces and their ids) stay under
    the cap too."""
    monkeypatch.setattr(prompt_pieces, "CACHE_BYTES", 64 << 10)
    pieces = [f"piece {i} " + "some text to tokenize " * 40 for i in range(60)]
    wants = [demo.encode(p, add_special_tokens=False) for p in pieces]
    gc.collect()
    tracemalloc.start()
    try:
        held_before = tracemalloc.get_traced_memory()[0]
        enc = PieceEncoder(demo.backend_tokenizer)
        for piece, want in zip(pieces, wants, strict=True):
            assert enc.encode(piece) == want
            assert enc.figures()["bytes"] <= 64 << 10
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - held_before
    finally:
        tracemalloc.stop()
    assert 0 < enc.figures()["pieces"] < 60  # the oldest went
    assert held <= 64 << 10, held


class CountingTokenizer:
    """A real ``tokenizers.Tokenizer`` that records every piece it is asked to tokenize and
    can hold or fail a call (to line up threads), delegating everything else."""

    def __init__(self, rust, hold_s: float = 0.0, fail_first: bool = False):
        self._rust, self.hold_s, self.fail_first = rust, hold_s, fail_first
        self.pieces: list[str] = []
        self.inside = threading.Event()  # set once a call has begun tokenizing
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._rust, name)

    def encode_batch(self, pieces, **kwargs):
        with self._lock:
            self.pieces += pieces
            first = len(self.pieces) == len(pieces)
        self.inside.set()
        time.sleep(self.hold_s)
        if self.fail_first and first:
            raise RuntimeError("the first tokenizing fails")
        return self._rust.encode_batch(pieces, **kwargs)


def _sub_agent_prompts(demo, n: int) -> tuple[str, list[str]]:
    system = "A new system prompt every sub-agent shares, with its tools. " * 120
    return system, [demo.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": f"task {i}"}],
                                             tokenize=False, add_generation_prompt=True)
                    for i in range(n)]


def test_prompts_that_arrive_together_tokenize_their_shared_piece_once(demo):
    """Eight prompts with one new long system prompt, on eight threads at once: the piece is
    tokenized by one of them, the others wait for its ids; every prompt's ids are the
    tokenizer's own. (The code before tokenized it eight times.)"""
    system, prompts = _sub_agent_prompts(demo, 8)
    rust = CountingTokenizer(demo.backend_tokenizer, hold_s=0.2)
    enc = PieceEncoder(rust)
    barrier = threading.Barrier(len(prompts))

    def one(prompt):
        barrier.wait(timeout=10)
        return enc.encode(prompt)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    for prompt, ids in zip(prompts, got, strict=True):
        assert ids == demo.encode(prompt, add_special_tokens=False)
    assert sum(system in piece for piece in rust.pieces) == 1, len(rust.pieces)
    figures = enc.figures()
    assert figures["waited"] == 7 and figures["misses"] >= 1


def test_a_piece_twice_in_one_prompt_is_tokenized_once(demo):
    piece = "the same long instructions, repeated in the prompt " * 20
    text = f"{piece}<|im_start|>{piece}<|im_end|>"
    rust = CountingTokenizer(demo.backend_tokenizer)
    assert PieceEncoder(rust).encode(text) == demo.encode(text, add_special_tokens=False)
    assert rust.pieces.count(piece) == 1


def test_a_failed_tokenizing_lets_its_waiters_go_on(demo):
    """The thread tokenizing a shared piece fails: the one waiting for it is let go and
    tokenizes the piece itself, with the right ids; the failure stays the first one's."""
    _, prompts = _sub_agent_prompts(demo, 2)
    rust = CountingTokenizer(demo.backend_tokenizer, hold_s=0.3, fail_first=True)
    enc = PieceEncoder(rust)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(enc.encode, prompts[0])
        assert rust.inside.wait(timeout=10)  # the first is tokenizing: the second waits on it
        second = pool.submit(enc.encode, prompts[1])
        assert second.result(timeout=30) == demo.encode(prompts[1], add_special_tokens=False)
        with pytest.raises(RuntimeError, match="first tokenizing fails"):
            first.result(timeout=30)
    assert enc.figures()["waited"] == 0


def test_a_tokenizer_whose_pieces_are_not_independent_is_refused(tmp_path_factory):
    """A Metaspace pre-tokenizer that prepends only at the input's start (SentencePiece
    style) tokenizes a piece after an added token otherwise than the same piece alone: the
    start-time check finds it, and prompts are tokenized whole."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "▁hi": 1, "hi": 2, "▁there": 3, "there": 4,
                                      "▁": 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in tokenizer_build.SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in tokenizer_build.TOOL_TOKENS])
    hf = fast_tokenizer(tmp_path_factory, tok, "metaspace")
    text = "hi there<|im_start|>hi there"
    if PieceEncoder(hf.backend_tokenizer).encode(text) == hf.encode(text,
                                                                    add_special_tokens=False):
        pytest.skip("this tokenizers release prepends per piece: nothing to refuse")
    enc, reason = checked(hf)
    assert enc is None and "differ" in reason
    wrapped = PromptTokenizer(hf)
    assert wrapped.figures() == {"enabled": False, "reason": reason}
    assert wrapped.encode_prompt(text) == hf.encode(text, add_special_tokens=False)


def test_the_wrapper_is_the_tokenizer_otherwise(demo):
    wrapped = PromptTokenizer(demo)
    assert wrapped.figures()["enabled"] is True
    assert len(wrapped) == len(demo)
    assert wrapped.eos_token == demo.eos_token
    text = demo.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                    add_generation_prompt=True)
    assert wrapped.encode_prompt(text) == demo.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=True, add_generation_prompt=True,
        return_dict=False)


def test_a_worker_reuses_a_shared_system_prompts_ids(tiny_model, tmp_path):
    from conftest import Worker
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    system = "Shared instructions for every sub-agent. " * 60
    w = Worker(tiny_model, log=tmp_path / "w.log")
    try:
        usage = []
        for i in range(3):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"task number {i}"}]
            r = httpx.post(w.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"]["prompt_tokens"])
            want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
            assert usage[-1] == len(want)
        figures = w.status()["prompt_pieces"]
    finally:
        w.stop()
    assert figures["enabled"] is True, json.dumps(figures)
    assert figures["hits"] >= 2


def test_a_worker_tokenizes_a_new_shared_system_prompt_once_for_requests_sent_together(
        tiny_model, tmp_path):
    """Eight chat requests sent at once (clients made first, released together) with one
    system prompt the worker has not seen: its piece is tokenized by one of them; each other
    either found its ids cached or waited for them (``hits + waited`` = 7, where tokenizing it
    again would leave it short), and every prompt's token count is the template's."""
    from conftest import Worker
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    system = "New shared instructions for eight sub-agents started together. " * 80
    w = Worker(tiny_model, log=tmp_path / "w.log")
    try:
        before = w.status()["prompt_pieces"]
        barrier = threading.Barrier(8)

        def one(i: int) -> tuple[int, int]:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"sub-task {i}"}]
            with httpx.Client() as client:
                barrier.wait(timeout=30)
                r = client.post(w.url + "/v1/chat/completions", timeout=300, json={
                    "model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
            return r.json()["usage"]["prompt_tokens"], len(want)

        with ThreadPoolExecutor(8) as pool:
            counts = list(pool.map(one, range(8)))
        after = w.status()["prompt_pieces"]
    finally:
        w.stop()
    assert all(got == want for got, want in counts), counts
    assert (after["hits"] - before["hits"]) + (after["waited"] - before["waited"]) == 7, after
