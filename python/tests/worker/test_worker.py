"""The paged-KV worker, for real: uvicorn on 127.0.0.1, mlx-lm inference, the openai client."""

from __future__ import annotations

import itertools
import math
import re
import threading
import time

import httpx
import openai
import pytest
from conftest import Worker


def client(w: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=w.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_round_trips(worker):
    c = client(worker)
    assert [m.id for m in c.models.list()] == ["tiny"]
    r = c.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                  messages=[{"role": "user", "content": "hello there"}])
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 3
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(c.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hello there"}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (r.choices[0].message.content or "")  # greedy: same answer streamed
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    comp = c.completions.create(model="tiny", prompt="def main(", max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model="tiny", prompt="def main(", max_tokens=6, temperature=0, stream=True))
    assert streamed == comp.choices[0].text


def test_top_k_and_min_p_reach_the_sampler(worker):
    """top_k 1 or min_p 1 leaves only the most likely token: any temperature then answers as
    greedy decoding does (OpenAI's extension fields and Anthropic's ``top_k``)."""
    c = client(worker)
    msgs = [{"role": "user", "content": "tell me a story"}]

    def chat(**kw) -> str:
        return c.chat.completions.create(model="tiny", max_tokens=12, messages=msgs,
                                         **kw).choices[0].message.content

    def anthropic(**kw) -> list:
        r = httpx.post(worker.url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 12, "messages": msgs, **kw})
        assert r.status_code == 200, r.text
        return r.json()["content"]

    greedy = chat(temperature=0)
    assert chat(temperature=1.5, extra_body={"top_k": 1}) == greedy
    assert chat(temperature=1.5, seed=3, extra_body={"min_p": 1.0}) == greedy
    assert {chat(temperature=1.5, seed=s) for s in range(3)} != {greedy}  # they do sample
    assert anthropic(temperature=1.0, top_k=1) == anthropic(temperature=0)


def test_status_reports_the_kernel_self_check(worker):
    """The engine's custom kernels were checked at start (on the CPU none is used), and it
    says how it runs a step."""
    st = worker.status()
    verdict, metal, write, gather, skinny, writing = st["kernels"]
    assert verdict["name"] == "paged_decode_cuda" and verdict["used"] is False
    assert verdict["reason"] == "not this device: the engine runs on cpu"
    assert metal["name"] == "paged_decode_metal" and metal["used"] is False
    assert write["name"] == "pool_write_cuda" and write["used"] is False
    assert gather["name"] == "pool_gather_cuda" and gather["used"] is False
    assert skinny["name"] == "skinny_matmul_cuda" and skinny["used"] is False
    assert writing["name"] == "paged_decode_writing_cuda" and writing["used"] is False
    # and every step is one forward: the model's attention modules are regrouped
    assert st["one_forward"] == {"regrouped": ["mlx_lm.models.qwen3.Attention"], "reason": ""}


def test_status_splits_the_engine_threads_steady_decode_time(worker):
    """``host``: the engine thread's time over passes that submit decode rows only, by part;
    a pass's whole includes its build and its wait, and a prefill pass is not counted."""
    before = worker.status()["host"]
    r = httpx.post(worker.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "count the ways"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 24
    deadline = time.monotonic() + 10
    while (after := worker.status()["host"])["steps"] == before["steps"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    # 24 tokens: the first from the prefill's pass, at most 23 decode-only passes
    assert 10 <= after["steps"] - before["steps"] <= 23
    d = {k: after[k] - before[k] for k in after}
    assert d["build_ms"] > 0 and d["build_cpu_ms"] > 0 and d["flush_ms"] >= 0
    assert d["iterate_ms"] >= d["build_ms"] + d["wait_ms"] - 0.01


def test_unknown_model_and_bad_input(worker):
    c = client(worker)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = httpx.post(worker.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(worker.url + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "x"}],
                         "max_tokens": (1 << 20) + 1})  # over the sanity cap (below: clamped)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_context_overflow_names_the_five_figures(worker):
    prompt = "word " * 5000
    r = httpx.post(worker.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 100})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    figures = {k: int(v) for k, v in re.findall(r"(model-native maximum context|configured "
                                                r"total context|prompt|output reservation "
                                                r"\(max_tokens\)|total): (\d+)", msg)}
    assert figures["model-native maximum context"] == 40960
    assert figures["configured total context"] == 4096
    assert figures["output reservation (max_tokens)"] == 100
    assert figures["prompt"] > 4096
    assert figures["total"] == figures["prompt"] + 100


def test_physical_bound_under_eight_growing_conversations(worker):
    c = client(worker)
    bound = worker.status()["kv_bytes_bound"]
    errors: list[BaseException] = []
    samples: list[dict] = []
    done = threading.Event()

    def converse(i: int) -> None:
        history = [{"role": "system", "content": "You are one of eight careful coding "
                    "agents sharing this system prompt. " * 8},
                   {"role": "user", "content": f"agent {i}"}]
        try:
            for turn in range(3):
                history.append({"role": "user", "content": f"tool output {turn} " * 40})
                r = c.chat.completions.create(model="tiny", messages=history, max_tokens=12,
                                              temperature=0)
                history.append({"role": "assistant", "content": r.choices[0].message.content})
        except BaseException as err:
            errors.append(err)

    def sample() -> None:
        while not done.is_set():
            samples.append(worker.status())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=converse, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    sampler.join()
    assert not errors, errors
    assert max(s["running"] for s in samples) > 1  # they really ran together
    assert max(s["shared_blocks"] for s in samples) > 0  # the system prompt, held once
    for s in samples:
        assert s["kv_bytes_held"] <= bound
        assert s["kv_bytes_allocated"] <= bound  # the engine's physical arrays
        pool = s["pool"]
        assert pool["used"] + pool["cached"] + pool["free"] == pool["total"]
        assert s["kv_bytes_held"] == (pool["used"] + pool["cached"]) * s["block_bytes"]
    final = worker.wait_idle()
    assert final["kv_bytes_peak"] <= bound  # the allocated figure's high-water mark


def test_growing_conversation_keeps_one_kv_copy(worker):
    c = client(worker)
    s0 = worker.wait_idle()
    per_token = s0["kv_bytes_per_token"]
    history = [{"role": "system", "content": "You are a coding agent."}]
    cached = []
    for turn in range(12):
        history.append({"role": "user", "content": f"tool result {turn}: " + "x = 1\n" * 30})
        r = c.chat.completions.create(model="tiny", messages=history, max_tokens=8,
                                      temperature=0)
        history.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        total = r.usage.prompt_tokens + r.usage.completion_tokens
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached))  # reuse grows
    assert cached[-1] > 0.8 * total
    s = worker.wait_idle()
    # The conversation is held once: its blocks are shared turn to turn, and each turn adds
    # at most its own tail (the answer's blocks, which the next turn's template renders
    # differently) to the cached blocks — not one copy per turn (that would be ~6 × total).
    held_conv = s["kv_bytes_held"] - s0["kv_bytes_held"]
    block = s["block_tokens"]
    assert (total - 1 - block) * per_token <= held_conv <= (total + 12 * 2 * block) * per_token


def test_disconnect_frees_blocks(worker):
    worker.wait_idle()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as h, h.stream(
            "POST", worker.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert worker.status()["running"] == 1
    # the connection is closed: the request is cancelled and its blocks freed
    s = worker.wait_idle(timeout=10)
    assert s["counters"].get("cancelled", 0) >= 1


@pytest.fixture(scope="module")
def small_worker(tiny_model):
    # One sequence of the whole context fits; a second concurrent one does not.
    w = Worker(tiny_model, max_cache_blocks=80, context=1024, max_tokens=900,
               cache_memory_mb=0, max_wait=0.5, max_num_seqs=4)
    yield w
    w.stop()


def test_pool_exhausted_is_503_with_retry_after_then_recovers(small_worker):
    w = small_worker
    hog = {"model": "tiny", "messages": [{"role": "user", "content": "hog " * 30}],
           "max_tokens": 900, "temperature": 0}
    late = {"model": "tiny", "messages": [{"role": "user", "content": "late"}],
            "max_tokens": 900}
    results: dict[str, httpx.Response] = {}
    hog_thread = threading.Thread(target=lambda: results.setdefault("hog", httpx.post(
        w.url + "/v1/chat/completions", json=hog, timeout=120)))
    hog_thread.start()
    deadline = time.monotonic() + 30
    while w.status()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = httpx.post(w.url + "/v1/chat/completions", json=late, timeout=30)
    hog_thread.join(120)
    assert results["hog"].status_code == 200
    # greedy decoding of a fixed model: the hog ran its whole reservation
    assert results["hog"].json()["usage"]["completion_tokens"] == 900
    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "pool_exhausted"
    asked, free, _cached, held = map(int, re.findall(
        r"needs (\d+) blocks; (\d+) are available \((\d+) of them cached prefixes\) and (\d+) "
        r"are held", err["message"])[0])
    assert asked >= math.ceil(900 / 16) and asked > free and held >= math.ceil(930 / 16)
    w.wait_idle()
    ok = httpx.post(w.url + "/v1/chat/completions", json=late | {"max_tokens": 20}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] <= 20
