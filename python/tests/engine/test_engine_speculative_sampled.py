"""Sampled speculation for real: the tiny demo model, drafts by prompt lookup verified in the
one forward by the rejection-sampling rule (engine/verify.py).

The prompt is the model's own sampled continuation (it repeats itself), the first of ten
where prompt lookup drafts after half the first token's probability mass or more. At
temperature 1.0 with top-k 4, the first two tokens generated after it are drawn for 2000
seeds plainly and for 2000 more with the second token's step verifying drafts; each arm must
pass a chi-square test (test_verify_rule.chi_square_p, p-value above ALPHA) against the exact
joint distribution ``p(t1) p(t2 | t1)`` from the model's logits as the plain sampler
processes them. The speculating arm must verify a third of the second tokens or more, accept
some drafts and reject others, and reproduce a seed's tokens when run again. The prompt is
prefilled once into shared blocks; each seed then decodes its last token in one batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from test_verify_rule import ALPHA, chi_square_p

mx = pytest.importorskip("mlx.core")

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.sampling import scaled_logits  # noqa: E402
from plimsoll.engine.work import Sampling, Step, Work  # noqa: E402
from plimsoll.worker.ngram import prompt_lookup  # noqa: E402

BLOCK = 16
SHARED_BLOCKS = 7  # the prompt less its last token
RULE = Sampling(temperature=1.0, top_k=4)
SEEDS = 2000
BATCH = 250


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = build_demo_model(tmp_path_factory.mktemp("spec-sampled") / "tiny", preset="tiny")
    eng = Engine.load(d, block_tokens=BLOCK, max_blocks=SHARED_BLOCKS + BATCH)
    prompt = next(p for p in map(lambda seed: continuation(eng, seed), range(10))
                  if drafted_mass(eng, p) >= 0.5)
    shared = tuple(range(SHARED_BLOCKS))
    eng.run(Step(prefills=(Work(-1, tuple(prompt[:-1]), 0, shared, False),)))
    return eng, prompt, shared


def continuation(eng, seed: int) -> list[int]:
    """The model's own sampled continuation of a short text, its last tokens."""
    mx.random.seed(seed)
    base = eng.tokenizer.encode("one two three four five six " * 2)
    gen = [t for t, _ in generate_step(mx.array(base), eng.model, max_tokens=120,
                                       sampler=make_sampler(1.0, top_k=4))]
    return (base + gen)[-(SHARED_BLOCKS * BLOCK + 1):]


def drafted_mass(eng, prompt: list[int]) -> float:
    """How likely the first token is one after which prompt lookup drafts."""
    p1 = target(eng, prompt)
    return sum(float(p1[t]) for t in np.flatnonzero(p1) if prompt_lookup([*prompt, int(t)], 3, 2))


def target(eng, tokens: list[int]) -> np.ndarray:
    """The plain sampler's distribution of the token after ``tokens``."""
    logits = eng.model(mx.array([tokens]))[0, -1:]
    return np.array(mx.softmax(scaled_logits(logits, [RULE]).astype(mx.float32), axis=-1))[0]


def first_two(eng, prompt, shared, seeds: range, speculate: bool):
    """``{seed: (t1, t2)}`` and, for the speculating arm, how many second tokens were
    verified and how many of those were the accepted first draft."""
    n, rule = len(prompt), lambda s: replace(RULE, seed=s)
    tables = {s: (*shared, SHARED_BLOCKS + i) for i, s in enumerate(seeds)}
    t1 = eng.run(Step(decodes=tuple(Work(s, (prompt[-1],), n - 1, tables[s], True, rule(s))
                                    for s in seeds)))
    decodes, verifying = [], []
    for s in seeds:
        draft = prompt_lookup([*prompt, t1[s]], 3, 2) if speculate else ()
        if draft:
            verifying.append(Work(s, (t1[s], *draft), n, tables[s], True, rule(s),
                                  draft=len(draft)))
        else:
            decodes.append(Work(s, (t1[s],), n, tables[s], True, rule(s)))
    out = eng.run(Step(tuple(decodes), tuple(verifying)))
    for s in seeds:
        eng.free_state(s)
    pairs = {s: (t1[s], out[s] if isinstance(out[s], int) else out[s][0]) for s in seeds}
    hits = sum(len(out[w.seq_id]) > 1 for w in verifying)  # its first draft accepted
    return pairs, len(verifying), hits


def test_drafted_second_tokens_follow_the_plain_distribution(setup):
    eng, prompt, shared = setup
    p1 = target(eng, prompt)
    joint = {(a, b): p1[a] * q for a in np.flatnonzero(p1)
             for b, q in enumerate(target(eng, [*prompt, int(a)])) if q > 0}
    cells = {pair: i for i, pair in enumerate(joint)}
    probs = np.array(list(joint.values()), dtype=np.float64)
    verified = hits = 0
    for speculate, first in ((False, 0), (True, SEEDS)):
        pairs = {}
        for lo in range(first, first + SEEDS, BATCH):
            got, v, h = first_two(eng, prompt, shared, range(lo, lo + BATCH), speculate)
            pairs |= got
            verified, hits = verified + v, hits + h
        counts = Counter(cells.get(pair, len(probs)) for pair in pairs.values())
        assert counts.get(len(probs), 0) == 0, "a pair the target never draws"
        assert chi_square_p(counts, probs) > ALPHA, (speculate, counts)
    assert verified > SEEDS // 3  # about half the second tokens were verified drafts
    assert 0.05 * verified < hits < 0.95 * verified  # some accepted, some rejected
    again, _, _ = first_two(eng, prompt, shared, range(SEEDS, SEEDS + 50), True)
    assert again == {s: pairs[s] for s in range(SEEDS, SEEDS + 50)}
