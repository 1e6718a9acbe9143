"""Paged decode attention as one CUDA kernel (MLX's CUDA backend only; imports mlx).

Why: MLX's gather on CUDA moves a decode batch's tables at ~200 GB/s (its copy reaches
3.4 TB/s on an H200), so gathering every row's K/V into a transient and then running
``mx.fast.scaled_dot_product_attention`` with a padding mask cost ~25 ms a step at 32
streams of ~500 tokens (36 layers) — most of a step. This kernel reads each row's K/V
straight from the pool through its block table, so there is no transient and no mask.

Shape of the work (flash-decoding): one thread block per (row, KV head, split of the row's
table); its warps take the split's tokens in turn and keep an online softmax (running max,
sum and V accumulator) for every query head of the KV head's group, so each K/V row is read
once per group. The splits come from the grid the step needs (:func:`splits_for`): none when
rows × KV heads already give every SM a block, else enough to cover the SMs, never more than
one per :data:`CHUNK` tokens of the longest row. Without splits the kernel writes the
attention itself; with them it writes partial results (max, sum, accumulator) and one more
kernel combines them (:data:`_COMBINE`, the math of :func:`combine`): at most two launches a
layer. Accumulation in float32.

Pool layout (:class:`plimsoll.engine.paged.FullAttention`): (kv_heads, slots, dim),
slot = table[p // B] * B + p % B. Used for decode rows (one query each) without
attention sinks and with equal K and V head sizes, and only after it checked itself on this
device against the gather path (:mod:`plimsoll.engine.kernels`); anything else takes the
gather path.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from plimsoll.core.transients import DECODE_KERNEL_SPLIT
from plimsoll.engine import backend, pool_cuda

CHUNK = DECODE_KERNEL_SPLIT  # the fewest tokens a split takes (admission counts its partials)
WARPS = 4
#: SMs assumed where MLX's device info names none (an H100/H200's 132)
FALLBACK_SMS = 132
_COMBINE_THREADS = 256

# One thread block per (row, KV head, split); a split takes the tokens
# [split × span, (split + 1) × span) of its row's table, span = ceil(table tokens / splits).
_ATTEND = r"""
    const float NEG_INF = __int_as_float(0xff800000);
    const int b = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int HQ = q_shape[1];
    const int S = __POOL___shape[1];
    const int MB = tables_shape[1];
    const int NS = gridDim.z;
    const int len = lengths[b];
    const float scale = scale_arr[0];
    constexpr int DPL = D / 32;
    float qr[G][DPL];
    float m[G], s[G], acc[G][DPL];
    for (int g = 0; g < G; ++g) {
        const T* qp = q + ((size_t)(b * HQ + kvh * G + g)) * D + lane * DPL;
        for (int i = 0; i < DPL; ++i) {
            qr[g][i] = static_cast<float>(qp[i]) * scale;
            acc[g][i] = 0.f;
        }
        m[g] = NEG_INF; s[g] = 0.f;
    }
    const int span = (MB * BT + NS - 1) / NS;
    const int lo = split * span;
    const int hi = min(len, lo + span);
    for (int t = lo + warp; t < hi; t += WARPS) {
        const int slot = tables[b * MB + t / BT] * BT + t % BT;
        float kf[DPL], vf[DPL];
__LOAD__
        for (int g = 0; g < G; ++g) {
            float dot = 0.f;
            for (int i = 0; i < DPL; ++i) dot += qr[g][i] * kf[i];
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
            const float mn = fmaxf(m[g], dot);
            const float c = __expf(m[g] - mn), p = __expf(dot - mn);
            s[g] = s[g] * c + p;
            for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * c + p * vf[i];
            m[g] = mn;
        }
    }
    __shared__ float sm_m[WARPS][G], sm_s[WARPS][G], sm_a[WARPS][G][D];
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < DPL; ++i) sm_a[warp][g][lane * DPL + i] = acc[g][i];
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_s[warp][g] = s[g]; }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
        const int g = idx / D, d = idx % D;
        float M = NEG_INF;
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w][g]);
        float tot = 0.f, val = 0.f;
        if (M > NEG_INF) {
            for (int w = 0; w < WARPS; ++w) {
                const float e = __expf(sm_m[w][g] - M);
                tot += sm_s[w][g] * e; val += sm_a[w][g][d] * e;
            }
        }
        const size_t o = ((size_t)(b * HQ + kvh * G + g)) * NS + split;
"""
# a float pool's K/V: (kv_heads, slots, D), the lane's DPL consecutive elements of a row
_LOAD_FLOAT = r"""
        const size_t row = ((size_t)kvh * S + slot) * D + lane * DPL;
        for (int i = 0; i < DPL; ++i) {
            kf[i] = static_cast<float>(kp[row + i]);
            vf[i] = static_cast<float>(vp[row + i]);
        }
"""
# the same, in a step whose rows' new tokens are written here too (:func:`paged_decode_writing`):
# a position at or past the row's sequence's first new one (``first``) comes from ``kn``/``vn``
# (rows, kv_heads, 1, D) — the row holding it is ``base`` (the sequence's first row) plus its
# distance from ``first`` — and the row's own last position is stored into the pool's slot by
# the warp that reads it (one block a row and KV head holds it): no position is both written
# and read from the pool in one launch
_LOAD_FLOAT_WRITING = r"""
        const size_t row = ((size_t)kvh * S + slot) * D + lane * DPL;
        const int fb = first[b];
        if (t >= fb) {
            const size_t nr = ((size_t)(base[b] + t - fb) * kp_shape[0] + kvh) * D + lane * DPL;
            for (int i = 0; i < DPL; ++i) {
                kf[i] = static_cast<float>(kn[nr + i]);
                vf[i] = static_cast<float>(vn[nr + i]);
            }
            if (t == len - 1) {
                T* kw = const_cast<T*>(kp);
                T* vw = const_cast<T*>(vp);
                for (int i = 0; i < DPL; ++i) {
                    kw[row + i] = kn[nr + i];
                    vw[row + i] = vn[nr + i];
                }
            }
        } else {
            for (int i = 0; i < DPL; ++i) {
                kf[i] = static_cast<float>(kp[row + i]);
                vf[i] = static_cast<float>(vp[row + i]);
            }
        }
"""
# the token every later read of the pools takes as its ``after`` (engine/pool_cuda.py)
_DONE = r"""
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) done[0] = 1;
"""
# a quantized pool's (engine/quantized.py, mx.quantize's format): packed values (kv_heads,
# slots, D * BITS / 32) uint32, element e at bits [e * BITS % 32, +BITS) of word e * BITS / 32;
# scales and biases (kv_heads, slots, D / GS); an element is scale * value + bias
_LOAD_QUANT = r"""
        constexpr int W = D * BITS / 32, NG = D / GS;
        constexpr unsigned MASK = (1u << BITS) - 1u;
        const size_t vec = (size_t)kvh * S + slot;
        for (int i = 0; i < DPL; ++i) {
            const int e = lane * DPL + i;
            const size_t wi = vec * W + (e * BITS) / 32, gi = vec * NG + e / GS;
            const int sh = (e * BITS) % 32;
            kf[i] = static_cast<float>(ks[gi]) * (float)((kq[wi] >> sh) & MASK)
                + static_cast<float>(kb[gi]);
            vf[i] = static_cast<float>(vs[gi]) * (float)((vq[wi] >> sh) & MASK)
                + static_cast<float>(vb[gi]);
        }
"""


def _attend(quantized: bool, writing: bool = False) -> str:
    """The attention kernel's body for a float or a quantized pool (``writing``: a float
    pool's, storing each row's new token as it reads it)."""
    load = _LOAD_QUANT if quantized else _LOAD_FLOAT_WRITING if writing else _LOAD_FLOAT
    body = _ATTEND.replace("__LOAD__", load).replace("__POOL__", "kq" if quantized else "kp")
    return _DONE + body if writing else body


# the partial results of a split, for _COMBINE (plain C: the Metal kernel's tail too)
PARTIAL_OUT = r"""
        part_a[o * D + d] = val;
        if (d == 0) { part_m[o] = M; part_s[o] = tot; }
    }
"""
# one split (NS = 1, so o is the row's query head): the attention itself
DIRECT_OUT = r"""
        out[o * D + d] = static_cast<T>(val / tot);
    }
"""
# the splits' partial results combined, one thread per (row, query head, dim): combine()
_COMBINE = r"""
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int HQ = part_m_shape[1], NS = part_m_shape[2];
    if (i >= part_m_shape[0] * HQ * D) return;
    const size_t bh = i / D;
    const int d = i % D;
    float M = __int_as_float(0xff800000);
    for (int k = 0; k < NS; ++k) M = fmaxf(M, part_m[bh * NS + k]);
    float tot = 0.f, val = 0.f;
    for (int k = 0; k < NS; ++k) {
        const float e = expf(part_m[bh * NS + k] - M);
        tot += part_s[bh * NS + k] * e;
        val += part_a[(bh * NS + k) * D + d] * e;
    }
    out[i] = static_cast<T>(val / tot);
"""

#: ``after``: the pools' last in-place write token, never read (engine/pool_cuda.py)
_INPUTS = ["q", "kp", "vp", "tables", "lengths", "scale_arr", "after"]
_INPUTS_QUANT = ["q", "kq", "ks", "kb", "vq", "vs", "vb", "tables", "lengths", "scale_arr",
                 "after"]
_INPUTS_WRITING = ["q", "kp", "vp", "kn", "vn", "first", "base", "tables", "lengths",
                   "scale_arr", "after"]


def available() -> bool:
    """Whether this process runs MLX's CUDA backend (the kernel's only home)."""
    return backend.name() == "cuda"


def serves(queries: mx.array, k_dim: int, v_dim: int, kv_heads: int) -> bool:
    """Whether :func:`paged_decode` computes this attention: one query per row, equal K and
    V head sizes that are a multiple of the warp, whole query-head groups."""
    return (queries.shape[2] == 1 and k_dim == v_dim and k_dim % 32 == 0
            and queries.shape[1] % kv_heads == 0)


def usable(queries: mx.array, k_dim: int, v_dim: int, kv_heads: int) -> bool:
    """:func:`serves` on MLX's CUDA backend."""
    return serves(queries, k_dim, v_dim, kv_heads) and available()


def splits_for(rows: int, kv_heads: int, longest: int, sms: int, chunk: int = CHUNK) -> int:
    """How many splits each row's context is cut into (pure): 1 when the ``rows × kv_heads``
    thread blocks already give each of the ``sms`` SMs one, else enough blocks to cover
    them — never more than one split per ``chunk`` tokens of the ``longest`` row."""
    blocks = max(1, rows * kv_heads)
    most = max(1, -(-longest // chunk))
    if blocks >= sms:
        return 1
    return max(1, min(most, -(-sms // blocks)))


def sms_of(info: dict) -> int:
    """The SM count in MLX's device info (``mx.device_info()``), or :data:`FALLBACK_SMS`."""
    for key in ("multi_processor_count", "multiprocessor_count", "sm_count",
                "num_multiprocessors"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return FALLBACK_SMS


@functools.cache
def sm_count() -> int:
    """This device's SMs (read once)."""
    try:
        return sms_of(dict(mx.device_info()))
    except (AttributeError, RuntimeError, ValueError):
        return FALLBACK_SMS


def combine(part_a: mx.array, part_m: mx.array, part_s: mx.array) -> mx.array:
    """The splits' partial results (rows, q_heads, splits[, dim]) as one attention
    (rows, q_heads, dim), float32: each split's accumulator and sum weighted by
    ``exp(its max − the largest max)``. What :data:`_COMBINE` computes in one launch."""
    top = part_m.max(axis=-1, keepdims=True)
    w = mx.exp(part_m - top)
    return (part_a * w[..., None]).sum(axis=2) / (part_s * w).sum(axis=-1, keepdims=True)


@functools.cache
def _kernel(which: str, quantized: bool = False, writing: bool = False):
    if which == "combine":
        return mx.fast.cuda_kernel(name="plimsoll_paged_combine",
                                   input_names=["part_a", "part_m", "part_s"],
                                   output_names=["out"], source=_COMBINE)
    body = _attend(quantized, writing)
    names = _INPUTS_QUANT if quantized else _INPUTS_WRITING if writing else _INPUTS
    suffix, done = ("_q" if quantized else "_w" if writing else ""), ["done"] if writing else []
    if which == "direct":
        return mx.fast.cuda_kernel(name=f"plimsoll_paged_decode_direct{suffix}",
                                   input_names=names, output_names=["out", *done],
                                   source=body + DIRECT_OUT)
    return mx.fast.cuda_kernel(name=f"plimsoll_paged_decode{suffix}", input_names=names,
                               output_names=["part_a", "part_m", "part_s", *done],
                               source=body + PARTIAL_OUT)


@functools.lru_cache(maxsize=16)
def scale_input(scale: float) -> mx.array:
    """The softmax scale as the kernel's one-element input, made once per value."""
    return mx.array([scale], dtype=mx.float32)


def paged_decode(queries: mx.array, k_pool: mx.array, v_pool: mx.array, tables: mx.array,
                 lengths: mx.array, longest: int, scale: float,
                 block_tokens: int, after: mx.array | None = None) -> mx.array:
    """Attention of ``queries`` (rows, q_heads, 1, dim) over each row's first
    ``lengths[row]`` positions of its table, read after the in-place write whose token is
    ``after``; returns (rows, q_heads, 1, dim)."""
    return _launch([k_pool, v_pool], (), queries, tables, lengths, longest, scale,
                   block_tokens, after)


def paged_decode_quantized(queries: mx.array, k_pool: tuple, v_pool: tuple, tables: mx.array,
                           lengths: mx.array, longest: int, scale: float, block_tokens: int,
                           after: mx.array | None = None) -> mx.array:
    """:func:`paged_decode` over quantized pools (engine/quantized.py): ``k_pool`` and
    ``v_pool`` the (packed values, scales, biases) triples, dequantized in registers as
    each K/V row is read (no float copy of the context); the bits and group size follow from
    the triples' widths."""
    d = queries.shape[-1]
    packing = (("BITS", k_pool[0].shape[-1] * 32 // d), ("GS", d // k_pool[1].shape[-1]))
    return _launch([*k_pool, *v_pool], packing, queries, tables, lengths, longest, scale,
                   block_tokens, after)


def paged_decode_writing(queries: mx.array, k_pool: mx.array, v_pool: mx.array,
                         k_new: mx.array, v_new: mx.array, first: mx.array, base: mx.array,
                         tables: mx.array, lengths: mx.array, longest: int, scale: float,
                         block_tokens: int, after: mx.array | None = None
                         ) -> tuple[mx.array, mx.array]:
    """:func:`paged_decode` of a step of decode rows only — each a sequence's one new token,
    or one of a verifying sequence's consecutive rows — whose new K/V (``k_new``, ``v_new``:
    (rows, kv_heads, 1, dim), the pools' dtype) the same launch stores in place, each row's
    at position ``lengths[row] − 1`` of its table: the step's separate write
    (:func:`plimsoll.engine.pool_cuda.write`, two launches a layer) is not made. ``first``
    (rows,): the first new position of each row's sequence; ``base`` (rows,): the row that
    holds it (a plain decode row: ``lengths − 1`` and itself). Returns the attention and the
    token every later read of the pools takes."""
    return _launch([k_pool, v_pool], (), queries, tables, lengths, longest, scale,
                   block_tokens, after, new=(k_new, v_new, first, base))


def _launch(pools: list[mx.array], packing: tuple, queries: mx.array, tables: mx.array,
            lengths: mx.array, longest: int, scale: float, block_tokens: int,
            after: mx.array | None, new: tuple = ()):
    """One decode launch (two with splits) over float pools, or quantized ones where
    ``packing`` names their bits and group size; ``new``: each row's new K and V, stored by
    the launch (with where each row's sequence's new positions are: :func:`paged_decode_writing`),
    which then returns the write's token too."""
    rows, hq, _, d = queries.shape
    kvh, quantized, writing = pools[0].shape[0], bool(packing), bool(new)
    template = [("T", queries.dtype), ("D", d), ("G", hq // kvh), ("BT", block_tokens),
                ("WARPS", WARPS), *packing]
    splits = splits_for(rows, kvh, longest, sm_count())
    # (rows, q_heads, 1, dim) is (rows, q_heads, dim) in memory: the kernel reads q_shape[1]
    inputs = [queries, *pools, *new, tables, lengths, scale_input(scale),
              pool_cuda.nothing() if after is None else after]
    return launch(lambda which: _kernel(which, quantized and which != "combine",
                                        writing and which != "combine"),
                  inputs, queries, kvh, template, splits, token=writing)


def launch(kernel_of, inputs: list[mx.array], queries: mx.array, kv_heads: int,
           template: list, splits: int, token: bool = False):
    """The decode kernel's launch over ``splits`` splits of every row's table (one launch
    when 1, else the partial results and one more launch combining them), on either backend:
    ``kernel_of(which)`` is its ``"direct"``, ``"partial"`` or ``"combine"`` kernel (this
    module's, or :mod:`plimsoll.engine.paged_metal`'s). ``token``: the kernel also outputs
    a write's token (:func:`paged_decode_writing`); returns (attention, token) then."""
    rows, hq, _, d = queries.shape
    grid, group = (rows * 32 * WARPS, kv_heads, splits), (32 * WARPS, 1, 1)
    done = ([(1,)], [mx.int32]) if token else ([], [])
    if splits == 1:
        out = kernel_of("direct")(inputs=inputs, template=template, grid=grid,
                                  threadgroup=group, output_shapes=[(rows, hq, 1, d), *done[0]],
                                  output_dtypes=[queries.dtype, *done[1]])
        return (out[0], out[1]) if token else out[0]
    parts = kernel_of("partial")(
        inputs=inputs, template=template, grid=grid, threadgroup=group,
        output_shapes=[(rows, hq, splits, d), (rows, hq, splits), (rows, hq, splits), *done[0]],
        output_dtypes=[mx.float32, mx.float32, mx.float32, *done[1]])
    threads = -(-rows * hq * d // _COMBINE_THREADS) * _COMBINE_THREADS
    out = kernel_of("combine")(inputs=parts[:3], template=[("T", queries.dtype), ("D", d)],
                               grid=(threads, 1, 1), threadgroup=(_COMBINE_THREADS, 1, 1),
                               output_shapes=[(rows, hq, 1, d)],
                               output_dtypes=[queries.dtype])[0]
    return (out, parts[3]) if token else out
