"""MLX CUDA's TF32 float32 matmuls, emulated on the CPU (for bench/conformance_margin.py).

MLX's CUDA backend multiplies float32 matrices of two or more rows on cuBLAS with TF32
inputs (10-bit mantissa) unless ``MLX_ENABLE_TF32=0``; a product of one row (batches
collapsed where the weight is shared) runs on its exact ``gemv``. So a batched decode step's
projections round their inputs where mlx-lm's one-sequence decode does not. :func:`install`
makes this process's float32 products do the same: ``@``, ``mx.matmul`` and ``mx.addmm`` of
two or more rows, ``mx.gather_mm`` with sorted indices (CUDA's grouped GEMM), and the
attention of two or more queries (CUDA's unfused float32 attention: two products, sinks and
masks as MLX applies them). What it cannot show is anything else a GPU does differently
(its kernels' reduction orders, the engine's custom kernels).
"""

from __future__ import annotations

import mlx.core as mx

#: how many products took each path since :func:`install` (a run reports it)
COUNTS: dict[str, int] = {"tf32": 0, "exact": 0}


def tf32(x: mx.array) -> mx.array:
    """``x`` rounded to TF32 (float32 with a 10-bit mantissa, to nearest); other dtypes as
    they are."""
    if x.dtype != mx.float32:
        return x
    bits = x.view(mx.uint32)
    bits = (bits + mx.array(0x1000, mx.uint32)) & mx.array(0xFFFFE000, mx.uint32)
    return bits.view(mx.float32)


def rows(a: mx.array, b: mx.array) -> int:
    """The rows of ``a @ b`` as MLX's CUDA matmul counts them: a weight shared by every
    batch folds the batches into the rows."""
    if a.ndim < 2:
        return 1
    if b.ndim <= 2 or all(d == 1 for d in b.shape[:-2]):
        n = 1
        for d in a.shape[:-1]:
            n *= d
        return n
    return a.shape[-2]


def install() -> None:
    """Patch this process's float32 products (idempotent; for a bench process only)."""
    if getattr(mx, "_plimsoll_tf32", False):
        return
    mm, addmm, gather = mx.array.__matmul__, mx.addmm, mx.gather_mm
    attention = mx.fast.scaled_dot_product_attention

    def counted(path: str) -> None:
        COUNTS[path] = COUNTS.get(path, 0) + 1

    def matmul(a, b):
        if rows(a, b) >= 2:
            counted("tf32")
            return mm(tf32(a), tf32(b))
        counted("exact")
        return mm(a, b)

    def addmm_(c, a, b, *args, **kw):
        return addmm(c, *((tf32(a), tf32(b)) if rows(a, b) >= 2 else (a, b)), *args, **kw)

    def gather_mm(a, b, *args, **kw):
        if kw.get("sorted_indices"):
            return gather(tf32(a), tf32(b), *args, **kw)
        return gather(a, b, *args, **kw)

    def sdpa(q, k, v, scale, mask=None, sinks=None, **kw):
        if q.dtype != mx.float32 or q.shape[2] < 2:
            return attention(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
        counted("attention")
        b, hq, n, d = q.shape
        hk, s = k.shape[1], k.shape[2]
        rep = hq // hk
        scores = mm(tf32((q * scale).reshape(b, hk, rep, n, d)),
                    tf32(k[:, :, None].swapaxes(-1, -2)))
        if isinstance(mask, str):  # "causal", aligned bottom-right
            seen = mx.arange(s - n, s)[:, None] >= mx.arange(s)[None, :]
            scores = mx.where(seen, scores, mx.array(-mx.inf, scores.dtype))
        elif mask is not None:
            m = (mx.broadcast_to(mask, (b, hq, n, s)).reshape(b, hk, rep, n, s)
                 if mask.ndim == 4 else mask)
            scores = (mx.where(m, scores, mx.array(-mx.inf, scores.dtype))
                      if m.dtype == mx.bool_ else scores + m)
        if sinks is not None:
            sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, hk, rep, 1, 1),
                                   (b, hk, rep, n, 1))
            p = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)[..., 1:]
        else:
            p = mx.softmax(scores, axis=-1, precise=True)
        return mm(tf32(p), tf32(v[:, :, None])).reshape(b, hq, n, -1)

    mx.array.__matmul__ = matmul
    mx.matmul, mx.addmm, mx.gather_mm = matmul, addmm_, gather_mm
    mx.fast.scaled_dot_product_attention = sdpa
    mx._plimsoll_tf32 = True
