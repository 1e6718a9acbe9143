"""Prompt lookup on the device: a speculating sequence's next step drafted from the step in
flight, so verifying steps pipeline as plain decodes do (imports mlx).

A verifying step's outcome (how many drafts it accepts, the target's token after them) is
known on the device long before the host reads it. Drafted on the host, the next step of
the sequence waits for that read: host work and device work in series, every step. Here a
verifying :class:`~plimsoll.engine.work.Work` with ``lookup`` = n > 0 leaves its *chain* on
the device — where the sequence's next token goes, that token, and the sequence's tokens so
far — and the sequence's next Work may be *chained* (``tokens`` None, ``draft`` = k): its
input is that token, then k drafts found by :func:`drafts` (the host's
:func:`plimsoll.worker.ngram.prompt_lookup` rule as array ops over the history), at the
position the chain says. The host plans it before reading the step before (its ``start`` is
the highest that position can be: its table covers it) and learns its drafts with its
verdicts (:class:`~plimsoll.engine.pending.Pending`).

Batched: the chains are one ``(rows, cap)`` history, one start and one token per row, for
the verifying lookup Works of the last step, in their order; a step with the same sequences
(the steady state) drafts, reads and advances all of them in a fixed number of ops, not a
number per sequence (on a GPU each op is a kernel launch). A sequence whose Work in a step
is anything else loses its chain, as does one that ends. A draft the rule does not find is
-1: never accepted (the model reads token 0 there). Histories are int32, ``cap`` grown in
:data:`HISTORY_ROUND`-token steps (16 KiB a row per 4k tokens).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from plimsoll.engine import verify
from plimsoll.engine.work import Work

HISTORY_ROUND = 4096  # the histories' width grows in steps of this many tokens


def drafts(history: mx.array, length: mx.array, longest: int, k: int) -> mx.array:
    """Up to ``k`` drafts after each row's ``history[:length]`` by prompt lookup, (rows, k)
    int32, -1 where none: for the largest ``n <= longest`` whose last ``n`` tokens occur
    earlier, the most recent occurrence with ``k`` tokens after it, else the most recent;
    the tokens that followed it (those past ``length`` are -1). ``history``: (rows, cap)
    int32, anything past ``length``; ``length``: (rows,) int32. The host rule's result by
    construction (tested against it), in ~25 ops whatever the rows (``longest`` = 3)."""
    rows, cap = history.shape
    pad = mx.concatenate([history, mx.full((rows, longest + k), -1, dtype=mx.int32)], axis=1)
    m = mx.arange(longest, dtype=mx.int32)
    # tail[r, m]: the token m + 1 places before the end; eq[r, m, i]: pad[r, i] is that token
    tail = mx.take_along_axis(pad, mx.maximum(length[:, None] - 1 - m[None], 0), axis=1)
    eq = pad[:, None, :] == tail[:, :, None]
    # the n-gram at i matches where the token at i + j is the one n - 1 - j places back
    grams = []
    for n in range(1, longest + 1):
        hit = eq[:, n - 1, :cap]
        for j in range(1, n):
            hit = hit & eq[:, n - 1 - j, j:j + cap]
        grams.append(hit)
    match = mx.stack(grams, axis=1)  # (rows, n, cap)
    n = m + 1
    at = mx.arange(cap, dtype=mx.int32)[None, None]  # (1, 1, cap); match: (rows, n, cap)
    end = length[:, None, None]
    match = match & (at + n[None, :, None] < end)  # starts strictly before the tail
    whole = mx.max(mx.where(match & (at + n[None, :, None] + k <= end), at, -1), axis=2)
    last = mx.where(whole >= 0, whole, mx.max(mx.where(match, at, -1), axis=2))  # (rows, n)
    found = (last >= 0) & (length[:, None] - 1 >= n[None])
    best_n = mx.max(mx.where(found, n[None], 0), axis=1)  # the longest n that occurs
    best = mx.take_along_axis(last, mx.maximum(best_n - 1, 0)[:, None], axis=1)[:, 0]
    pos = best[:, None] + best_n[:, None] + mx.arange(k, dtype=mx.int32)[None]
    out = mx.take_along_axis(pad, mx.clip(pos, 0, cap + longest + k - 1), axis=1)
    ok = (best_n[:, None] > 0) & (pos < length[:, None])
    return mx.where(ok, out, -1).astype(mx.int32)


def _room(tokens: int) -> int:
    return -(-tokens // HISTORY_ROUND) * HISTORY_ROUND


class Chains:
    """The engine's chains (see the module docstring): one row per sequence id."""

    def __init__(self) -> None:
        self._ids: tuple[int, ...] = ()
        self._start = self._token = self._history = None  # (rows,) (rows,) (rows, cap)
        #: this step's chained Works: their ids, longest draft, and drafts with a -1 column
        self._step: tuple[tuple[int, ...], int, mx.array] | None = None
        #: each chain's highest reachable start, kept on the host from what the engine
        #: itself knows (never from a chained Work's own ``start``, which its caller may have
        #: planned before a step it then read): the Work that began it's start + drafts + 1,
        #: plus drafts + 1 for every chained Work, less the drafts each step read rejected.
        #: A chained Work names at least this ``start`` (the history's width, the tables'
        #: reach and the reads follow it), never less
        self._reach: dict[int, int] = {}

    @property
    def held(self) -> bool:
        return bool(self._ids)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._ids

    def reach(self, seq_id: int) -> int:
        """The highest position sequence ``seq_id``'s chain can start its next Work at."""
        return self._reach[seq_id]

    def settled(self, seq_id: int, rejected: int) -> None:
        """A step of ``seq_id``'s chain was read: ``rejected`` of its drafts were not taken."""
        if seq_id in self._reach:
            self._reach[seq_id] -= rejected

    def drop(self, seq_id: int) -> None:
        if seq_id in self._ids:
            self._select(tuple(s for s in self._ids if s != seq_id))

    def nbytes(self) -> int:
        return 0 if self._history is None else self._history.nbytes

    def _select(self, ids: tuple[int, ...]) -> None:
        """Keep the rows of ``ids`` (all held), in that order."""
        if ids == self._ids:
            return
        self._reach = {s: self._reach[s] for s in ids if s in self._reach}
        if not ids:
            self._ids, self._start, self._token, self._history = (), None, None, None
            return
        idx = mx.array([self._ids.index(s) for s in ids], dtype=mx.int32)
        self._start, self._token = self._start[idx], self._token[idx]
        self._history, self._ids = self._history[idx], ids

    def _widen(self, history: mx.array, need: int) -> mx.array:
        if history.shape[1] >= need:
            return history
        more = mx.zeros((history.shape[0], _room(need) - history.shape[1]), dtype=mx.int32)
        return mx.concatenate([history, more], axis=1)

    def inputs(self, works: tuple[Work, ...]) -> tuple[mx.array, mx.array]:
        """The chained ``works``' rows (each Work's ``draft + 1``, in order): their input
        tokens (uint32: the chain's token, then its drafts, 0 for a -1) and positions
        (int32), lazy. Their drafts stay for :meth:`drafts` and :meth:`advance`. One lookup
        serves every row, at the step's longest draft: a Work of fewer drafts takes the
        first of them (its occurrence chosen for that length: drafts, never outputs)."""
        ids = tuple(w.seq_id for w in works)
        self._select(ids)
        k = max(w.draft for w in works)
        self._history = self._widen(self._history, max(w.start + w.draft + 2 for w in works))
        found = drafts(self._history, self._start + 1, works[0].lookup, k)
        self._step = (ids, k, mx.concatenate([found, mx.full((len(ids), 1), -1, mx.int32)],
                                             axis=1))
        tokens = mx.concatenate([self._token[:, None], mx.maximum(found, 0)], axis=1)
        positions = self._start[:, None] + mx.arange(k + 1, dtype=mx.int32)[None]
        flat = mx.array(np.concatenate([j * (k + 1) + np.arange(w.draft + 1)
                                        for j, w in enumerate(works)]).astype(np.int32))
        return (mx.take(tokens.reshape(-1), flat).astype(mx.uint32),
                mx.take(positions.reshape(-1), flat))

    def drafts(self, works: tuple[Work, ...]) -> mx.array:
        """The drafts every row of the verifying ``works`` judges, (rows,) int32: each
        Work's drafts (a chained one's as found on the device, -1 where none, never
        accepted), then -1 at its last row."""
        named = tuple(w for w in works if not w.chained)
        host = verify.named_drafts(named) if named else mx.zeros((0,), mx.int32)
        if len(named) == len(works):
            return host
        ids, k, found = self._step
        src, order, at = host.shape[0], [], 0  # indices into host + found (flattened)
        for w in works:
            if w.chained:
                j = ids.index(w.seq_id)
                order += [src + j * (k + 1) + i for i in range(w.draft)] + [src + j * (k + 1) + k]
            else:
                order += list(range(at, at + w.draft + 1))
                at += w.draft + 1
        both = mx.concatenate([host, found.reshape(-1)])
        return mx.take(both, mx.array(np.asarray(order, dtype=np.int32)))

    def advance(self, works: tuple[Work, ...], checks: mx.array, drafted: mx.array
                ) -> list[mx.array]:
        """The step's verifying ``works`` were checked (``checks``: (rows, 2) verdicts and
        tokens, :func:`plimsoll.engine.verify.check`; ``drafted``: :meth:`drafts`): the
        chains become those of its Works that draft by lookup, each moved past what it
        accepted (a chained one's from its chain, one that begins a chain from the history
        the host named). Returns the new arrays (to be queued with the step)."""
        rows, kept, new, row = [], [], [], 0
        for w in works:
            if w.lookup:
                rows.append((w, row))
                (kept if w.chained else new).append(w)
            row += w.draft + 1
        step, self._step = self._step, None
        if not rows:
            self._select(())
            return []
        k = max(w.draft for w, _ in rows)
        cap = _room(max(w.start + w.draft + 2 for w, _ in rows))
        ids = (step[0] if kept else ()) + tuple(w.seq_id for w in new)
        parts_h, parts_s = [], []
        if kept:  # the chained Works' rows, in their order (inputs selected them)
            parts_h.append(self._widen(self._history, cap))
            parts_s.append(self._start)
        if new:
            known = np.zeros((len(new), parts_h[0].shape[1] if parts_h else cap), np.int32)
            for j, w in enumerate(new):
                known[j, :len(w.history)] = w.history
            parts_h.append(mx.array(known))
            parts_s.append(mx.array([w.start for w in new], dtype=mx.int32))
        history = mx.concatenate(parts_h) if len(parts_h) > 1 else parts_h[0]
        start = mx.concatenate(parts_s) if len(parts_s) > 1 else parts_s[0]
        by = {w.seq_id: r for w, r in rows}
        # each row's k + 1 check rows; past a Work's own, its last (verdict 0, draft -1)
        work = {w.seq_id: w for w, _ in rows}
        idx = mx.array(np.asarray([[by[s] + min(i, work[s].draft) for i in range(k + 1)]
                                   for s in ids], dtype=np.int32))
        verdict, token = checks[:, 0][idx].astype(mx.int32), checks[:, 1][idx].astype(mx.int32)
        found = mx.maximum(drafted[idx], 0)
        took = mx.sum(mx.cumprod(verdict[:, :k], axis=1), axis=1)  # drafts accepted
        token = mx.take_along_axis(token, took[:, None], axis=1)  # (rows, 1)
        # positions start + 1 .. start + k + 1 take the accepted drafts, then the token (and
        # past it the token again: those positions lie past the chain's end)
        col = mx.arange(k + 1, dtype=mx.int32)[None]
        values = mx.where(col < took[:, None], mx.concatenate([found[:, :k], token], axis=1),
                          token)
        off = mx.arange(history.shape[1], dtype=mx.int32)[None] - (start + 1)[:, None]
        inside = (off >= 0) & (off <= k)
        history = mx.where(inside, mx.take_along_axis(values, mx.clip(off, 0, k), axis=1),
                           history)
        self._ids, self._history = ids, history
        self._reach = {w.seq_id: (self._reach[w.seq_id] if w.chained else w.start)
                       + w.draft + 1 for w, _ in rows}
        self._start, self._token = start + took + 1, token[:, 0]
        return [self._start, self._token, self._history]
