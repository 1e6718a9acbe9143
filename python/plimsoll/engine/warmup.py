"""Warm-up at load: pay a GPU backend's first-use compilation before the first request.

Measured on an H200 (MLX's CUDA backend): the first prefill chunk a worker ever runs takes
2.4-5.4 s (cuDNN initialisation, NVRTC kernels), the first chunk that reads a cached prefix
another ~2.5 s (its causal variant), a key length off the 64-token grid ~0.5 s once — the
agentic benchmark's turn 2 paid 3.15 s where later turns took 0.6-1.3 s. Metal compiles its
shaders on first use too. So a worker on a GPU runs a few tiny steps through the same paths
before it says ready: a chunk from position 0, a chunk at a prefix with an off-grid length
that samples beside two first chunks in the same forward (engine/forward.py), pipelined
decodes of one row and of two rows of different lengths, then two decodes beside a chunk at
a prefix in one forward (a newcomer while others stream). They write
the first blocks of the pool (the pool's first slab, which the first request allocates
anyway; the scheduler has handed out no block yet, and a block is always written before it
is read) and leave no state behind. The CPU backend compiles nothing: no warm-up there.
"""

from __future__ import annotations

import math
import time

from plimsoll.engine import backend
from plimsoll.engine.work import Step, Work

_A, _B, _C = -1, -2, -3  # sequence ids no scheduler hands out


def warm_up(engine, chunk: int = 128, *, force: bool = False) -> float:
    """Run the warm-up steps on a GPU backend (anywhere with ``force``); returns the seconds
    it took (0 when skipped)."""
    if not force and not backend.gpu():
        return 0.0
    bt = engine.block_tokens
    first = max(bt, min(chunk, 128) // bt * bt)  # on the block grid
    second = first // 2 + 3  # off every grid: a key length no aligned shape covers
    length_a, length_b = first + second + 4, first // 2 + 1
    need_a = math.ceil(length_a / bt)
    need_b = math.ceil((length_b + 3) / bt)  # its three decodes
    if need_a + 2 * need_b > engine.max_blocks:
        return 0.0
    table_a = tuple(range(need_a))
    table_b = tuple(range(need_a, need_a + need_b))
    table_c = tuple(range(need_a + need_b, need_a + 2 * need_b))
    vocab = max(2, len(engine.tokenizer) - 1) if engine.tokenizer is not None else 2
    tokens = tuple(1 + (i * 7919) % (vocab - 1) for i in range(first + second))
    start = time.perf_counter()
    try:
        engine.run(Step(prefills=(Work(_A, tokens[:first], 0, table_a, False),)))
        engine.run(Step(prefills=(Work(_A, tokens[first:], first, table_a, True),
                                  Work(_B, tokens[:length_b], 0, table_b, True),
                                  Work(_C, tokens[1:length_b - 5], 0, table_c, False))))
        at = first + second
        pending = None
        for k in range(3):  # one row, pipelined; then two rows of different lengths
            decodes = (Work(_A, None, at + k, table_a, True),)
            if k:
                decodes += (Work(_B, None, length_b + k - 1, table_b, True),)
            nxt = engine.run_async(Step(decodes=decodes))
            if pending is not None:
                pending.result()
            pending = nxt
        pending.result()
        # decodes beside a chunk at a prefix in one forward (a newcomer while others stream)
        engine.run(Step(decodes=(Work(_A, None, at + 3, table_a, True),
                                 Work(_B, None, length_b + 2, table_b, True)),
                        prefills=(Work(_C, tokens[:4], length_b - 6, table_c, True),)))
    finally:
        for seq in (_A, _B, _C):
            engine.free_state(seq)
    return time.perf_counter() - start


def plan_shapes(grid: int, budget: int, context: int, most: int) -> list[tuple[int, int]]:
    """The (queries, keys) shapes a causal chunk's attention takes on ``grid``
    (:func:`plimsoll.engine.attention.causal_on_grid`) for chunks of at most ``budget``
    tokens in sequences of at most ``context``, most likely first, at most ``most``: whole
    chunks from a chunk boundary (a long prompt's ``(budget, j × budget)``), then every other
    shape by key length (sessions grow). Empty without a grid."""
    if grid <= 0 or budget <= 0 or context <= 0 or most <= 0:
        return []
    top_q = -(-budget // grid) * grid + grid  # a chunk's end and front padding
    top_k = -(-context // grid) * grid
    first = [(budget, k) for k in range(budget, top_k + 1, budget)] if budget % grid == 0 else []
    seen = set(first)
    rest = [(q, k) for k in range(grid, top_k + 1, grid)
            for q in range(min(top_q, k), 0, -grid) if (q, k) not in seen]
    return (first + rest)[:most]


class PlanWarmer:
    """Builds the cuDNN attention plans of :func:`plan_shapes` ahead, one shape a call
    (:meth:`step`, ~40-55 ms on an H200), for every chunk signature this process has run
    (the load-time warm-up runs one): the worker calls it on its engine thread (MLX's plan
    cache is per thread) only while nothing is running or waiting, so a request waits at
    most one plan build. Its transient (zeros of one chunk's queries and one layer's keys at
    the context) is below a chunk's, which the reserve holds and nothing uses while idle;
    MLX's buffer cache is emptied when the last shape is built. Measured on the H200
    (bench/results/cuda-probes-h200-2026-12-02.md): 160 shapes in 8.9 s."""

    def __init__(self, shapes: list[tuple[int, int]]):
        self.shapes, self.built, self.seconds = shapes, 0, 0.0

    def step(self) -> bool:
        """Build the next shape's plans; False when none is left (or no chunk has run)."""
        from plimsoll.engine import attention

        sigs = attention.signatures()
        if self.built >= len(self.shapes) or not sigs:
            return False
        queries, keys = self.shapes[self.built]
        start = time.perf_counter()
        for sig in sigs:
            attention.build_plan(sig, queries, keys)
        self.built += 1
        if self.built == len(self.shapes):  # its zeros stay in MLX's buffer cache: returned
            from plimsoll.engine import limits

            limits.clear_buffer_cache()
        self.seconds += time.perf_counter() - start
        return True

    def figures(self) -> dict:
        return {"planned": len(self.shapes), "built": self.built,
                "seconds": round(self.seconds, 2)}


def plan_warmer(engine, budget: int) -> PlanWarmer | None:
    """The warmer for ``engine``'s chunks of ``budget`` tokens on this backend's grid, up to
    its context (None where the backend has no grid or the engine no context)."""
    from plimsoll.engine import limits

    grid = backend.causal_grid()
    if not grid or not engine.context:
        return None
    return PlanWarmer(plan_shapes(grid, budget, engine.context, limits.warm_plans_most()))
