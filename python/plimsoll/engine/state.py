"""Per-sequence recurrent state of hybrid models (mlx-lm ``ArraysCache``; imports mlx).

A sequence's state is, per state layer, the list of that cache's entries (any slot
count; ``None`` before the first write). A prefill runs against an ``ArraysCache``
holding the sequence's own entries; a batched decode stacks every row's entries into
one ``ArraysCache`` (a transient of ``rows × state_bytes_per_seq``), and the results are
split back as row views of the stacked arrays (they replace the old per-row arrays, so
what is held stays one state per sequence). Snapshots are copies (``mx.array``), never
views, so a snapshot does not pin a stacked batch buffer and a live sequence does not
pin a snapshot.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

Entries = list  # list[mx.array | None], one per slot of the layer's ArraysCache


def fresh(slots: int) -> Entries:
    return [None] * slots


def cache_of(entries: Entries) -> ArraysCache:
    c = ArraysCache(size=len(entries))
    c.cache = list(entries)
    return c


def stack(rows: list[Entries]) -> ArraysCache:
    """One ``ArraysCache`` for a decode batch: every slot concatenated over the rows."""
    slots = len(rows[0])
    c = ArraysCache(size=slots)
    for e in range(slots):
        arrays = [r[e] for r in rows]
        like = next((a for a in arrays if a is not None), None)
        if like is None:
            continue
        arrays = [mx.zeros(like.shape, like.dtype) if a is None else a for a in arrays]
        c.cache[e] = arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)
    return c


def split(c: ArraysCache, rows: int) -> list[Entries]:
    """Row ``i``'s entries of a stacked cache (views)."""
    if rows == 1:
        return [list(c.cache)]
    return [[None if a is None else a[i:i + 1] for a in c.cache] for i in range(rows)]


def copy(entries_per_layer: list[Entries]) -> list[Entries]:
    """A copy that shares no buffer with its source."""
    return [[None if a is None else mx.array(a) for a in layer] for layer in entries_per_layer]


def nbytes(entries_per_layer: list[Entries]) -> int:
    return sum(a.nbytes for layer in entries_per_layer for a in layer if a is not None)


def arrays(entries_per_layer: list[Entries]) -> list[mx.array]:
    return [a for layer in entries_per_layer for a in layer if a is not None]
