"""Decode steps that store their new K/V by the decode kernel's own launch (engine/decode_write.py
``check_writing``, attention.PagedView), on the CPU with stand-ins for the CUDA kernels.

Real MLX (CPU, float32), real engine: the check accepts a stand-in that stores each row's new
K/V at its last position and reads as the plain decode does, and refuses one that stores them
a position off, one without in-place pools, and no kernel at all; an engine whose pools are
written in place and whose decode kernel writes gives mlx-lm's greedy tokens (chunks beside
pipelined decodes, shuffled blocks) with the separate write left out of its decode-only steps,
and the off-by-one stand-in does not (the test can fail). The CUDA kernel itself is checked
where MLX has CUDA (test_pool_cuda.py).
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

import numpy as np  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, backend, decode_write, kernels, paged_cuda  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402

on_cpu = pytest.mark.skipif(backend.name() != "cpu", reason="the CPU's stand-in kernels")

SHAPES = [(2, 32, 32)]  # the tiny demo model: 8 query heads over 2 KV heads of 32
USED = kernels.Verdict(kernels.WRITE_KERNEL, "cpu", True, "stand-in")


def _store(pool: mx.array, rows: mx.array, slots: np.ndarray) -> None:
    """``rows`` (n, heads, dim) into ``pool``'s own buffer at ``slots`` (as a CUDA kernel
    writing through the pool's pointer: the pool keeps its buffer)."""
    mx.eval(pool, rows)
    np.array(pool, copy=False)[:, slots] = np.array(rows).transpose(1, 0, 2)


def _writing(off: int = 0, calls: list | None = None):
    """A ``decode_writing`` stand-in: each row's new K/V stored at position
    ``lengths − 1 − off`` of its table, then the reference decode; a token. It also checks
    what the CUDA kernel relies on: every position from a row's ``first`` on is the own
    position of row ``base + (position − first)``, whose table holds it in the same block."""

    def decode_writing(q, kp, vp, kn, vn, first, base, tables, lengths, longest, scale, bt,
                       after=None):
        mx.eval(tables, lengths, first, base)
        idx, n = np.array(tables), np.array(lengths) - 1
        fs, bs = np.array(first), np.array(base)
        for b in range(len(n)):
            for t in range(fs[b], n[b] + 1):
                r = bs[b] + t - fs[b]
                same = (idx[r, :t // bt + 1] == idx[b, :t // bt + 1]).all()
                assert n[r] == t and same, (b, t, r)
        if calls is not None:
            calls.append(tuple(bs))
        n = n - off
        slots = idx[np.arange(len(n)), n // bt] * bt + n % bt
        _store(kp, kn[:, :, 0], slots)
        _store(vp, vn[:, :, 0], slots)
        return (kernels.reference_decode(q, kp, vp, tables, lengths, longest, scale, bt),
                mx.array([1], dtype=mx.int32))

    return decode_writing


def _kernel(off: int = 0, calls: list | None = None) -> kernels.Kernel:
    def decode(*args, after=None):
        return kernels.reference_decode(*args)

    return kernels.Kernel("stand-in", "cpu", decode, paged_cuda.serves, _writing(off, calls))


def test_the_check_takes_a_kernel_that_writes_what_the_scatter_writes():
    verdict = decode_write.check_writing(_kernel(), mx.float32, 8, SHAPES, USED)
    assert verdict.used, verdict.reason
    assert verdict.name == "paged_decode_writing_cuda"


def test_the_check_refuses_a_kernel_writing_a_position_off():
    verdict = decode_write.check_writing(_kernel(off=1), mx.float32, 8, SHAPES, USED)
    assert not verdict.used and "bit for bit" in verdict.reason


def test_the_check_needs_a_writing_kernel_and_pools_written_in_place():
    assert not decode_write.check_writing(None, mx.float32, 8, SHAPES, USED).used
    plain = kernels.Kernel("stand-in", "cpu", kernels.reference_decode, paged_cuda.serves)
    assert not decode_write.check_writing(plain, mx.float32, 8, SHAPES, USED).used
    unused = kernels.Verdict(kernels.WRITE_KERNEL, "cpu", False, "not this device")
    verdict = decode_write.check_writing(_kernel(), mx.float32, 8, SHAPES, unused)
    assert not verdict.used and "not written in place" in verdict.reason


@on_cpu
def test_the_cpu_engine_does_not_write_in_its_decode(tmp_path):
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    assert not eng.decode_writes
    writing = eng.kernels.report()[-1]
    assert writing["name"] == "paged_decode_writing_cuda" and not writing["used"]


def _writing_engine(tmp_path, off: int = 0):
    """The tiny demo engine with stand-ins for the CUDA kernels as the engine sets them where
    all pass their checks: pools written in place (pool_cuda.write's contract), the decode
    kernel, and its writing launch; (engine, separate writes' rows, writing calls' bases)."""
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    separate, fused = [], []

    def write(pool, rows, slots, after=None):  # pool_cuda.write's contract
        separate.append(rows.shape[1])
        mx.eval(slots)
        _store(pool, rows.transpose(1, 0, 2), np.array(slots))
        return mx.array([1], dtype=mx.int32)

    eng.kernels.decode = _kernel(off, fused)
    eng.decode_writes = True
    for p in eng._pools:
        p.inplace = write
    return eng, separate, fused


@on_cpu
@pytest.mark.parametrize("off", [0, 1], ids=["right", "a-position-off"])
def test_an_engine_writing_in_its_decode_kernel_gives_mlx_lm_tokens(tmp_path, off):
    eng, separate, fused = _writing_engine(tmp_path, off)
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 70)]
    want = [reference(eng.model, p, 6) for p in prompts]
    got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=True)), chunk=32,
                pipelined=True)
    assert fused  # decode-only steps stored their tokens through it
    assert (got == want) is (off == 0)
    # every prompt token went through the separate write, and the decodes of steps with a
    # chunk beside them; a decode-only step's did not
    layers = len(eng._pools)
    rows = sum(len(bases) for bases in fused)
    assert sum(separate) + rows * 2 == 2 * layers * sum(len(p) + 5 for p in prompts)


@on_cpu
def test_verifying_rows_write_in_the_decode_kernel_with_mlx_lm_tokens(tmp_path):
    """Speculating sequences' rows (several drafts, host-drafted and chained on the device)
    in decode-only steps: each row's K/V stored by the writing launch, each later row of a
    sequence reading the earlier ones' new K/V, and the tokens still mlx-lm's (the
    speculative engine tests, run on this engine)."""
    import test_engine_speculative as spec

    eng, _, fused = _writing_engine(tmp_path)
    spec.test_several_verifying_sequences_share_the_decode_rows(eng)
    spec.test_chained_steps_decode_the_target_greedy_tokens(eng)
    assert any(len(set(bases)) < len(bases) for bases in fused)  # rows sharing a sequence
