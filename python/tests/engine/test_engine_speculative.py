"""Drafted tokens verified in the one forward (engine/forward.py, Work.draft), for real: the
tiny demo model (sharpened so greedy output varies), mlx-lm's own greedy tokens as truth.

One step holds a speculating sequence (a right, a right and a wrong draft), another
sequence's decode row and a third's prompt chunk; the speculating one accepts exactly the
agreeing prefix plus the target's next token, and after rolling back by length (the wrong
draft's slot is simply overwritten) it decodes mlx-lm's tokens on. Drafts on a constrained
row are refused. Two sequences whose verifying steps are chained on the device
(engine/chain.py: each step submitted before the one it follows is read, its input and
drafts the engine's own), beside a plain pipelined decode, decode mlx-lm's tokens too."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.chain import HISTORY_ROUND  # noqa: E402
from plimsoll.engine.drive import reference, sharpen, text  # noqa: E402
from plimsoll.engine.verify import accepted  # noqa: E402
from plimsoll.engine.work import Sampling, Step, Work  # noqa: E402
from plimsoll.worker.ngram import prompt_lookup  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = build_demo_model(tmp_path_factory.mktemp("spec") / "tiny", preset="tiny")
    e = Engine.load(d, block_tokens=BLOCK, max_blocks=64)
    sharpen(e.model)
    return e


def test_accepted_is_the_prefix_before_the_first_rejection_and_its_token():
    assert accepted((5, 6, 7), [[1, 5], [1, 6], [0, 9], [0, 1]]) == (5, 6, 9)
    assert accepted((5, 6, 7), [[1, 5], [1, 6], [1, 7], [0, 1]]) == (5, 6, 7, 1)
    assert accepted((5,), [[0, 4], [0, 2]]) == (4,)


def test_drafts_verify_beside_decodes_and_chunks(eng):
    a, b, c = text(eng.tokenizer, 40), text(eng.tokenizer, 24, 3), text(eng.tokenizer, 30, 7)
    ref_a, ref_b, ref_c = (reference(eng.model, p, 10) for p in (a, b, c))
    ta, tb, tc = tuple(range(0, 8)), tuple(range(8, 16)), tuple(range(16, 24))
    first = eng.run(Step(prefills=(Work(1, tuple(a), 0, ta, True),
                                   Work(2, tuple(b), 0, tb, True))))
    assert (first[1], first[2]) == (ref_a[0], ref_b[0])
    wrong = (ref_a[3] + 1) % eng.model.args.vocab_size
    out = eng.run(Step(decodes=(Work(2, (ref_b[0],), len(b), tb, True),),
                       prefills=(Work(1, (ref_a[0], ref_a[1], ref_a[2], wrong), len(a), ta,
                                      True, draft=3),
                                 Work(3, tuple(c), 0, tc, True))))
    assert out[1] == (ref_a[1], ref_a[2], ref_a[3])  # two accepted, then the target's own
    assert (out[2], out[3]) == (ref_b[1], ref_c[0])
    pos = len(a) + 3  # written rolls back by length: the wrong draft's slot is rewritten
    out = eng.run(Step(prefills=(Work(1, (ref_a[3], *ref_a[4:7]), pos, ta, True, draft=3),)))
    assert out[1] == tuple(ref_a[4:8])  # every draft right: k + 1 tokens
    got = [*ref_a[:8]]
    for _ in range(2):
        got.append(eng.run(Step(decodes=(Work(1, (got[-1],), len(a) + len(got) - 1, ta,
                                              True),)))[1])
    assert got == ref_a[:10]
    for seq in (1, 2, 3):
        eng.free_state(seq)


def test_several_verifying_sequences_share_the_decode_rows(eng):
    """Two speculating sequences (3 and 2 drafts, at different positions) beside a decode:
    their tokens are rows of the one decode group (engine/forward.rows_of_works), and each
    accepts exactly its agreeing prefix and the target's next token."""
    from plimsoll.engine import forward

    a, b, c = text(eng.tokenizer, 33, 5), text(eng.tokenizer, 21, 9), text(eng.tokenizer, 47, 2)
    ref_a, ref_b, ref_c = (reference(eng.model, p, 6) for p in (a, b, c))
    ta, tb, tc = tuple(range(24, 32)), tuple(range(32, 40)), tuple(range(40, 48))
    first = eng.run(Step(prefills=(Work(11, tuple(a), 0, ta, True), Work(12, tuple(b), 0, tb, True),
                                   Work(13, tuple(c), 0, tc, True))))
    assert (first[11], first[12], first[13]) == (ref_a[0], ref_b[0], ref_c[0])
    wrong = (ref_b[2] + 1) % eng.model.args.vocab_size
    step = Step(decodes=(Work(13, (ref_c[0],), len(c), tc, True),),
                prefills=(Work(11, (ref_a[0], *ref_a[1:4]), len(a), ta, True, draft=3),
                          Work(12, (ref_b[0], ref_b[1], wrong), len(b), tb, True, draft=2)))
    groups = forward.groups_of(eng, step)
    assert forward.verifies_as_rows(eng)
    assert len(groups) == 1 and groups[0].decode and len(groups[0].rows) == 1 + 4 + 3
    out = eng.run(step)
    assert out[11] == tuple(ref_a[1:5])  # all three right: k + 1 tokens
    assert out[12] == (ref_b[1], ref_b[2])  # one right, then the target's own
    assert out[13] == ref_c[1]
    for seq in (11, 12, 13):
        eng.free_state(seq)


class _AnyToken:
    def allowed(self):
        return None

    def advance(self, token_id: int) -> None:
        pass

    def done(self) -> bool:
        return False


def test_drafts_are_refused_on_a_constrained_row(eng):
    with pytest.raises(ValueError, match="unconstrained"):
        eng.run(Step(prefills=(Work(9, (1, 2, 3), 0, (0,), True, Sampling(temperature=0.7),
                                    _AnyToken(), draft=2),)))
    with pytest.raises(ValueError, match="one distribution per draft"):
        eng.run(Step(prefills=(Work(9, (1, 2, 3), 0, (0,), True, Sampling(temperature=0.7),
                                    draft=2, draft_probs=mx.ones((1, 8)) / 8),)))
    assert eng.speculation_refused == ""


def test_chained_steps_decode_the_target_greedy_tokens(eng):
    assert eng.chains_drafts
    k, n = 3, 90
    prompts = {21: tuple(text(eng.tokenizer, 12, 1)) * 3,
               22: tuple(text(eng.tokenizer, 9, 5)) * 2}
    plain = tuple(text(eng.tokenizer, 20, 9))  # a third decodes plainly, pipelined, beside
    refs = {s: reference(eng.model, p, n) for s, p in prompts.items()}
    ref3 = reference(eng.model, plain, n)
    tables = {21: tuple(range(0, 24)), 22: tuple(range(24, 48))}
    table3 = tuple(range(48, 60))
    first = eng.run(Step(prefills=(*(Work(s, p, 0, tables[s], True)
                                     for s, p in prompts.items()),
                                   Work(23, plain, 0, table3, True))))
    got = {s: [first[s]] for s in prompts}
    got3 = [first[23]]
    pending3 = eng.run_async(Step(decodes=(Work(23, (got3[0],), len(plain), table3, True),)))
    got3.append(pending3.result()[23])
    # each chain begins with drafts the host found, then the engine drafts every step
    start = {s: len(p) for s, p in prompts.items()}
    begin = []
    for s, p in prompts.items():
        toks = [*p, got[s][0]]
        d = prompt_lookup(toks, 3, k) or p[:k]  # any drafts: greedy output is the target's
        begin.append(Work(s, (toks[-1], *d), start[s], tables[s], True, draft=len(d),
                          lookup=3, history=np.asarray(toks, dtype=np.int32)))
    drafted = {w.seq_id: w.draft for w in begin}
    pending = eng.run_async(Step(prefills=tuple(begin)))
    chained, longer = 0, 0
    while min(len(v) for v in got.values()) < n - k - 1 and len(got3) < n - 1:
        # planned before the step in flight is read: the highest start it can have
        nxt = eng.run_async(Step(
            decodes=(Work(23, None, len(plain) + 1 + chained, table3, True),),
            prefills=tuple(Work(s, None, start[s] + drafted[s] + 1, tables[s], True,
                                draft=k, lookup=3) for s in prompts)))
        chained += 1
        for s, out in pending.result().items():
            if s == 23:
                got3.append(out)
                continue
            assert isinstance(out, tuple) and 1 <= len(out) <= drafted[s] + 1
            got[s] += out
            longer += len(out) > 1
            start[s] += len(out)
            drafted[s] = k
        pending = nxt
    for s, out in pending.result().items():
        if s == 23:
            got3.append(out)
        else:
            got[s] += out
    for s in prompts:
        assert got[s] == refs[s][:len(got[s])], s
    assert got3 == ref3[:len(got3)]
    assert chained >= 3
    assert longer >= 1  # some drafts of the engine's own were accepted
    # the bytes the chains hold: one int32 row a chained sequence, its positions rounded up
    # to HISTORY_ROUND (DESIGN's bound: max_batch rows of the context so rounded)
    reach = max(start.values()) + 2 * k + 3  # a planned start is at most k + 1 ahead
    width = -(-reach // HISTORY_ROUND) * HISTORY_ROUND
    assert eng.chains.nbytes() == eng.chains._history.nbytes <= len(prompts) * 4 * width
    # a chained Work names the highest start its chain can reach (the Work before's start +
    # drafts + 1): one below it is refused before anything is built (a start too low would
    # send the device's positions past what the history, tables and reads were sized for)
    reach = eng.chains.reach(22)
    assert reach > start[22]  # the true position (read) is behind the planned one
    with pytest.raises(ValueError, match=rf"can reach \({reach}\), not {reach - 1}"):
        eng.run_async(Step(prefills=(Work(22, None, reach - 1, tables[22], True, draft=k,
                                          lookup=3),)))
    # a plain step ends a sequence's chain; an ended sequence's goes with its state
    eng.run(Step(decodes=(Work(21, (got[21][-1],), start[21], tables[21], True),)))
    assert not eng.chains.holds(21) and eng.chains.holds(22)
    for seq in (21, 22, 23):
        eng.free_state(seq)
    assert not eng.chains.held
