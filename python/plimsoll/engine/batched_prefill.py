"""First prompt chunks of several sequences as ONE forward (imports mlx).

A step that starts several prompts (a burst of requests) ran each first chunk as its own
(1, L) forward: on MLX's CUDA backend every forward is a fixed cost and every new (L, L)
shape a ~40-55 ms cuDNN plan build (bench/results/cuda-attention-h200-2026-12-01.md), so
32 short prompts arriving together waited ~4 s for their first tokens where mlx_lm.server's batched
prefill took ~1 s. Here the chunks that start at position 0 are run as padded rows:

- the *body* (every token but the one that samples) as (rows, L) with the causal mask: a
  pad sits after a row's last token, so no real query ever sees one; only the real tokens'
  K/V are written (:attr:`Batch.select`), the pads' slots exist nowhere. Its logits are never
  evaluated (MLX is lazy), so the lm head runs on no padded position;
- the sampled last tokens as one batched decode of those rows (the engine's own decode:
  paged attention over what the body just wrote).

Rows are grouped longest first, each group padded to its longest row rounded up to 64
tokens (so shapes repeat and their plans are reused) while ``rows × padded`` stays within the
step's real prompt tokens (or its longest chunk): the scheduler bounded those, so a group's
transient stays within what it planned. Only models whose every cache layer is plain
full-attention KV take this path (recurrent state would see the pads).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from plimsoll.engine.attention import Batch
from plimsoll.engine.paged import slots_of, write_of
from plimsoll.engine.work import Work

GRID = 64  # padded lengths are multiples of this (so a shape's attention plan is reused)


def groups(bodies: list[int], cap: int) -> list[list[int]]:
    """Indices of ``bodies`` (lengths > 0) in groups, longest first, each padded to its first
    row's length rounded up to :data:`GRID`, with ``rows × padded <= cap`` (a row alone
    always fits; a padded length past ``cap`` is not rounded). Pure."""
    order = sorted((i for i, n in enumerate(bodies) if n > 0), key=lambda i: -bodies[i])
    out: list[list[int]] = []
    for i in order:
        if out:
            pad = padded(bodies[out[-1][0]], cap)
            if (len(out[-1]) + 1) * pad <= cap:
                out[-1].append(i)
                continue
        out.append([i])
    return out


def padded(longest: int, cap: int) -> int:
    up = -(-longest // GRID) * GRID
    return up if up <= cap else longest


def run(engine, works: list[Work]):
    """Run the first chunks ``works`` (all ``start == 0``); returns the decode's
    ``(sampled works, tokens)`` for those that sample, or None."""
    bt = engine.block_tokens
    bodies = [list(w.tokens[:-1] if w.sample else w.tokens) for w in works]
    cap = max(sum(len(b) for b in bodies), max(len(b) for b in bodies))
    for group in groups([len(b) for b in bodies], cap):
        pad = padded(len(bodies[group[0]]), cap)
        inputs = np.zeros((len(group), pad), dtype=np.uint32)
        slots, select = [], []
        for row, i in enumerate(group):
            n = len(bodies[i])
            inputs[row, :n] = bodies[i]
            slots.append(slots_of(works[i].block_table, 0, n, bt))
            select.append(row * pad + np.arange(n, dtype=np.int32))
        engine._ensure([works[i] for i in group])
        batch = Batch(write_of(np.concatenate(slots)), None, "causal", 0,
                      select=mx.array(np.concatenate(select)))
        engine._forward(mx.array(inputs), batch, [])  # logits never evaluated: no lm head
        engine._submit(None, [])
    lasts = tuple(Work(w.seq_id, (w.tokens[-1],), len(w.tokens) - 1, w.block_table, True,
                       w.sampling, w.constraint) for w in works if w.sample)
    return engine._decode(lasts, reads=engine._prefill_reads) if lasts else None
