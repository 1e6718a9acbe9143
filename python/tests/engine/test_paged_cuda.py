"""The CUDA paged-decode kernel against the gather path (runs where MLX has CUDA; CI's CPU
checks only that the engine never picks the kernel there)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from plimsoll.engine import paged_cuda


def test_the_kernel_is_only_picked_on_cuda():
    q = mx.zeros((2, 8, 1, 64))
    assert paged_cuda.usable(q, 64, 64, 2) is paged_cuda.available()
    assert not paged_cuda.usable(mx.zeros((2, 8, 3, 64)), 64, 64, 2)  # prefill chunks
    assert not paged_cuda.usable(q, 64, 32, 2)  # MLA-like unequal K/V sizes


@pytest.mark.skipif(not paged_cuda.available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize(("rows", "lo", "hi"), [(32, 100, 560), (1, 300, 300), (4, 2000, 9000),
                                                (8, 1, 40)])
def test_kernel_equals_gathered_attention(rows, lo, hi):
    heads, q_heads, dim, bt = 8, 32, 128, 16
    rng = np.random.default_rng(rows)
    lengths = rng.integers(lo, hi + 1, size=rows)
    nb = -(-int(lengths.max()) // bt)
    blocks = rows * nb + 8
    tables = rng.permutation(blocks)[:rows * nb].reshape(rows, nb).astype(np.int32)
    kp = mx.random.normal((heads, blocks * bt, dim)).astype(mx.bfloat16)
    vp = mx.random.normal((heads, blocks * bt, dim)).astype(mx.bfloat16)
    q = mx.random.normal((rows, q_heads, 1, dim)).astype(mx.bfloat16)
    got = paged_cuda.paged_decode(q, kp, vp, mx.array(tables), mx.array(lengths.astype(np.int32)),
                                  int(lengths.max()), dim ** -0.5, bt)
    for r in range(rows):
        p = np.arange(lengths[r])
        slots = mx.array((tables[r][p // bt] * bt + p % bt).astype(np.int32))
        want = mx.fast.scaled_dot_product_attention(q[r:r + 1], kp[:, slots][None],
                                                    vp[:, slots][None], scale=dim ** -0.5,
                                                    mask=None)
        err = mx.abs(got[r:r + 1].astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert err < 2e-2, (r, err)
