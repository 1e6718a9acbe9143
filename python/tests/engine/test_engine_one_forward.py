"""One forward per step (engine/forward.py, engine/mixers.py), every served family through it.

Real mlx-lm inference (CPU, float32) on the tiny random-weight models of tests/families.py:
one step mixes a running decode, two prompt chunks at position 0 and a chunk after a prefix
hit (another sequence's two blocks, so at offset 32), then the four sequences decode
together, pipelined. Every sequence gets mlx-lm's own greedy tokens (quantized KV: mlx-lm's
over its QuantizedKVCache), and every step calls the model exactly once (a counter on the
model class's ``__call__``); the lm head sees only the rows that sample. A model whose
mixing modules cannot be regrouped runs one forward per group and gives the same tokens.
"""

from __future__ import annotations

import contextlib

import pytest

mx = pytest.importorskip("mlx.core")

from families import FAMILIES, has_module  # noqa: E402
from test_engine_quantized import quantized_reference  # noqa: E402

from plimsoll.core.capability import check  # noqa: E402
from plimsoll.core.model_facts import inspect_model  # noqa: E402
from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, mixers  # noqa: E402
from plimsoll.engine.drive import (  # noqa: E402
    Blocks,
    engine_cache,
    family_prompts,
    reference,
    sharpen,
    text,
)
from plimsoll.engine.work import Step, Work  # noqa: E402

BLOCK = 16
POOL = 64
BASE = 2 * BLOCK  # the shared prefix: two full blocks
NEW = 8
REFUSED = {"llama4", "mamba2"}  # refused up front (test_families_served covers them)
NAMES = [n for n, f in FAMILIES.items() if has_module(f) and n not in REFUSED
         and "_w" not in n]


@pytest.fixture(scope="module")
def engines(family_dir):
    """Engines whose decode steps are built eagerly: the forwards counted here are the model's
    calls in Python, which a compiled decode step replays without (test_engine_compiled
    compares the two paths' tokens)."""
    get = engine_cache(family_dir, BLOCK, POOL)

    def eager(name: str, **kw):
        return get(name, compile_decode=False, **kw)
    eager.family_dir = family_dir
    return eager


@contextlib.contextmanager
def counted(model):
    """Calls of ``model``'s class ``__call__`` (the model's forwards) while inside."""
    cls = type(model)
    original = cls.__call__
    calls: list[int] = []

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    cls.__call__ = counting
    try:
        yield calls
    finally:
        cls.__call__ = original


def mixed_prompts() -> list[list[int]]:
    base = family_prompts(BASE)[0]
    return [base + [(11 * i) % 500 + 2 for i in range(9)],  # 0: decoding in the mixed step
            [(13 * i + 5) % 500 + 1 for i in range(23)],  # 1: a first chunk
            base + [(17 * i + 3) % 500 + 1 for i in range(14)],  # 2: a chunk at a prefix hit
            [(19 * i + 7) % 500 + 1 for i in range(5)]]  # 3: another first chunk


def run_mixed(eng, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The scenario of the module docstring; every sequence's tokens and the forwards of
    every step."""
    tables = [tuple(range(0, 4)), tuple(range(4, 6)), (0, 1, 6, 7, 8),
              tuple(range(9, 10))]
    out: list[list[int]] = [[] for _ in prompts]
    forwards: list[int] = []

    def step(s: Step, calls) -> object:
        before = len(calls)
        pending = eng.run_async(s)
        forwards.append(len(calls) - before)
        return pending

    with counted(eng.model) as calls:
        step(Step(prefills=(Work(0, tuple(prompts[0][:BASE]), 0, tables[0], False),)), calls)
        eng.snapshot_state(0, "base")  # hybrid models reuse a prefix through a snapshot
        first = step(Step(prefills=(Work(0, tuple(prompts[0][BASE:]), BASE, tables[0],
                                         True),)), calls)
        eng.restore_state("base", 2)
        mixed = step(Step(decodes=(Work(0, None, len(prompts[0]), tables[0], True),),
                          prefills=(Work(1, tuple(prompts[1]), 0, tables[1], True),
                                    Work(2, tuple(prompts[2][BASE:]), BASE, tables[2], True),
                                    Work(3, tuple(prompts[3]), 0, tables[3], True))), calls)
        planned = [2, 1, 1, 1]  # tokens sampled so far (the last ones still lazy)
        pending = [first, mixed]
        while any(n < NEW for n in planned):  # all four decoding, pipelined: tokens=None
            rows = tuple(Work(i, None, len(p) + planned[i] - 1, tables[i], True)
                         for i, p in enumerate(prompts) if planned[i] < NEW)
            pending.append(step(Step(decodes=rows), calls))
            for w in rows:
                planned[w.seq_id] += 1
            while len(pending) > 1:
                for sid, tok in pending.pop(0).result().items():
                    out[sid].append(tok)
        for sid, tok in pending.pop().result().items():
            out[sid].append(tok)
    for i in range(len(prompts)):
        eng.free_state(i)
    eng.drop_snapshot("base")
    return out, forwards


@pytest.mark.parametrize("name", NAMES)
def test_a_mixed_step_is_one_forward_with_mlx_lm_greedy_output(engines, name):
    eng = engines(name)
    assert check(inspect_model(engines.family_dir(name)), name) is None
    assert eng.mixers.ok, eng.mixers.reason  # no family falls back to one forward per group
    # the engine's kinds are the served-kinds table's rows that model facts name
    assert {k.table_kind for k in eng.flat_kinds} == set(eng.facts.cache_kinds)
    assert eng.select_rows
    prompts = mixed_prompts()
    want = [reference(eng.model, p, NEW) for p in prompts]
    assert len({tuple(w) for w in want}) > 1
    got, forwards = run_mixed(eng, prompts)
    assert got == want
    assert set(forwards) == {1}, forwards
    # no state or snapshot left behind (window rings keep their allocated rows)
    assert eng.state_bytes_held() == sum(k.nbytes for k in eng._rings.layers)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_mixed_step_equals_mlx_lm(engines, bits):
    eng = engines("qwen3", kv_dtype=f"q{bits}")
    prompts = mixed_prompts()
    want = [quantized_reference(eng.model, p, NEW, bits, chunk=BASE) for p in prompts]
    got, forwards = run_mixed(eng, prompts)
    assert got == want
    assert set(forwards) == {1}


def test_the_lm_head_sees_only_the_sampled_rows(engines):
    eng = engines("qwen3")
    head = eng.model.lm_head
    cls = type(head)
    original, rows = cls.__call__, []

    def spy(self, x):
        if self is head:
            rows.append(x.shape[0] * x.shape[1])
        return original(self, x)

    cls.__call__ = spy
    try:
        eng.run(Step(decodes=(), prefills=(
            Work(0, tuple(range(1, 41)), 0, (0, 1, 2), True),
            Work(1, tuple(range(5, 30)), 0, (3, 4), False),
            Work(2, tuple(range(7, 20)), 0, (5,), True))))
    finally:
        cls.__call__ = original
        for i in range(3):
            eng.free_state(i)
    assert rows == [2]  # 78 tokens in the forward, two of them sample


def test_without_regrouping_each_group_is_its_own_forward(engines):
    """A model whose mixing modules could not be found runs one forward per group (the
    decode rows, then each chunk) and gives the same tokens."""
    eng = engines("qwen3")
    prompts = mixed_prompts()
    found = eng.mixers
    try:
        eng.mixers = mixers.Mixers((), "forced off for the test")
        got, forwards = run_mixed(eng, prompts)
    finally:
        eng.mixers = found
    assert got == [reference(eng.model, p, NEW) for p in prompts]
    assert forwards[2] == 4  # the mixed step: its decode rows and three chunks
    assert set(forwards[:2] + forwards[3:]) == {1}


def test_several_first_chunks_in_one_step_equal_mlx_lm(tmp_path):
    """A step that starts four prompts of different lengths (three sample, one's first chunk
    does not) on the demo model: every sequence gets mlx-lm's own greedy tokens."""
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=128)
    sharpen(eng.model)
    new, chunk = 6, 48
    prompts = [text(eng.tokenizer, n, salt=s) for n, s in ((37, 1), (90, 2), (5, 3), (70, 4))]
    want = [reference(eng.model, p, new) for p in prompts]
    blocks = Blocks(128, shuffle=True)
    tables = [blocks.take(-(-(len(p) + new) // 16)) for p in prompts]
    # prompt 3 is chunked: its first chunk (start 0) joins the batch without sampling
    first = [Work(i, tuple(p if i != 3 else p[:chunk]), 0, tables[i], i != 3)
             for i, p in enumerate(prompts)]
    out = {i: [] for i in range(4)}
    for sid, tok in eng.run(Step(prefills=tuple(first))).items():
        out[sid].append(tok)
    assert set(out) == {0, 1, 2, 3} and not out[3]
    for sid, tok in eng.run(Step(prefills=(Work(3, tuple(prompts[3][chunk:]), chunk,
                                                tables[3], True),))).items():
        out[sid].append(tok)
    pending = None
    for _ in range(new):  # pipelined decodes of every row until each has `new` tokens
        rows = tuple(Work(i, None, len(prompts[i]) + len(out[i]) - 1 + (pending is not None),
                          tables[i], True) for i in range(4)
                     if len(out[i]) + (pending is not None) < new)
        nxt = eng.run_async(Step(decodes=rows)) if rows else None
        if pending is not None:
            for sid, tok in pending.result().items():
                out[sid].append(tok)
        pending = nxt
        if nxt is None:
            break
    if pending is not None:
        for sid, tok in pending.result().items():
            out[sid].append(tok)
    assert [out[i][:new] for i in range(4)] == want


@pytest.mark.parametrize(("queries", "keys"), [(1, 1), (5, 5), (7, 40), (130, 130), (33, 97),
                                              (20, 300), (100, 1000)])
def test_a_causal_chunk_padded_to_the_grid_attends_as_unpadded(queries, keys):
    """engine/attention.causal_on_grid pads queries and keys at the end by the same count and
    puts dummy queries in front (the CUDA plan-cache grid): the real rows are what the
    unpadded causal attention gives."""
    from plimsoll.engine.attention import causal_on_grid

    mx.random.seed(queries * 1000 + keys)
    q = mx.random.normal((1, 4, queries, 16))
    k, v = (mx.random.normal((1, 2, keys, 16)) for _ in range(2))
    want = causal_on_grid(q, k, v, 0.25, "causal", None, 0)
    got = causal_on_grid(q, k, v, 0.25, "causal", None, 64)
    assert got.shape == want.shape == (1, 4, queries, 16)
    assert mx.allclose(got, want, atol=1e-5).item()
    # a padded key visible to a real query would change it: the check can fail
    wrong = mx.fast.scaled_dot_product_attention(
        q, mx.pad(k, [(0, 0), (0, 0), (0, 3), (0, 0)]),
        mx.pad(v, [(0, 0), (0, 0), (0, 3), (0, 0)]) + 1.0, scale=0.25, mask="causal")
    assert not mx.allclose(wrong, want, atol=1e-5).item()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next", "gpt_oss", "deepseek_v3"])
def test_the_mixed_step_on_the_causal_grid_gives_mlx_lm_greedy_output(engines, name,
                                                                       monkeypatch):
    """With the CUDA grid forced on here, the mixed step's chunks (first chunks and one at
    a prefix hit) still give mlx-lm's greedy tokens."""
    from plimsoll.engine import backend

    if name not in NAMES:
        pytest.skip(f"{name} is not a served family here")
    eng = engines(name)
    prompts = mixed_prompts()
    want = [reference(eng.model, p, NEW) for p in prompts]
    monkeypatch.setattr(backend, "causal_grid", lambda: 64)
    got, _ = run_mixed(eng, prompts)
    assert got == want
