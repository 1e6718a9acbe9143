"""The paged engine on multi-head latent attention (MLA) models, against mlx-lm's own generation.

Real mlx-lm inference (CPU, float32) on tiny random-weight models built with mlx-lm's own
classes (tests/families.py): deepseek_v3, glm4_moe_lite, kimi_k25, mistral4 (its llama-4
query scale per row offset), and kimi_linear (MLA beside
recurrent state). Batched rows of different lengths (the padding mask must reach the
model's positional scores), prompts over several blocks, chunked prefills at start > 0
(the causal mask aligned bottom-right), scattered and shared blocks, pipelined steps; the
pool's bytes against model facts and against the bytes mlx-lm's own cache holds.
"""

from __future__ import annotations

import math

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.drive import (  # noqa: E402
    Blocks,
    drive,
    engine_cache,
    family_prompts,
    reference,
    seqs_for,
)
from plimsoll.engine.work import Step, Work  # noqa: E402

BLOCK = 16
POOL = 64
MLA = ["deepseek_v3", "glm4_moe_lite", "kimi_k25", "mistral4"]


@pytest.fixture(scope="module")
def engines(family_dir):
    return engine_cache(family_dir, BLOCK, POOL)


@pytest.mark.parametrize("name", MLA)
def test_latent_layers_hold_the_latent_and_rope_key_once(engines, name):
    eng = engines(name)
    cfg = eng.facts
    assert [k.kind for k in eng.layers] == ["latent"] * cfg.num_layers
    rank, rope = 64, 64  # tests/families.py _MLA
    for k in eng.layers:
        assert (k.kv_heads, k.k_dim, k.v_dim) == (1, rank, rope)
        assert k.block_bytes == BLOCK * (rank + rope) * 4
    assert eng.block_bytes == BLOCK * cfg.kv_bytes_per_token


@pytest.mark.parametrize("name", MLA)
def test_one_sequence_over_several_blocks_equals_mlx_lm(engines, name):
    eng = engines(name)
    prompt = family_prompts(70)[0]
    want = reference(eng.model, prompt, 10)
    assert len(set(want)) > 3  # scaled weights: equality means something
    seqs = seqs_for([prompt], 10, BLOCK, Blocks(POOL, shuffle=True, seed=3))
    assert drive(eng, seqs, chunk=200) == [want]


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("pipelined", [False, True])
def test_batched_rows_of_different_lengths_and_chunked_prefill(engines, name, pipelined):
    """Three rows (9, 40 and 75 tokens) decoded together while the others still prefill in
    chunks of 16 (every chunk after the first at start > 0), on scattered blocks."""
    eng = engines(name)
    prompts = family_prompts(9, 40, 75)
    want = [reference(eng.model, p, 8) for p in prompts]
    assert len({tuple(w) for w in want}) == 3
    seqs = seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=16, pipelined=pipelined) == want


def test_two_rows_of_equal_length_batched(engines):
    """Rows of one length: no padding mask at all (mask None reaches the model)."""
    eng = engines("deepseek_v3")
    prompts = family_prompts(33, 33)
    prompts[1] = [(t * 5) % 500 + 1 for t in prompts[1]]
    want = [reference(eng.model, p, 8) for p in prompts]
    assert want[0] != want[1]
    seqs = seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True, seed=5))
    assert drive(eng, seqs, chunk=64) == want


def test_a_shared_prefix_of_latent_blocks(engines):
    """Two sequences map the same two prompt blocks: the second prefills only its tail."""
    eng = engines("deepseek_v3")
    base = family_prompts(2 * BLOCK)[0]
    prompts = [base + [(11 * i) % 500 + 2 for i in range(n)] for n in (9, 20)]
    want = [reference(eng.model, p, 6) for p in prompts]
    blocks = Blocks(POOL, shuffle=True, seed=7)
    a = seqs_for(prompts[:1], 6, BLOCK, blocks)
    assert drive(eng, a, chunk=64) == want[:1]
    b = seqs_for(prompts[1:], 6, BLOCK, blocks, shared={0: a[0].table[:2]})
    b[0].written = len(base)  # the prefix is in the shared blocks already
    assert drive(eng, b, chunk=64) == want[1:]


def test_mla_beside_recurrent_state(engines):
    """kimi_linear: KDA state layers and an MLA layer, batched, chunked, pipelined."""
    eng = engines("kimi_linear")
    assert [k.kind for k in eng.layers] == ["state", "state", "state", "latent"]
    prompts = family_prompts(9, 30, 45)
    want = [reference(eng.model, p, 6) for p in prompts]
    seqs = seqs_for(prompts, 6, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=16, pipelined=True) == want


@pytest.mark.parametrize("name", MLA)
def test_bytes_held_equal_facts_and_mlx_lm_cache(engines, family_dir, name):
    """A 300-token sequence in a pool grown one block at a time: the bytes the pool holds
    equal model facts' figure and the bytes mlx-lm's own cache holds, within 2 %."""
    eng = engines(name, slab_blocks=1)
    tokens = 300
    blocks = math.ceil(tokens / BLOCK)
    prompt = family_prompts(tokens)[0]
    eng.run(Step(prefills=(Work(0, tuple(prompt), 0, tuple(range(blocks)), True),)))
    eng.free_state(0)
    held = eng.kv_bytes_allocated()
    assert held == blocks * eng.block_bytes
    assert held == pytest.approx(eng.facts.sequence_bytes(tokens), rel=0.02)
    cache = make_prompt_cache(eng.model)
    mx.eval(eng.model(mx.array([prompt]), cache=cache))
    mlx_held = sum(c.nbytes / c.keys.shape[2] * c.offset for c in cache)
    assert held == pytest.approx(mlx_held, rel=0.02)


@pytest.mark.parametrize("name", ["deepseek_v2", "minicpm3", "youtu_llm"])
def test_latent_projections_with_an_expanded_cache_are_full_attention(engines, name):
    """deepseek_v2, minicpm3 and youtu_llm project through a latent but cache per-head K (qk_nope +
    qk_rope) and V: full-attention pools of unequal K and V widths, counted as such."""
    eng = engines(name)
    assert {k.kind for k in eng.layers} == {"full"}
    assert all(k.k_dim != k.v_dim for k in eng.layers)
    assert eng.facts.cache_kinds == ("kv",)
    assert eng.block_bytes == BLOCK * eng.facts.kv_bytes_per_token
    prompts = family_prompts(9, 40, 75)
    want = [reference(eng.model, p, 8) for p in prompts]
    seqs = seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=16, pipelined=True) == want


def test_mla_transients_stay_under_the_published_bounds(engines):
    """Physical: an MLA prefill expands the latent of every context token into per-head keys
    and values and holds positional scores beside the attention's own; MLX's measured peak
    over a chunk and over a batched decode stays under what admission counts, and the chunk's
    peak is over what the bound would be without the MLA terms (so they are needed)."""
    import random

    from plimsoll.core.transients import decode_transient_bytes, prefill_transient_bytes

    eng = Engine.load(engines.family_dir("deepseek_v3_wide"), block_tokens=BLOCK,
                      max_blocks=256, slab_blocks=256)
    assert eng.facts.prefill_expand_per_token == 32 * (64 + 64)
    plain = eng.facts.model_copy(update={"prefill_expand_per_token": 0})
    ids = list(range(256))
    random.Random(0).shuffle(ids)
    prompt = family_prompts(1024)[0]
    for chunk in (16, 256):
        eng.run(Step(prefills=(Work(0, tuple(prompt[:-chunk]), 0, tuple(ids), False),)))
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        eng.run(Step(prefills=(Work(0, tuple(prompt[-chunk:]), 1024 - chunk, tuple(ids), True),)))
        peak = mx.get_peak_memory() - before
        assert peak <= prefill_transient_bytes(eng.facts, chunk, 1024)
        if chunk == 16:
            assert peak > prefill_transient_bytes(plain, chunk, 1024)
        eng.free_state(0)
    lengths = [100 + 50 * i for i in range(8)]
    tables = [tuple(ids[32 * i:32 * (i + 1)]) for i in range(8)]
    for i, n in enumerate(lengths):
        eng.run(Step(prefills=(Work(i, tuple(prompt[:n]), 0, tables[i], True),)))
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    eng.run(Step(decodes=tuple(Work(i, None, n, tables[i], True) for i, n in enumerate(lengths))))
    assert mx.get_peak_memory() > 0
    assert mx.get_peak_memory() - before <= decode_transient_bytes(eng.facts, 8, max(lengths) + 1)
