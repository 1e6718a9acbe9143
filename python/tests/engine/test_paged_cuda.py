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


@pytest.mark.parametrize(("rows", "kv_heads", "longest", "sms", "want"), [
    (32, 8, 4096, 132, 1),    # 256 blocks already cover 132 SMs: no split
    (17, 8, 9000, 132, 1),    # 136 >= 132
    (16, 8, 9000, 132, 2),    # 128 blocks: two splits cover them
    (1, 8, 4096, 132, 16),    # 8 blocks want 17 splits; 4096 tokens allow 16
    (1, 8, 300, 132, 2),      # capped by the context: one split per 256 tokens at most
    (1, 8, 33, 132, 1),
    (4, 2, 100000, 132, 17),  # 8 blocks: ceil(132 / 8) splits
    (0, 8, 10, 132, 1),
])
def test_splits_come_from_the_grid(rows, kv_heads, longest, sms, want):
    assert paged_cuda.splits_for(rows, kv_heads, longest, sms) == want


def test_splits_never_exceed_one_per_chunk_and_cover_the_sms():
    for rows in (1, 2, 3, 5, 8, 13, 32, 64):
        for longest in (1, 255, 256, 257, 1000, 5000, 40000):
            n = paged_cuda.splits_for(rows, 4, longest, 132)
            assert 1 <= n <= max(1, -(-longest // paged_cuda.CHUNK))
            if n < -(-longest // paged_cuda.CHUNK):  # not capped: the SMs are covered
                assert rows * 4 * n >= 132


def test_sm_count_from_device_info_or_the_fallback():
    assert paged_cuda.sms_of({"multi_processor_count": 108}) == 108
    assert paged_cuda.sms_of({"device_name": "x"}) == paged_cuda.FALLBACK_SMS
    assert paged_cuda.sm_count() > 0


def _partials(q, k, v, lengths, splits, bt):
    """What the kernel's partial launch writes, in numpy: per (row, head, split) of the span
    ceil(table tokens / splits), the max score, the sum of exp(score − max) and the
    accumulator of V weighted so (an empty split: max −inf, sum and accumulator 0)."""
    rows, heads, dim = q.shape
    table = -(-int(lengths.max()) // bt) * bt
    span = -(-table // splits)
    part_a = np.zeros((rows, heads, splits, dim), np.float32)
    part_m = np.full((rows, heads, splits), -np.inf, np.float32)
    part_s = np.zeros((rows, heads, splits), np.float32)
    for r in range(rows):
        for s in range(splits):
            lo, hi = s * span, min(int(lengths[r]), (s + 1) * span)
            if lo >= hi:
                continue
            scores = np.einsum("hd,htd->ht", q[r], k[r][:, lo:hi])
            m = scores.max(axis=-1)
            e = np.exp(scores - m[:, None])
            part_m[r, :, s], part_s[r, :, s] = m, e.sum(axis=-1)
            part_a[r, :, s] = np.einsum("ht,htd->hd", e, v[r][:, lo:hi])
    return part_a, part_m, part_s


@pytest.mark.parametrize(("rows", "longest", "splits"), [(3, 700, 3), (2, 40, 5), (4, 300, 2)])
def test_combine_of_split_partials_is_the_attention(rows, longest, splits):
    """The combine's math (mlx ops on the CPU) over partials cut as the kernel cuts them
    equals the softmax attention over each row's whole context, empty splits included."""
    heads, dim, bt = 4, 32, 16
    rng = np.random.default_rng(rows)
    lengths = rng.integers(1, longest + 1, size=rows)
    lengths[0] = longest
    q = rng.standard_normal((rows, heads, dim)).astype(np.float32) * dim ** -0.5
    k = rng.standard_normal((rows, heads, longest, dim)).astype(np.float32)
    v = rng.standard_normal((rows, heads, longest, dim)).astype(np.float32)
    got = np.array(paged_cuda.combine(*(mx.array(a) for a in
                                        _partials(q, k, v, lengths, splits, bt))))
    for r in range(rows):
        n = int(lengths[r])
        scores = np.einsum("hd,htd->ht", q[r], k[r][:, :n])
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        want = np.einsum("ht,htd->hd", p / p.sum(axis=-1, keepdims=True), v[r][:, :n])
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_quantized_load_reads_what_dequantize_gives(bits, dim):
    """The quantized kernel's load (``_LOAD_QUANT``) in numpy, lane by lane, with its own
    expressions (W, NG, word and group of element e, its shift), against ``mx.dequantize``
    of the same pool: the packing it assumes is MLX's. (The kernel itself runs on CUDA.)"""
    heads, slots, gs = 2, 24, 64
    x = mx.random.normal((heads, slots, dim), key=mx.random.key(bits + dim))
    kq, ks, kb = mx.quantize(x, group_size=gs, bits=bits)
    want = np.array(mx.dequantize(kq, ks, kb, group_size=gs, bits=bits))
    q, s, b = (np.array(a).reshape(-1) for a in (kq, ks, kb))
    w_words, ng, dpl, mask = dim * bits // 32, dim // gs, dim // 32, (1 << bits) - 1
    assert "constexpr int W = D * BITS / 32, NG = D / GS;" in paged_cuda._LOAD_QUANT
    got = np.zeros((heads, slots, dim), np.float32)
    for kvh in range(heads):
        for slot in range(slots):
            vec = kvh * slots + slot
            for lane in range(32):
                for i in range(dpl):
                    e = lane * dpl + i
                    wi, gi, sh = vec * w_words + e * bits // 32, vec * ng + e // gs, e * bits % 32
                    got[kvh, slot, e] = s[gi] * ((int(q[wi]) >> sh) & mask) + b[gi]
    # to the last bit on the CPU; a GPU's dequantize may fuse s * q + b (one rounding)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_float_and_quantized_kernels_differ_only_in_their_load():
    plain, quant = paged_cuda._attend(False), paged_cuda._attend(True)
    assert paged_cuda._LOAD_FLOAT in plain and paged_cuda._LOAD_QUANT in quant
    assert (plain.replace(paged_cuda._LOAD_FLOAT, "").replace("kp_shape", "")
            == quant.replace(paged_cuda._LOAD_QUANT, "").replace("kq_shape", ""))
    assert "__LOAD__" not in plain + quant and "__POOL__" not in plain + quant


@pytest.mark.skipif(not paged_cuda.available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("rows", "lo", "hi"), [(1, 300, 300), (8, 1, 2000)])
def test_quantized_kernel_equals_the_engines_quantized_read(bits, rows, lo, hi):
    from plimsoll.engine import kernels

    args = kernels._problem(rows, lo, hi, 8, 32, 128, mx.bfloat16, rows)
    q, kp, vp, *rest = args
    qargs = (q, tuple(mx.quantize(kp, group_size=64, bits=bits)),
             tuple(mx.quantize(vp, group_size=64, bits=bits)), *rest)
    got = paged_cuda.paged_decode_quantized(*qargs)
    want = kernels.reference_decode_quantized(*qargs)
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 2e-2
