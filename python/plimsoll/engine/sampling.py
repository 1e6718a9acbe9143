"""Sampling one token per row of a batch of logits (imports mlx).

- Greedy fast path: every row greedy and unconstrained → one ``argmax`` for all.
- Otherwise per row: greedy rows take the argmax, the others mlx-lm's own
  ``apply_top_p`` and a categorical draw at ``1 / temperature``, with the row's own
  seeded key when the request gave a seed (split once per draw, so a seeded
  sequence reproduces whatever it is batched with).
- Constraints: for a row with a :class:`~plimsoll.engine.work.TokenConstraint`, the
  logits where ``allowed()`` is False become ``-inf`` before sampling (a numpy mask
  over the vocabulary, padded with False past its end). The engine tells the
  constraint the sampled token (``advance``) once it is known, which is why a
  constrained row is never pipelined.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from plimsoll.engine.work import Sampling, Work


class Keys:
    """Per-sequence random keys for seeded sampling."""

    def __init__(self) -> None:
        self._keys: dict[int, mx.array] = {}

    def next(self, seq_id: int, sampling: Sampling) -> mx.array | None:
        if sampling.seed is None:
            return None
        key = self._keys.get(seq_id)
        if key is None:
            key = mx.random.key(sampling.seed)
        self._keys[seq_id], sub = mx.random.split(key)
        return sub

    def drop(self, seq_id: int) -> None:
        self._keys.pop(seq_id, None)


def _constrain(logits: mx.array, works: tuple[Work, ...]) -> mx.array:
    masks = [None if w.constraint is None else w.constraint.allowed() for w in works]
    if all(m is None for m in masks):
        return logits
    vocab = logits.shape[-1]
    allow = np.ones((len(works), vocab), dtype=bool)
    for row, m in enumerate(masks):
        if m is None:
            continue
        m = np.asarray(m, dtype=bool).ravel()[:vocab]
        allow[row] = False
        allow[row, :m.size] = m
    return mx.where(mx.array(allow), logits, mx.array(-float("inf"), logits.dtype))


def sample(logits: mx.array, works: tuple[Work, ...], keys: Keys) -> mx.array:
    """One token per row of ``logits`` (rows, vocab), still lazy: shape (rows,)."""
    logits = _constrain(logits, works)
    if all(w.sampling.greedy for w in works):
        return mx.argmax(logits, axis=-1)
    picks = []
    for row, w in enumerate(works):
        x = logits[row:row + 1]
        if w.sampling.greedy:
            picks.append(mx.argmax(x, axis=-1))
            continue
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0.0 < w.sampling.top_p < 1.0:
            x = apply_top_p(x, w.sampling.top_p)
        picks.append(mx.random.categorical(x * (1.0 / w.sampling.temperature),
                                           key=keys.next(w.seq_id, w.sampling)))
    return mx.concatenate(picks).astype(mx.uint32)
