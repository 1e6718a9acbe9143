"""Codex CLI (``codex exec``, pinned, from npm) against a real worker's ``/v1/responses``.

Codex is configured as a user would: a model provider with only a base URL, an API key
variable and ``wire_api = "responses"``. It sends its real first turn (developer
instructions, ~20 tools including hosted and namespaced ones, ``store: false``,
``include``, ``reasoning``, ``prompt_cache_key``) and must exit 0 having printed the
model's answer. A random-weight model never stops by itself, and Codex (as against the
real API) fails a turn that ends ``incomplete``: the model here is the tiny demo with a
third of its vocabulary declared end-of-sequence (generation_config.json), so sampled
answers end after a few tokens, as a real model's do. Skips with the reason where npm or
the package cannot be had.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import Worker
from npm_clients import CODEX, npm_command


@pytest.fixture(scope="module")
def stopping_model(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stopping") / "tiny"
    out.mkdir()
    for f in tiny_model.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((tiny_model / "generation_config.json").read_text())
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    cfg["eos_token_id"] = [2, *range(3, vocab, 3)]
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return out


def test_codex_exec_against_the_worker(stopping_model, tmp_path):
    codex = npm_command(*CODEX)
    w = Worker(stopping_model, context=16384, max_tokens=1024, default_max_tokens=256)
    try:
        home = tmp_path / "codex-home"
        home.mkdir()
        (home / "config.toml").write_text(
            'model = "tiny"\nmodel_provider = "plimsoll"\n\n[model_providers.plimsoll]\n'
            f'name = "plimsoll"\nbase_url = "{w.url}/v1"\nwire_api = "responses"\n'
            'env_key = "PLIMSOLL_API_KEY"\n')
        work = tmp_path / "work"
        work.mkdir()
        env = {**os.environ, "CODEX_HOME": str(home), "PLIMSOLL_API_KEY": "none"}
        done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "say hi"],
                              env=env, cwd=work, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
        status = w.status()
    finally:
        w.stop()
    assert done.returncode == 0, f"codex exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert "ERROR" not in done.stderr, done.stderr[-3000:]
    assert status["counters"].get("admitted", 0) >= 1
    assert not any(k.startswith("refused") for k in status["counters"]), status["counters"]
