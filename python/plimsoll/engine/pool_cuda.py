"""A pool's writes and gathers as CUDA kernels (MLX's CUDA backend only; imports mlx).

**Writes in place.** An MLX array is immutable, and a scatter into a pool updates the
pool's buffer in place only when nothing else holds that buffer. MLX's CUDA backend holds
every op's inputs until the command batch that runs it has completed, and the engine builds
step n + 1 while step n runs; so a write of a layer whose read by the step before (or by an
earlier group of the same step) has not completed yet copies the layer's whole K and V
arrays. Measured on an H200 (the step trace, bench/results/trace-h200-2026-12-03e.jsonl.gz):
one stream's decode steps at 28-31k tokens held 1-4.5 GiB of such copies, in bursts, far
above the transient admission counts. :func:`write` stores the new rows through the pool's
own pointer and returns a one-element token. The pool arrays keep their buffers;
:meth:`~plimsoll.engine.paged.FullAttention.write` hands the layer's readers the pools made
to depend on the token (``mx.depends``, which shares the buffers), and every reader of such a
pool takes the token as an input of its own (``after``: :func:`gather`, the paged-decode
kernel). That input is what orders a read after the write on the device: MLX's CUDA backend
runs a command batch as a CUDA graph whose edges follow the buffers an op *outputs*, and the
write's output is the token, not the pool (measured on an H200 before the token was an
input: an engine's greedy tokens differed from mlx-lm's where a step wrote and read a pool
in one batch). Each write takes the pool's previous token too, so the last token stands for
every write before it. Separate evaluations are ordered by the engine's one stream. Used
after :func:`check_write` found the pool read back equal to the scatter's bit for bit
(random rows into scattered slots), only where :func:`gather` is used too (every read of
the pool then takes the token: MLX's own gather or slice could not), never for compiled
decode steps (their writes are scatters of the traced function's inputs).

**Gathers.** A chunk at a prefix whose blocks are not one consecutive run gathers its
context from the pool every layer; MLX's gather on CUDA moves a table at ~200 GB/s (its copy
reaches 3.4 TB/s on an H200), and on the H200 a 2048-token chunk at a 2-16k prefix took
0.13-0.16 s through a scattered table against 0.05-0.07 s through a consecutive one (a
slice). :func:`gather` copies 16-byte vectors, one thread each, straight into the
``(rows, heads, length, dim)`` the attention takes; used after :func:`check_gather` found
it equal to MLX's gather bit for bit and not slower.
"""

from __future__ import annotations

import functools

import mlx.core as mx

_THREADS = 256

# one thread per (head, row, element); ``rows`` is (heads, n, D), ``slots`` the n pool slots
_WRITE = r"""
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t S = pool_shape[1];
    const int N = slots_shape[0];
    if (i < (size_t)pool_shape[0] * N * D) {
        const int d = i % D;
        const size_t hn = i / D;
        const int n = hn % N, h = hn / N;
        T* dst = const_cast<T*>(pool);
        dst[((size_t)h * S + slots[n]) * D + d] = rows[i];
    }
    if (i == 0) done[0] = 1;
"""
# ``after`` (an input of every kernel here) is never read: it is the token of the write the
# kernel must follow, an input only so that MLX's CUDA graph has the edge


# one thread per 16-byte vector of the output (rows, heads, length, D)
_GATHER = r"""
    constexpr int V = 16 / sizeof(T);
    constexpr int DV = D / V;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int H = pool_shape[0];
    const size_t S = pool_shape[1];
    const int NB = index_shape[1];
    const int L = length[0];
    if (i >= (size_t)index_shape[0] * H * L * DV) return;
    const int dv = i % DV;
    size_t rest = i / DV;
    const int t = rest % L;
    rest /= L;
    const int h = rest % H, r = rest / H;
    const size_t slot = (size_t)index[r * NB + t / BT] * BT + t % BT;
    reinterpret_cast<uint4*>(out)[i] =
        reinterpret_cast<const uint4*>(pool + ((size_t)h * S + slot) * D)[dv];
"""


@functools.cache
def _kernel(which: str):
    if which == "gather":
        return mx.fast.cuda_kernel(name="plimsoll_pool_gather",
                                   input_names=["pool", "index", "length", "after"],
                                   output_names=["out"], source=_GATHER)
    return mx.fast.cuda_kernel(name="plimsoll_pool_write",
                               input_names=["pool", "rows", "slots", "after"],
                               output_names=["done"], source=_WRITE)


@functools.cache
def nothing() -> mx.array:
    """The ``after`` of a kernel that follows no in-place write."""
    return mx.zeros((1,), dtype=mx.int32)


@functools.lru_cache(maxsize=256)
def _length(n: int) -> mx.array:
    return mx.array([n], dtype=mx.int32)


def gather(pool: mx.array, index: mx.array, length: int, block_tokens: int,
           after: mx.array | None = None) -> mx.array:
    """Positions ``0 .. length - 1`` of each row's blocks ``index`` (rows, blocks) in
    ``pool`` (heads, slots, dim), as (rows, heads, length, dim), read after the write whose
    token is ``after``."""
    heads, _, dim = pool.shape
    rows = index.shape[0]
    vectors = rows * heads * length * dim * pool.dtype.size // 16
    threads = -(-vectors // _THREADS) * _THREADS
    return _kernel("gather")(inputs=[pool, index, _length(length),
                                     nothing() if after is None else after],
                             template=[("T", pool.dtype), ("D", dim), ("BT", block_tokens)],
                             grid=(max(threads, _THREADS), 1, 1), threadgroup=(_THREADS, 1, 1),
                             output_shapes=[(rows, heads, length, dim)],
                             output_dtypes=[pool.dtype])[0]


def write(pool: mx.array, rows: mx.array, slots: mx.array,
          after: mx.array | None = None) -> mx.array:
    """Store ``rows`` (heads, n, dim) at ``slots`` (n,) of ``pool`` (heads, slots, dim) in
    place, after the write whose token is ``after``; returns the token every read of the
    written pool must take as its ``after``."""
    heads, n, dim = rows.shape
    threads = -(-heads * n * dim // _THREADS) * _THREADS
    return _kernel("write")(inputs=[pool, rows.astype(pool.dtype), slots.astype(mx.int32),
                             nothing() if after is None else after],
                     template=[("T", pool.dtype), ("D", dim)], grid=(max(threads, _THREADS), 1, 1),
                     threadgroup=(_THREADS, 1, 1), output_shapes=[(1,)],
                     output_dtypes=[mx.int32])[0]


def check_write(dtype: mx.Dtype, kv_heads: int, dim: int) -> str:
    """Why the in-place write is not used for pools of this shape ("" when it is): on this
    device, rows written into scattered slots must read back as the scatter leaves them."""
    try:
        slots_n, rows_n = 256, 40
        k1, k2, k3 = mx.random.split(mx.random.key(7), 3)
        pool = mx.random.normal((kv_heads, slots_n, dim), key=k1).astype(dtype)
        rows = mx.random.normal((kv_heads, rows_n, dim), key=k2).astype(dtype)
        slots = mx.random.permutation(slots_n, key=k3)[:rows_n].astype(mx.int32)
        want = mx.array(pool)
        want[:, slots] = rows
        mine = pool + 0  # a buffer of its own
        mx.eval(want, mine)
        done = write(mine, rows, slots)
        (after,) = mx.depends([mine], [done])
        mx.eval(after)
        if not mx.array_equal(after, want).item():
            return "disagrees with the scatter: the pool read back differs"
    except Exception as err:  # any failure means: do not use it
        return f"failed on this device: {type(err).__name__}: {err}"
    return ""


def check_gather(dtype: mx.Dtype, kv_heads: int, dim: int, block_tokens: int,
                 reference) -> str:
    """Why :func:`gather` is not used for pools of this shape ("" when it is): on this
    device it must equal ``reference(pool, index, length)`` (the pool's MLX gather) bit for
    bit on shuffled tables (a long row and padded short ones) and not be slower (best of 5)."""
    import time

    if (dim * dtype.size) % 16:
        return f"rows of {dim} x {dtype} are not whole 16-byte vectors"
    try:
        blocks, rows, nb = 1200, 2, 512
        k1, k2 = mx.random.split(mx.random.key(11))
        pool = mx.random.normal((kv_heads, blocks * block_tokens, dim), key=k1).astype(dtype)
        index = mx.random.permutation(blocks, key=k2)[:rows * nb].reshape(rows, nb)
        index = index.astype(mx.int32)
        length = nb * block_tokens - 5
        mx.eval(pool, index)
        times = []
        for fn in (lambda: gather(pool, index, length, block_tokens),
                   lambda: reference(pool, index, length)):
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                out = fn()
                mx.eval(out)
                best = min(best, time.perf_counter() - t0)
            times.append((best, out))
        (mine, got), (theirs, want) = times
        if not mx.array_equal(got, want).item():
            return "disagrees with the gather"
        if mine > theirs * 1.1:
            return f"slower than the gather: {mine * 1e3:.3f} ms against {theirs * 1e3:.3f} ms"
    except Exception as err:  # any failure means: do not use it
        return f"failed on this device: {type(err).__name__}: {err}"
    return ""
