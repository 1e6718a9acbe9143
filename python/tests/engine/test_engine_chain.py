"""Prompt lookup on the device (engine/chain.py): the device rule drafts what the host's
does, for several sequences at once; a chain moves past exactly what its step accepted and
drafts the next step from there. (Chained steps on a real engine against mlx-lm's greedy
tokens: test_engine_speculative.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")

from plimsoll.engine.chain import Chains, drafts  # noqa: E402
from plimsoll.engine.work import Work  # noqa: E402
from plimsoll.worker.ngram import prompt_lookup  # noqa: E402

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
