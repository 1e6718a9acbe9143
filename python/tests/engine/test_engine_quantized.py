"""Quantized KV (8 and 4 bit) in the block-paged engine, against mlx-lm's QuantizedKVCache.

Real engine, tiny random-weight models (tests/families.py, head dims of 64 so the groups of
64 fit), CPU float32: greedy output equals mlx-lm's own ``generate_step`` with
``kv_bits`` / ``kv_group_size=64`` / ``quantized_kv_start=0``; batched rows give the tokens
they give alone; the bytes the pools hold equal the model facts' formula.
"""

from __future__ import annotations

import math

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.generate import generate_step  # noqa: E402

from plimsoll.core.model_facts import inspect_model  # noqa: E402
from plimsoll.core.transients import dequant_transient_bytes, prefill_transient_bytes  # noqa: E402
from plimsoll.engine import Engine, backend, kernels  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, seqs_for, text  # noqa: E402
from plimsoll.engine.quantized import QuantizedAttention  # noqa: E402

BLOCK = 16
POOL = 48


def quantized_reference(model, prompt: list[int], n: int, bits: int,
                        chunk: int = 2048) -> list[int]:
    """mlx-lm's own greedy generation over its QuantizedKVCache (prefill in ``chunk`` s: its
    first chunk attends float K/V, later ones the quantized cache, as the engine's do)."""
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, kv_bits=bits,
                                        kv_group_size=64, quantized_kv_start=0,
                                        prefill_step_size=chunk)]


@pytest.fixture(scope="module", params=[8, 4], ids=["q8", "q4"])
def engine(request, family_dir) -> Engine:
    return Engine.load(family_dir("qwen3"), block_tokens=BLOCK, max_blocks=POOL,
                       kv_dtype=f"q{request.param}", slab_blocks=4)


def test_single_sequence_greedy_equals_mlx_lm_quantized_cache(engine):
    prompt = text(engine.tokenizer, 29, salt=5)
    want = quantized_reference(engine.model, prompt, 12, engine.kv_bits)
    assert len(set(want)) > 3
    got = drive(engine, seqs_for([prompt], 12, BLOCK, Blocks(POOL, shuffle=True)), chunk=64)
    assert got == [want]


def test_batched_rows_give_the_tokens_they_give_alone(engine):
    """Rows of different lengths, chunked prefills interleaved with batched decode,
    scattered block ids: each row's tokens equal its run alone (and mlx-lm's)."""
    prompts = [text(engine.tokenizer, n, salt=n) for n in (7, 40, 23)]
    alone = [drive(engine, seqs_for([p], 8, BLOCK, Blocks(POOL)), chunk=64)[0]
             for p in prompts]
    together = drive(engine, seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True, seed=2)),
                     chunk=64, pipelined=True)
    assert together == alone
    assert alone[1] == quantized_reference(engine.model, prompts[1], 8, engine.kv_bits)


def test_pool_bytes_equal_the_facts(engine, family_dir):
    """The arrays the pools really hold (values + scales + biases) equal the formula."""
    facts = inspect_model(family_dir("qwen3"), kv_dtype=f"q{engine.kv_bits}")
    assert facts.kv_bits == engine.kv_bits
    pools = [k for k in engine.layers if isinstance(k, QuantizedAttention)]
    assert pools and all(p.bits == engine.kv_bits for p in pools)
    drive(engine, seqs_for([text(engine.tokenizer, 50)], 2, BLOCK, Blocks(POOL)), chunk=64)
    assert engine.block_bytes == facts.kv_bytes_per_token * BLOCK
    held = engine.kv_bytes_allocated()
    assert held == sum(a.nbytes for p in pools for a in p.arrays())
    assert held == engine.blocks_allocated() * engine.block_bytes
    plain = inspect_model(family_dir("qwen3"))
    ratio = facts.kv_bytes_per_token / plain.kv_bytes_per_token
    # float32 base, head_dim 64: 8 bit = (64 + 2·4·1)/256 B, 4 bit = (32 + 8)/256 B a vector
    assert ratio == pytest.approx((72 if engine.kv_bits == 8 else 40) / 256)
    # a prefill chunk attends through a float copy of its context: counted, float pools 0
    assert dequant_transient_bytes(facts, BLOCK) == 2 * 2 * 64 * 4 * BLOCK
    assert dequant_transient_bytes(plain, BLOCK) == 0
    assert prefill_transient_bytes(facts, 32, 256) > prefill_transient_bytes(
        facts.model_copy(update={"kv_bits": None}), 32, 256)


def test_head_dims_off_the_groups_are_refused_before_the_weights(tmp_path):
    """The tiny demo's head_dim 32 cannot form groups of 64: a clear error, no load."""
    from plimsoll.core.model_facts import ModelInspectionError
    from plimsoll.demo.model import build_demo_model

    path = build_demo_model(tmp_path / "tiny", "tiny")
    with pytest.raises(ModelInspectionError, match="groups of 64"):
        Engine.load(path, block_tokens=BLOCK, max_blocks=8, kv_dtype="q8")


def test_growth_in_slabs_keeps_written_blocks(family_dir):
    """A pool grown one block at a time (six growths) gives the tokens of a pool grown in
    one slab: every quantized triple written before a growth is kept."""
    outs, blocks = [], []
    for slab in (1, POOL):
        eng = Engine.load(family_dir("qwen3"), block_tokens=BLOCK, max_blocks=POOL,
                          kv_dtype="q8", slab_blocks=slab)
        prompt = text(eng.tokenizer, 70, salt=9)
        outs.append(drive(eng, seqs_for([prompt], 10, BLOCK, Blocks(POOL)), chunk=20))
        blocks.append(eng.blocks_allocated())
    assert blocks == [math.ceil((70 + 10) / BLOCK), POOL]
    assert outs[0] == outs[1] and len(set(outs[0][0])) > 3
    # the chunks past position 0 attend to the dequantized pool: mlx-lm's chunked prefill
    assert outs[0] == [quantized_reference(eng.model, prompt, 10, 8, chunk=20)]


def test_chunked_prefill_equals_mlx_lm_chunked_prefill(engine):
    prompt = text(engine.tokenizer, 90, salt=4)
    got = drive(engine, seqs_for([prompt], 8, BLOCK, Blocks(POOL, shuffle=True)), chunk=32)
    assert got == [quantized_reference(engine.model, prompt, 8, engine.kv_bits, chunk=32)]


def test_a_quantized_block_round_trips_through_the_disk_tier_payload(engine):
    """export_block gives values + scales + biases of every layer (block_bytes exactly);
    import_block into another id makes that block read the same triples."""
    from plimsoll.engine import block_io
    from plimsoll.engine.paged import Read

    assert block_io.supports(engine) == ""
    drive(engine, seqs_for([text(engine.tokenizer, 20, salt=1)], 2, BLOCK, Blocks(POOL)),
          chunk=64)
    payload = block_io.export_block(engine, 0)
    assert len(payload) == engine.block_bytes
    target = engine.blocks_allocated() - 1
    block_io.import_block(engine, target, payload)
    for pool in (k for k in engine.layers if isinstance(k, QuantizedAttention)):
        for a, b in zip(pool.gather(Read(span=(0, BLOCK))),
                        pool.gather(Read(span=(target * BLOCK, (target + 1) * BLOCK))),
                        strict=True):
            assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def _stand_in():
    """A CPU stand-in for the CUDA decode kernel over quantized blocks: the engine's own
    quantized read (so its tokens are the reference's), counting its calls' rows."""
    calls = []

    def decode(*args, after=None):
        calls.append(args[0].shape[0])
        return kernels.reference_decode_quantized(*args)

    def serves(queries, k_dim, v_dim, kv_heads):
        return queries.shape[2] == 1 and k_dim == v_dim

    return kernels.Kernel("quantized_stand_in_cpu", "cpu", decode, serves), calls


@pytest.mark.skipif(backend.name() != "cpu", reason="the CPU's kernel choice")
def test_quantized_pools_off_cuda_keep_their_own_read(engine):
    verdict = next(v for v in engine.kernels.verdicts if v.name == kernels.QUANTIZED.name)
    assert not verdict.used and verdict.reason == "not this device: the engine runs on cpu"
    assert not engine.quantized_kernel
    assert all(p.decode_kernel is None for p in engine._pools)


@pytest.mark.skipif(backend.name() != "cpu", reason="the CPU's kernel choice")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_checked_quantized_decode_kernel_serves_the_decode_rows(family_dir, monkeypatch, bits):
    """A kernel that passes its check on quantized problems reads every decode row of the
    quantized pools (through the block index, a single row too) with the same tokens; a
    perturbed one is refused with its reason and the pools keep their own read."""
    good, calls = _stand_in()
    monkeypatch.setattr(kernels, "MARGIN", float("inf"))  # the stand-in IS the reference
    monkeypatch.setattr(kernels, "QUANTIZED", good)
    eng = Engine.load(family_dir("qwen3"), block_tokens=BLOCK, max_blocks=POOL,
                      kv_dtype=f"q{bits}", slab_blocks=4)
    verdict = eng.kernels.verdicts[-1]
    assert verdict.name == good.name and verdict.used, verdict.reason
    assert verdict.max_error == 0.0 and eng.quantized_kernel
    pools = [p for p in eng._pools if isinstance(p, QuantizedAttention)]
    assert pools and all(p.decode_kernel is good.decode for p in pools)
    prompts = [text(eng.tokenizer, n, salt=n) for n in (7, 40)]
    calls.clear()
    got = drive(eng, seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True)), chunk=64,
                pipelined=True)
    assert calls and set(calls) <= {1, 2}  # decode rows only
    calls.clear()  # one sequence in consecutive blocks: read through its index, not a slice
    alone = drive(eng, seqs_for(prompts[1:], 8, BLOCK, Blocks(POOL)), chunk=64)
    assert calls and set(calls) == {1}
    assert got[1] == alone[0] == quantized_reference(eng.model, prompts[1], 8, bits)

    def perturbed(*args, after=None):
        return kernels.reference_decode_quantized(*args) * 1.01 + 0.01

    monkeypatch.setattr(kernels, "QUANTIZED", kernels.Kernel("perturbed_cpu", "cpu", perturbed,
                                                             good.serves))
    refused = kernels.check_quantized(pools, mx.float32, eng.facts.num_attention_heads)
    assert not refused.used and refused.reason.startswith("disagrees with the reference")
