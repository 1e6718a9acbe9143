"""The paged engine on layers holding several caches at once (mlx-lm ``CacheList``).

Real mlx-lm inference (CPU, float32) on tiny random-weight models of tests/families.py:
falcon_h1 (mamba state + full-attention KV in one layer), longcat_flash (two MLA
sublayers: two latents), deepseek_v32 and glm_moe_dsa (the MLA latent + the sparse
attention's indexer keys; prompts past ``index_topk`` = 64 so the top-k selection runs
over the gathered history, padded rows masked). Each member in its own kind; greedy
output equal to mlx-lm's own, batched, chunked, pipelined, on scattered blocks; bytes
against model facts.
"""

from __future__ import annotations

import math

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine import composite as cl  # noqa: E402
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
MEMBERS = {"falcon_h1": ("state", "full"), "longcat_flash": ("latent", "latent"),
           "deepseek_v32": ("latent", "indexer"), "glm_moe_dsa": ("latent", "indexer")}


@pytest.fixture(scope="module")
def engines(family_dir):
    return engine_cache(family_dir, BLOCK, POOL)


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_each_member_in_its_own_kind(engines, name):
    eng = engines(name)
    assert all(k.kind == "composite" for k in eng.layers)
    assert {tuple(p.kind for p in k.parts) for k in eng.layers} == {MEMBERS[name]}
    assert eng.block_bytes == BLOCK * eng.facts.kv_bytes_per_token
    assert eng.state_bytes_per_seq == pytest.approx(eng.facts.state_bytes_per_seq, rel=0.02)


@pytest.mark.parametrize("name", sorted(MEMBERS))
@pytest.mark.parametrize("pipelined", [False, True])
def test_batched_chunked_greedy_equals_mlx_lm(engines, name, pipelined):
    eng = engines(name)
    prompts = family_prompts(30, 90, 150)
    want = [reference(eng.model, p, 8) for p in prompts]
    assert len({tuple(w) for w in want}) == 3
    seqs = seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=32, pipelined=pipelined) == want
    assert eng.state_bytes_held() == 0


def test_state_member_prefix_reuse_through_a_snapshot(engines):
    """falcon_h1: a prefix is reusable where a state snapshot exists for it, the KV member's
    blocks shared, the state member restored from the snapshot."""
    eng = engines("falcon_h1")
    base = family_prompts(2 * BLOCK)[0]
    prompts = [base + [(11 * i) % 500 + 2 for i in range(n)] for n in (9, 14)]
    want = [reference(eng.model, p, 6) for p in prompts]
    blocks = Blocks(POOL)
    a = seqs_for(prompts[:1], 6, BLOCK, blocks)
    eng.run(Step(prefills=(Work(0, tuple(base), 0, a[0].table, False),)))
    eng.snapshot_state(0, "base")
    a[0].written = len(base)
    assert drive(eng, a, chunk=64) == want[:1]
    b = seqs_for(prompts[1:], 6, BLOCK, blocks, shared={0: a[0].table[:2]})
    eng.restore_state("base", 0)
    b[0].written = len(base)
    assert drive(eng, b, chunk=64) == want[1:]
    eng.drop_snapshot("base")
    assert eng.state_bytes_held() == 0


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_bytes_held_equal_facts_and_mlx_lm_cache(engines, name):
    """A 300-token sequence in pools grown one block at a time: blocks + state held equal
    facts' figure and what mlx-lm's own CacheList holds for it, within 2 %."""
    eng = engines(name, slab_blocks=1)
    tokens = 300
    blocks = math.ceil(tokens / BLOCK)
    prompt = family_prompts(tokens)[0]
    eng.run(Step(prefills=(Work(0, tuple(prompt), 0, tuple(range(blocks)), True),)))
    mx.synchronize()
    held = eng.kv_bytes_allocated() + eng.state_bytes_held()
    eng.free_state(0)
    assert eng.kv_bytes_allocated() == blocks * eng.block_bytes
    assert held == pytest.approx(eng.facts.sequence_bytes(tokens), rel=0.02)
    cache = make_prompt_cache(eng.model)
    mx.eval(eng.model(mx.array([prompt]), cache=cache))
    mlx_held = 0
    for layer in cache:
        for c in cl.members(layer):
            if type(c).__name__ == "ArraysCache":
                mlx_held += c.nbytes
            else:
                mlx_held += c.nbytes / c.keys.shape[2] * c.offset
    assert held == pytest.approx(mlx_held, rel=0.02)


def test_a_layout_that_disagrees_with_mlx_lm_is_refused():
    from mlx_lm.models.cache import ArraysCache, KVCache

    with pytest.raises(NotImplementedError, match="model facts say 'kv'"):
        cl.check_member("m", 3, ArraysCache(2), "kv")
    with pytest.raises(NotImplementedError, match="model facts say 'state'"):
        cl.check_member("m", 3, KVCache(), "state")
    cl.check_member("m", 3, KVCache(), "indexer")
    assert cl.pool_class("indexer") is cl.Indexer and cl.pool_class(None).kind == "full"


def test_cache_entries_map_onto_the_layers_that_hold_a_cache(engines):
    """nemotron_h's MLP blocks hold no cache: make_prompt_cache's entries are the mamba and
    attention layers only, and each gets the kind facts give its layer."""
    eng = engines("nemotron_h")
    assert [k.kind for k in eng.layers] == ["state", "state", "full", "state"]  # "M-M*-M"
    prompts = family_prompts(20, 50)
    want = [reference(eng.model, p, 6) for p in prompts]
    seqs = seqs_for(prompts, 6, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=32, pipelined=True) == want


def test_facts_that_misread_the_layout_are_refused_at_load(engines):
    """Admission sizes the pool from facts: an MLA model whose facts counted per-head K/V
    (as deepseek_v2's expanded cache) is refused rather than served on that figure."""
    from families import FAMILIES

    from plimsoll.core.model_facts import facts_from_config

    eng = engines("deepseek_v3")
    wrong = facts_from_config({**FAMILIES["deepseek_v3"].config, "model_type": "deepseek_v2"}, 0)
    assert wrong.kv_bytes_per_token != eng.facts.kv_bytes_per_token
    with pytest.raises(NotImplementedError, match="misreads this model's cache layout"):
        Engine(eng.model, eng.tokenizer, wrong, block_tokens=BLOCK, max_blocks=POOL)


@pytest.mark.parametrize("name", ["deepseek_v32", "falcon_h1"])
def test_block_payloads_cover_every_member_pool(engines, name):
    """The disk tier's block payloads: every pool of every CacheList member, in order; a
    block exported and imported elsewhere holds the same bytes. A state member (falcon_h1)
    keeps the tier off, for the hybrid reason."""
    from plimsoll.engine import block_io

    eng = engines(name)
    if name == "falcon_h1":
        assert "hybrid" in block_io.supports(eng)
        return
    assert block_io.supports(eng) == ""
    prompt = family_prompts(40)[0]
    eng.run(Step(prefills=(Work(0, tuple(prompt), 0, (5, 9, 2), True),)))
    eng.free_state(0)
    payload = block_io.export_block(eng, 9)
    assert len(payload) == eng.block_bytes
    block_io.import_block(eng, 30, payload)
    pools = [p for k in eng.layers for p in k.parts]
    assert len(pools) == 2 * eng.facts.num_layers
    for p in pools:
        for arr in (p.keys, p.values):
            assert mx.array_equal(arr[:, 30 * BLOCK:31 * BLOCK], arr[:, 9 * BLOCK:10 * BLOCK])
