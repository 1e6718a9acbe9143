"""The rejection-sampling rule of engine/verify.py on hand-made distributions (mlx, no model).

Four thousand seeded trials of one verifying step (two drafts over a vocabulary of 8) in one
``check`` call; the tokens each trial emits are tested by a chi-square goodness-of-fit test
against the target distribution the plain sampler draws from (``scaled_logits``): the first
emitted token against ``p_0``, and, among trials whose first draft was accepted, the second
against ``p_1``. The test passes at a p-value above ``ALPHA`` = 1e-3; the seeds are fixed, so
a run is deterministic. The same check is shown to fail for two wrong rules (always accept;
on a rejection draw from ``p`` without removing the draft). Drafts from a draft model's ``q``
(``Work.draft_probs``) pass the same check, greedy rows are the argmax's prefix, and a seeded
row draws the same alone or batched.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.engine.sampling import Keys, scaled_logits  # noqa: E402
from plimsoll.engine.verify import accepted, check  # noqa: E402
from plimsoll.engine.work import Sampling, Work  # noqa: E402

ALPHA = 1e-3
TRIALS = 4000
# rows 0 and 1 judge the drafts, row 2 gives the token after both
LOGITS = [[1.0, 2.0, 0.5, 1.5, -1.0, 0.0, 0.2, -0.5],
          [0.3, 1.2, -0.4, 0.9, 1.1, -2.0, 0.0, 0.6],
          [0.0, 0.5, 1.0, -1.0, 0.2, 0.4, -0.3, 2.0]]
DRAFTS = (3, 4)
RULES = [Sampling(temperature=1.0),
         Sampling(temperature=0.7, top_k=5),
         Sampling(temperature=1.3, top_p=0.9, min_p=0.05)]


def chi_square_p(counts: dict[int, int], probs: np.ndarray) -> float:
    """The p-value of ``counts`` (token -> how often) drawn from ``probs``: Pearson's
    statistic over the tokens expected at least 5 times (the rest pooled into one cell; a
    token of probability 0 drawn at all gives 0), its tail by the Wilson-Hilferty
    approximation of the chi-square distribution."""
    n = sum(counts.values())
    if any(probs[t] == 0 for t in counts):
        return 0.0
    expected = {t: n * float(q) for t, q in enumerate(probs) if q > 0}
    big = [t for t, e in expected.items() if e >= 5]
    cells = [(counts.get(t, 0), expected[t]) for t in big]
    rest = sum(e for t, e in expected.items() if t not in big)
    if rest > 0:
        cells.append((n - sum(c for c, _ in cells), rest))
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    if df <= 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def target(logits: mx.array, rule: Sampling) -> np.ndarray:
    """The plain sampler's distribution at each row, (rows, vocab)."""
    scaled = scaled_logits(logits, [rule] * logits.shape[0]).astype(mx.float32)
    return np.array(mx.softmax(scaled, axis=-1))


def trials(rule: Sampling, drafts: list[tuple[int, ...]], probs=None, verify=check,
           first_seed: int = 0) -> list[tuple[int, ...]]:
    """What each trial's verifying step emits: trial i drafts ``drafts[i]`` (with
    ``probs[i]`` as its q when given) under ``rule`` seeded ``first_seed + i``."""
    works = tuple(Work(i, (0, *d), 0, (0,), True, replace(rule, seed=first_seed + i),
                       draft=len(d), draft_probs=None if probs is None else probs[i])
                  for i, d in enumerate(drafts))
    logits = mx.array(LOGITS)
    rows = mx.concatenate([logits[:len(d) + 1] for d in drafts])
    checks = verify(rows, works, Keys()).tolist()
    out, row = [], 0
    for d in drafts:
        out.append(accepted(d, checks[row:row + len(d) + 1]))
        row += len(d) + 1
    return out


def fit(emitted: list[tuple[int, ...]], p: np.ndarray, drafts: list[tuple[int, ...]]):
    """The p-values of the first emitted token against ``p[0]`` and of the second, where the
    first draft was accepted, against ``p[1]``."""
    first = Counter(e[0] for e in emitted)
    second = Counter(e[1] for e, d in zip(emitted, drafts, strict=True) if e[0] == d[0]
                     and len(e) > 1)
    assert sum(second.values()) > 300, "too few accepted first drafts to judge the second"
    return chi_square_p(first, p[0]), chi_square_p(second, p[1])


@pytest.mark.parametrize("rule", RULES, ids=["t1", "t0.7-k5", "t1.3-p0.9-min0.05"])
def test_emitted_tokens_follow_the_target_distribution(rule):
    p = target(mx.array(LOGITS), rule)
    drafts = [DRAFTS] * TRIALS
    emitted = trials(rule, drafts)
    assert min(fit(emitted, p, drafts)) > ALPHA
    accepts = sum(e[0] == DRAFTS[0] for e in emitted) / TRIALS  # a point mass: p(x)
    assert abs(accepts - p[0][DRAFTS[0]]) < 0.03


def always_accept(rows, works, keys):
    checks = check(rows, works, keys)
    return mx.concatenate([mx.ones_like(checks[:, :1]), checks[:, 1:]], axis=1)


def redraw_from_p(rows, works, keys):
    """Rejects as the rule does, but then draws from ``p`` with the draft left in."""
    checks = check(rows, works, keys)
    p = target(rows, works[0].sampling)
    rng = np.random.default_rng(0)
    redrawn = [rng.choice(len(row), p=row / row.sum()) for row in p]
    return mx.concatenate([checks[:, :1], mx.array(redrawn, dtype=mx.uint32)[:, None]], axis=1)


@pytest.mark.parametrize("wrong", [always_accept, redraw_from_p])
def test_the_check_detects_a_wrong_rule(wrong):
    rule = RULES[0]
    p = target(mx.array(LOGITS), rule)
    drafts = [DRAFTS] * TRIALS
    assert fit(trials(rule, drafts, verify=wrong), p, drafts)[0] < ALPHA


def test_a_draft_models_distributions_keep_the_target_distribution():
    rule = RULES[0]
    p = target(mx.array(LOGITS), rule)
    rng = np.random.default_rng(7)
    q = np.array([[0.05, 0.1, 0.05, 0.4, 0.1, 0.1, 0.1, 0.1],
                  [0.1, 0.3, 0.05, 0.05, 0.3, 0.05, 0.1, 0.05]], dtype=np.float32)
    drafts = [tuple(int(rng.choice(8, p=row / row.sum())) for row in q) for _ in range(TRIALS)]
    emitted = trials(rule, drafts, probs=[mx.array(q)] * TRIALS)
    assert min(fit(emitted, p, drafts)) > ALPHA
    # accepted with min(1, p/q): more often than a point mass's p(x)
    accepts = sum(e[0] == d[0] for e, d in zip(emitted, drafts, strict=True)) / TRIALS
    want = sum(q[0][x] * min(1.0, p[0][x] / q[0][x]) for x in range(8))
    assert abs(accepts - want) < 0.03


def test_greedy_rows_take_the_argmax_prefix_beside_sampled_ones():
    greedy, sampled = Sampling(), replace(RULES[0], seed=3)
    argmax = [int(np.argmax(row)) for row in LOGITS]
    logits = mx.array(LOGITS)
    works = (Work(1, (0, argmax[0], 0), 0, (0,), True, greedy, draft=2),
             Work(2, (0, *DRAFTS), 0, (0,), True, sampled, draft=2),
             Work(3, (0, argmax[0], argmax[1]), 0, (0,), True, greedy, draft=2))
    checks = check(mx.concatenate([logits] * 3), works, Keys()).tolist()
    assert accepted(works[0].tokens[1:], checks[0:3]) == (argmax[0], argmax[1])
    assert accepted(works[2].tokens[1:], checks[6:9]) == tuple(argmax)


def test_a_seeded_row_draws_the_same_alone_or_batched():
    rule = RULES[1]
    alone = [trials(rule, [DRAFTS], first_seed=s)[0] for s in range(40)]
    batched = trials(rule, [DRAFTS] * 40)
    assert batched == alone
    assert trials(rule, [DRAFTS] * 40) == batched  # and again: the seeds reproduce
    mixed = trials(rule, [DRAFTS, DRAFTS[:1]] * 20)[::2]  # beside rows of another length
    assert mixed == alone[::2]
    assert len(set(batched)) > 3


def test_a_one_hot_q_is_a_point_mass_beside_other_rows():
    """The general path (some Work has q) gives a one-hot q's rows what the point-mass path
    gives them: the same verdicts, and the same draws up to float rounding."""
    rule, n = RULES[0], 400
    one_hot = mx.array(np.eye(8, dtype=np.float32)[list(DRAFTS)])
    point = trials(rule, [DRAFTS] * n)
    general = trials(rule, [DRAFTS] * n, probs=[one_hot] * n)
    mixed = trials(rule, [DRAFTS] * n, probs=[one_hot if i % 2 else None for i in range(n)])
    assert [len(e) for e in general] == [len(e) for e in point] == [len(e) for e in mixed]
    assert sum(g == e for g, e in zip(general, point, strict=True)) >= 0.99 * n
    assert sum(m == e for m, e in zip(mixed, point, strict=True)) >= 0.99 * n
