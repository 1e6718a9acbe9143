"""The engine adapter against real mlx-lm inference on tiny random-weight demo models.

No mocks: greedy outputs are compared with mlx-lm's own ``generate_step``, and the
physical bound is checked on the arrays the engine holds. Run with OpenBLAS for
speed (the float32 matmuls are ~5x faster)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        pytest python/tests/test_engine.py
"""

from __future__ import annotations

import math

import pytest

mx = pytest.importorskip("mlx.core")
from mlx_lm.generate import generate_step  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import CapacityError, Engine  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Engine:
    return Engine.load(build_demo_model(tmp_path_factory.mktemp("tiny"), "tiny"), BLOCK)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Engine:
    return Engine.load(build_demo_model(tmp_path_factory.mktemp("hybrid"), "hybrid"), BLOCK)


def _text(eng: Engine, n: int, salt: int = 0) -> list[int]:
    words = "import os\nclass Foo:\n    def bar(self, x):\n        return x + %d\n"
    ids: list[int] = []
    i = salt
    while len(ids) < n:
        ids += eng.tokenizer.encode(words % i)
        i += 1
    return ids[:n]


def _reference(eng: Engine, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy generation, with its own (growing) KVCache."""
    return [t for t, _ in generate_step(mx.array(prompt), eng.model, max_tokens=n)]


def _solo(eng: Engine, prompt: list[int], n: int) -> list[int]:
    out = [eng.add("solo", prompt, n).first_token]
    while len(out) < n:
        out += [t for _, t in eng.step()]
    eng.finish("solo")
    return out


def test_single_sequence_matches_mlx_lm_greedy(tiny):
    for length in (5, 37, 150):
        prompt = _text(tiny, length)
        assert _solo(tiny, prompt, 24) == _reference(tiny, prompt, 24)
    assert tiny.kv_bytes_held() == 0


@pytest.mark.parametrize("pipeline", [True, False])
def test_staggered_batch_matches_solo_runs(tiny, pipeline):
    """Sequences of different lengths join and leave between steps; each equals its solo run."""
    tiny.pipeline = pipeline
    lengths, budgets, joins = [9, 70, 33, 140, 20], [20, 12, 25, 16, 10], [0, 0, 3, 5, 9]
    prompts = [_text(tiny, n, salt=i) for i, n in enumerate(lengths)]
    want = [_reference(tiny, p, m) for p, m in zip(prompts, budgets, strict=True)]
    got: dict[int, list[int]] = {}
    step = 0
    while len(got) < len(prompts) or tiny.running:
        for i, at in enumerate(joins):
            if at == step:
                got[i] = [tiny.add(i, prompts[i], budgets[i]).first_token]
        for sid in [s for s in tiny.running if len(got[s]) == budgets[s]]:
            tiny.finish(sid)
        for sid, tok in tiny.step():
            got[sid].append(tok)
        step += 1
    tiny.pipeline = True
    assert [got[i] for i in range(len(prompts))] == want


def test_capacity_is_the_reservation_and_never_grows(tiny):
    prompt = _text(tiny, 21)
    r = tiny.add("c", prompt, 11)
    assert r.capacity_tokens == 32 == tiny.capacity_tokens(21, 11)
    kvbpt = tiny.facts.kv_bytes_per_token
    assert tiny.kv_bytes_held() == 32 * kvbpt
    for _ in range(10):
        tiny.step()
        assert tiny.kv_bytes_held() == 32 * kvbpt
    tiny.step()  # token 12 of a reservation rounded up to 32 tokens still fits
    while tiny.generated("c") < 32 - 21 + 1:
        tiny.step()
    with pytest.raises(CapacityError):
        tiny.step()
    tiny.finish("c")
    assert tiny.kv_bytes_held() == 0


def test_bound_holds_under_eight_growing_conversations(tiny):
    """After every add, step and finish, the arrays fit the blocks the caller reserved."""
    kvbpt, block_bytes = tiny.facts.kv_bytes_per_token, tiny.facts.kv_bytes_per_token * BLOCK
    pool_blocks = 8 * math.ceil(260 / BLOCK) + 8  # 8 sequences of ≤ 260 tokens + move headroom
    history = {i: _text(tiny, 20 + 9 * i, salt=i) for i in range(8)}
    budget = {i: 6 + i % 4 for i in range(8)}
    turns = dict.fromkeys(range(8), 0)
    prefix: dict[int, object] = {}
    out: dict[int, list[int]] = {}
    tiny.reset_peak()

    def reserved_blocks() -> int:
        live = sum(tiny.capacity_tokens(len(history[s]), budget[s]) for s in tiny.running)
        kept = sum(math.ceil(len(p.tokens) / BLOCK) * BLOCK for p in prefix.values())
        return (live + kept) // BLOCK

    def check() -> None:
        held = tiny.kv_bytes_held()
        assert held <= reserved_blocks() * block_bytes <= pool_blocks * block_bytes
        assert tiny.kv_bytes_peak() <= pool_blocks * block_bytes

    def start(i: int) -> None:
        r = tiny.add(i, history[i], budget[i], prefix.pop(i, None))
        out[i] = [r.first_token]
        check()

    step = 0
    while any(t < 4 for t in turns.values()) or tiny.running:
        if step < 8:
            start(step)
        for sid, tok in tiny.step():
            out[sid].append(tok)
        check()
        for sid in [s for s in tiny.running if len(out[s]) == budget[s]]:
            prefix[sid] = tiny.finish(sid, retain=True)
            check()
            turns[sid] += 1
            history[sid] = history[sid] + out[sid] + _text(tiny, 25, salt=sid + turns[sid])
            if turns[sid] < 4:
                start(sid)
        step += 1
    used = sum(len(p.tokens) for p in prefix.values())
    assert tiny.kv_bytes_held() - used * kvbpt < 8 * block_bytes
    for p in list(prefix.values()):
        tiny.drop_prefix(p)
    assert tiny.kv_bytes_held() == 0


def test_twelve_turn_conversation_holds_one_copy_and_prefills_only_new_tokens(tiny):
    kvbpt, block_bytes = tiny.facts.kv_bytes_per_token, tiny.facts.kv_bytes_per_token * BLOCK
    history = _text(tiny, 60)
    prefix = None
    for turn in range(12):
        r = tiny.add("chat", history, 8, prefix)
        if prefix is not None:
            assert r.reused_tokens == len(prefix.tokens)
            assert r.prefilled_tokens == len(history) - len(prefix.tokens)
            assert tiny.prefixes == []  # moved, not copied
        assert tiny.kv_bytes_held() == r.capacity_tokens * kvbpt
        out = [r.first_token]
        while len(out) < 8:
            out += [t for _, t in tiny.step()]
        prefix = tiny.finish("chat", retain=True)
        # every token whose KV is written: all but the last, or all if the next step was queued
        assert prefix.tokens in (tuple(history + out[:-1]), tuple(history + out))
        held = tiny.kv_bytes_held()
        assert len(prefix.tokens) * kvbpt <= held < len(prefix.tokens) * kvbpt + block_bytes
        history = history + out + _text(tiny, 40, salt=turn)
    # the moved KV is the real KV: continuing from it equals a from-scratch generation
    assert len(history) > 600
    r = tiny.add("chat", history, 6, prefix)
    got = [r.first_token] + [t for _ in range(5) for _, t in tiny.step()]
    tiny.finish("chat")
    assert got == _reference(tiny, history, 6)
    assert tiny.kv_bytes_held() == 0


def test_finish_frees_the_arrays(tiny):
    mx.clear_cache()
    before = tiny.memory()["active"]
    tiny.add("f", _text(tiny, 200), 300)
    for _ in range(3):
        tiny.step()  # the last one queues a fourth, which writes token 204's KV
    grown = tiny.memory()["active"] - before
    assert grown >= tiny.kv_bytes_held() == 512 * tiny.facts.kv_bytes_per_token
    p = tiny.finish("f", retain=True)
    assert len(p.tokens) == 204
    assert tiny.kv_bytes_held() == 208 * tiny.facts.kv_bytes_per_token
    tiny.drop_prefix(p)
    assert tiny.kv_bytes_held() == 0
    assert tiny.memory()["active"] - before < tiny.facts.kv_bytes_per_token * BLOCK
    with pytest.raises(KeyError):
        tiny.drop_prefix(p)


def test_partial_prefix_reuse_and_mismatch(tiny):
    base = _text(tiny, 50)
    tiny.add("a", base, 4)
    tiny.step()
    p = tiny.finish("a", retain=True)
    forked = base[:30] + _text(tiny, 10, salt=99)
    assert tiny.reusable_tokens(p, forked) == 30
    assert tiny.reusable_tokens(p, base[:10]) == 9  # the last prompt token is always prefilled
    r = tiny.add("b", forked, 5, p)
    assert (r.reused_tokens, r.prefilled_tokens) == (30, 10)
    got = [r.first_token] + [t for _ in range(4) for _, t in tiny.step()]
    tiny.finish("b")
    assert got == _reference(tiny, forked, 5)


def test_seeded_sampling_is_reproducible(tiny):
    prompt = _text(tiny, 30)

    def run(seed: int) -> list[int]:
        out = [tiny.add("s", prompt, 12, temperature=0.9, top_p=0.95, seed=seed).first_token]
        out += [t for _ in range(11) for _, t in tiny.step()]
        tiny.finish("s")
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_hybrid_model_batches_and_reuses_prefixes(hybrid):
    """qwen3_next: gated-delta state per sequence, full-attention KV in slots."""
    assert hybrid.facts.per_sequence_fixed_bytes > 0
    prompts = [_text(hybrid, n, salt=n) for n in (12, 45, 80)]
    want = [_reference(hybrid, p, 10) for p in prompts]
    got = {i: [hybrid.add(i, p, 10).first_token] for i, p in enumerate(prompts)}
    assert hybrid.fixed_bytes_held() == 3 * hybrid.facts.per_sequence_fixed_bytes
    for _ in range(9):
        for sid, tok in hybrid.step():
            got[sid].append(tok)
    assert [got[i] for i in range(3)] == want
    p = hybrid.finish(0, retain=True)
    hybrid.finish(1)
    hybrid.finish(2)
    assert hybrid.reusable_tokens(p, [*prompts[0][:5], 1, 2, 3]) == 0  # state cannot be cut
    follow = prompts[0] + got[0] + _text(hybrid, 20, salt=5)
    r = hybrid.add("t", follow, 6, p)
    assert r.reused_tokens == len(p.tokens) >= len(prompts[0]) + 9
    out = [r.first_token] + [t for _ in range(5) for _, t in hybrid.step()]
    hybrid.finish("t")
    assert out == _reference(hybrid, follow, 6)
    assert hybrid.kv_bytes_held() == hybrid.fixed_bytes_held() == 0


def test_plan_arithmetic_is_pure():
    from plimsoll.engine import plan

    assert plan.capacity_tokens(21, 11, 16) == 32
    assert plan.capacity_tokens(1, 1, 16) == 16
    # a 6,700-token prefix of a 28-layer model: one array is 1/56 of it, ~120 tokens, 8 blocks
    assert plan.move_headroom_blocks(6700, 28, 16) == 8
    assert plan.move_headroom_blocks(0, 28, 16) == 0
    assert plan.reusable_tokens((1, 2, 3), [1, 2, 3, 4], whole_only=True) == 3
    assert plan.reusable_tokens((1, 2, 3), [1, 2, 3], whole_only=False) == 2
    assert plan.reusable_tokens((1, 2, 3), [1, 2, 3], whole_only=True) == 0
    assert plan.reusable_tokens((1, 2, 9), [1, 2, 3, 4], whole_only=False) == 2
