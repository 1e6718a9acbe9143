"""Decode steps that store their new K/V by the decode kernel's launch, checked (imports mlx).

A decode-only step (each row one sequence's one new token) can leave out its layers' separate
pool writes where the decode kernel serves and the pools are written in place: the kernel's
:attr:`~plimsoll.engine.kernels.Kernel.decode_writing` stores each row's K/V as it reads them
(:func:`plimsoll.engine.paged_cuda.paged_decode_writing`). :func:`check_writing` decides at
engine start, on this device, whether it may: the pools and the attention must come out bit
for bit as the scatter and the kernel's plain decode leave them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from plimsoll.engine.kernels import PROBLEMS, Kernel, Verdict, _problem

WRITING_KERNEL = "paged_decode_writing_cuda"


def _written_reference(queries, k_pool, v_pool, k_new, v_new, tables, lengths, longest, scale,
                       bt, decode) -> tuple[mx.array, mx.array, mx.array]:
    """Each row's new K/V scattered into its last position's slot, then ``decode``: the
    step's write and read as the engine makes them without :attr:`Kernel.decode_writing`
    (a verifying sequence's later rows read its earlier rows' from the pool)."""
    idx, n = np.array(tables), np.array(lengths) - 1
    slots = mx.array((idx[np.arange(len(n)), n // bt] * bt + n % bt).astype(np.int32))
    k_pool, v_pool = mx.array(k_pool), mx.array(v_pool)
    k_pool[:, slots] = k_new[:, :, 0].transpose(1, 0, 2)
    v_pool[:, slots] = v_new[:, :, 0].transpose(1, 0, 2)
    out = decode(queries, k_pool, v_pool, tables, lengths, longest, scale, bt)
    return out, k_pool, v_pool


def _problems(kv_heads: int, q_heads: int, dim: int, dtype: mx.Dtype):
    """The check's problems: :data:`~plimsoll.engine.kernels.PROBLEMS`' decode rows, each
    its own sequence, then the largest with a verifying sequence in its first four rows (one
    table, consecutive lengths: each row reads the ones before it) — each with its rows' new
    K/V and (first, base)."""
    cases = [(seed, *p, 0) for seed, p in enumerate(PROBLEMS)]
    cases.append((len(PROBLEMS), *PROBLEMS[-1], 4))
    for seed, rows, lo, hi, verifying in cases:
        q, kp, vp, tables, lengths, longest, scale, bt = _problem(rows, lo, hi, kv_heads,
                                                                  q_heads, dim, dtype, seed)
        first, base = np.array(lengths) - 1, np.arange(rows)
        if verifying:
            n = np.array(lengths)
            n[:verifying] = longest - verifying + 1 + np.arange(verifying)
            t = np.array(tables)
            t[:verifying] = t[0]  # row 0's own blocks (every table covers the longest)
            first[:verifying], base[:verifying] = n[0] - 1, 0
            tables, lengths = mx.array(t), mx.array(n.astype(np.int32))
        kn, vn = (mx.random.normal((rows, kv_heads, 1, dim), key=mx.random.key(s)).astype(dtype)
                  for s in (seed + 100, seed + 200))
        yield (q, kp, vp, kn, vn, mx.array(first.astype(np.int32)),
               mx.array(base.astype(np.int32)), tables, lengths, longest, scale, bt)


def check_writing(kernel: Kernel | None, dtype: mx.Dtype, q_heads: int | None,
                  shapes: list[tuple[int, int, int]], write: Verdict) -> Verdict:
    """Whether decode-only steps store their new K/V by the decode kernel's own launch
    (:attr:`Kernel.decode_writing`) instead of :mod:`~plimsoll.engine.pool_cuda`'s write
    before it: only where that kernel is in use and the pools are written in place
    (``write``, its verdict: the launch keeps the same token protocol), and only if on this
    device, for every pool shape and :func:`_problems`' rows (plain and verifying), it
    leaves the pools and gives the attention bit for bit as the scatter and the kernel's
    plain decode do."""
    device = "cuda" if kernel is None else kernel.device
    if kernel is None or kernel.decode_writing is None:
        return Verdict(WRITING_KERNEL, device, False, "no decode kernel with a write is used")
    if not write.used:
        return Verdict(WRITING_KERNEL, device, False,
                       f"the pools are not written in place ({write.reason})")
    try:
        for kv_heads, k_dim, v_dim in shapes:
            if k_dim != v_dim:
                return Verdict(WRITING_KERNEL, device, False, "K and V widths differ")
            for q, kp, vp, kn, vn, first, base, *rest in _problems(
                    kv_heads, q_heads or kv_heads, k_dim, dtype):
                want, k_want, v_want = _written_reference(q, kp, vp, kn, vn, *rest,
                                                          kernel.decode)
                kp, vp = kp + 0, vp + 0  # buffers of their own, written in place
                mx.eval(kp, vp)
                got, token = kernel.decode_writing(q, kp, vp, kn, vn, first, base, *rest)
                k_got, v_got = mx.depends([kp, vp], [token])
                if not (mx.array_equal(got, want).item() and mx.array_equal(k_got, k_want).item()
                        and mx.array_equal(v_got, v_want).item()):
                    return Verdict(WRITING_KERNEL, device, False, "differs from the write then "
                                   "the decode: pools or attention not equal bit for bit")
    except Exception as err:  # any failure means: do not use it
        return Verdict(WRITING_KERNEL, device, False,
                       f"failed on this device: {type(err).__name__}: {err}")
    return Verdict(WRITING_KERNEL, device, True,
                   "stores and reads what the write then the decode do, in one launch")


def new_positions(g) -> tuple[mx.array, mx.array] | None:
    """(first, base) of a decode group's rows (engine/groups.Group) for a kernel that writes
    them as it reads (:attr:`~plimsoll.engine.attention.Batch.writes_in_read`): each row's
    sequence's first new position and the row that holds it. A verifying Work's rows are
    consecutive (:func:`plimsoll.engine.forward.rows_of_works`); a chained one's positions
    are on the device. None where the rows are not the works' in that way."""
    firsts: list[int] = []
    bases: list[int] = []
    nth: list[int] = []
    for w in g.works:
        n = w.draft + 1 if w.draft else 1
        firsts += [w.start] * n
        bases += [len(bases)] * n
        nth += range(n)
    if len(bases) != len(g.rows):
        return None
    base = mx.array(bases, dtype=mx.int32)
    if g.inputs is None:
        return mx.array(firsts, dtype=mx.int32), base
    return g.batch.lengths - 1 - mx.array(nth, dtype=mx.int32), base
