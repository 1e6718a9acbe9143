"""Compiled decode steps (engine/compiled.py) give the eager engine's greedy tokens.

Real mlx-lm inference (CPU, float32) on the tiny demo model and tiny models of
tests/families.py: the same sequences run on an engine that compiles its decode-only steps
and on one that builds every step eagerly, with decodes beside prefill chunks (eager) and
decode-only steps (compiled) over rows of different lengths, rows leaving one by one (a
bucket per row count) and a row crossing a bucket's width; the tokens are equal token for
token. A hybrid model is not compiled at all.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.engine import Engine, compiled  # noqa: E402
from plimsoll.engine.drive import (  # noqa: E402
    Blocks,
    drive,
    engine_cache,
    family_prompts,
    reference,
    seqs_for,
    sharpen,
)

BLOCK = 16
POOL = 96
# lengths around a bucket's width (8 blocks of 16 tokens): the first row crosses 128
LENGTHS = (118, 60, 131, 9)
NEW = (20, 14, 9, 5)


def _run(eng, pipelined: bool = True) -> list[list[int]]:
    prompts = family_prompts(*LENGTHS)
    seqs = seqs_for(prompts, max(NEW), BLOCK, Blocks(POOL, shuffle=True))
    for s, n in zip(seqs, NEW, strict=True):
        s.new = n
    return drive(eng, seqs, chunk=64, pipelined=pipelined)


@pytest.fixture(scope="module")
def engines(family_dir):
    return engine_cache(family_dir, BLOCK, POOL)


def _counting(monkeypatch) -> list[int]:
    runs: list[int] = []
    original = compiled.run

    def counted(c, works):
        runs.append(len(works))
        return original(c, works)

    monkeypatch.setattr(compiled, "run", counted)
    return runs


def test_bucket_width_rounds_blocks_up():
    assert compiled.width(1, 16) == compiled.BUCKET_BLOCKS
    assert compiled.width(16 * compiled.BUCKET_BLOCKS, 16) == compiled.BUCKET_BLOCKS
    assert compiled.width(16 * compiled.BUCKET_BLOCKS + 1, 16) == 2 * compiled.BUCKET_BLOCKS


def test_only_plain_full_attention_engines_compile():
    from plimsoll.engine.paged import FullAttention, RecurrentState

    pool = FullAttention(2, 32, 32, mx.float32, 16, 8, 8)
    assert compiled.eligible([pool, pool])
    assert not compiled.eligible([pool, RecurrentState(2, 10)])
    assert not compiled.eligible([])


def test_tiny_demo_compiled_equals_eager_and_mlx_lm(tiny_model, monkeypatch):
    eager = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=False)
    eng = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=True)
    for e in (eager, eng):
        sharpen(e.model)
    assert eager.compiled is None and eng.compiled is not None
    runs = _counting(monkeypatch)
    want = _run(eager)
    for pipelined in (True, False):
        assert _run(eng, pipelined) == want
    assert len(set(runs)) >= 3  # rows leaving one by one: a bucket per row count
    assert eng.compiled.traced >= 4 and len(runs) > eng.compiled.traced
    # the lengths crossing a bucket's width: two widths for the first row's count
    assert any(w > compiled.BUCKET_BLOCKS for _, w, _ in eng.compiled.buckets)
    prompts = family_prompts(*LENGTHS)
    assert want[0] == reference(eng.model, prompts[0], NEW[0])


def test_the_bucket_cap_holds_and_outputs_stay_equal(tiny_model):
    eager = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=False)
    eng = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=True)
    eng.compiled.max_buckets = 2
    assert _run(eng) == _run(eager)
    assert len(eng.compiled.buckets) <= 2 < eng.compiled.traced


def test_weights_replaced_after_a_trace_are_read(tiny_model):
    eager = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=False)
    eng = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=True)
    _run(eng)  # traced on the weights as loaded
    for e in (eager, eng):
        sharpen(e.model, 3.0)
    assert _run(eng) == _run(eager)


@pytest.mark.parametrize("name", ["llama", "qwen3_4bit", "qwen3_moe", "glm4_moe", "phi3",
                                  "qwen3_next"])
def test_families_compiled_equal_eager(engines, name, monkeypatch):
    eager, eng = engines(name, compile_decode=False), engines(name, compile_decode=True)
    runs = _counting(monkeypatch)
    assert _run(eng) == _run(eager)
    if name == "qwen3_next":  # hybrid: recurrent state, built eagerly
        assert eng.compiled is None and not runs
    else:
        assert eng.compiled is not None and runs


def test_a_model_that_does_not_trace_runs_eagerly(tiny_model, monkeypatch):
    """A forward that reads a value on the host cannot be traced: that step and every later
    one are built eagerly, with the same tokens, and the reason is kept."""
    eager = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=False)
    eng = Engine.load(tiny_model, block_tokens=BLOCK, max_blocks=POOL, compile_decode=True)
    cls = type(eng.model)
    original = cls.__call__

    def reads_the_host(self, inputs, *args, **kwargs):
        inputs.sum().item()  # an eval: refused inside mx.compile
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", reads_the_host)
    assert _run(eng) == _run(eager)
    assert eng.compiled.refused and not eng.compiled.buckets
    assert not eng.compiled.takes(())


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_compiled_pool_writes_stay_in_place(monkeypatch, pipelined, tmp_path_factory):
    """test_engine_pool_writes' measure on compiled decode steps: MLX's peak over the steps
    does not follow the pool's size (pipelined too: each step is submitted once the step
    before is done, or a queued read of it would make the write copy its array)."""
    import test_engine_pool_writes as writes

    from plimsoll.demo.model import build_demo_model

    class Compiling(Engine):
        @classmethod
        def load(cls, *args, **kwargs):
            return Engine.load(*args, **kwargs, compile_decode=True)

    monkeypatch.setattr(writes, "Engine", Compiling)
    model = build_demo_model(tmp_path_factory.mktemp("tiny"), "tiny")
    small = writes.step_peak(model, 64, pipelined, False)
    large = writes.step_peak(model, 512, pipelined, False)
    one_array = 64 * writes.MIB // (2 * 4)
    assert small < one_array // 4 and large < one_array // 4, (small, large)
