"""Sliding-window layers (mlx-lm ``RotatingKVCache``) in the block-paged engine (imports mlx).

**The design**: a window layer's K/V live in a bounded per-sequence *ring* of exactly
``window`` slots, not in the shared block pool. Every window layer owns one ring region
shaped ``(kv_heads, rows × window, dim)`` (a :class:`~plimsoll.engine.paged.FullAttention`
whose "block" is one ring of ``window`` tokens); a running sequence holds one row of it, the
same row in every window layer (:class:`Rings`), and the token at position ``p`` lives in
slot ``row × window + p % window``. So:

- memory for window layers is ``window`` tokens a sequence, whatever its length — exactly
  what model facts count as ``per_sequence_fixed_bytes`` (``RotatingKVCache`` at its cap),
  so admission (one sizing home, :mod:`plimsoll.core.sizing`) charges it as fixed blocks per
  live sequence, the way it charges recurrent state;
- prefix reuse goes through the hybrid machinery that already exists: the engine reports
  the rings in ``state_bytes_per_seq``, so the worker's pool runs *hybrid*, prompt chunks end
  on blocks, and a ring is snapshotted (copied, so no view pins the region) at block
  boundaries exactly like recurrent state; a later prompt maps the full-attention blocks up
  to a snapshot and the ring is restored from it. Each snapshot is charged
  ``fixed_blocks_per_seq`` under the cache cap, as recurrent state's are;
- full-attention layers of the same model stay in the shared block pool, unchanged.

Why a ring, not a separate block group for window layers (vLLM's way): a block group needs
a second table per sequence in the pure pool and the scheduler, and a prefix hit then needs
the window group's last blocks before the hit to be still cached — a second eviction
policy. The ring needs no change to the pool, the scheduler or
admission (which already counted windows at their cap), costs ``window`` tokens a live
sequence (the same as mlx-lm's ``RotatingKVCache`` once it has wrapped) and one decode
gather of ``rows × window`` per window layer — bounded, unlike a full layer's gather.
What it gives up: snapshots are whole-window copies (vLLM shares the window blocks).

**Attention.** A query at position ``q`` sees the keys at ``(q − window, q]`` (mlx-lm's
``create_attention_mask(..., window_size=window)`` / ``RotatingKVCache``), sinks kept:

- a one-token forward (a decode row, a prefill's sampled last token) writes its K/V into
  its ring slot first (overwriting position ``q − window``, now outside the window) and
  attends over its ring: every slot written holds a position inside the window; rows of a
  batch that have not wrapped yet mask the slots past their length. Order inside a ring
  does not matter (rope is applied before caching; sinks are per head, not positional);
- a prompt chunk of ``L`` tokens at ``start`` reads the ring's last ``min(start,
  window − 1)`` positions (a gather, before the chunk's write), attends over them plus its
  own fresh K/V with a banded causal mask, then writes its last ``min(L, window)`` tokens.

Not served here: ``keep > 0`` (a ring that never evicts its first tokens; no family in
mlx-lm 0.32 passes it) and llama4's ``ChunkedKVCache`` (refused by the capability table).
"""

from __future__ import annotations

import heapq

import mlx.core as mx
import numpy as np

from plimsoll.engine.attention import Batch, PagedView
from plimsoll.engine.paged import FullAttention, Read, read_of, write_of


class WindowAttention:
    """The rings of one sliding-window layer: ``size`` slots a sequence, the window or, when
    the engine's context is shorter, the context (a ring that never wraps)."""

    kind = "window"
    table_kind = "window"
    plain_kv = False
    block_bytes = 0  # nothing in the shared block pool

    def __init__(self, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype, window: int,
                 max_rows: int, slab_rows: int, size: int | None = None):
        self.window = window
        self.size = min(window, size) if size else window
        self.ring = FullAttention(kv_heads, k_dim, v_dim, dtype, self.size, max_rows,
                                  slab_rows)

    @property
    def bytes_per_seq(self) -> int:
        """One sequence's ring (K and V): what facts count for this layer at its cap."""
        return self.ring.block_bytes

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def arrays(self) -> list[mx.array]:
        return [] if self.ring.keys is None else [self.ring.keys, self.ring.values]

    def copy_row(self, row: int) -> tuple[mx.array, mx.array]:
        """A copy of ``row``'s ring (a gather: a new buffer, never a view of the region)."""
        w = self.size
        idx = mx.arange(row * w, (row + 1) * w, dtype=mx.int32)
        return mx.take(self.ring.keys, idx, axis=1), mx.take(self.ring.values, idx, axis=1)

    def put_row(self, row: int, kv: tuple[mx.array, mx.array]) -> None:
        self.ring.ensure(row)
        w = self.size
        self.ring.keys[:, row * w:(row + 1) * w] = kv[0]
        self.ring.values[:, row * w:(row + 1) * w] = kv[1]


class Rings:
    """Which ring row each sequence holds (one row id for every window layer), and the
    ring snapshots (per key, one (K, V) copy per window layer)."""

    def __init__(self, layers: list[WindowAttention]):
        self.layers = layers
        self._rows: dict[int, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._snapshots: dict[object, list[tuple[mx.array, mx.array]]] = {}

    def __bool__(self) -> bool:
        return bool(self.layers)

    @property
    def bytes_per_seq(self) -> int:
        return sum(k.bytes_per_seq for k in self.layers)

    def row(self, seq_id: int) -> int:
        """``seq_id``'s row, taken (lowest free first) on its first write."""
        row = self._rows.get(seq_id)
        if row is None:
            if self._free:
                row = heapq.heappop(self._free)
            else:
                row, self._next = self._next, self._next + 1
            self._rows[seq_id] = row
            for k in self.layers:
                k.ring.ensure(row)
        return row

    def free(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            heapq.heappush(self._free, row)

    def live(self) -> int:
        return len(self._rows)

    def snapshot(self, seq_id: int, key) -> list[mx.array]:
        """Copy ``seq_id``'s rings as ``key`` (a sequence with none yet: empty rings)."""
        row = self._rows.get(seq_id)
        if row is None:
            snap = [(mx.zeros((k.ring.kv_heads, k.size, k.ring.k_dim), k.ring.dtype),
                     mx.zeros((k.ring.kv_heads, k.size, k.ring.v_dim), k.ring.dtype))
                    for k in self.layers]
        else:
            snap = [k.copy_row(row) for k in self.layers]
        self._snapshots[key] = snap
        return [a for kv in snap for a in kv]

    def restore(self, key, seq_id: int) -> None:
        row = self.row(seq_id)
        for k, kv in zip(self.layers, self._snapshots[key], strict=True):
            k.put_row(row, kv)

    def drop(self, key) -> None:
        self._snapshots.pop(key, None)

    def nbytes(self) -> int:
        """Every ring region allocated plus every snapshot held."""
        return (sum(k.nbytes for k in self.layers)
                + sum(a.nbytes for snap in self._snapshots.values() for kv in snap for a in kv))

    def arrays(self) -> list[mx.array]:
        return [a for k in self.layers for a in k.arrays()]

    def batch(self, seq_ids: list[int], starts: list[int], length: int) -> WindowBatch:
        return WindowBatch([self.row(s) for s in seq_ids], starts, length)


class WindowBatch:
    """What every window layer of one forward shares: rows, positions, and per (window, ring
    size) the write slots, the read and the mask (built once, on first use)."""

    def __init__(self, rows: list[int], starts: list[int], length: int):
        if length > 1 and len(rows) != 1:
            raise ValueError("a prompt chunk is one sequence")
        self.rows, self.starts, self.length = rows, starts, length
        self._plans: dict[int, tuple] = {}

    def plan(self, window: int, size: int) -> tuple:
        plan = self._plans.get((window, size))
        if plan is None:
            if size < window and max(self.starts) + self.length > size:
                raise ValueError(f"position {max(self.starts) + self.length - 1} is past the "
                                 f"engine's context of {size} tokens")
            plan = self._plans[window, size] = (self._one_token(size) if self.length == 1
                                                else self._chunk(window, size))
        return plan

    def _one_token(self, r: int) -> tuple:
        """(write, read, mask): write the token first, then read each row's written slots
        (a ring of ``r`` slots holds positions ``(q − r, q]``, all inside the window)."""
        write = np.array([row * r + q % r for row, q in zip(self.rows, self.starts,
                                                            strict=True)], dtype=np.int32)
        held = [min(q + 1, r) for q in self.starts]
        read = read_of([(row,) for row in self.rows], held, r)
        mask = None
        if min(held) != max(held):
            m = np.arange(max(held))[None, :] < np.array(held)[:, None]
            mask = mx.array(m)[:, None, None, :]
        return write_of(write), read, mask

    def _chunk(self, w: int, r: int) -> tuple:
        """(write, old slots, tail, mask) of one prompt chunk (see the module docstring)."""
        (row,), (s,), n = self.rows, self.starts, self.length
        old_pos = np.arange(max(0, s - w + 1), s)
        old = None if old_pos.size == 0 else mx.array((row * r + old_pos % r).astype(np.int32))
        tail = min(n, r)
        new_pos = np.arange(s + n - tail, s + n)
        write = write_of((row * r + new_pos % r).astype(np.int32))
        q = np.arange(s, s + n)[:, None]
        keys = np.concatenate([old_pos, np.arange(s, s + n)])[None, :]
        banded = old_pos.size > 0 or n > w  # else every chunk key is inside the window
        mask = mx.array((keys <= q) & (q - keys < w)) if banded else "causal"
        return write, old, n - tail, mask


class WindowView(PagedView):
    """One window layer's cache for one forward (mlx-lm's cache protocol)."""

    def __init__(self, kind: WindowAttention, batch: Batch, wbatch: WindowBatch):
        super().__init__(kind.ring, batch)
        self.kind, self.wbatch = kind, wbatch
        self._old: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        plan = self.wbatch.plan(self.kind.window, self.kind.size)
        ring = self.kind.ring
        if self.wbatch.length == 1:
            ring.write(plan[0], keys, values)
        else:
            write, old, cut, _ = plan
            if old is not None:  # read before this chunk's write overwrites them
                self._old = (mx.take(ring.keys, old, axis=1)[None],
                             mx.take(ring.values, old, axis=1)[None])
                ring.fence(list(self._old))
            ring.write(write, keys[:, :, cut:], values[:, :, cut:])
            keys, values = ring.tied(keys, values)
        self._fresh = (keys, values)
        return keys, values

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        self.batch.attended += 1
        plan = self.wbatch.plan(self.kind.window, self.kind.size)
        fresh, old, self._fresh, self._old = self._fresh, self._old, None, None  # see PagedView
        if self.wbatch.length == 1:
            _, read, mask = plan
            keys, values = self.kind.ring.gather(read)
        else:
            mask = plan[3]
            keys, values = fresh
            if old is not None:
                ok, ov = old
                keys = mx.concatenate([ok.astype(keys.dtype), keys], axis=2)
                values = mx.concatenate([ov.astype(values.dtype), values], axis=2)
        if keys.dtype != queries.dtype:
            keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask, sinks=sinks)


def window_kind(cache, dtype: mx.Dtype, max_rows: int, slab_rows: int,
                context: int | None = None) -> WindowAttention:
    """The kind of one probed ``RotatingKVCache`` (after a one-token forward); its rings hold
    ``min(window, context)`` slots."""
    if cache.keep:
        raise NotImplementedError(
            f"RotatingKVCache(keep={cache.keep}) keeps its first tokens forever; the paged "
            "engine serves sliding windows with keep=0 only")
    _, heads, _, k_dim = cache.keys.shape
    return WindowAttention(heads, k_dim, cache.values.shape[3], dtype, cache.max_size,
                           max_rows, slab_rows, context)


__all__ = ["Read", "Rings", "WindowAttention", "WindowBatch", "WindowView", "window_kind"]
