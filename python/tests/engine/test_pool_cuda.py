"""The CUDA pool write and gather kernels (engine/pool_cuda.py) where MLX has CUDA; on the
CPU, CI checks that the engine reports them unused (test_engine_kernels.py)."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, backend, pool_cuda  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402

cuda = pytest.mark.skipif(backend.name() != "cuda", reason="needs MLX's CUDA backend")


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_write_kernel_stores_what_the_scatter_stores(dtype):
    assert pool_cuda.check_write(dtype, 8, 128) == ""


@cuda
def test_the_gather_kernel_copies_what_mlx_gathers():
    from plimsoll.engine.kernels import check_gather
    from plimsoll.engine.paged import FullAttention

    verdict = check_gather([FullAttention(8, 128, 128, mx.bfloat16, 16, 64, 64)])
    assert verdict.used, verdict.reason


@cuda
def test_an_engine_on_cuda_writes_and_gathers_through_them_with_mlx_lm_tokens(tmp_path):
    """Prompts in chunks beside pipelined decodes on shuffled blocks: the pools written in
    place and gathered by the kernels give mlx-lm's greedy tokens."""
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    assert all(p.inplace is pool_cuda.write for p in eng._pools)
    # the gather kernel is timed against MLX's at start: on a tiny pool it may lose (it did on
    # an H100), and then the engine must say so and gather as MLX does
    gathers = {p.fast_gather for p in eng._pools}
    assert gathers == {pool_cuda.gather} or (
        gathers == {None} and "slower than the gather" in str(eng.kernels.report()))
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 70)]
    got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=True)), chunk=32)
    assert got == [reference(eng.model, p, 6) for p in prompts]


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_decode_kernel_stores_its_rows_as_the_write_then_the_decode_do(dtype):
    from plimsoll.engine import decode_write, kernels

    used = kernels.Verdict(kernels.WRITE_KERNEL, "cuda", True, "checked")
    verdict = decode_write.check_writing(kernels.REGISTRY[0], dtype, 32, [(8, 128, 128)], used)
    assert verdict.used, verdict.reason


@cuda
def test_an_engine_on_cuda_stores_decode_tokens_by_its_decode_kernel(tmp_path):
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    assert eng.decode_writes, eng.kernels.report()
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 70)]
    got = drive(eng, seqs_for(prompts, 8, 16, Blocks(64, shuffle=True)), chunk=32,
                pipelined=True)
    assert got == [reference(eng.model, p, 8) for p in prompts]
