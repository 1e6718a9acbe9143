"""Several prompts' first chunks as one padded forward (engine/batched_prefill.py).

Real engine on the tiny demo (CPU, float32): a step that starts four prompts of different
lengths — three that sample, one whose first chunk does not — gives every sequence mlx-lm's
own greedy tokens; the grouping is pure and bounded.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.engine.batched_prefill import GRID, groups, padded

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.drive import Blocks, reference, sharpen, text  # noqa: E402
from plimsoll.engine.work import Step, Work  # noqa: E402


@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40))
def test_groups_cover_every_row_once_within_the_cap(bodies):
    cap = max(sum(bodies), max(bodies))
    got = groups(bodies, cap)
    assert sorted(i for g in got for i in g) == [i for i, n in enumerate(bodies) if n > 0]
    for g in got:
        pad = padded(bodies[g[0]], cap)
        assert all(bodies[i] <= pad for i in g)  # the first row is the group's longest
        assert len(g) == 1 or len(g) * pad <= cap
        assert pad % GRID == 0 or pad == bodies[g[0]]


def test_batched_first_chunks_equal_mlx_lm(tmp_path):
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=128)
    sharpen(eng.model)
    assert eng.batch_prefill
    new, chunk = 6, 48
    prompts = [text(eng.tokenizer, n, salt=s) for n, s in ((37, 1), (90, 2), (5, 3), (70, 4))]
    want = [reference(eng.model, p, new) for p in prompts]
    blocks = Blocks(128, shuffle=True)
    tables = [blocks.take(-(-(len(p) + new) // 16)) for p in prompts]
    # prompt 3 is chunked: its first chunk (start 0) joins the batch without sampling
    first = [Work(i, tuple(p if i != 3 else p[:chunk]), 0, tables[i], i != 3)
             for i, p in enumerate(prompts)]
    out = {i: [] for i in range(4)}
    for sid, tok in eng.run(Step(prefills=tuple(first))).items():
        out[sid].append(tok)
    assert set(out) == {0, 1, 2, 3} and not out[3]
    for sid, tok in eng.run(Step(prefills=(Work(3, tuple(prompts[3][chunk:]), chunk,
                                                tables[3], True),))).items():
        out[sid].append(tok)
    pending = None
    for _ in range(new):  # pipelined decodes of every row until each has `new` tokens
        rows = tuple(Work(i, None, len(prompts[i]) + len(out[i]) - 1 + (pending is not None),
                          tables[i], True) for i in range(4)
                     if len(out[i]) + (pending is not None) < new)
        nxt = eng.run_async(Step(decodes=rows)) if rows else None
        if pending is not None:
            for sid, tok in pending.result().items():
                out[sid].append(tok)
        pending = nxt
        if nxt is None:
            break
    if pending is not None:
        for sid, tok in pending.result().items():
            out[sid].append(tok)
    assert [out[i][:new] for i in range(4)] == want
