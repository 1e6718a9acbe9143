"""The causal grid's shapes and the attention plans an idle worker builds ahead
(engine/attention.grid_pads, engine/warmup.plan_shapes and PlanWarmer)."""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.engine import attention
from plimsoll.engine.warmup import PlanWarmer, plan_shapes


@settings(deadline=None, max_examples=300)
@given(st.integers(1, 4096), st.integers(0, 50000), st.sampled_from([16, 64, 128, 512]))
def test_grid_pads_put_both_lengths_on_the_grid_when_the_chunk_starts_late_enough(
        queries, start, grid):
    keys = start + queries
    front, back = attention.grid_pads(queries, keys, grid)
    assert 0 <= back < grid and 0 <= front < grid
    assert (keys + back) % grid == 0
    assert front <= start  # a dummy query needs a cached key before the chunk's first
    if start >= grid:  # late enough: the queries reach the grid too
        assert (queries + back + front) % grid == 0
    if front:
        assert (queries + back + front) % grid == 0


def test_plan_shapes_cover_every_shape_a_chunk_takes_most_likely_first():
    grid, budget, context = 512, 2048, 40960
    shapes = plan_shapes(grid, budget, context, 10_000)
    assert shapes[:20] == [(2048, 2048 * j) for j in range(1, 21)]  # a long prompt's chunks
    assert len(shapes) == len(set(shapes))
    assert all(q <= k and q % grid == 0 and k % grid == 0 for q, k in shapes)
    # every chunk of <= budget tokens in a sequence of <= context, on the grid
    for start in range(0, context, 997):
        for n in (1, 300, 1173, 2048):
            if start + n > context:
                continue
            front, back = attention.grid_pads(n, start + n, grid)
            shape = (n + front + back, start + n + back)
            assert shape in shapes or shape[0] % grid, (start, n, shape)
    assert plan_shapes(grid, budget, context, 7) == shapes[:7]
    assert plan_shapes(0, budget, context, 100) == []


def test_the_warmer_builds_the_plans_of_the_signatures_this_process_ran(monkeypatch):
    """Each step builds one shape for every recorded signature (here on the CPU, where the
    call is a plain attention: the mechanism, not the plan cache), and says when done."""
    built: list[tuple] = []
    monkeypatch.setattr(attention, "_SIGNATURES", {})
    warmer = PlanWarmer([(64, 64), (64, 128)])
    assert not warmer.step()  # no chunk has run: nothing to warm for
    q = mx.zeros((1, 4, 10, 16))
    k = v = mx.zeros((1, 2, 30, 16))
    attention.causal_on_grid(q, k, v, 0.25, "causal", None, 64)
    assert attention.signatures() == [(4, 16, 2, 16, mx.float32, None)]
    real = attention.build_plan
    monkeypatch.setattr(attention, "build_plan",
                        lambda sig, a, b: (built.append((sig, a, b)), real(sig, a, b)))
    assert warmer.step() and warmer.step() and not warmer.step()
    assert [(a, b) for _, a, b in built] == [(64, 64), (64, 128)]
    assert warmer.figures()["built"] == 2 and warmer.figures()["planned"] == 2
