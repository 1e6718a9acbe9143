"""Sliding-window layers (mlx-lm ``RotatingKVCache``) in the paged engine (engine/window.py).

Real mlx-lm inference (CPU, float32) on tiny random-weight gpt_oss (attention sinks),
gemma3_text and ministral3 models with a 24-token window — not a multiple of the 16-token
block, and far shorter than the prompts and generations, so every sequence wraps its ring
many times: greedy output equal to mlx-lm's own generation (its ``RotatingKVCache``), one
sequence and several rows batched, chunked prefills with chunks shorter and longer than the
window, pipelined; the bytes held for window layers stay one window a sequence (asserted on
the arrays' nbytes) while mlx-lm's full-attention cache of the same layers would grow; a
prefix reused through a ring snapshot by the real scheduler; a real worker over HTTP.
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest

mx = pytest.importorskip("mlx.core")

from conftest import Worker  # noqa: E402
from families import FAMILIES, Family, build_model  # noqa: E402
from test_worker_paged import Req, drain, scheduler  # noqa: E402

from plimsoll.core.capability import check  # noqa: E402
from plimsoll.core.model_facts import inspect_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for  # noqa: E402
from plimsoll.engine.window import WindowAttention  # noqa: E402

BLOCK = 16
POOL = 96
WINDOW = 24
NAMES = ["gpt_oss", "gemma3_text", "ministral3"]


def _variant(name: str, window: int) -> str:
    key = f"{name}_w{window}"
    if key not in FAMILIES:
        fam = FAMILIES[name]
        FAMILIES[key] = Family({**fam.config, "sliding_window": window}, fam.module)
    return key


def prompts_of(ns) -> list[list[int]]:
    return [[(7 * i + 3 * n) % 500 + 1 for i in range(n)] for n in ns]


@pytest.fixture(scope="module")
def engines(family_dir):
    cache: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in cache:
            cache[name] = Engine.load(family_dir(_variant(name, WINDOW)), block_tokens=BLOCK,
                                      max_blocks=POOL)
        return cache[name]
    return get


@pytest.mark.parametrize("name", NAMES)
def test_window_layers_follow_mlx_lm_cache_and_facts(engines, family_dir, name):
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    eng = engines(name)
    caches = make_prompt_cache(eng.model)
    assert [k.kind for k in eng.layers] == [
        "window" if type(c) is RotatingKVCache else "full" for c in caches]
    facts = inspect_model(family_dir(_variant(name, WINDOW)))
    assert check(facts, name) is None  # the capability table serves it
    # one ring a sequence is exactly what facts count for the window layers at their cap
    assert eng.state_bytes_per_seq == facts.per_sequence_fixed_bytes > 0
    assert eng.block_bytes == facts.kv_bytes_per_token * BLOCK  # full layers only
    assert {k.window for k in eng.layers if isinstance(k, WindowAttention)} == {WINDOW}


@pytest.mark.parametrize("name", NAMES)
def test_the_window_changes_the_output(name):
    """The tests below can fail: with a window past the prompt, mlx-lm's greedy output
    differs from its output with the 24-token window (same weights)."""
    prompt = prompts_of([70])[0]
    small = build_model(FAMILIES[_variant(name, WINDOW)])
    large = build_model(FAMILIES[_variant(name, 4096)])
    assert reference(small, prompt, 30) != reference(large, prompt, 30)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunk,pipelined", [(16, True), (50, False), (200, True)])
def test_batched_chunked_greedy_equals_mlx_lm(engines, name, chunk, pipelined):
    eng = engines(name)
    prompts = prompts_of([9, 30, 70, 101])
    want = [reference(eng.model, p, 40) for p in prompts]
    assert len({tuple(w) for w in want}) == len(want)
    seqs = seqs_for(prompts, 40, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=chunk, pipelined=pipelined) == want
    assert eng._rings.live() == 0  # drive freed every sequence's ring


@pytest.mark.parametrize("name", ["gpt_oss"])
def test_one_sequence_equals_mlx_lm(engines, name):
    eng = engines(name)
    prompt = prompts_of([57])[0]
    seqs = seqs_for([prompt], 60, BLOCK, Blocks(POOL))
    assert drive(eng, seqs, chunk=512) == [reference(eng.model, prompt, 60)]


def test_window_bytes_stay_one_window_while_the_sequence_grows(family_dir):
    from mlx_lm.models.cache import KVCache

    eng = Engine.load(family_dir(_variant("gemma3_text", WINDOW)), block_tokens=BLOCK,
                      max_blocks=POOL)
    windows = [k for k in eng.layers if isinstance(k, WindowAttention)]
    ring_bytes = sum(k.bytes_per_seq for k in windows)
    prompt = prompts_of([40])[0]
    seqs = seqs_for([prompt], 160, BLOCK, Blocks(POOL))
    held = []
    orig = eng.run_async

    def spy(step):
        pending = orig(step)
        mx.eval([a for k in windows for a in k.arrays()])
        held.append(sum(k.nbytes for k in windows))
        return pending

    eng.run_async = spy
    try:
        out = drive(eng, seqs, chunk=32)
    finally:
        del eng.run_async
    assert out == [reference(eng.model, prompt, 160)]
    # 200 tokens written, 8 windows' worth: the rings held one window all along ...
    assert held and set(held) == {ring_bytes}
    assert ring_bytes == sum(2 * WINDOW * k.ring.kv_heads * k.ring.k_dim * 4 for k in windows)
    # ... where the same layers in a full KVCache hold the whole history
    full = [KVCache() for _ in eng.layers]
    mx.eval(eng.model(mx.array([prompt + out[0]]), cache=full))
    grown = sum(c.nbytes for c, k in zip(full, eng.layers, strict=True)
                if isinstance(k, WindowAttention))
    assert grown >= 200 * ring_bytes // WINDOW > 8 * ring_bytes


def test_a_prefix_is_reused_through_a_ring_snapshot(engines):
    """The real scheduler and pool: the second prompt maps the first's blocks up to a ring
    snapshot, restores the rings, and generates what mlx-lm generates."""
    eng = engines("gpt_oss")
    s = scheduler(eng, POOL, prefill=48)
    assert s.pool.hybrid and s.pool.fixed_blocks_per_seq >= 1
    base = prompts_of([3 * BLOCK + 5])[0][:3 * BLOCK]
    prompts = [base + p for p in prompts_of([11, 29, 40])]
    first = Req(s, prompts[0], 30)
    drain(s)
    reqs = [Req(s, p, 30) for p in prompts[1:]]  # two at once: batched
    drain(s)
    assert first.started.cached_tokens == 0
    assert [r.started.cached_tokens for r in reqs] == [3 * BLOCK, 3 * BLOCK]
    assert max(len(w) for _, w, _ in s.step_log) >= 2
    assert [first.tokens, *(r.tokens for r in reqs)] == [
        reference(eng.model, p, 30) for p in prompts]
    # what the engine holds for rings is the rows it allocated plus the snapshots
    snaps, rows = s.pool.stats()["snapshots"], eng._rings.layers[0].ring.blocks
    assert snaps >= 1 and rows <= 4  # at most as many rows as sequences ever live at once
    assert eng.state_bytes_held() == (rows + snaps) * eng.state_bytes_per_seq


def _complete(url: str, prompt: str, n: int = 24) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", NAMES)
def test_a_worker_serves_concurrent_requests_like_alone(family_dir, tmp_path, name):
    path = family_dir(_variant(name, WINDOW))
    w = Worker(path, context=1024, max_tokens=64, max_cache_blocks=512,
               log=tmp_path / "worker.log")
    try:
        system = "You are a careful assistant. " * 8
        prompts = [system + f"Task {i}: count the apples in basket {i * 7}." for i in range(4)]
        alone = [_complete(w.url, p)["choices"][0]["text"] for p in prompts]
        assert len(set(alone)) > 1
        with cf.ThreadPoolExecutor(4) as ex:
            together = list(ex.map(lambda p: _complete(w.url, p), prompts))
        assert [d["choices"][0]["text"] for d in together] == alone
        # each prompt was prefilled alone before: all of it up to its last block is a hit now
        assert [d["usage"]["prompt_tokens_details"]["cached_tokens"] for d in together] == [
            (d["usage"]["prompt_tokens"] - 1) // 16 * 16 for d in together]
        st = w.wait_idle()
        assert st["state_bytes_held"] > 0  # the rings and their snapshots are reported
        # the rings of at most 4 live sequences plus the snapshots the pool accounts for
        one = inspect_model(path).per_sequence_fixed_bytes
        assert st["state_bytes_held"] <= (4 + st["pool"]["snapshots"]) * one
        print(json.dumps({k: st[k] for k in ("state_bytes_held", "kv_bytes_allocated")}))
    finally:
        w.stop()


def test_a_context_shorter_than_the_window_holds_only_the_context(family_dir):
    """Rings are min(window, context): what admission counts (``fixed_bytes(context)``) is
    what the engine holds, and the worker's pool is sized by the same figure."""
    path = family_dir(_variant("gpt_oss", WINDOW))
    eng = Engine.load(path, block_tokens=BLOCK, max_blocks=POOL, context=20)
    facts = inspect_model(path)
    assert eng.state_bytes_per_seq == facts.fixed_bytes(20) < facts.fixed_bytes(None)
    prompts = prompts_of([7, 12])
    want = [reference(eng.model, p, 8) for p in prompts]
    assert drive(eng, seqs_for(prompts, 8, BLOCK, Blocks(POOL)), chunk=5) == want
    with pytest.raises(ValueError, match="past the engine's context of 20"):
        drive(eng, seqs_for(prompts_of([15]), 8, BLOCK, Blocks(POOL)), chunk=16)
