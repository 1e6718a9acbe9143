"""Prompt lookup on the device: a speculating sequence's next step drafted from the step in
flight, so verifying steps pipeline as plain decodes do (imports mlx).

A verifying step's outcome (how many drafts it accepts, the target's token after them) is
known on the device long before the host reads it. Drafted on the host, the next step of
the sequence waits for that read: host work and device work in series, every step. Here a
verifying :class:`~plimsoll.engine.work.Work` with ``lookup`` = n > 0 leaves a
:class:`Chain` on the device — where the sequence's next token goes, that token, and the
sequence's tokens so far — and the sequence's next Work may be *chained* (``tokens`` None,
``draft`` = k): its input is that token, then k drafts found by :func:`drafts` (the same
n-gram rule as the host's :func:`plimsoll.worker.ngram.prompt_lookup`, as array ops over the
history), at the position the chain says. The host plans it before reading the step before
(its ``start`` is the highest that position can be: its table covers it) and learns its
drafts with its verdicts (:class:`~plimsoll.engine.core.Pending`).

A draft the rule does not find is -1: never accepted (the model reads token 0 there). The
history lives on the device as int32, one array per chained sequence, grown in
:data:`HISTORY_ROUND`-token steps (40 KiB a 10k-token sequence); a chain is dropped when
its sequence runs any other Work or ends.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from plimsoll.engine.work import Work

HISTORY_ROUND = 4096  # a chain's history array grows in steps of this many tokens


def drafts(history: mx.array, length: mx.array, longest: int, k: int) -> mx.array:
    """Up to ``k`` drafts after ``history[:length]`` by prompt lookup, (k,) int32, -1 where
    none: for the largest ``n <= longest`` whose last ``n`` tokens occur earlier, the most
    recent occurrence with ``k`` tokens after it, else the most recent; the tokens that
    followed it (those past ``length`` are -1). ``history``: (cap,) int32, anything past
    ``length``; ``length``: a scalar int32 array. Equal to the host rule by construction
    (tested against it)."""
    cap = history.shape[0]
    pad = mx.concatenate([history, mx.full((longest + k,), -1, dtype=mx.int32)])
    at = mx.arange(cap, dtype=mx.int32)
    best, best_n = mx.array(-1, dtype=mx.int32), mx.array(0, dtype=mx.int32)
    for n in range(1, longest + 1):  # a longer n that occurs overrides a shorter one
        tail = mx.take(pad, mx.maximum(length - n + mx.arange(n, dtype=mx.int32), 0))
        match = (at + n) < length  # starts strictly before the tail
        for j in range(n):
            match = match & (pad[j:j + cap] == tail[j])
        whole = mx.max(mx.where(match & (at + n + k <= length), at, -1))
        last = mx.where(whole >= 0, whole, mx.max(mx.where(match, at, -1)))
        found = (last >= 0) & (length - 1 >= n)
        best, best_n = mx.where(found, last, best), mx.where(found, n, best_n)
    pos = best + best_n + mx.arange(k, dtype=mx.int32)
    out = mx.take(pad, mx.clip(pos, 0, cap + longest + k - 1))
    return mx.where((best >= 0) & (pos < length), out, -1).astype(mx.int32)


def _room(tokens: int) -> int:
    return -(-tokens // HISTORY_ROUND) * HISTORY_ROUND


def _grown(history: mx.array, need: int) -> mx.array:
    if history.shape[0] >= need:
        return history
    return mx.concatenate([history, mx.zeros((_room(need) - history.shape[0],), mx.int32)])


class Chain:
    """One sequence's state on the device after its last verifying step."""

    __slots__ = ("history", "start", "token")

    def __init__(self, start: mx.array, token: mx.array, history: mx.array):
        self.start = start      # int32 scalar: the position its next token is written at
        self.token = token      # int32 scalar: that token (the target's, after the accepted)
        self.history = history  # (cap,) int32: its tokens at positions 0 .. start


class Chains:
    """The engine's chains, by sequence id (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[int, Chain] = {}

    @property
    def held(self) -> bool:
        return bool(self._held)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def drop(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)

    def nbytes(self) -> int:
        return sum(c.history.nbytes for c in self._held.values())

    def inputs(self, w: Work) -> tuple[mx.array, mx.array, mx.array]:
        """A chained Work's ``draft + 1`` input tokens (uint32), its drafts (int32, -1 where
        none) and its start (an int32 scalar), all lazy."""
        c = self._held[w.seq_id]
        c.history = _grown(c.history, w.start + w.draft + 2)
        found = drafts(c.history, c.start + 1, w.lookup, w.draft)
        tokens = mx.concatenate([c.token[None], mx.maximum(found, 0)]).astype(mx.uint32)
        return tokens, found, c.start

    def advance(self, w: Work, start: mx.array | None, found: mx.array,
                checks: mx.array) -> list[mx.array]:
        """``w`` (verifying, ``lookup`` > 0) was checked: its chain moves past what it
        accepts. ``start``: where it was written (None: ``w.start``, named by the host);
        ``found``: its drafts (k,) int32; ``checks``: its rows' (k + 1, 2) verdicts and
        tokens (:func:`plimsoll.engine.verify.check`). Returns the chain's new arrays (to
        be queued with the step)."""
        k = w.draft
        if start is None:  # the chain begins: the history the host named
            start = mx.array(w.start, dtype=mx.int32)
            known = np.zeros(_room(w.start + k + 2), dtype=np.int32)
            known[:len(w.history)] = w.history
            history = mx.array(known)
        else:
            history = _grown(self._held[w.seq_id].history, w.start + k + 2)
        ok = checks[:k, 0].astype(mx.int32)
        took = mx.sum(mx.cumprod(ok)).astype(mx.int32)  # drafts accepted
        token = mx.take(checks[:, 1], took).astype(mx.int32)
        # positions start + 1 .. start + k + 1 take the accepted drafts, then the token (and
        # past it the token again: those positions lie past the chain's end)
        row = mx.arange(k + 1, dtype=mx.int32)
        values = mx.where(row < took, mx.concatenate([mx.maximum(found, 0), token[None]]),
                          token)
        off = mx.arange(history.shape[0], dtype=mx.int32) - (start + 1)
        history = mx.where((off >= 0) & (off <= k), mx.take(values, mx.clip(off, 0, k)),
                           history)
        chain = self._held[w.seq_id] = Chain(start + took + 1, token, history)
        return [chain.start, chain.token, chain.history]
