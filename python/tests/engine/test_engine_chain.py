"""Prompt lookup on the device (engine/chain.py), for real: the device rule drafts what the
host's does, and two sequences whose verifying steps are chained — each step submitted
before the one it follows is read, its input and drafts the engine's own — decode mlx-lm's
greedy tokens on the tiny demo model (sharpened so greedy output varies)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.chain import Chains, drafts  # noqa: E402
from plimsoll.engine.drive import reference, sharpen, text  # noqa: E402
from plimsoll.engine.work import Step, Work  # noqa: E402
from plimsoll.worker.ngram import prompt_lookup  # noqa: E402

BLOCK = 16


TOKENS = st.lists(st.integers(0, 4), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(TOKENS, min_size=1, max_size=3), st.integers(1, 3), st.integers(1, 4),
       st.integers(0, 9))
def test_the_device_rule_drafts_what_the_host_rule_does(rows, longest, k, junk):
    """Several sequences at once, each its own length; past it anything."""
    history = np.full((len(rows), max(map(len, rows)) + junk), 3, dtype=np.int32)
    for r, tokens in enumerate(rows):
        history[r, :len(tokens)] = tokens
    got = drafts(mx.array(history), mx.array([len(t) for t in rows], dtype=mx.int32),
                 longest, k)
    for r, tokens in enumerate(rows):
        want = prompt_lookup(tokens, longest, k)
        assert got[r].tolist() == [*want, *[-1] * (k - len(want))], (r, tokens)


@pytest.mark.parametrize("took", [0, 1, 2, 3])
def test_a_chain_moves_past_what_its_step_accepted(took):
    chains, k = Chains(), 3
    history = np.array([7, 8, 9, 7, 8], dtype=np.int32)  # positions 0 .. 4; 8 is at 4
    w = Work(1, (8, 9, 7, 5), 4, tuple(range(4)), True, draft=k, lookup=2, history=history)
    verdicts = [1] * took + [0] * (k + 1 - took)
    checks = mx.array([[v, 40 + i] for i, v in enumerate(verdicts)], dtype=mx.uint32)
    drafted = chains.drafts((w,))
    assert drafted.tolist() == [9, 7, 5, -1]
    chains.advance((w,), checks, drafted)
    want = [7, 8, 9, 7, 8, *[9, 7, 5][:took], 40 + took]
    assert chains._start.tolist() == [4 + took + 1] and chains._token.tolist() == [40 + took]
    assert chains._history[0, :len(want)].tolist() == want
    # the next step's rows: that token, then what lookup finds after it, from there on
    nxt = Work(1, None, 8, tuple(range(4)), True, draft=2, lookup=2)
    tokens, positions = chains.inputs((nxt,))
    found = [*prompt_lookup(want, 2, 2), -1, -1][:2]
    assert tokens.tolist() == [40 + took, *[max(t, 0) for t in found]]
    assert positions.tolist() == [5 + took, 6 + took, 7 + took]
    assert chains.drafts((nxt,)).tolist() == [*found, -1]


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = build_demo_model(tmp_path_factory.mktemp("chain") / "tiny", preset="tiny")
    e = Engine.load(d, block_tokens=BLOCK, max_blocks=64)
    sharpen(e.model)
    return e


def test_chained_steps_decode_the_target_greedy_tokens(eng):
    assert eng.chains_drafts
    k, n = 3, 90
    prompts = {1: tuple(text(eng.tokenizer, 12, 1)) * 3, 2: tuple(text(eng.tokenizer, 9, 5)) * 2}
    plain = tuple(text(eng.tokenizer, 20, 9))  # a third decodes plainly, pipelined, beside
    refs = {s: reference(eng.model, p, n) for s, p in prompts.items()}
    ref3 = reference(eng.model, plain, n)
    tables = {1: tuple(range(0, 24)), 2: tuple(range(24, 48))}
    table3 = tuple(range(48, 60))
    first = eng.run(Step(prefills=(*(Work(s, p, 0, tables[s], True)
                                     for s, p in prompts.items()),
                                   Work(3, plain, 0, table3, True))))
    got = {s: [first[s]] for s in prompts}
    got3 = [first[3]]
    pending3 = eng.run_async(Step(decodes=(Work(3, (got3[0],), len(plain), table3, True),)))
    got3.append(pending3.result()[3])
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
            decodes=(Work(3, None, len(plain) + 1 + chained, table3, True),),
            prefills=tuple(Work(s, None, start[s] + drafted[s] + 1, tables[s], True,
                                draft=k, lookup=3) for s in prompts)))
        chained += 1
        for s, out in pending.result().items():
            if s == 3:
                got3.append(out)
                continue
            assert isinstance(out, tuple) and 1 <= len(out) <= drafted[s] + 1
            got[s] += out
            longer += len(out) > 1
            start[s] += len(out)
            drafted[s] = k
        pending = nxt
    for s, out in pending.result().items():
        if s == 3:
            got3.append(out)
        else:
            got[s] += out
    for s in prompts:
        assert got[s] == refs[s][:len(got[s])], s
    assert got3 == ref3[:len(got3)]
    assert chained >= 3
    assert longer >= 1  # some drafts of the engine's own were accepted
    # a plain step ends a sequence's chain; an ended sequence's goes with its state
    eng.run(Step(decodes=(Work(1, (got[1][-1],), start[1], tables[1], True),)))
    assert not eng.chains.holds(1) and eng.chains.holds(2)
    eng.free_state(2)
    assert not eng.chains.held
