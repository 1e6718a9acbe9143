"""Speculation with the checkpoint's own MTP head (``--mtp``, where the checkpoint has one
and no ``--draft-model`` is given).

The head (:mod:`plimsoll.engine.mtp_head`, handed in: this module never imports mlx) drafts
from the target's hidden states, which the target's one forward hands it every step. Per
step, before the target's step is planned (:meth:`MTPDrafter.prepare`), every running
unconstrained sequence's head KV catches up over the positions whose hidden state and next
token are known (a pipelined sequence's in-flight position waits for the next step), and
those that draft this step (read, length > 0) get ``k`` greedy drafts from it; the target
verifies them in its forward (:mod:`.speculate`), so the output is the target's alone. A
constrained sequence never drafts: the head keeps nothing for it.

Memory: the head's weights and its KV (one layer, a block of tokens at a time, at most a
block per sequence past its own blocks) are checked against the allocation limit at load
(:func:`fit_problem`), together with the model and its pool; a head that does not fit is
not used (the worker logs the figures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.core.units import fmt_bytes

from .speculate import Drafter, may_draft
from .waiting import Run


def fit_problem(*, weights: int, mtp_weights: int, blocks: int, seqs: int, block_bytes: int,
                mtp_block_bytes: int, transient: int, limit: int) -> str:
    """Why the model, its MTP head, the pool of ``blocks`` blocks, the head's KV (a block of
    tokens for each of them and one more per sequence) and the transient do not fit the
    allocation limit ("" when they do)."""
    need = (weights + mtp_weights + blocks * block_bytes + (blocks + seqs) * mtp_block_bytes
            + transient)
    if need <= limit:
        return ""
    return (f"the MTP head does not fit: weights {fmt_bytes(weights)} + MTP weights "
            f"{fmt_bytes(mtp_weights)} + {blocks} blocks × {block_bytes} B + the head's KV "
            f"({blocks} + {seqs} blocks × {mtp_block_bytes} B) + transient "
            f"{fmt_bytes(transient)} = {fmt_bytes(need)} > the allocation limit "
            f"{fmt_bytes(limit)}: drop --mtp, or lower --max-cache-blocks")


@dataclass
class MTPDrafter(Drafter):
    """Drafts from the checkpoint's MTP head (see the module docstring)."""

    proposer = "mtp"
    head: Any = None  # the engine's MTP head (None where refused)
    kv_bytes: int = 0  # the head's KV held, as of the last prepare or forget (status)
    _ready: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def lookup(self, seq_id: int, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        return self._ready.get(seq_id, ())[:k]

    def prepare(self, pool: Any, running: dict[int, Run]) -> None:
        """Every sequence's head KV caught up; drafts for those that draft this step."""
        wants: dict[int, tuple[list[int], int]] = {}
        for run in running.values():
            sid = run.req.id
            if run.req.constraint is not None:
                self.head.forget(sid)
                continue
            k = 0
            if not (run.prefilling or run.pending or run.generated >= run.req.max_tokens) \
                    and may_draft(self, run):
                k = min(self.length(sid), run.req.max_tokens - run.generated - 1)
            wants[sid] = (run.tokens, k)
        self._ready = self.head.draft(wants) if wants else {}
        self.kv_bytes = self.head.kv_bytes()  # read here, on the engine's thread

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self._ready.pop(seq_id, None)
        if self.head is not None:
            self.head.forget(seq_id)
            self.kv_bytes = self.head.kv_bytes()

    def report(self) -> dict:
        out = super().report()
        if self.on:
            out.pop("prompt_lookup", None)
            out.update(mtp_weights_bytes=self.head.weights_bytes,
                       mtp_block_bytes=self.head.block_bytes,
                       mtp_kv_bytes_held=self.kv_bytes)
        return out
