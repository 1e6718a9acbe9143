"""Custom kernels check themselves on the device before use (engine/kernels.py), on the CPU.

Real MLX (CPU, float32): a deliberately wrong kernel registered for the CPU (an mlx-op
implementation that perturbs the output) is rejected with its reason, a failing one too, a
correct one is accepted and then serves the engine's decode rows with mlx-lm's greedy
output; the default registry leaves the CPU on the reference path; the verdicts reach the
doctor's lines. The decision itself is pure and tested on values.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, backend, kernels  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402
from plimsoll.reliability.doctor import MlxView, mlx_lines  # noqa: E402

#: the CPU stand-in kernels are "not this device" where MLX runs on a GPU (test_pool_cuda.py
#: covers the CUDA ones there)
on_cpu = pytest.mark.skipif(backend.name() != "cpu", reason="the CPU's kernel choice")

SHAPES = [(2, 32, 32)]  # the tiny demo model: 8 query heads over 2 KV heads of 32


def _perturbed(*args):
    return kernels.reference_decode(*args) * 1.01 + 0.01


def _broken(*args):
    raise RuntimeError("no kernel image for this device")


def _serves(queries, k_dim, v_dim, kv_heads):
    return queries.shape[2] == 1 and k_dim == v_dim


WRONG = kernels.Kernel("perturbed_cpu", "cpu", _perturbed, _serves)
BROKEN = kernels.Kernel("broken_cpu", "cpu", _broken, _serves)


def _counting():
    calls = []

    def decode(*args, after=None):
        calls.append(args[0].shape[0])
        return kernels.reference_decode(*args)

    return kernels.Kernel("mlx_ops_cpu", "cpu", decode, _serves), calls


def test_the_decision():
    assert kernels.decide(1e-6, 1e-4, 1.0, 1.0) == ""
    assert kernels.decide(1e-6, 1e-4, 1.05, 1.0) == ""  # inside the margin
    assert kernels.decide(1e-3, 1e-4, 0.5, 1.0).startswith("disagrees")
    assert kernels.decide(float("nan"), 1e-4, 0.5, 1.0).startswith("disagrees")
    assert kernels.decide(1e-6, 1e-4, 2.0, 1.0).startswith("slower")


def test_a_wrong_kernel_is_rejected_with_its_reason():
    verdict = kernels.check(WRONG, mx.float32, 8, SHAPES)
    assert not verdict.used
    assert verdict.reason.startswith("disagrees with the reference")
    assert verdict.max_error > kernels.TOLERANCE[mx.float32]
    failed = kernels.check(BROKEN, mx.float32, 8, SHAPES)
    assert not failed.used and "failed on this device: RuntimeError" in failed.reason


def test_a_correct_kernel_is_accepted(monkeypatch):
    # the kernel here IS the reference, so its timing is a coin toss on a loaded CPU; the
    # speed rule has its own test (test_the_decision): here only agreement decides
    monkeypatch.setattr(kernels, "MARGIN", float("inf"))
    good, calls = _counting()
    verdict = kernels.check(good, mx.float32, 8, SHAPES)
    assert verdict.used, verdict.reason
    assert verdict.max_error == 0.0 and verdict.kernel_ms > 0 and verdict.reference_ms > 0
    assert calls  # it ran on the problems
    assert not kernels.check(good, mx.float32, 8, [(2, 32, 16)]).used  # a shape it won't serve


@on_cpu
def test_the_cpu_keeps_the_reference_path(tmp_path):
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    assert eng.kernels.decode is None
    verdict, metal, write, gather, skinny, writing = eng.kernels.report()
    assert verdict["name"] == "paged_decode_cuda" and not verdict["used"]
    assert verdict["reason"] == "not this device: the engine runs on cpu"
    assert metal["name"] == "paged_decode_metal" and not metal["used"]
    assert metal["reason"] == "not this device: the engine runs on cpu"
    # nor does a pool take its writes through the CUDA write kernel: MLX's scatter does
    assert write["name"] == "pool_write_cuda" and not write["used"]
    assert gather["name"] == "pool_gather_cuda" and not gather["used"]
    assert skinny["name"] == "skinny_matmul_cuda" and not skinny["used"]
    assert writing["name"] == "paged_decode_writing_cuda" and not writing["used"]
    assert all(p.inplace is None and p.fast_gather is None for p in eng._pools)
    assert eng.decode_gathers  # admission charges the decode's gather


@on_cpu
def test_the_engine_uses_only_the_kernel_that_passes(tmp_path, monkeypatch):
    good, calls = _counting()
    monkeypatch.setattr(kernels, "REGISTRY", [WRONG, good])
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    wrong, right, *_pool_kernels = eng.kernels.verdicts
    assert not wrong.used and wrong.reason.startswith("disagrees")
    assert right.used and eng.kernels.decode is good
    assert not eng.decode_gathers  # every attention layer is read by the kernel
    calls.clear()
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45)]
    got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=True)), chunk=64)
    assert got == [reference(eng.model, p, 6) for p in prompts]
    assert calls and set(calls) <= {1, 2}  # the decode rows went through it


def test_the_doctor_shows_each_verdict():
    rows = (kernels.Verdict("k1", "cuda", True, "agrees with the reference and is not slower",
                            1e-3, 0.2, 0.8).as_dict(),
            kernels.check(WRONG, mx.float32, 8, SHAPES).as_dict(),
            kernels.Verdict("k3", "cuda", False, "not this device: the engine runs on cpu")
            .as_dict(),
            kernels.Verdict("pool_write_cuda", "cuda", True,
                            "stores in place what the scatter stores").as_dict())
    lines = mlx_lines(MlxView("0.32.4", False, "cpu", kernels=rows), "linux")
    assert [ln.level for ln in lines] == ["ok", "ok", "warn", "ok", "ok"]
    assert lines[4].text.endswith("used, stores in place what the scatter stores")  # untimed
    assert "kernel k1 (cuda): used" in lines[1].text and "0.2 ms" in lines[1].text
    assert "perturbed_cpu" in lines[2].text and "disagrees" in lines[2].text
    assert "the reference path serves" in lines[3].text


def _eager_inplace(pool, rows, slots, after=None):
    """The CUDA write kernel's contract on the CPU: the rows stored into the pool's own
    buffer (a numpy view of it), the pool keeping its buffer; a token to depend on."""
    import numpy as np

    mx.eval(pool, rows, slots)
    np.array(pool, copy=False)[:, np.array(slots)] = np.array(rows)
    return mx.array([1], dtype=mx.int32)


def test_pools_written_in_place_give_the_same_tokens(tmp_path):
    """The engine's in-place write path (a pool's ``inplace``: what pool_cuda.write
    does on a GPU; its readers depend on its token, its buffer stays) gives mlx-lm's greedy
    tokens, with prompts in chunks beside running decodes, pipelined, on shuffled blocks."""
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    writes = []

    def counted(pool, rows, slots, after=None):
        writes.append(rows.shape[1])
        return _eager_inplace(pool, rows, slots)

    for p in eng._pools:
        p.inplace = counted
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 70)]
    got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=True)), chunk=32)
    assert got == [reference(eng.model, p, 6) for p in prompts]
    # every token of every sequence went through it: K and V of each layer
    assert sum(writes) == 2 * len(eng._pools) * sum(len(p) + 5 for p in prompts)


def _own_gather(shift: int = 0):
    """The CUDA gather kernel's contract (engine/pool_cuda.gather), computed another way:
    each position's slot from its block, the pool's rows taken at those slots."""
    calls = []

    def gather(pool, index, length, block_tokens, after=None):
        calls.append(length)
        t = mx.arange(length)
        slots = index[:, t // block_tokens] * block_tokens + t % block_tokens + shift
        return pool[:, slots.reshape(-1)].reshape(pool.shape[0], index.shape[0], length,
                                                   pool.shape[2]).transpose(1, 0, 2, 3)
    return gather, calls


@pytest.mark.parametrize("shift", [0, 1], ids=["right", "off-by-one"])
def test_a_pool_gathering_through_its_own_kernel_gives_the_same_tokens(tmp_path, shift):
    """The engine's gather path through a pool's ``fast_gather`` (what pool_cuda.gather
    does on a GPU) gives mlx-lm's greedy tokens for chunks at a prefix on shuffled blocks;
    one that reads a slot off does not (the test can fail)."""
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    gather, calls = _own_gather(shift)
    for p in eng._pools:  # (a stand-in takes no write token: no in-place writes beside it)
        p.fast_gather, p.inplace = gather, None
    prompts = [text(eng.tokenizer, n, salt=n) for n in (45, 70)]
    got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=True)), chunk=32)
    assert calls  # the chunks after the first gathered through it
    assert (got == [reference(eng.model, p, 6) for p in prompts]) is (shift == 0)


def test_every_read_of_a_pool_written_in_place_takes_its_last_write_token(tmp_path):
    """Where pools are written in place, every read of them (the gather kernel's, the
    decode kernel's, a consecutive run's too) takes the pool's last write token as its
    ``after``: on MLX's CUDA backend that input is the only edge that orders the read after
    the write inside one command batch (a CUDA graph's edges follow the buffers an op
    outputs; measured on an H200 without it: tokens differed from mlx-lm's). Stand-ins for
    the three kernels on the CPU, as the engine sets them where all three pass their
    checks; the tokens are still mlx-lm's, in order and shuffled blocks, pipelined too."""
    from plimsoll.engine import paged_cuda
    from plimsoll.engine.kernels import Kernel, reference_decode

    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    afters: list[mx.array | None] = []  # every write's ``after``
    reads: list[bool] = []
    gather, _ = _own_gather()

    def write(pool, rows, slots, after=None):
        afters.append(after)
        return _eager_inplace(pool, rows, slots)

    def owner(k_pool):
        return next(p for p in eng._pools if p.keys is k_pool)

    def checked_gather(pool, index, length, block_tokens, after=None):
        p = next(p for p in eng._pools if pool is p.keys or pool is p.values)
        reads.append(after is not None and after is p.token)
        return gather(pool, index, length, block_tokens)

    def decode(queries, k_pool, v_pool, tables, lengths, longest, scale, bt, after=None):
        p = owner(k_pool)
        reads.append(after is not None and after is p.token)
        return reference_decode(queries, k_pool, v_pool, tables, lengths, longest, scale, bt)

    eng.kernels.decode = Kernel("stand-in", "cpu", decode, paged_cuda.serves)
    for p in eng._pools:
        p.inplace, p.fast_gather = write, checked_gather
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 70)]
    want = [reference(eng.model, p, 6) for p in prompts]
    for shuffle in (False, True):
        for pipelined in (False, True):
            reads.clear()
            got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=shuffle)), chunk=32,
                        pipelined=pipelined)
            assert got == want
            assert reads and all(reads), (shuffle, pipelined)
    # the writes are chained: only each pool's very first (its keys') follows no token
    assert sum(a is None for a in afters) == len(eng._pools) < len(afters) / 4
