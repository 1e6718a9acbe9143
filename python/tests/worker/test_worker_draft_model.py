"""Speculation with a draft model, for real: workers on the tiny demo model (sharpened, so
greedy output varies token to token), one plain, one with the model as its own draft and one
with a different-seed draft. Greedy answers are token for token the plain worker's (alone and
four at once, through the HTTP API); the self-draft accepts (nearly) everything it proposes,
the other one little; the status names the proposer. A draft of another vocabulary, or one
that does not fit beside the model, is refused at load with what to change; admission counts
the draft's weights and KV (``plimsoll admit``)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from click.testing import CliRunner
from conftest import Worker, sharpened_model

from plimsoll.demo.model import build_demo_model

PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
           "def main(): return main() def main(): return",
           "hello there, how are you today?",
           "one two three four one two three four one two"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = sharpened_model(build_demo_model(root / "t", preset="tiny"), root / "target")
    other = sharpened_model(build_demo_model(root / "o", preset="tiny", seed=1), root / "other")
    return target, other


@pytest.fixture(scope="module")
def trio(models, tmp_path_factory):
    target, other = models
    log = tmp_path_factory.mktemp("draft-log") / "worker.log"
    plain = Worker(target)
    itself = Worker(target, log=log, draft_model=target, num_draft_tokens=3)
    differ = Worker(target, draft_model=other, prompt_lookup=3)  # the draft model wins
    yield plain, itself, differ, log
    for w in (plain, itself, differ):
        w.stop()


def complete(w: Worker, prompt: str, n: int = 24, **sampling) -> str:
    r = httpx.post(w.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **sampling})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_model_as_its_own_draft_gives_its_output_and_accepts_everything(trio):
    plain, itself, _, log = trio
    want = [complete(plain, p, 32) for p in PROMPTS]
    assert len(set(want)) == len(want) and len(set(want[0].split())) > 3  # not one token
    assert [complete(itself, p, 32) for p in PROMPTS] == want  # alone
    with concurrent.futures.ThreadPoolExecutor(4) as ex:  # four at once
        assert list(ex.map(lambda p: complete(itself, p, 32), PROMPTS)) == want
    st = itself.wait_idle()["speculative"]
    assert st["enabled"] is True and st["proposer"] == "draft_model"
    assert st["proposed"] > 50 and st["accepted"] >= 0.95 * st["proposed"]
    assert st["by_proposer"]["draft_model"]["accepted"] == st["accepted"]
    # sampled rows speculate too (the rejection-sampling rule: their draws differ from
    # plain decoding's, their distribution does not); a seed reproduces them, batched
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        seeded = [ex.submit(complete, itself, PROMPTS[0], 16, temperature=0.8, seed=3)
                  for _ in range(2)]
    assert seeded[0].result() == seeded[1].result()
    assert itself.wait_idle()["speculative"]["proposed"] > st["proposed"]
    assert st["accepted_per_step"] > 2  # k = 3: nearly three drafts a step
    assert 0 < st["draft_kv_bytes_allocated"] <= 2048 * st["draft_block_bytes"]
    lines = [ln for ln in log.read_text().splitlines() if "access " in ln and "drafted=" in ln]
    assert len(lines) >= 8 and all("accepted=" in ln for ln in lines)


def test_a_different_draft_gives_the_same_output_and_accepts_little(trio):
    plain, _, differ, _ = trio
    want = [complete(plain, p, 32) for p in PROMPTS]
    assert [complete(differ, p, 32) for p in PROMPTS] == want
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert list(ex.map(lambda p: complete(differ, p, 32), PROMPTS)) == want
    st = differ.wait_idle()["speculative"]
    assert st["proposer"] == "draft_model" and "prompt_lookup" not in st["by_proposer"]
    assert st["proposed"] > 0 and st["acceptance_rate"] < 0.3  # its length falls towards 0


def refusal(model, log, **flags) -> str:
    with pytest.raises(RuntimeError, match="worker exited"):
        Worker(model, log=log, **flags)
    return log.read_text()


def test_a_draft_of_another_vocabulary_is_refused_at_load(models, family_dir, tmp_path):
    text = refusal(models[0], tmp_path / "w.log", draft_model=family_dir("qwen3"))
    assert "vocabulary" in text and "same tokenizer" in text and "--draft-model" in text


def test_a_draft_that_does_not_fit_is_refused_at_load(models, tmp_path):
    # weights 2 × ~16 MiB + 2048 blocks × (32 KiB + 32 KiB) = ~160 MiB > 0.9 × 150 MiB
    text = refusal(models[0], tmp_path / "w.log", draft_model=models[1],
                   ceiling_bytes=150 << 20, mlx_cache_mb=0)
    assert "the draft model does not fit" in text and "allocation limit" in text
    assert "2048 blocks" in text


def test_admission_counts_the_draft(models):
    from plimsoll.cli.main import main as cli

    target, other = models
    base = ["admit", str(target), "--budget-gib", "1", "--ceiling-mib", "2048",
            "--total-ram-gib", "4", "--context", "4096", "--json"]
    alone = json.loads(CliRunner().invoke(cli, base).output)
    both = json.loads(CliRunner().invoke(cli, [*base, "--draft-model", str(other)]).output)
    draft_weights = both["draft_weights_bytes"]
    assert alone["draft_weights_bytes"] == 0 and draft_weights == alone["weights_bytes"]
    assert both["draft_block_bytes"] == alone["block_bytes"]  # the same architecture
    # the envelope is the same: the draft's weights and a block of its KV per pool block
    assert both["pool_blocks"] < alone["pool_blocks"]
    assert both["draft_pool_bytes"] == both["pool_blocks"] * both["draft_block_bytes"]
    assert both["footprint_bytes"] == (both["weights_bytes"] + draft_weights
                                       + both["transient_reserve_bytes"]
                                       + both["pool_bytes"] + both["draft_pool_bytes"])
    text = CliRunner().invoke(cli, [*base[:-1], "--draft-model", str(other)]).output
    assert "draft model     weights" in text and "(the draft model's included)" in text


def test_the_policy_entry_and_the_flags_carry_the_draft_model(models):
    from plimsoll.cli.serve_model import served_policy
    from plimsoll.core.policy import ModelEntry
    from plimsoll.core.worker_config import worker_flags
    from plimsoll.launch.live_admission import MemoryFigures, Wanted, plan
    from plimsoll.launch.spawn import worker_config

    target, other = models
    entry = ModelEntry.model_validate({"path": str(target), "context": 8192,
                                       "draftModel": str(other)})
    facts, _, d = plan(target, entry, None, MemoryFigures(2 << 30, 4 << 30, 1 << 30, "test"),
                       Wanted())
    assert d.admitted and d.draft_weights_bytes > 0  # the entry's draft, counted
    flags = worker_flags(worker_config(target, "t", facts, d, entry, None, port=1))
    assert flags[flags.index("--draft-model") + 1] == str(other)
    pol = served_policy(None, str(target), 4096, 1, None, None, str(other))
    assert pol.models["target"].draft_model == str(other)
