"""The batched decode's read of the block tables, kept from one step to the next (imports mlx).

A decode step reads positions ``0 .. length - 1`` of every row's table (:func:`.paged.read_of`).
Built from scratch every step, that is a Python copy of every row's whole table into a
numpy index and an ``mx.array`` of it — O(context) per row per step, on the thread that
also has to keep the device busy. Between two steps of the same rows a table only grows,
by one block every ``block_tokens`` tokens, so :class:`DecodeReads` keeps the index and
writes only the blocks that are new; an unchanged step reuses the same ``mx.array``.

A row whose table is not its old table extended (a caller reusing a sequence id with
another table) is rebuilt; a change of the rows (ids or order) rebuilds everything. The
highest block id in the index comes with it: every block the step reads or writes, so
the caller grows the pools once for all of them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from plimsoll.engine.paged import Read


class DecodeReads:
    """The last decode's index (rows × blocks, padded with each row's first block)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: tuple[int, ...] | None = None

    def forget(self, seq_id: int) -> None:
        """``seq_id`` ended: the next decode that names it again starts afresh."""
        if self._ids is not None and seq_id in self._ids:
            self._ids = None

    def read(self, ids: tuple[int, ...], tables: list[tuple[int, ...]],
             lengths: list[int], width: int | None = None,
             slice_ok: bool = True) -> tuple[Read, int]:
        """The Read of ``lengths`` positions of each table, and the highest block id in it;
        ``width`` (blocks, at least the longest table's): the index padded to it, never a
        slice (a compiled bucket's shape, :mod:`plimsoll.engine.compiled`). ``slice_ok``
        False: never a slice either (a decode kernel reads the pools in place through the
        index; a slice would send one row to the reference path, whose attention copies the
        strided view: measured on an H200, 2-4.5 GiB of such copies in flight at 31k)."""
        bt = self.block_tokens
        ns = [-(-n // bt) for n in lengths]
        longest = max(lengths)
        nb = max(ns) if width is None else width
        if ids != self._ids or nb > self._index.shape[1]:
            self._rebuild(ids, tables, ns, nb)
        else:
            for row, (table, n) in enumerate(zip(tables, ns, strict=True)):
                old, had = self._tables[row], self._ns[row]
                if table is old and n == had:
                    continue
                self._mx = None
                if n < had or table[:had] != old[:had]:  # not an extension: this row afresh
                    self._fill(row, table, n)
                    continue
                new = table[had:n]
                self._index[row, had:n] = new
                self._top = max(self._top, *new) if new else self._top
                if row == 0 and self._run and new:
                    self._run = all(b == table[0] + had + i for i, b in enumerate(new))
                self._tables[row], self._ns[row] = table, n
        if len(ids) == 1 and self._run and width is None and slice_ok:  # one run: a slice
            lo = self._index[0, 0].item() * bt
            return Read(span=(lo, lo + longest)), self._top
        if self._mx is None or self._mx_nb != nb:
            self._mx, self._mx_nb = mx.array(np.ascontiguousarray(self._index[:, :nb])), nb
        return Read(index=self._mx, length=longest), self._top

    def _rebuild(self, ids, tables, ns, nb) -> None:
        self._ids = ids
        self._index = np.empty((len(ids), nb + 64), dtype=np.int32)  # room to grow
        self._tables: list[tuple[int, ...]] = list(tables)
        self._ns: list[int] = list(ns)
        self._top = 0
        self._mx: mx.array | None = None
        self._mx_nb = 0
        for row, (table, n) in enumerate(zip(tables, ns, strict=True)):
            self._fill(row, table, n)

    def _fill(self, row: int, table: tuple[int, ...], n: int) -> None:
        self._index[row, :n] = table[:n]
        self._index[row, n:] = table[0]
        self._top = max(self._top, max(table[:n]))
        self._tables[row], self._ns[row] = table, n
        if row == 0:
            first = table[0]
            self._run = all(b == first + i for i, b in enumerate(table[:n]))
