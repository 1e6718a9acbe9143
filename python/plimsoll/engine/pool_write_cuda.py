"""Pool writes in place as one CUDA kernel (MLX's CUDA backend only; imports mlx).

Why: an MLX array is immutable, and a scatter into a pool updates the pool's buffer in place
only when nothing else holds that buffer. MLX's CUDA backend holds every op's inputs until
the command batch that runs it has completed, and the engine builds step n + 1 while step
n runs; so a write of a layer whose read by the step before (or by an earlier group of the
same step) has not completed yet copies the layer's whole K and V arrays. Measured on an
H200 (the step trace, bench/results/trace-h200-2026-12-03e.jsonl.gz): one stream's decode
steps at 28-31k tokens held 1-4.5 GiB of such copies, in bursts, far above the transient
admission counts.

This kernel stores the new rows through the pool's own pointer and returns a one-element
token. The pool arrays keep their buffers; :meth:`~plimsoll.engine.paged.FullAttention.write`
hands the layer's readers the pools made to depend on the token (``mx.depends``, which shares
the buffers), so every read of this step runs after the write, and the write itself, encoded
after every read of the steps and groups before it, runs after them: the engine's one stream
runs its ops in the order they are encoded.

Used only after :func:`check` passed on this device at engine start (random rows written
into scattered slots of a pool, read back, must equal the scatter's result bit for bit),
and not for compiled decode
steps (their writes are scatters of the traced function's inputs).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from plimsoll.engine import backend

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


def available() -> bool:
    return backend.name() == "cuda"


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="plimsoll_pool_write", input_names=["pool", "rows", "slots"],
                               output_names=["done"], source=_WRITE)


def write(pool: mx.array, rows: mx.array, slots: mx.array) -> mx.array:
    """Store ``rows`` (heads, n, dim) at ``slots`` (n,) of ``pool`` (heads, slots, dim) in
    place; returns the token a read of the written pool must depend on."""
    heads, n, dim = rows.shape
    threads = -(-heads * n * dim // _THREADS) * _THREADS
    return _kernel()(inputs=[pool, rows.astype(pool.dtype), slots.astype(mx.int32)],
                     template=[("T", pool.dtype), ("D", dim)], grid=(max(threads, _THREADS), 1, 1),
                     threadgroup=(_THREADS, 1, 1), output_shapes=[(1,)],
                     output_dtypes=[mx.int32])[0]


def check(dtype: mx.Dtype, kv_heads: int, dim: int) -> str:
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
