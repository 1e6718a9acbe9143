"""Every family of issue 15 through the real server: served with mlx-lm's greedy output, or
refused up front with a reason.

Each family (tests/families.py: mlx-lm's own model classes, each family's real config field
names, weights scaled so greedy output varies) is started with ``plimsoll launch`` (live
admission, then a verified worker: real subprocesses, real uvicorn on 127.0.0.1). A served
family answers

- a completion (token-id prompt), non-streamed and streamed,
- two different completions at once (batched decode),
- a two-turn chat (the first answer fed back; the second prompt shares the first's blocks),

each with exactly the text of mlx-lm's own greedy generation (``generate_step`` with mlx-lm's
cache) of the same prompt, cut at EOS, through one text path (plimsoll's streaming
detokenizer, as the issue asks: mlx-lm's byte-level decode and its streaming detokenizer
disagree on a few byte tokens). A family the engine does not serve is refused by launch before
any worker starts, the refusal naming the model type and the kind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from conftest import free_port, worker_env
from families import FAMILIES, has_module

from plimsoll.core.capability import check
from plimsoll.core.model_facts import inspect_model

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

from plimsoll.protocol.assembler import fresh_detokenizer  # noqa: E402

NEW = 12  # tokens generated per request
NAMES = [n for n, f in FAMILIES.items() if has_module(f)]


def _reference(model, tokenizer, prompt: list[int], n: int = NEW) -> str:
    """mlx-lm's greedy text for ``prompt``: its own cache, cut at EOS, plimsoll's text path."""
    eos = set(tokenizer.eos_token_ids)
    detok, text = fresh_detokenizer(tokenizer), []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        if int(tok) in eos:
            break
        detok.add_token(int(tok))
        text.append(detok.last_segment)
    detok.finalize()
    return "".join(text) + detok.last_segment


def _launch(model_dir, port):
    argv = [sys.executable, "-m", "plimsoll.cli", "launch", str(model_dir), "--port", str(port),
            "--concurrency", "2", "--context", "1024", "--max-tokens", "64"]
    return subprocess.Popen(argv, env=worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _complete(base, name, prompt, stream=False) -> str:
    body = {"model": name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "stream": stream}
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(c.get("text", "") for c in json.loads(line[6:])["choices"])
    return "".join(text)


def _chat(base, name, messages) -> str:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": name, "messages": messages, "max_tokens": NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"] or ""


@pytest.mark.parametrize("family", NAMES)
def test_family_is_served_like_mlx_lm_or_refused_up_front(family_dir, family):
    model_dir = family_dir(family)
    facts = inspect_model(model_dir)
    refusal = check(facts, model_dir.name)
    port = free_port()
    proc = _launch(model_dir, port)
    if refusal is not None:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, out
        assert facts.model_type in err and refusal.message.split(":")[1].strip()[:30] in err, err
        assert "num_attention_heads" not in err  # never the wrong advice (issue 15: mamba2)
        assert '"ready"' not in out  # no worker was started
        return
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", proc.stderr.read() if proc.poll() is not None \
            else ready
        base, name = f"http://127.0.0.1:{port}", model_dir.name
        model, tokenizer = mlx_lm.load(str(model_dir))
        vocab = len(tokenizer)
        a = [(7 * i + 3) % (vocab - 10) + 5 for i in range(40)]  # spans several blocks
        b = [(11 * i + 1) % (vocab - 10) + 5 for i in range(23)]
        want_a, want_b = _reference(model, tokenizer, a), _reference(model, tokenizer, b)
        assert want_a != want_b or not want_a  # the prompts differ in what they produce

        assert _complete(base, name, a) == want_a
        assert _complete(base, name, a, stream=True) == want_a  # a prefix hit this time

        got: dict[str, str] = {}
        threads = [threading.Thread(target=lambda k=k, p=p: got.__setitem__(
            k, _complete(base, name, p, stream=True))) for k, p in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert got == {"a": want_a, "b": want_b}

        turn1 = [{"role": "user", "content": "Name three colours."}]
        ids1 = tokenizer.apply_chat_template(turn1, add_generation_prompt=True)
        answer = _chat(base, name, turn1)
        assert answer == _reference(model, tokenizer, ids1)
        turn2 = [*turn1, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And three more?"}]
        ids2 = tokenizer.apply_chat_template(turn2, add_generation_prompt=True)
        assert _chat(base, name, turn2) == _reference(model, tokenizer, ids2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
