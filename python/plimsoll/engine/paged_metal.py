"""Paged decode attention as one Metal kernel (MLX's Metal backend only; imports mlx).

Why: on Metal, as on CUDA, a decode step without a kernel gathers every row's context from
the pool into a transient each layer (:meth:`~plimsoll.engine.paged.FullAttention.gather`)
and then runs ``mx.fast.scaled_dot_product_attention`` with a padding mask: at a long
context that copy is O(context) bytes a layer a step, beside the weights the step reads
once. This kernel reads each row's K/V straight from the pool through its block table.

The same flash-decoding kernel as :mod:`plimsoll.engine.paged_cuda` (which has run and
checked itself on an H200), written in the Metal Shading Language line for line: one
threadgroup per (row, KV head, split of the row's table), its simdgroups (32 threads on
every Apple GPU, as a CUDA warp) taking the split's tokens in turn with an online softmax
for every query head of the KV head's group; one split writes the attention, several write
partial results that a second kernel combines. The splits follow
:func:`~plimsoll.engine.paged_cuda.splits_for` with :data:`PARALLEL_GROUPS` in place of a
CUDA device's SM count (MLX reports no core count for an Apple GPU). Accumulation in float32.

**Never run on a Mac by this project's machines** (neither they nor CI have one). Like every
custom kernel it is used only after it checked itself on the device it runs on, at engine
start (:func:`plimsoll.engine.kernels.select`: a few random problems against the gather path,
within a tolerance, and not slower): a Metal compiler that refuses it, a wrong answer or a
slower one leaves the gather path serving, with the reason in ``/v1/plimsoll/status`` and
``plimsoll doctor``.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from plimsoll.engine import backend
from plimsoll.engine.paged_cuda import (
    DIRECT_OUT,
    PARTIAL_OUT,
    WARPS,
    launch,
    scale_input,
    splits_for,
)

#: threadgroups the splits aim to cover: an M-series GPU has 8-80 cores, each running
#: several threadgroups at once
PARALLEL_GROUPS = 64
#: threadgroup memory a kernel may declare on every Apple GPU MLX runs on
THREADGROUP_BYTES = 32 * 1024

# One threadgroup per (row, KV head, split); a split takes the tokens
# [split × span, (split + 1) × span) of its row's table, span = ceil(table tokens / splits).
# The CUDA kernel's body with Metal's names: threadgroup_position_in_grid for blockIdx,
# thread_index_in_simdgroup / simdgroup_index_in_threadgroup for the lane and warp,
# simd_sum for the warp's shuffle reduction, threadgroup arrays and threadgroup_barrier for
# __shared__ and __syncthreads, the same tails (paged_cuda.PARTIAL_OUT / DIRECT_OUT, plain
# C); a finite lowest score where CUDA's is -inf (Metal's fast
# math may assume no infinities; every real score is far above it, so the result is the
# same: an empty warp's or split's weight exp(-1e30 - M) is 0).
_ATTEND = r"""
    const float NEG_INF = -1e30f;  // finite: Metal compiles with fast math (no infinities)
    const int b = (int)threadgroup_position_in_grid.x;
    const int kvh = (int)threadgroup_position_in_grid.y;
    const int split = (int)threadgroup_position_in_grid.z;
    const int lane = (int)thread_index_in_simdgroup;
    const int warp = (int)simdgroup_index_in_threadgroup;
    const int tid = (int)thread_position_in_threadgroup.x;
    const int HQ = q_shape[1];
    const int S = kp_shape[1];
    const int MB = tables_shape[1];
    const int NS = (int)threadgroups_per_grid.z;
    const int len = lengths[b];
    const float scale = scale_arr[0];
    constexpr int DPL = D / 32;
    threadgroup float sm_m[WARPS][G];
    threadgroup float sm_s[WARPS][G];
    threadgroup float sm_a[WARPS][G][D];
    float qr[G][DPL];
    float m[G], s[G], acc[G][DPL];
    for (int g = 0; g < G; ++g) {
        const size_t qo = ((size_t)(b * HQ + kvh * G + g)) * D + lane * DPL;
        for (int i = 0; i < DPL; ++i) {
            qr[g][i] = static_cast<float>(q[qo + i]) * scale;
            acc[g][i] = 0.0f;
        }
        m[g] = NEG_INF; s[g] = 0.0f;
    }
    const int span = (MB * BT + NS - 1) / NS;
    const int lo = split * span;
    const int hi = metal::min(len, lo + span);
    for (int t = lo + warp; t < hi; t += WARPS) {
        const int slot = tables[b * MB + t / BT] * BT + t % BT;
        const size_t row = ((size_t)kvh * S + slot) * D + lane * DPL;
        float kf[DPL], vf[DPL];
        for (int i = 0; i < DPL; ++i) {
            kf[i] = static_cast<float>(kp[row + i]);
            vf[i] = static_cast<float>(vp[row + i]);
        }
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
            for (int i = 0; i < DPL; ++i) dot += qr[g][i] * kf[i];
            dot = metal::simd_sum(dot);
            const float mn = metal::max(m[g], dot);
            const float c = metal::exp(m[g] - mn), p = metal::exp(dot - mn);
            s[g] = s[g] * c + p;
            for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * c + p * vf[i];
            m[g] = mn;
        }
    }
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < DPL; ++i) sm_a[warp][g][lane * DPL + i] = acc[g][i];
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_s[warp][g] = s[g]; }
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    for (int idx = tid; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, d = idx % D;
        float M = NEG_INF;
        for (int w = 0; w < WARPS; ++w) M = metal::max(M, sm_m[w][g]);
        float tot = 0.0f, val = 0.0f;
        if (M > NEG_INF) {
            for (int w = 0; w < WARPS; ++w) {
                const float e = metal::exp(sm_m[w][g] - M);
                tot += sm_s[w][g] * e; val += sm_a[w][g][d] * e;
            }
        }
        const size_t o = ((size_t)(b * HQ + kvh * G + g)) * NS + split;
"""
# the splits' partial results combined, one thread per (row, query head, dim)
_COMBINE = r"""
    const int i = (int)thread_position_in_grid.x;
    const int HQ = part_m_shape[1], NS = part_m_shape[2];
    if (i >= part_m_shape[0] * HQ * D) return;
    const size_t bh = i / D;
    const int d = i % D;
    float M = -1e30f;
    for (int k = 0; k < NS; ++k) M = metal::max(M, part_m[bh * NS + k]);
    float tot = 0.0f, val = 0.0f;
    for (int k = 0; k < NS; ++k) {
        const float e = metal::exp(part_m[bh * NS + k] - M);
        tot += part_s[bh * NS + k] * e;
        val += part_a[(bh * NS + k) * D + d] * e;
    }
    out[i] = static_cast<T>(val / tot);
"""

_INPUTS = ["q", "kp", "vp", "tables", "lengths", "scale_arr"]


def available() -> bool:
    """Whether this process runs MLX's Metal backend (the kernel's only home)."""
    return backend.name() == "metal"


def threadgroup_bytes(group: int, dim: int) -> int:
    """The threadgroup memory the kernel declares for ``group`` query heads of ``dim``."""
    return 4 * WARPS * group * (dim + 2)


def serves(queries: mx.array, k_dim: int, v_dim: int, kv_heads: int) -> bool:
    """Whether :func:`paged_decode` computes this attention: one query per row, equal K and
    V head sizes that are a multiple of the simdgroup, whole query-head groups whose
    partial results fit a threadgroup's memory."""
    heads = queries.shape[1]
    return (queries.shape[2] == 1 and k_dim == v_dim and k_dim % 32 == 0
            and heads % kv_heads == 0
            and threadgroup_bytes(heads // kv_heads, k_dim) <= THREADGROUP_BYTES)


@functools.cache
def _kernel(which: str):
    if which == "combine":
        return mx.fast.metal_kernel(name="plimsoll_paged_combine",
                                    input_names=["part_a", "part_m", "part_s"],
                                    output_names=["out"], source=_COMBINE)
    if which == "direct":
        return mx.fast.metal_kernel(name="plimsoll_paged_decode_direct", input_names=_INPUTS,
                                    output_names=["out"], source=_ATTEND + DIRECT_OUT)
    return mx.fast.metal_kernel(name="plimsoll_paged_decode", input_names=_INPUTS,
                                output_names=["part_a", "part_m", "part_s"],
                                source=_ATTEND + PARTIAL_OUT)


def paged_decode(queries: mx.array, k_pool: mx.array, v_pool: mx.array, tables: mx.array,
                 lengths: mx.array, longest: int, scale: float, block_tokens: int,
                 after: mx.array | None = None) -> mx.array:
    """Attention of ``queries`` (rows, q_heads, 1, dim) over each row's first
    ``lengths[row]`` positions of its table; returns (rows, q_heads, 1, dim). ``after`` (an
    in-place write's token, CUDA's alone) is never set on Metal and is ignored."""
    rows, hq, _, d = queries.shape
    kvh = k_pool.shape[0]
    template = [("T", queries.dtype), ("D", d), ("G", hq // kvh), ("BT", block_tokens),
                ("WARPS", WARPS)]
    splits = splits_for(rows, kvh, longest, PARALLEL_GROUPS)
    inputs = [queries.reshape(rows, hq, d), k_pool, v_pool, tables, lengths, scale_input(scale)]
    return launch(_kernel, inputs, queries, kvh, template, splits)
