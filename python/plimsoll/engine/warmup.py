"""Warm-up at load: pay a GPU backend's first-use compilation before the first request.

Measured on an H200 (MLX's CUDA backend): the first prefill chunk a worker ever runs takes
2.4-5.4 s (cuDNN initialisation, NVRTC kernels), the first chunk that reads a cached prefix
another ~2.5 s (its causal variant), a key length off the 64-token grid ~0.5 s once — the
agentic benchmark's turn 2 paid 3.15 s where later turns took 0.6-1.3 s. Metal compiles its
shaders on first use too. So a worker on a GPU runs a few tiny steps through the same paths
before it says ready: a chunk from position 0, a chunk at a prefix with an off-grid length
that samples beside two first chunks in the same forward (engine/forward.py), pipelined
decodes of one row and of two rows of different lengths. They write
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
    need_b = math.ceil((length_b + 2) / bt)  # its two decodes
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
    finally:
        for seq in (_A, _B, _C):
            engine.free_state(seq)
    return time.perf_counter() - start
