"""A model's linear layers at 2-8 rows as one bandwidth-bound CUDA kernel (imports mlx).

Why: a step of a few rows (a sequence verifying 3 drafts is 4 rows, 8 streams decoding are
8) reads every weight once, so it should cost what one row costs. On an H200 (MLX CUDA
0.32.4, the Qwen3-4B-shaped bf16 model, bench/results/gpu-step-h200-2026-12-04.md) every
linear layer of the model plus the lm head took 2.94 ms at 1 row (MLX's matrix-vector
kernel, ~2.7 TB/s) but 6.9-7.3 ms at 2 to 32 rows (cuBLAS): 4 ms more a step for every
verifying step and every batch of a few streams.

:func:`skinny` computes ``x @ w.T`` for ``x`` (m, k), 2 ≤ m ≤ :data:`MAX_ROWS`, ``w``
(n, k) in bf16 or f16, ``k`` a multiple of 8: one warp per 2 or 4 rows of ``w``
(:func:`layout`), its lanes reading 16 bytes of each row at a time (a warp reads 512
consecutive bytes; loaded streaming, so that ``x`` stays in L1) and every one of the ``m``
rows of ``x`` at the same columns, accumulating in float32 registers, then a warp
reduction. Each weight byte is read once, whatever ``m``.

Measured, a first version (a warp's rows in a loop with an early exit, so its accumulators
were not all registers; 4-warp blocks; no unrolling): the model's linear layers at 2 / 4 /
8 rows 4.65 / 6.06 / 7.17 ms against cuBLAS's 6.30 / 7.44 / 8.32 in the same run
(bench/results/gpu-step-skinny-h200-2026-12-04.md) — faster, still ~2× one row, so bound
by latency rather than bandwidth. This version (every fixed loop unrolled, two iterations'
loads in flight, streaming weight loads, 8-warp blocks for tall weights): 4.59 / 4.68 / 6.08
ms against cuBLAS's 7.71 / 8.08 / 7.24 and one row's 3.10 in the same run
(bench/results/gpu-step-skinny2-h200-2026-12-04.md): 4 rows at 1.5 × one row. Its check
decides, shape by shape, whether it is used.

:func:`install` puts it under a model's ``nn.Linear`` layers (and a tied embedding's
``as_linear``, the lm head) by giving those modules a subclass whose call takes the kernel
for 2-8 rows of a matching dtype and the layer's own path otherwise; only after
:func:`plimsoll.engine.kernels.check_skinny` found it equal to ``x @ w.T`` within the
dtype's tolerance and not slower on the model's own weights, shape by shape, on this device
(the verdict goes to the status's ``kernels`` with the other kernels').
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from plimsoll.engine.linear import HeldEmbedding, HeldLinear, modules, plain

NAME = "skinny_matmul_cuda"
MAX_ROWS = 8  # rows of x the kernel takes (its accumulators are registers)
ROWS_PER_WARP = 2
WIDE = 8192  # rows of w from which blocks are 8 warps and, past 4 rows of x, a warp takes 4
WARPS = 4
CHECK_ROWS = (2, 4, 8)  # the row counts its check times (it compares every count it takes)
DTYPES = (mx.bfloat16, mx.float16)

_SOURCE = r"""
    constexpr int V = 8;  // 2-byte elements per 16-byte load
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int N = w_shape[0], K = w_shape[1];
    const int n0 = (blockIdx.x * WARPS + warp) * R;
    if (n0 >= N) return;
    const T* wr[R];  // a last warp's rows past N read row N - 1 again and store nothing
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + (size_t)min(n0 + r, N - 1) * K;
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#pragma unroll 2
    for (int k = lane * V; k < K; k += 32 * V) {
        uint4 wu[R];  // the weights stream through once: not kept in L1, x is
#pragma unroll
        for (int r = 0; r < R; ++r) wu[r] = __ldcs(reinterpret_cast<const uint4*>(wr[r] + k));
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4 xu = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K + k));
            const T* xe = reinterpret_cast<const T*>(&xu);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const T* we = reinterpret_cast<const T*>(&wu[r]);
#pragma unroll
                for (int i = 0; i < V; ++i)
                    acc[m][r] += static_cast<float>(xe[i]) * static_cast<float>(we[i]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                acc[m][r] += __shfl_xor_sync(0xffffffff, acc[m][r], o);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (n0 + r < N) {
#pragma unroll
                for (int m = 0; m < M; ++m)
                    out[(size_t)m * N + n0 + r] = static_cast<T>(acc[m][r]);
            }
        }
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="plimsoll_skinny_matmul", input_names=["x", "w"],
                               output_names=["out"], source=_SOURCE)


def takes(rows: int, x: mx.array, w: mx.array) -> bool:
    """Whether :func:`skinny` computes ``x @ w.T`` for ``rows`` rows of ``x`` (pure)."""
    return (2 <= rows <= MAX_ROWS and x.dtype == w.dtype and x.dtype in DTYPES
            and w.ndim == 2 and x.shape[-1] == w.shape[1] and w.shape[1] % 8 == 0)


def layout(m: int, n: int) -> tuple[int, int]:
    """(rows of ``w`` a warp takes, warps a block) for ``m`` rows of ``x`` over ``n`` rows of
    ``w`` (pure): a tall ``w`` gets 8-warp blocks and, at more than 4 rows of ``x``, 4 rows
    a warp (fewer reads of ``x`` per weight byte); a short one 2 rows a warp in 4-warp blocks,
    so that it still gives every SM blocks."""
    if n >= WIDE:
        return (4 if m > 4 else ROWS_PER_WARP), 8
    return ROWS_PER_WARP, WARPS


def skinny(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for ``x`` (m, k), ``w`` (n, k) as :func:`takes` allows: (m, n)."""
    m, n = x.shape[0], w.shape[0]
    r, warps = layout(m, n)
    blocks = -(-n // (r * warps))
    return _kernel()(inputs=[x, w], template=[("T", x.dtype), ("M", m), ("R", r),
                                              ("WARPS", warps)],
                     grid=(blocks * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                     output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]


def _through(fn: Callable[[mx.array, mx.array], mx.array], x: mx.array, w: mx.array):
    """``x @ w.T`` through ``fn`` where it takes it, else None."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if not takes(rows, x, w):
        return None
    return fn(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


class SkinnyLinear(HeldLinear):
    """An ``nn.Linear`` whose call of 2-8 rows goes through :attr:`matmul` (other calls
    through its held view: :mod:`plimsoll.engine.linear`)."""

    matmul: Callable[[mx.array, mx.array], mx.array] = staticmethod(skinny)

    def __call__(self, x: mx.array) -> mx.array:
        out = _through(self.matmul, x, self["weight"])
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class SkinnyEmbedding(HeldEmbedding):
    """An ``nn.Embedding`` whose ``as_linear`` (a tied lm head) of 2-8 rows goes through
    :attr:`matmul`."""

    matmul: Callable[[mx.array, mx.array], mx.array] = staticmethod(skinny)

    def as_linear(self, x: mx.array) -> mx.array:
        out = _through(self.matmul, x, self.weight)
        return super().as_linear(x) if out is None else out


def shape_key(w: mx.array) -> tuple:
    """A weight's ``(n, k, dtype)``: what the check decides on and :func:`install` matches."""
    return (*w.shape, w.dtype)


def install(model, matmul: Callable[[mx.array, mx.array], mx.array] = skinny,
            shapes: set[tuple] | None = None) -> int:
    """Give every plain ``nn.Linear`` and ``nn.Embedding`` of ``model`` (those whose weight's
    ``(n, k, dtype)`` is in ``shapes``, if given) the subclass that takes 2-8 rows through
    ``matmul`` (the weights stay the module's own); how many."""
    swapped = 0
    for module in modules(model):
        for kind, skinny_type in ((nn.Linear, SkinnyLinear), (nn.Embedding, SkinnyEmbedding)):
            if plain(module, kind) and (shapes is None or shape_key(module.weight) in shapes):
                module.__class__ = skinny_type
                if matmul is not skinny:
                    module.matmul = matmul
                swapped += 1
    return swapped


def weights(model) -> list[mx.array]:
    """One weight of every distinct (shape, dtype) among ``model``'s plain linear layers and
    embeddings that the kernel could take."""
    seen: dict[tuple, mx.array] = {}
    for m in modules(model):
        w = m.get("weight") if plain(m, nn.Linear) or plain(m, nn.Embedding) else None
        if w is not None and w.ndim == 2 and w.dtype in DTYPES and w.shape[1] % 8 == 0:
            seen.setdefault(shape_key(w), w)
    return list(seen.values())
