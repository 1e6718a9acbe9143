"""Speculation with the checkpoint's MTP head, for real: two workers on ``glm4_moe_mtp``
(mlx-lm's glm4_moe with a random nextn layer), one with the head (``--mtp``: found in the
checkpoint) and one without (prompt lookup instead). Greedy answers are token
for token the same, alone and four at once, through the HTTP API; the status names the
proposer, the head drafted, and its weights and KV are reported."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from conftest import Worker

PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
           "def main(): return main() def main(): return",
           "hello there, how are you today?",
           "one two three four one two three four one two"]


@pytest.fixture(scope="module")
def pair(family_dir):
    d = family_dir("glm4_moe_mtp")
    with_head, without = Worker(d, mtp=True), Worker(d, prompt_lookup=2)
    yield with_head, without
    for w in (with_head, without):
        w.stop()


def complete(w: Worker, prompt: str, n: int = 24) -> str:
    r = httpx.post(w.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_mtp_head_drafts_and_changes_no_token(pair):
    with_head, without = pair
    want = [complete(without, p) for p in PROMPTS]
    assert len(set(want)) == len(want)
    assert [complete(with_head, p) for p in PROMPTS] == want  # alone
    with concurrent.futures.ThreadPoolExecutor(4) as ex:  # four at once
        assert list(ex.map(lambda p: complete(with_head, p), PROMPTS)) == want
    st = with_head.wait_idle()["speculative"]
    assert st["enabled"] is True and st["proposer"] == "mtp"
    assert st["proposed"] > 0 and st["by_proposer"]["mtp"]["proposed"] == st["proposed"]
    assert st["mtp_weights_bytes"] > 0 and st["mtp_block_bytes"] > 0
    assert st["mtp_kv_bytes_held"] == 0  # every sequence ended: its head KV went with it
    off = without.wait_idle()["speculative"]
    assert off["proposer"] == "prompt_lookup"


def test_without_mtp_a_checkpoint_with_a_head_speculates_with_nothing(family_dir):
    w = Worker(family_dir("glm4_moe_mtp"))
    try:
        complete(w, PROMPTS[0], 8)
        assert "speculative" not in w.wait_idle()
    finally:
        w.stop()
