"""Sampling one token per row of a batch of logits (imports mlx).

- Greedy fast path: every row greedy → one ``argmax`` for all.
- Otherwise one graph for the whole batch, whatever each row asks for: log-probabilities,
  then mlx-lm's ``make_sampler`` chain (``apply_top_p``, ``apply_min_p``, ``apply_top_k``,
  in that order), then a categorical draw at ``1 / temperature`` as mlx's
  ``categorical`` draws a single row.
  Per-row parameters are arrays; a row with a filter off gets a value that removes
  nothing. Greedy rows of a mixed batch take their ``argmax`` through one ``where``.
- Equal to mlx-lm: a row draws the token ``make_sampler(temp, top_p, min_p, top_k)`` draws
  for that row alone with the same random key (``mx.random.seed(seed)`` for a seeded
  sequence, token after token), including top-k's choice among tokens tied at the k-th
  value. mlx draws a single distribution by its inverse CDF (one uniform), so every row
  is drawn so here (mlx draws a batch of rows with Gumbel noise instead, which a row alone
  never sees).
- Seeds: a seeded row draws its uniform with its own key, split once per draw (all seeded
  rows in one ``vmap``), so a seeded sequence reproduces whatever it is batched with.
  Unseeded rows share one draw from mlx's global key.
- Constraints: for a row with a :class:`~plimsoll.engine.work.TokenConstraint`, the
  logits where ``allowed()`` is False become ``-inf`` before sampling (a numpy mask
  over the vocabulary, padded with False past its end). The engine tells the
  constraint the sampled token (``advance``) once it is known, which is why a
  constrained row is never pipelined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import mlx.core as mx
import numpy as np

from plimsoll.engine.work import Sampling, Work

_split_rows = mx.vmap(lambda key: mx.random.split(key))
_uniform_rows = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))


class Keys:
    """Per-sequence random keys for seeded sampling.

    Each sequence's key is a row of the array the previous draw split (``(array, row)``),
    so a decode batch that keeps its rows splits all its keys in one op and restacks
    nothing.
    """

    def __init__(self) -> None:
        self._keys: dict[int, tuple[mx.array, int]] = {}

    def draw(self, works: tuple[Work, ...]) -> mx.array:
        """One fresh subkey per work, shape (len(works), 2); each sequence's key moves on
        (the first from ``mx.random.key(seed)``, as ``mx.random.seed`` sets mlx's own)."""
        held = [self._keys.get(w.seq_id) for w in works]
        first = held[0]
        if (first is not None and first[0].shape[0] == len(works)
                and all(h is not None and h[0] is first[0] and h[1] == row
                        for row, h in enumerate(held))):
            current = first[0]
        else:
            current = mx.stack([mx.random.key(w.sampling.seed) if h is None else h[0][h[1]]
                                for w, h in zip(works, held, strict=True)])
        pairs = _split_rows(current)  # (rows, 2, 2): split(key) is (next key, subkey)
        following = pairs[:, 0]
        for row, w in enumerate(works):
            self._keys[w.seq_id] = (following, row)
        return pairs[:, 1]

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


def _column(values: list[float], dtype: mx.Dtype = mx.float32) -> mx.array:
    """A (rows, 1) column; a Python float goes through float32 first, as mlx casts a
    scalar operand to an array's dtype, so a row computes what mlx-lm's scalar does."""
    with np.errstate(over="ignore"):  # 1 / 1e-40 is inf in float32, in mlx-lm too
        column = np.asarray(values, dtype=np.float32)[:, None]
    return mx.array(column).astype(dtype)


@dataclass(frozen=True)
class _Rows:
    """The per-row parameters of a batch as (rows, 1) columns; a filter no row uses is
    None (its ops are left out of the graph). Off values: ``top_p`` ∞ (no mass reaches
    it), ``log_min_p`` -∞, ``top_k`` the whole vocabulary; a greedy row has all three off
    and temperature 1."""

    inv_temp: mx.array
    top_p: mx.array | None
    log_min_p: mx.array | None
    top_k: mx.array | None

    @classmethod
    def of(cls, rules: list[Sampling], vocab: int, dtype: mx.Dtype) -> _Rows:
        on = [not r.greedy for r in rules]
        top_p = [r.top_p if o and 0.0 < r.top_p < 1.0 else math.inf
                 for o, r in zip(on, rules, strict=True)]
        log_min_p = [math.log(r.min_p) if o and r.min_p > 0.0 else -math.inf
                     for o, r in zip(on, rules, strict=True)]
        top_k = [r.top_k if o and 0 < r.top_k < vocab else vocab
                 for o, r in zip(on, rules, strict=True)]
        return cls(
            _column([1.0 / r.temperature if o else 1.0 for o, r in zip(on, rules, strict=True)],
                    dtype),
            _column(top_p) if min(top_p) < math.inf else None,
            _column(log_min_p, dtype) if max(log_min_p) > -math.inf else None,
            mx.array(np.asarray(top_k, dtype=np.int32)[:, None]) if min(top_k) < vocab else None)


def filter_logprobs(logprobs: mx.array, top_p: mx.array | None, log_min_p: mx.array | None,
                    top_k: mx.array | None) -> mx.array:
    """mlx-lm's ``apply_top_p``, ``apply_min_p`` and ``apply_top_k`` (make_sampler's
    order) over (rows, vocab) log-probabilities at once, with per-row (rows, 1) parameters
    (see :class:`_Rows`; None: no row filters so).

    top-p and min-p each keep what is at or above a threshold, and the max survives both,
    so the two are one threshold, the larger. top-k keeps exactly k as mlx's
    ``argpartition`` does (ordered by value, then by token id: the lowest ids win a tie
    at the k-th value): what is above the k-th value, then the first of those equal to
    it. One sort of the rows serves all three (masking by a threshold keeps it sorted).
    """
    vocab = logprobs.shape[-1]
    ascending = mx.sort(logprobs, axis=-1) if top_p is not None or top_k is not None else None
    lows = []
    if top_p is not None:  # apply_top_p, line for line
        probs = mx.exp(ascending.astype(mx.float32))
        mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
        total_mass = mass_above[..., :1] + probs[..., :1]
        dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
        lows.append(mx.take_along_axis(ascending, dropped, axis=-1))
    if log_min_p is not None:
        lows.append(mx.max(logprobs, axis=-1, keepdims=True) + log_min_p)
    out = logprobs
    if lows:
        low = reduce(mx.maximum, lows)
        out = mx.where(logprobs < low, -math.inf, logprobs)
        if top_k is not None:
            ascending = mx.where(ascending < low, -math.inf, ascending)
    if top_k is not None:
        kth = mx.take_along_axis(ascending, vocab - top_k, axis=-1)
        above, tied = out > kth, out == kth
        room = top_k - above.astype(mx.int32).sum(axis=-1, keepdims=True)
        first = mx.cumsum(tied.astype(mx.int32), axis=-1) <= room
        out = mx.where(above | (tied & first), out, -math.inf)
    return out


def _uniforms(works: tuple[Work, ...], keys: Keys) -> mx.array:
    """One uniform per row, (rows, 1): seeded sampling rows from their own keys (one
    ``vmap``), every other row from one draw of mlx's global key."""
    rows = len(works)
    seeded = [i for i, w in enumerate(works)
              if not w.sampling.greedy and w.sampling.seed is not None]
    if not seeded:
        return mx.random.uniform(shape=(rows, 1))
    own = _uniform_rows(keys.draw(tuple(works[i] for i in seeded)))
    if len(seeded) == rows:
        return own
    others = np.setdiff1d(np.arange(rows), seeded)
    order = np.empty(rows, dtype=np.int32)
    order[others] = np.arange(others.size)
    order[seeded] = others.size + np.arange(len(seeded))
    shared = mx.random.uniform(shape=(int(others.size), 1))
    return mx.concatenate([shared, own])[mx.array(order)]


def categorical(logits: mx.array, uniforms: mx.array) -> mx.array:
    """``mx.random.categorical`` of each row alone, all rows at once: for one distribution
    mlx draws by the inverse CDF (the index where ``u × Σw`` falls among the exclusive
    cumulative weights ``w = exp(x - max)``, uniform over the maxima when the max is
    infinite); ``uniforms`` (rows, 1) are the rows' ``u``. Shape (rows,), int32."""
    x = logits.astype(mx.float32)
    top = mx.max(x, axis=-1, keepdims=True)
    w = mx.where(mx.isinf(top), (x == top).astype(mx.float32), mx.exp(x - top))
    cdf = mx.cumsum(w, axis=-1, inclusive=False)
    return (cdf <= uniforms * mx.sum(w, axis=-1, keepdims=True)).sum(axis=-1) - 1


def scaled_logits(logits: mx.array, rules: list[Sampling]) -> mx.array:
    """What each row of ``logits`` (rows, vocab) is drawn from, as logits: its
    log-probabilities filtered (top-p, min-p, top-k) and divided by its temperature, so
    ``softmax`` of a row is the distribution its draw follows (a greedy row: its
    log-probabilities)."""
    rows = _Rows.of(rules, logits.shape[-1], logits.dtype)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return filter_logprobs(logprobs, rows.top_p, rows.log_min_p, rows.top_k) * rows.inv_temp


def sample(logits: mx.array, works: tuple[Work, ...], keys: Keys) -> mx.array:
    """One token per row of ``logits`` (rows, vocab), still lazy: shape (rows,)."""
    logits = _constrain(logits, works)
    greedy = [w.sampling.greedy for w in works]
    if all(greedy):
        return mx.argmax(logits, axis=-1)
    scaled = scaled_logits(logits, [w.sampling for w in works])
    tokens = categorical(scaled, _uniforms(works, keys)).astype(mx.uint32)
    if any(greedy):
        tokens = mx.where(mx.array(greedy), mx.argmax(logits, axis=-1), tokens)
    return tokens
