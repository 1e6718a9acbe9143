"""The capability check: unsupported cache kinds are refused before any weight load or eviction.

Pure: every family's facts (from its config alone) against the engine support table. Real:
``plimsoll admit`` (text and --json), ``plimsoll launch`` (exit 3, no worker process ever
exists) and the proxy (503 ``model_unsupported``, the resident worker neither evicted nor
restarted) on tiny random-weight models built with mlx-lm's own classes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import psutil
import pytest
from click.testing import CliRunner
from conftest import worker_env
from families import FAMILIES

from plimsoll.cli.main import main
from plimsoll.core import capability
from plimsoll.core.model_facts import facts_from_config

SERVED = {"llama", "qwen3", "qwen3_4bit", "qwen3_moe", "qwen3_next", "qwen3_5", "mistral",
          "glm4_moe", "glm4_moe_mtp", "phi3", "olmo2", "nemotron_h", "jamba",
          "granitemoehybrid", "lfm2", "olmo_hybrid", "deepseek_v3", "glm4_moe_lite",
          "kimi_linear", "kimi_k25", "mistral4", "deepseek_v2", "minicpm3",
          "deepseek_v3_wide", "longcat_flash", "deepseek_v32", "glm_moe_dsa", "falcon_h1",
          "youtu_llm", "gpt_oss", "gemma3_text", "ministral3"}
REFUSED = {"llama4": "chunked", "mamba2": "state-only"}


@pytest.mark.pure
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_served_or_refused_with_its_kind(name):
    facts = facts_from_config(FAMILIES[name].config, 0)
    refusal = capability.check(facts, name)
    if name in SERVED:
        assert refusal is None, refusal
        return
    assert refusal is not None and refusal.kind == REFUSED[name]
    assert refusal.message.startswith(name) and "not served yet by this engine" in refusal.message
    assert "num_attention_heads" not in refusal.message  # never the old wrong advice


@pytest.mark.pure
def test_a_pure_state_space_model_is_refused_for_what_it_is():
    facts = facts_from_config(FAMILIES["mamba2"].config, 0)
    assert facts.cache_kinds == ("state",) and facts.kv_bytes_per_token == 0
    message = capability.check(facts).message
    assert "pure state-space" in message and "mlx_lm" in message


@pytest.mark.pure
def test_quantized_kv_is_served_for_attention_and_state_layers(monkeypatch):
    def at64(name):  # head dims in groups of 64 (the tiny families use 16)
        return {**FAMILIES[name].config, "head_dim": 64}

    for name in ("llama", "qwen3_next"):  # full attention; gated-delta state beside it
        facts = facts_from_config(at64(name), 0, kv_dtype="q8")
        assert facts.kv_bits == 8 and capability.check(facts, name) is None
    # a kind the engine serves but does not quantize (here: windows, once served) is refused
    monkeypatch.setitem(capability.ENGINE_SUPPORT, "window",
                        capability.KindSupport("sliding-window layers", True))
    facts = facts_from_config(at64("gemma3_text"), 0, kv_dtype="q4")
    refusal = capability.check(facts, "gemma3_text")
    assert refusal.kind == "quantized-kv" and "window" in refusal.message
    assert "kvDtype" in refusal.message
    assert capability.check(facts_from_config(at64("gemma3_text"), 0)) is None


def _admit(*args):
    return CliRunner().invoke(main, ["admit", *args, "--budget-gib", "4", "--ceiling-mib",
                                     "8192", "--total-ram-gib", "16"])


def test_admit_reports_an_unsupported_kind_in_text_and_json(family_dir):
    path = family_dir("llama4")
    text = _admit(str(path))
    assert text.exit_code == 3, text.output
    assert text.output.startswith("REFUSE (engine)")
    assert "REFUSE (chunked)" in text.output and "ChunkedKVCache" in text.output
    assert "chunked   " in text.output  # the per-cache breakdown
    out = _admit(str(path), "--json")
    assert out.exit_code == 3
    doc = json.loads(out.output)
    assert doc["servable"] is False and doc["unsupported"]["kind"] == "chunked"
    assert doc["cache_kinds"] == ["chunked", "kv"]
    assert doc["decision"] != "refuse"  # memory would admit it: the engine is the reason


@pytest.mark.pure
def test_a_window_that_keeps_its_first_tokens_is_refused():
    facts = facts_from_config(FAMILIES["gemma3_text"].config, 0)
    caches = tuple(c.model_copy(update={"keep": 4}) if c.kind == "window" else c
                   for c in facts.caches)
    refusal = capability.check(facts.model_copy(update={"caches": caches}), "gemma3_text")
    assert refusal.kind == "window" and "keep=4" in refusal.message


def test_admit_says_a_served_model_is_servable(family_dir):
    out = _admit(str(family_dir("qwen3_next")), "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["servable"] is True and doc["unsupported"] is None
    assert doc["fixed_blocks_per_seq"] > 0  # the recurrent state is counted
    assert any(c["kind"] == "state" and c["state_bytes"] > 0 for c in doc["caches"])


def test_admit_mamba2_gives_no_attention_head_advice(family_dir):
    out = _admit(str(family_dir("mamba2")))
    assert out.exit_code == 3, out.output
    assert "pure state-space" in out.output and "num_attention_heads" not in out.output


def _workers_of(path) -> list[int]:
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(path) in part for part in (p.info["cmdline"] or [])):
            pids.append(p.pid)
    return pids


def test_launch_refuses_before_spawning_a_worker(family_dir, tmp_path):
    path = tmp_path / "chunked-model"
    shutil.copytree(family_dir("llama4"), path)
    proc = subprocess.run([sys.executable, "-m", "plimsoll.cli", "launch", str(path)],
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "REFUSE" in proc.stderr and "chunked-attention" in proc.stderr
    assert "llama4" in proc.stderr and "mlx_lm.server" in proc.stderr
    assert "loading" not in proc.stderr and proc.stdout == ""  # no "ready" event, no spawn
    assert _workers_of(path) == []


def test_proxy_refuses_before_evicting_anyone(tiny_model, family_dir, tmp_path):
    from test_proxy import Proxy, chat

    swa = tmp_path / "swa"
    shutil.copytree(family_dir("llama4"), swa)
    cfg = json.loads((swa / "config.json").read_text())
    (swa / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 262144}))
    big = {"context": 32768, "maxTokens": 1024, "concurrency": 4}
    (tmp_path / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 0.5}, "clustered": {"maxLocalLlmGb": 1}},
        "models": {"a": {"path": str(tiny_model), **big},
                   # alone it fits the envelope, beside "a" it does not: admission would evict
                   "swa": {"path": str(swa), "context": 262144, "maxTokens": 1024,
                           "concurrency": 2}}}))
    p = Proxy(["--policy", str(tmp_path / "policy.json")], tmp_path / "serve.log",
              {"PLIMSOLL_CACHE": str(tmp_path / "cache")})
    try:
        client = p.client()
        chat(client, "a")
        a_pid, mark = p.worker("a")["pid"], p.last_seq()
        r = httpx.post(p.url + "/v1/chat/completions", timeout=60, json={
            "model": "swa", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_unsupported" and "chunked-attention" in err["message"]
        assert p.worker("a")["state"] == "ready" and p.worker("a")["pid"] == a_pid
        assert not [e for e in p.events(mark) if e["kind"] in ("evict", "spawn")]
        assert p.worker("swa")["state"] == "stopped" and _workers_of(swa) == []
        # and memory alone would have evicted "a" for it: the check is what kept "a"
        doc = json.loads(CliRunner().invoke(main, [
            "admit", "swa", "--policy", str(tmp_path / "policy.json"), "--json"]).output)
        assert doc["decision"] != "refuse"
        a_bytes = p.worker("a")["admitted"]["footprint_bytes"]
        assert doc["footprint_bytes"] + a_bytes > 512 * 1024 * 1024
    finally:
        assert not p.stop()


def test_admit_counts_quantized_kv_exactly_and_serves_it(family_dir):
    path = str(family_dir("llama"))  # 4 layers, 2 KV heads × head_dim 64, float32
    plain = json.loads(_admit(path, "--json", "--block-tokens", "16").output)
    q8 = json.loads(_admit(path, "--json", "--block-tokens", "16", "--kv-dtype", "q8").output)
    q4 = json.loads(_admit(path, "--json", "--block-tokens", "16", "--kv-dtype", "q4").output)
    per_vector = {8: 64 + 2 * 4, 4: 32 + 2 * 4}  # packed values + scale & bias (float32)
    assert plain["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4
    assert q8["kv_bytes_per_token"] == 2 * 4 * 2 * per_vector[8]
    assert q4["kv_bytes_per_token"] == 2 * 4 * 2 * per_vector[4]
    assert q8["kv_dtype"] == "q8" and q8.get("unsupported") is None
