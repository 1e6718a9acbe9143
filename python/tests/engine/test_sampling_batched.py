"""The batched sampler against mlx-lm's own samplers, on the CPU (pure: no model).

Every row of one batched draw is compared token for token with
``mlx_lm.sample_utils.make_sampler(temp, top_p, min_p, top_k=…)`` applied to that row
alone, after ``mx.random.seed(seed)``, over several draws in a row (a seeded sequence's
key moves on as mlx's global key does), for float32, bfloat16 and float16 logits, some
rounded coarsely so that many tie (top-k's choice among tokens tied at the k-th value).
Greedy rows are compared with the argmax of their logits (the engine's greedy path). A
seeded row draws the same whatever it is batched with; constraints still mask.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")
sample_utils = pytest.importorskip("mlx_lm.sample_utils")

from plimsoll.engine.sampling import Keys, sample  # noqa: E402
from plimsoll.engine.work import Sampling, Work  # noqa: E402

VOCAB = 257
DRAWS = 3
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


def logits_of(seed: int, rows: int, scale: float, dtype: str, vocab: int = VOCAB,
              step: float = 0.0) -> mx.array:
    """Normal logits times ``scale``; rounded to multiples of ``step`` (many ties) if set."""
    x = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * scale
    return (mx.round(x / step) * step if step else x).astype(DTYPES[dtype])


def works_of(samplings: list[Sampling], constraints=None) -> tuple[Work, ...]:
    constraints = constraints or [None] * len(samplings)
    return tuple(Work(100 + i, None, 0, (0,), True, s, c)
                 for i, (s, c) in enumerate(zip(samplings, constraints, strict=True)))


def batched(logits: mx.array, samplings: list[Sampling], draws: int = DRAWS,
            constraints=None) -> list[list[int]]:
    """``draws`` batched draws: one list of tokens per row."""
    keys, works = Keys(), works_of(samplings, constraints)
    steps = [sample(logits, works, keys).tolist() for _ in range(draws)]
    return [list(row) for row in zip(*steps, strict=True)]


def mlx_lm_alone(row: mx.array, s: Sampling, draws: int = DRAWS) -> list[int]:
    """What mlx-lm draws for this one row (1, vocab), seeded with the row's seed."""
    if s.greedy:
        return [mx.argmax(row, axis=-1).item()] * draws
    logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
    top_k = s.top_k if s.top_k < row.shape[-1] else 0  # mlx-lm refuses k ≥ vocab
    sampler = sample_utils.make_sampler(s.temperature, s.top_p, s.min_p, top_k=top_k)
    mx.random.seed(s.seed)
    return [sampler(logprobs).item() for _ in range(draws)]


SAMPLINGS = st.builds(
    Sampling,
    temperature=st.sampled_from([0.0, 0.1, 0.5, 0.7, 1.0, 1.3, 2.0]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.2, 0.01]),
    seed=st.integers(0, 2**32 - 1),
    top_k=st.sampled_from([0, 1, 2, 5, 40, VOCAB - 1, VOCAB, VOCAB + 7]),
    min_p=st.sampled_from([0.0, 0.01, 0.05, 0.3, 0.9, 1.0]))


@SETTINGS
@given(samplings=st.lists(SAMPLINGS, min_size=1, max_size=8), seed=st.integers(0, 2**31),
       scale=st.sampled_from([0.5, 2.0, 6.0]), dtype=st.sampled_from(sorted(DTYPES)),
       step=st.sampled_from([0.0, 0.0, 0.5]))
def test_each_row_draws_what_mlx_lm_draws_for_it_alone(samplings, seed, scale, dtype, step):
    logits = logits_of(seed, len(samplings), scale, dtype, step=step)
    got = batched(logits, samplings)
    for i, s in enumerate(samplings):
        assert got[i] == mlx_lm_alone(logits[i:i + 1], s), (i, s)


@SETTINGS
@given(s=SAMPLINGS.filter(lambda s: not s.greedy), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(sorted(DTYPES)))
def test_an_unseeded_row_draws_from_mlx_global_key_as_mlx_lm_does(s, seed, dtype):
    row = logits_of(seed, 1, 2.0, dtype)
    mx.random.seed(seed)
    got = [sample(row, works_of([Sampling(s.temperature, s.top_p, None, s.top_k, s.min_p)]),
                  Keys()).item() for _ in range(DRAWS)]
    assert got == mlx_lm_alone(row, Sampling(s.temperature, s.top_p, seed, s.top_k, s.min_p))


class Only:
    """A constraint allowing a fixed set of token ids."""

    def __init__(self, ids, vocab=VOCAB):
        self.mask = np.zeros(vocab, dtype=bool)
        self.mask[list(ids)] = True

    def allowed(self):
        return self.mask


NEIGHBOURS = [Sampling(), Sampling(0.8), Sampling(1.0, 0.9, 11, 5, 0.05),
              Sampling(0.6, 0.5, 3), Sampling(1.2, min_p=0.1), Sampling(0.9, top_k=3),
              Sampling(1.0, 1.0, 99), Sampling(0.0, 0.9, 5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("others", [0, 3, 7])
def test_a_seeded_row_draws_the_same_whatever_it_is_batched_with(others, dtype):
    mine = Sampling(0.9, 0.95, 1234, 40, 0.02)
    logits = logits_of(5, 8, 2.0, dtype)
    alone = batched(logits[:1], [mine], draws=8)[0]
    for at in range(others + 1):  # every position in the batch
        rows = list(range(1, others + 1))
        order = [*rows[:at], 0, *rows[at:]]
        samplings = [mine if r == 0 else NEIGHBOURS[r] for r in order]
        constraints = [Only(range(0, VOCAB, 2)) if r == 3 else None for r in order]
        got = batched(logits[mx.array(order)], samplings, draws=8, constraints=constraints)
        assert got[at] == alone, (others, at)
    assert alone == mlx_lm_alone(logits[:1], mine, draws=8)
    other_seed = batched(logits[:1], [Sampling(0.9, 0.95, 4321, 40, 0.02)], draws=8)[0]
    assert other_seed != alone  # the seed matters


def test_greedy_rows_take_the_argmax_in_a_mixed_batch_and_alone():
    logits = logits_of(9, 6, 3.0, "float32")
    argmax = mx.argmax(logits, axis=-1).tolist()
    mixed = [Sampling(), Sampling(1.0), Sampling(0.0, 0.5, 3, 2, 0.5), Sampling(0.7, seed=1),
             Sampling(), Sampling(1.5, top_k=10)]
    got = batched(logits, mixed, draws=4)
    for i, s in enumerate(mixed):
        if s.greedy:
            assert got[i] == [argmax[i]] * 4
    assert batched(logits, [Sampling()] * 6, draws=1) == [[t] for t in argmax]
    assert any(got[i] != [argmax[i]] * 4 for i in (1, 3, 5))  # sampled rows do sample


def test_constraints_still_mask():
    logits = logits_of(2, 4, 3.0, "float32")
    allowed = [range(10, 20), None, range(0, VOCAB, 7), range(200, 201)]
    samplings = [Sampling(1.5), Sampling(1.0, seed=2), Sampling(1.0, 0.9, 8, 3), Sampling()]
    got = batched(logits, samplings, draws=20,
                  constraints=[None if a is None else Only(a) for a in allowed])
    assert set(got[0]) <= set(range(10, 20)) and len(set(got[0])) > 1
    assert set(got[2]) <= set(range(0, VOCAB, 7))
    assert got[3] == [200] * 20
    masked = mx.where(mx.array(Only(range(10, 20)).mask), logits[0], -mx.inf)
    assert mx.argmax(masked).item() in range(10, 20)
    greedy = batched(logits[:1], [Sampling()], draws=1, constraints=[Only(range(10, 20))])
    assert greedy == [[mx.argmax(masked).item()]]


def test_top_k_keeps_exactly_k_and_the_lowest_ids_win_a_tie():
    flat = mx.zeros((2, VOCAB))  # every token ties
    got = batched(flat, [Sampling(1.0, seed=1, top_k=3), Sampling(1.0, seed=2, top_k=VOCAB)],
                  draws=60)
    assert set(got[0]) == {0, 1, 2}  # mlx's argpartition orders ties by id
    assert len(set(got[1])) > 3  # k ≥ vocab is off


def test_top_p_and_min_p_keep_only_the_head():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)]))
    samplings = [Sampling(1.0, 0.7, 1), Sampling(1.0, seed=2, min_p=0.5),
                 Sampling(1.0, seed=3, min_p=0.7), Sampling(1.0, seed=4)]
    got = batched(mx.concatenate([logits] * 4), samplings, draws=80)
    assert set(got[0]) == {0, 1}  # 0.5 alone is under 0.7 of the mass; with 0.3 over
    assert set(got[1]) == {0, 1}  # 0.3 ≥ 0.5 × 0.5 > 0.15
    assert set(got[2]) == {0}  # 0.3 < 0.7 × 0.5
    assert set(got[3]) == {0, 1, 2, 3}  # nothing filtered; zero-probability tokens never
