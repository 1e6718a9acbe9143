"""Prompt lookup's n-gram search (pure, numpy): where a sequence's last tokens occurred
before in its prompt and output, and what followed them there (:mod:`.speculate` drafts with
it). It runs on the scheduler's thread for every speculating sequence every step, over the
whole history, so it is vectorized, over an array each sequence grows as its tokens grow.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prompt_lookup(tokens: Sequence[int] | np.ndarray, longest: int, k: int
                  ) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed an earlier occurrence of ``tokens``' last ``n``
    tokens, for the largest ``n <= longest`` that occurs: the most recent occurrence with
    ``k`` tokens after it (one that overlaps the tail has fewer: a loop of one token would
    draft one), else the most recent; () when none occurs.

    Vectorized (numpy): each ``n`` compares the whole history ``n`` times in C, so a 32k
    token history costs tens of microseconds, not the milliseconds a Python scan took a
    sequence and a step (``bench/lookup.py``); pass a :class:`History`'s array to skip the
    list's conversion."""
    seq = np.asarray(tokens)
    size = len(seq)
    if k <= 0 or size < 2:
        return ()
    for n in range(min(longest, size - 1), 0, -1):
        tail = seq[size - n:]
        match = seq[:size - n] == tail[0]  # candidate starts i = 0 .. size - n - 1
        for j in range(1, n):
            match &= seq[j:size - n + j] == tail[j]
        starts = np.flatnonzero(match)
        if starts.size:
            whole = starts[starts + n + k <= size]
            i = int(whole[-1] if whole.size else starts[-1])
            return tuple(int(t) for t in seq[i + n:i + n + k])
    return ()


class History:
    """One sequence's tokens as an int64 numpy array, grown as the sequence grows (tokens
    are only ever appended), so a lookup does not convert the whole list every step."""

    def __init__(self) -> None:
        self._buf = np.empty(1024, dtype=np.int64)
        self._n = 0

    def of(self, tokens: Sequence[int]) -> np.ndarray:
        """``tokens`` as an array (the view is valid until the next call)."""
        size = len(tokens)
        if size < self._n or (self._n and self._buf[self._n - 1] != tokens[self._n - 1]):
            self._n = 0  # not this history's continuation: start again
        if size > len(self._buf):
            grown = np.empty(max(size, 2 * len(self._buf)), dtype=np.int64)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        if size > self._n:
            self._buf[self._n:size] = tokens[self._n:size]
            self._n = size
        return self._buf[:size]
