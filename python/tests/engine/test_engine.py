"""The block-paged engine against real mlx-lm inference on tiny random-weight demo models.

No mocks: greedy outputs are compared with mlx-lm's own ``generate_step`` token for
token, and memory is asserted on the bytes of the arrays the engine allocated. The
tests own block ids (``plimsoll.engine.drive.Blocks``); the real scheduler is tested elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.core.transients import growth_transient_bytes  # noqa: E402
from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402
from plimsoll.engine.work import Sampling, Step, Work  # noqa: E402

BLOCK = 16
POOL = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Engine:
    eng = Engine.load(tiny_dir, block_tokens=BLOCK, max_blocks=POOL, slab_blocks=4)
    sharpen(eng.model)
    return eng


def _fresh(tiny_dir, **kw) -> Engine:
    eng = Engine.load(tiny_dir, block_tokens=BLOCK, **{"max_blocks": POOL, **kw})
    sharpen(eng.model)
    return eng


def test_batched_chunked_greedy_equals_mlx_lm(tiny):
    """Sequences of different lengths, prefilled in chunks smaller than their prompts while
    the others decode, batched decode, scattered block ids: mlx-lm's greedy output."""
    prompts = [text(tiny.tokenizer, n, salt=n) for n in (5, 37, 70, 23)]
    want = [reference(tiny.model, p, 9) for p in prompts]
    assert len({tuple(w) for w in want}) == 4 and all(len(set(w)) > 3 for w in want)
    seqs = seqs_for(prompts, 9, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(tiny, seqs, chunk=12) == want


def test_pipelined_equals_unpipelined(tiny):
    prompts = [text(tiny.tokenizer, n, salt=3 * n) for n in (40, 9, 66)]
    plain = drive(tiny, seqs_for(prompts, 10, BLOCK, Blocks(POOL)), chunk=32)
    piped = drive(tiny, seqs_for(prompts, 10, BLOCK, Blocks(POOL, shuffle=True)), chunk=32,
                  pipelined=True)
    assert piped == plain == [reference(tiny.model, p, 10) for p in prompts]


def test_single_stream_pipelined_matches_reference(tiny):
    prompt = text(tiny.tokenizer, 50, salt=1)
    out = drive(tiny, seqs_for([prompt], 20, BLOCK, Blocks(POOL)), chunk=512, pipelined=True)
    assert out == [reference(tiny.model, prompt, 20)]


def test_shared_prefix_blocks_are_read_not_copied(tiny_dir):
    eng = _fresh(tiny_dir, slab_blocks=1)
    base = text(eng.tokenizer, 3 * BLOCK, salt=11)  # three full blocks
    tails = [text(eng.tokenizer, 7, salt=50), text(eng.tokenizer, 12, salt=60)]
    prompts = [base + t for t in tails]
    want = [reference(eng.model, p, 6) for p in prompts]
    blocks = Blocks(POOL)
    first = seqs_for(prompts[:1], 6, BLOCK, blocks)
    assert drive(eng, first, chunk=20) == want[:1]
    # the second sequence maps the first's three full blocks and prefills only its tail
    second = seqs_for(prompts[1:], 6, BLOCK, blocks, shared={0: first[0].table[:3]})
    second[0].seq_id = 0
    second[0].written = 3 * BLOCK
    assert drive(eng, second, chunk=20) == want[1:]
    distinct = set(first[0].table) | set(second[0].table)
    assert len(distinct) == len(first[0].table) + len(second[0].table) - 3
    assert eng.kv_bytes_allocated() == len(distinct) * eng.block_bytes
    # unshared, the same two sequences would allocate three more blocks
    assert eng.blocks_allocated() == max(distinct) + 1 == len(distinct)


def test_pool_grows_in_slabs_and_never_past_max_blocks(tiny_dir):
    eng = _fresh(tiny_dir, max_blocks=10, slab_blocks=4)
    assert eng.kv_bytes_allocated() == 0  # nothing preallocated
    prompt = text(eng.tokenizer, 20, salt=2)
    eng.run(Step(prefills=(Work(0, tuple(prompt), 0, (0, 1), True),)))
    assert eng.blocks_allocated() == 4
    assert eng.kv_bytes_allocated() == 4 * eng.block_bytes
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    for pool in eng._pools:  # what a Work writing block 9 does first: grow to the cap
        pool.ensure(9)
    grown = 6 * eng.block_bytes
    assert mx.get_active_memory() - before == grown
    slack = 1024  # mx.zeros' fill scalars
    assert mx.get_peak_memory() - before <= grown + growth_transient_bytes(
        eng.block_bytes, 10, eng.facts.kv_layers) + slack
    eng.run(Step(decodes=(Work(0, None, 20, (0, 9), True),)))
    assert eng.blocks_allocated() == 10
    with pytest.raises(ValueError, match="outside the pool of 10 blocks"):
        eng.run(Step(decodes=(Work(0, None, 21, (0, 10), True),)))
    assert eng.kv_bytes_allocated() == 10 * eng.block_bytes
    with pytest.raises(ValueError, match="does not cover"):
        eng.run(Step(decodes=(Work(0, (5,), 40, (0, 1), True),)))


def test_kv_dtype_float16_halves_block_bytes(tiny_dir, tiny):
    eng = _fresh(tiny_dir, kv_dtype="float16")
    assert eng.block_bytes * 2 == tiny.block_bytes
    assert tiny.block_bytes == 2 * BLOCK * tiny.facts.kv_layers * \
        tiny.facts.num_key_value_heads * tiny.facts.head_dim * 4
    prompt = text(eng.tokenizer, 30, salt=4)
    out = drive(eng, seqs_for([prompt], 5, BLOCK, Blocks(POOL)), chunk=16)
    pools = [a for p in eng._pools for a in (p.keys, p.values)]
    assert pools and all(a.dtype == mx.float16 for a in pools)
    assert eng.kv_bytes_allocated() == sum(a.nbytes for a in pools)
    assert len(out[0]) == 5


class OneToken:
    """A constraint that allows exactly one token id."""

    def __init__(self, token: int, vocab: int):
        self.token, self.vocab, self.told = token, vocab, []

    def allowed(self):
        mask = np.zeros(self.vocab, dtype=bool)
        mask[self.token] = True
        return mask

    def advance(self, token_id: int) -> None:
        self.told.append(token_id)

    def done(self) -> bool:
        return False


@pytest.mark.parametrize("pipelined", [False, True])
def test_constraint_mask_is_honoured(tiny, pipelined):
    prompts = [text(tiny.tokenizer, n, salt=n) for n in (20, 33)]
    seqs = seqs_for(prompts, 6, BLOCK, Blocks(POOL))
    seqs[1].constraint = OneToken(77, len(tiny.tokenizer.vocab))
    out = drive(tiny, seqs, chunk=16, pipelined=pipelined)
    assert out[1] == [77] * 6 and seqs[1].constraint.told == [77] * 6
    assert out[0] == reference(tiny.model, prompts[0], 6)  # its neighbour is unconstrained


def test_seeded_sampling_reproduces_in_any_batch(tiny):
    prompts = [text(tiny.tokenizer, n, salt=n) for n in (25, 40)]

    def run(seed: int, batched: bool) -> list[int]:
        seqs = seqs_for(prompts if batched else prompts[:1], 10, BLOCK, Blocks(POOL))
        seqs[0].sampling = Sampling(temperature=0.9, top_p=0.95, seed=seed)
        return drive(tiny, seqs, chunk=64)[0]

    assert run(7, False) == run(7, True)
    assert run(7, False) != run(8, False)


@pytest.mark.parametrize("kind", ["chunked", "keep"])
def test_refuses_unsupported_cache_kind(tiny_dir, kind):
    import mlx_lm
    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

    from plimsoll.core.model_facts import inspect_model

    model, tok = mlx_lm.load(str(tiny_dir))
    make, match = {"chunked": (lambda: ChunkedKVCache(64), "ChunkedKVCache"),
                   "keep": (lambda: RotatingKVCache(max_size=64, keep=4), "keep=4")}[kind]
    model.make_cache = lambda: [make() for _ in model.layers]
    with pytest.raises(NotImplementedError, match=match):
        Engine(model, tok, inspect_model(tiny_dir), block_tokens=BLOCK, max_blocks=POOL)


def test_bad_steps_are_refused(tiny):
    with pytest.raises(ValueError, match="nothing was sampled"):
        tiny.run(Step(decodes=(Work(999, None, 3, (0,), True),)))
    with pytest.raises(ValueError, match="exactly one token"):
        tiny.run(Step(decodes=(Work(999, (1, 2), 3, (0,), True),)))
    with pytest.raises(ValueError, match="twice"):
        w = Work(5, (1,), 0, (0,), True)
        tiny.run(Step(decodes=(w,), prefills=(w,)))


def test_transients_stay_under_the_published_bounds(tiny_dir):
    """Physical: MLX's peak over a prefill chunk and over a batched decode step stays under
    the figures admission counts (engine.work), with scattered block ids (the gather path)."""
    import random

    from plimsoll.core.transients import decode_transient_bytes, prefill_transient_bytes

    eng = _fresh(tiny_dir, max_blocks=256, slab_blocks=256)
    ids = list(range(256))
    random.Random(0).shuffle(ids)
    prompt = text(eng.tokenizer, 1024, salt=9)
    for chunk in (32, 256):
        eng.run(Step(prefills=(Work(0, tuple(prompt[:-chunk]), 0, tuple(ids), False),)))
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        eng.run(Step(prefills=(Work(0, tuple(prompt[-chunk:]), 1024 - chunk, tuple(ids), True),)))
        # the upper bound is the claim; a buffer the previous step frees meanwhile can make
        # the difference slightly negative for a small transient (the slice-write path)
        assert mx.get_peak_memory() > 0
        assert mx.get_peak_memory() - before <= prefill_transient_bytes(eng.facts, chunk, 1024)
        eng.free_state(0)
    lengths = [100 + 50 * i for i in range(8)]
    tables = [tuple(ids[32 * i:32 * (i + 1)]) for i in range(8)]
    for i, n in enumerate(lengths):
        eng.run(Step(prefills=(Work(i, tuple(prompt[:n]), 0, tables[i], True),)))
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    eng.run(Step(decodes=tuple(Work(i, None, n, tables[i], True) for i, n in enumerate(lengths))))
    bound = decode_transient_bytes(eng.facts, 8, max(lengths) + 1)
    assert mx.get_peak_memory() > 0
    assert mx.get_peak_memory() - before <= bound


def test_a_prefill_chunk_holds_one_layer_in_flight_whatever_the_depth(tiny_dir, tmp_path):
    """A 512-token chunk holds one layer's transient at a time: its peak is the same for 4
    layers and for 24, under the one-layer figure admission counts. (Were a layer's pool
    write left to the end of the graph, or its fresh K/V kept by its view, the peak would
    grow by a layer's K/V per layer: FullAttention.tied, PagedView.attend.)"""
    import json
    import shutil

    import mlx_lm.utils as mlu

    from plimsoll.core.transients import prefill_transient_bytes

    deep = tmp_path / "deep"
    deep.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    config["num_hidden_layers"] = 24
    model_class, args_class = mlu._get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mlu.save_model(deep, model)
    mlu.save_config(config, deep / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_dir / name, deep / name)
    peaks = []
    for path in (tiny_dir, deep):
        eng = Engine.load(path, block_tokens=BLOCK, max_blocks=64, slab_blocks=64)
        eng.run(Step(prefills=(Work(0, (1,), 0, (0,), True),)))  # the pools exist
        eng.free_state(0)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        eng.run(Step(prefills=(Work(1, tuple(range(3, 515)), 0, tuple(range(32, 64)), True),)))
        mx.synchronize()
        peaks.append(mx.get_peak_memory() - before)
        assert peaks[-1] <= prefill_transient_bytes(eng.facts, 512, 512)
    assert peaks[1] < 1.1 * peaks[0], peaks
