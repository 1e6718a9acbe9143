"""Engine calls as int32 messages between rank 0 and its peers (pure: no mlx).

When the ranks' layers run on the worker's engine (:mod:`plimsoll.cluster.engine_stage`),
rank 0's scheduler makes the same engine calls a local worker's does, and every peer makes
them too, in the same order: a :class:`~plimsoll.engine.work.Step`, ``free_state``,
``snapshot_state``, ``restore_state``, ``drop_snapshot``. Each is one header of
:data:`HEADER` ints ``[op, seq_id, payload length, key, 0, 0, 0]`` (the lockstep
protocol's header shape, :func:`plimsoll.cluster.protocol.header`) and, for a step, a
payload:

``[n_decodes, n_prefills, then per Work (decodes first): seq_id, start, sample,
n_tokens, temperature (2 ints: float64 bits), top_p (2), seed flag, seed (2 ints:
64 bits), top_k, min_p (2), kept, n_new, *new blocks, *token ids]``.

Token ids are sent only with ``tokens`` (tensor parallel: every rank embeds); split by
layers only rank 0 embeds, and the peers need their count. A Work's block
table goes as a change against the last one sent for that sequence (``kept`` leading
blocks stay, ``new`` follow), so a decode step sends no table at all until a sequence
takes a new block; both ends keep the tables in a :class:`Tables`. Floats and seeds go as
their bits, so the last rank samples with exactly what rank 0's scheduler asked.
"""

from __future__ import annotations

import struct

from plimsoll.engine.work import Sampling, Step, Work

HEADER = 7
#: The engine ops (distinct from the slot protocol's 1..5; PING and SHUTDOWN are shared).
OP_RUN, OP_FREE_STATE, OP_SNAPSHOT, OP_RESTORE, OP_DROP = 11, 12, 13, 14, 15
_MASK64 = (1 << 64) - 1


def op_header(op: int, seq_id: int = 0, n: int = 0, key: int = 0) -> list[int]:
    return [op, seq_id, n, key, 0, 0, 0]


def _pair(value: int) -> list[int]:
    """A 64-bit value as two int32s (high, low), each in the int32 range."""
    hi, lo = (value >> 32) & 0xFFFFFFFF, value & 0xFFFFFFFF
    return [hi - (1 << 32) if hi >= 1 << 31 else hi, lo - (1 << 32) if lo >= 1 << 31 else lo]


def _unpair(hi: int, lo: int) -> int:
    return ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)


def _float(x: float) -> list[int]:
    return _pair(struct.unpack("<Q", struct.pack("<d", float(x)))[0])


def _unfloat(hi: int, lo: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", _unpair(hi, lo)))[0]


class Tables:
    """The block table last sent for each sequence (each end keeps its own copy)."""

    def __init__(self) -> None:
        self.tables: dict[int, tuple[int, ...]] = {}

    def forget(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)

    def delta(self, seq_id: int, table: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """``(kept, new)`` for ``table`` against the last sent; remembers ``table``."""
        old = self.tables.get(seq_id, ())
        kept = 0
        for a, b in zip(old, table, strict=False):
            if a != b:
                break
            kept += 1
        self.tables[seq_id] = table
        return kept, table[kept:]

    def apply(self, seq_id: int, kept: int, new: tuple[int, ...]) -> tuple[int, ...]:
        table = self.tables.get(seq_id, ())[:kept] + new
        self.tables[seq_id] = table
        return table


def encode_step(step: Step, tables: Tables, tokens: bool = False) -> list[int]:
    """The payload of ``step`` (constraints stay on rank 0: a constrained Work is refused);
    ``tokens``: with the token ids."""
    out = [len(step.decodes), len(step.prefills)]
    for w in (*step.decodes, *step.prefills):
        if w.constraint is not None:
            raise ValueError(f"sequence {w.seq_id}: constrained decoding is not served "
                             "across ranks")
        if w.tokens is None:
            raise ValueError(f"sequence {w.seq_id}: a step sent to the peers names its tokens")
        kept, new = tables.delta(w.seq_id, w.block_table)
        s = w.sampling
        out += [w.seq_id, w.start, int(w.sample), len(w.tokens), *_float(s.temperature),
                *_float(s.top_p), int(s.seed is not None),
                *_pair(0 if s.seed is None else s.seed & _MASK64), s.top_k, *_float(s.min_p),
                kept, len(new), *new, *(w.tokens if tokens else ())]
    return out


def decode_step(payload: list[int], tables: Tables, tokens: bool = False) -> Step:
    """The Step a peer runs: ``payload``'s Works, with their tokens where ``tokens`` (else
    placeholder zeros)."""
    n_decodes, n_prefills = payload[0], payload[1]
    works, i = [], 2
    for _ in range(n_decodes + n_prefills):
        seq_id, start, sample, n = payload[i:i + 4]
        temperature = _unfloat(payload[i + 4], payload[i + 5])
        top_p = _unfloat(payload[i + 6], payload[i + 7])
        seed = _unpair(payload[i + 9], payload[i + 10]) if payload[i + 8] else None
        top_k, min_p = payload[i + 11], _unfloat(payload[i + 12], payload[i + 13])
        kept, n_new = payload[i + 14], payload[i + 15]
        i += 16
        table = tables.apply(seq_id, kept, tuple(payload[i:i + n_new]))
        i += n_new
        ids = tuple(payload[i:i + n]) if tokens else (0,) * n
        i += n if tokens else 0
        works.append(Work(seq_id=seq_id, tokens=ids, start=start, block_table=table,
                          sample=bool(sample), sampling=Sampling(temperature, top_p, seed,
                                                                 top_k, min_p)))
    if i != len(payload):
        raise ValueError(f"a step payload of {len(payload)} ints held {i}")
    return Step(decodes=tuple(works[:n_decodes]), prefills=tuple(works[n_decodes:]))


def sampled(step: Step) -> list[int]:
    """The sequences whose tokens the last rank sends back, in order."""
    return [w.seq_id for w in (*step.decodes, *step.prefills) if w.sample]
