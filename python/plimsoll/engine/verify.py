"""Verifying a speculating sequence's drafts against the target's logits (imports mlx).

A verifying :class:`~plimsoll.engine.work.Work` (``draft`` = k > 0) brings k + 1 rows of
logits: row i follows its i-th written token, so rows 0 .. k-1 judge the drafts
``x_i = tokens[i + 1]`` and row k gives the token after all of them. :func:`check` judges
every verifying row of a step in one graph: each row's verdict (is ``x_i`` accepted) and the
token emitted if the accepted prefix ends at that row. :func:`accepted` (host numbers) takes
the prefix: the drafts before the first rejected one, then that row's token (row k's when
none is rejected), so 1 .. k + 1 tokens.

- Greedy rows: the target's argmax. A draft is accepted when it is the argmax and the token
  emitted is the argmax, so the output is the target's own greedy tokens.
- Sampled rows: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), so
  every emitted token follows the target's distribution. ``p_i`` is the distribution the
  plain sampler draws from (:func:`~plimsoll.engine.sampling.scaled_logits`: top-p, min-p,
  top-k, then temperature), ``q_i`` the proposer's (``Work.draft_probs``; a point mass at
  ``x_i`` when None, as prompt lookup's drafts are). ``x_i`` is accepted when
  ``u · q_i(x_i) < p_i(x_i)``, with probability ``min(1, p_i(x_i) / q_i(x_i))`` (``p_i(x_i)``
  for a point mass); the token emitted at row i is drawn from ``norm(max(0, p_i - q_i))``
  (for a point mass: ``p_i`` without ``x_i``, renormalised; at row k, where q is 0, ``p_k``
  itself) by the plain sampler's inverse-CDF draw.
- Randomness: two uniforms per row (the verdict's, the draw's). A seeded Work takes its rows'
  from its own key (:class:`~plimsoll.engine.sampling.Keys`: the key moves on once per
  verifying step, as once per plain step), one ``vmap`` per draft length, so a seeded
  sequence reproduces whatever it is batched with; every other row draws from mlx's global
  key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from plimsoll.engine.sampling import Keys, categorical, scaled_logits
from plimsoll.engine.work import Accepted, Work

_DRAWS: dict[int, Callable] = {}  # draft length -> the vmapped draw of its rows' uniforms


def _draws(k: int) -> Callable:
    if k not in _DRAWS:
        _DRAWS[k] = mx.vmap(lambda key: mx.random.uniform(shape=(k + 1, 2), key=key))
    return _DRAWS[k]


def _uniforms(works: tuple[Work, ...], keys: Keys) -> mx.array:
    """(rows, 2) uniforms in the works' row order: a seeded sampled Work's from its own key,
    the others' from one draw of mlx's global key."""
    seeded = [n for n, w in enumerate(works)
              if not w.sampling.greedy and w.sampling.seed is not None]
    shared = sum(works[n].draft + 1 for n in set(range(len(works))) - set(seeded))
    parts = [mx.random.uniform(shape=(shared, 2))] if shared else []
    if not seeded:
        return parts[0]
    subkeys = keys.draw(tuple(works[n] for n in seeded))
    by_length: dict[int, list[int]] = {}
    for j, n in enumerate(seeded):
        by_length.setdefault(works[n].draft, []).append(j)
    start, at = {}, shared
    for k, rows in by_length.items():
        parts.append(_draws(k)(subkeys[mx.array(rows, dtype=mx.int32)]).reshape(-1, 2))
        for i, j in enumerate(rows):
            start[seeded[j]] = at + i * (k + 1)
        at += len(rows) * (k + 1)
    order, next_shared = [], 0
    for n, w in enumerate(works):
        if n not in start:
            start[n], next_shared = next_shared, next_shared + w.draft + 1
        order.extend(range(start[n], start[n] + w.draft + 1))
    return mx.concatenate(parts)[mx.array(np.asarray(order, dtype=np.int32))]


def _fit(probs, vocab: int) -> mx.array:
    """A proposer's (draft, vocab') probabilities over the target's ``vocab`` columns."""
    probs = mx.array(probs).astype(mx.float32)
    width = probs.shape[-1]
    if width >= vocab:
        return probs[:, :vocab]
    return mx.concatenate([probs, mx.zeros((probs.shape[0], vocab - width))], axis=-1)


def _draft_probs(works: tuple[Work, ...], drafts: mx.array, vocab: int) -> mx.array:
    """q at every row, (rows, vocab): each Work's ``draft_probs`` or a point mass at its
    draft; 0 at a Work's last row (nothing was drafted there)."""
    point = (mx.arange(vocab, dtype=mx.int32)[None] == drafts[:, None]).astype(mx.float32)
    parts, row = [], 0
    for w in works:
        if w.draft_probs is None:
            parts.append(point[row:row + w.draft + 1])
        else:
            parts += [_fit(w.draft_probs, vocab), mx.zeros((1, vocab))]
        row += w.draft + 1
    return mx.concatenate(parts)


def named_drafts(works: tuple[Work, ...]) -> mx.array:
    """The drafts the Works name, a row each, -1 at each Work's last row: (rows,) int32."""
    return mx.array(np.asarray([t for w in works for t in (*w.tokens[1:], -1)],
                               dtype=np.int32))


def check(logits: mx.array, works: tuple[Work, ...], keys: Keys,
          drafts: mx.array | None = None) -> mx.array:
    """Every verifying row of a step, still lazy: (rows, 2) uint32, a row's verdict on its
    draft (1: accepted; always 0 at a Work's last row and where the draft is -1) and the
    token emitted if the accepted prefix ends there. ``logits``: (rows, vocab), each Work's
    ``draft + 1`` rows in order; ``drafts``: the draft each row judges, -1 at a Work's
    last row (default: the Works' own; :meth:`plimsoll.engine.chain.Chains.drafts`)."""
    vocab = logits.shape[-1]
    if drafts is None:
        drafts = named_drafts(works)
    rules = [w.sampling for w in works for _ in range(w.draft + 1)]
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    greedy = [r.greedy for r in rules]
    if all(greedy):
        return mx.stack([target == drafts, target], axis=-1).astype(mx.uint32)
    scaled = scaled_logits(logits, rules).astype(mx.float32)
    logp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    at = mx.maximum(drafts, 0)[:, None]
    p_x = mx.exp(mx.take_along_axis(logp, at, axis=-1)[:, 0])
    u = _uniforms(works, keys)
    if all(w.draft_probs is None for w in works):  # point masses: q(x) = 1, p - q is p less x
        ok = (drafts >= 0) & (u[:, 0] < p_x)
        drafted = mx.arange(vocab, dtype=mx.int32)[None] == drafts[:, None]
        residual = mx.where(drafted, -mx.inf, logp)
    else:
        p, q = mx.exp(logp), _draft_probs(works, drafts, vocab)
        q_x = mx.take_along_axis(q, at, axis=-1)[:, 0]
        ok = (drafts >= 0) & (u[:, 0] * q_x < p_x)
        residual = mx.log(mx.maximum(p - q, 0.0))  # log 0: -inf, never drawn
    token = categorical(residual, u[:, 1:])
    if any(greedy):
        is_greedy = mx.array(greedy)
        ok = mx.where(is_greedy, target == drafts, ok)
        token = mx.where(is_greedy, target, token)
    return mx.stack([ok.astype(mx.uint32), token.astype(mx.uint32)], axis=-1)


def accepted(drafts: Sequence[int], checks: Sequence[Sequence[int]]) -> Accepted:
    """The tokens a verifying Work yields from its rows' ``checks`` (``[verdict, token]``
    each, ``len(drafts) + 1`` of them, :func:`check`): the drafts before the first rejected
    one, then that row's token."""
    m = 0
    while m < len(drafts) and checks[m][0]:
        m += 1
    return Accepted((*drafts[:m], checks[m][1]), sum(d >= 0 for d in drafts))
