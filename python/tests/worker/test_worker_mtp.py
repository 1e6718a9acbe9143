"""Speculation with the checkpoint's MTP head, for real: two workers on ``glm4_moe_mtp``
(mlx-lm's glm4_moe with a random nextn layer), one with the head (found in the checkpoint
and used by default) and one without (``--no-mtp``: prompt lookup instead). Greedy answers are token
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
    with_head, without = Worker(d), Worker(d, prompt_lookup=2, mtp=False)
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
    assert st["mtp_kv_bytes_allocated"] > 0  # the head's own paged pool
    off = without.wait_idle()["speculative"]
    assert off["proposer"] == "prompt_lookup"


def test_with_no_mtp_a_checkpoint_with_a_head_speculates_with_nothing(family_dir):
    w = Worker(family_dir("glm4_moe_mtp"), mtp=False)
    try:
        complete(w, PROMPTS[0], 8)
        assert "speculative" not in w.wait_idle()
    finally:
        w.stop()


def test_admission_counts_the_mtp_head_it_would_load(family_dir):
    """``plimsoll admit`` counts the head mlx-lm drops at load, as the worker uses it, unless
    ``--no-mtp``: its tensors' bytes (what the worker's head reports) and one decoder
    layer's KV for every pool block."""
    import json

    from click.testing import CliRunner

    from plimsoll.cli.main import main as cli
    from plimsoll.core.model_facts import inspect_model

    d = family_dir("glm4_moe_mtp")
    facts = inspect_model(d)
    assert facts.mtp_weights_bytes > 0
    assert facts.mtp_kv_bytes_per_token == facts.kv_bytes_per_token // facts.kv_layers
    base = ["admit", str(d), "--budget-gib", "1", "--ceiling-mib", "2048",
            "--total-ram-gib", "4", "--context", "4096", "--json"]
    plain = json.loads(CliRunner().invoke(cli, [*base, "--no-mtp"]).output)
    head = json.loads(CliRunner().invoke(cli, base).output)
    assert json.loads(CliRunner().invoke(cli, [*base, "--mtp"]).output) == head
    assert plain["draft_weights_bytes"] == 0
    assert head["draft_weights_bytes"] == facts.mtp_weights_bytes
    assert head["draft_block_bytes"] == facts.mtp_kv_bytes_per_token * head["block_tokens"]
    assert head["pool_blocks"] < plain["pool_blocks"]
    assert head["footprint_bytes"] == (head["weights_bytes"] + head["draft_weights_bytes"]
                                       + head["transient_reserve_bytes"] + head["pool_bytes"]
                                       + head["draft_pool_bytes"])
    text = CliRunner().invoke(cli, base[:-1]).output
    assert "MTP head        weights" in text and "(the MTP head's included)" in text
    assert "MTP head" not in CliRunner().invoke(cli, [*base[:-1], "--no-mtp"]).output


def test_the_worker_reports_the_head_admission_counts(pair, family_dir):
    """The head the worker loads weighs what admission counted from the headers."""
    from plimsoll.core.model_facts import inspect_model

    st = httpx.get(pair[0].url + "/v1/plimsoll/status", timeout=10).json()["speculative"]
    want = inspect_model(family_dir("glm4_moe_mtp")).mtp_weights_bytes
    assert st["mtp_weights_bytes"] == want
