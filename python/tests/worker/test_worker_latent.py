"""MLA models (tiny random-weight families) behind a real worker over HTTP.

Issue 15 measured two concurrent requests to an MLA model answering HTTP 500 each. Here a
real ``plimsoll worker`` (uvicorn on 127.0.0.1, mlx-lm inference) answers chat, stream,
two and three concurrent chats (200, the same greedy text as alone) and a two-turn
conversation that reuses its first turn's blocks; the KV bytes it reports held equal
model facts' figure for the blocks it holds. The concurrent test also runs deepseek_v32
(latent + indexer keys) and falcon_h1 (mamba state + KV), mlx-lm ``CacheList`` layers.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from conftest import Worker

from plimsoll.core.model_facts import inspect_model

pytest.importorskip("mlx.core")

BLOCK = 16
QUESTIONS = ["what is a latent vector?", "name three rivers in europe and one in asia",
             "def main(args):"]


@pytest.fixture(scope="module")
def workers(family_dir):
    started: dict[str, Worker] = {}

    def get(name: str) -> Worker:
        if name not in started:
            path = family_dir(name)
            started[name] = Worker(path, **{"block-tokens": BLOCK, "max-cache-blocks": 512})
            started[name].facts = inspect_model(path)
        return started[name]
    yield get
    for w in started.values():
        w.stop()


@pytest.fixture
def mla_worker(workers):
    return workers("deepseek_v3")


def _chat(w: Worker, messages: list[dict], n: int = 12, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": n, "temperature": 0}
    if not stream:
        return httpx.post(w.url + "/v1/chat/completions", json=body, timeout=120)
    with httpx.stream("POST", w.url + "/v1/chat/completions", json=body | {"stream": True},
                      timeout=120) as r:
        r.read()
        return r


def _text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"] or ""


def _user(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "falcon_h1"])
def test_concurrent_chats_answer_200_with_the_text_of_each_alone(workers, family):
    """An MLA model, MLA + indexer keys (CacheList) and mamba state + KV (CacheList)."""
    mla_worker = workers(family)
    alone = []
    for q in QUESTIONS:
        r = _chat(mla_worker, _user(q))
        assert r.status_code == 200, r.text
        alone.append(_text(r))
    assert len(set(alone)) == 3 and all(alone)
    for group in (QUESTIONS[:2], QUESTIONS):
        results: dict[int, httpx.Response] = {}

        def ask(i: int, q: str, results=results) -> None:
            results[i] = _chat(mla_worker, _user(q))
        threads = [threading.Thread(target=ask, args=(i, q)) for i, q in enumerate(group)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [results[i].status_code for i in range(len(group))] == [200] * len(group)
        assert [_text(results[i]) for i in range(len(group))] == alone[:len(group)]
    mla_worker.wait_idle()


def test_stream_equals_the_plain_answer(mla_worker):
    plain = _text(_chat(mla_worker, _user(QUESTIONS[1])))
    r = _chat(mla_worker, _user(QUESTIONS[1]), stream=True)
    assert r.status_code == 200
    text = ""
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    assert text == plain


def test_two_turns_reuse_the_first_turns_blocks_and_bytes_match_facts(mla_worker):
    first = _user("tell me about " + "blocks of latent attention " * 8)
    r1 = _chat(mla_worker, first, n=16)
    assert r1.status_code == 200
    turn2 = [*first, {"role": "assistant", "content": _text(r1)},
             {"role": "user", "content": "and then?"}]
    r2 = _chat(mla_worker, turn2, n=8)
    assert r2.status_code == 200, r2.text
    usage = r2.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= BLOCK
    s = mla_worker.wait_idle()
    per_block = BLOCK * mla_worker.facts.kv_bytes_per_token  # latent + rope key, per layer
    assert s["pool"]["cached"] > 0
    assert s["kv_bytes_held"] == (s["pool"]["used"] + s["pool"]["cached"]) * per_block
    assert s["kv_bytes_allocated"] % per_block == 0  # the engine's real arrays: whole blocks
