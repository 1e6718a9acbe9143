"""What the scheduler and the HTTP edge exchange: requests, limits and the events a request's
sink receives (on the scheduler thread; sinks must not block). Pure values, no engine.

A request crosses to the engine process as data (:mod:`.ipc`): every field the scheduler
reads is a number, a list of ids or ``spec``; ``constraint`` (the matcher) is built from
``spec`` where the engine runs, and ``sink``, ``cancelled``, ``deadline`` and ``hashes``
belong to the side that holds them."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plimsoll.core.transients import PREFILL_CHUNK
from plimsoll.engine.work import TokenConstraint


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens mapped from shared blocks (not computed)


@dataclass(frozen=True)
class Token:
    token_id: int


@dataclass(frozen=True)
class Finished:
    reason: str  # "length" | "eos" | "stop" (a constraint finished) | "cancelled"
    completion_tokens: int
    drafted: int = 0   # tokens speculation proposed for the request
    accepted: int = 0  # of those, accepted


@dataclass(frozen=True)
class Refused:
    status: int
    message: str
    code: str
    retry_after: int | None = None


Event = Started | Token | Finished | Refused
Sink = Callable[[Event], None]


@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    sink: Sink
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0        # 0 is off
    min_p: float = 0.0    # 0 is off
    constraint: TokenConstraint | None = None  # the matcher, where the engine runs
    ignore_eos: bool = False  # only max_tokens (or the edge's stop strings) end it
    spec: Any = None  # the constraint as data (a plimsoll.constrain.Spec), or None
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float = 0.0
    hashes: list[bytes] | None = None  # the prompt's block hashes, computed once
    drafted: int = 0   # tokens speculation proposed for it (set before their tokens are sunk)
    accepted: int = 0  # of those, accepted


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int         # the load-time worst case admission checked (reported)
    max_queue: int
    max_wait_s: float
    trip_bytes: int
    retry_after_s: int = 1
    max_batch: int = 64       # sequences running (decoding or prefilling) at once
    prefill_tokens: int = PREFILL_CHUNK  # prompt tokens computed per step, over all prefills
    transient_bytes: int = 0   # the compute transient bound (decode_bytes must stay under)
    decode_bytes: Callable[[int, int], int] | None = None  # (rows, longest) → transient
    decode_rows_per_seq: int = 1  # decode rows a sequence may take (1 + drafts: verified as rows)
    chunk_for: Callable[[int], int] | None = None  # a prompt's length → its largest chunk
    chunk_align: int = 0       # a chunk not its prompt's last ends on a multiple (0: anywhere)
    split_decodes: bool = False  # decodes in alternate halves (a pipeline across ranks)
