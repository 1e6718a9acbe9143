"""The worker's global KV pool, in blocks: live reservations plus retained prefixes.

Why this shape: the engine holds each sequence's KV in arrays sized once to its
reservation and *moves* a finished conversation's KV into the next turn (one copy,
never shared between two live sequences). So the pool counts exactly what the engine
physically holds:

- ``used``   — blocks reserved by live sequences: ``ceil((prompt + max_tokens) / block)``
  plus the fixed per-sequence blocks (recurrent state, windows), taken at admission;
- ``cached`` — blocks of retained prefixes (finished sequences' KV kept for reuse,
  LRU, capped by ``--cache-memory-mb``), always reclaimable for live work;
- ``free``   — the rest, less a fixed ``headroom`` kept aside for the one array that is
  held twice while a prefix moves (see ``Engine.move_headroom_blocks``).

Invariant: ``used + cached + headroom + free == total`` and ``free >= 0`` after every
verb, so the bytes the engine holds never exceed ``total × block_bytes``.

Pairs, as in nano-vllm: :meth:`plan` is the question (changes nothing), :meth:`admit`
the verb. Running out is a :class:`Refusal` value, never an exception. The scheduler is
the only caller; it tells the engine which prefixes to drop.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def reusable_tokens(prefix: Sequence[int], prompt: Sequence[int], whole_only: bool) -> int:
    """Leading tokens of ``prompt`` a prefix covers, leaving at least one to prefill (its
    logits give the first token). ``whole_only``: a recurrent state cannot be cut, so
    anything short of the whole prefix is 0."""
    n = 0
    for a, b in zip(prefix, prompt[:-1], strict=False):
        if a != b:
            break
        n += 1
    return 0 if whole_only and n != len(prefix) else n


@dataclass(frozen=True)
class Refusal:
    """Why a request can't be admitted now: the figures for a 503."""

    asked: int
    free: int
    cached: int
    held: int
    total: int

    @property
    def never_fits(self) -> bool:
        return self.asked > self.total

    @property
    def message(self) -> str:
        base = (
            f"KV pool exhausted: this request needs {self.asked} blocks; {self.free} are free, "
            f"{self.cached} cached (reclaimable) and {self.held} held by running requests, "
            f"of {self.total}"
        )
        if self.never_fits:
            return base + ": it can never fit this pool; lower max_tokens or shorten the prompt"
        return base + ": retry when running requests finish"


@dataclass(frozen=True)
class Plan:
    """What admitting a request would do: reuse one prefix, evict others, take blocks."""

    blocks: int
    prefix: int | None
    reused_tokens: int
    evict: tuple[int, ...]


@dataclass
class _Prefix:
    tokens: tuple[int, ...]
    blocks: int


@dataclass
class KVPool:
    total: int
    block_tokens: int
    cache_cap_blocks: int
    fixed_blocks_per_seq: int = 0
    headroom: int = 0
    whole_prefix_only: bool = False  # hybrid models: recurrent state can't be cut
    _live: dict[object, int] = field(default_factory=dict)
    _prefixes: OrderedDict[int, _Prefix] = field(default_factory=OrderedDict)  # LRU first

    def __post_init__(self) -> None:
        if self.total < 1 or self.block_tokens < 1:
            raise ValueError("a pool needs at least one block of at least one token")
        if self.headroom >= self.total:
            raise ValueError(f"headroom {self.headroom} leaves no blocks of {self.total}")

    # --- counts ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(self._live.values())

    @property
    def cached(self) -> int:
        return sum(p.blocks for p in self._prefixes.values())

    @property
    def free(self) -> int:
        return self.total - self.headroom - self.used - self.cached

    def stats(self) -> dict[str, int]:
        return {"total": self.total, "used": self.used, "cached": self.cached,
                "free": self.free, "headroom": self.headroom,
                "cache_cap": self.cache_cap_blocks, "prefixes": len(self._prefixes)}

    def blocks_for(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` total context holds, fixed state included."""
        return math.ceil(tokens / self.block_tokens) + self.fixed_blocks_per_seq

    # --- questions ------------------------------------------------------------------------
    def reusable_tokens(self, handle: int, prompt: Sequence[int]) -> int:
        return reusable_tokens(self._prefixes[handle].tokens, prompt, self.whole_prefix_only)

    def plan(self, prompt: Sequence[int], max_tokens: int) -> Plan | Refusal:
        """Which prefix to reuse and which to evict so ``prompt + max_tokens`` fits; or why not."""
        need = self.blocks_for(len(prompt) + max_tokens)
        best, best_tokens = None, 0
        for handle, p in self._prefixes.items():
            n = self.reusable_tokens(handle, prompt)
            # Reuse moves the whole prefix into this request: worth it only when the prompt
            # covers most of it, or a shared template header would destroy a conversation.
            if n > best_tokens and n >= self.block_tokens and 2 * n >= len(p.tokens):
                best, best_tokens = handle, n
        # The reused prefix is consumed into the new reservation, so its blocks count as free.
        have = self.free + (self._prefixes[best].blocks if best is not None else 0)
        evict: list[int] = []
        for handle, p in self._prefixes.items():  # least recently used first
            if have >= need:
                break
            if handle != best:
                evict.append(handle)
                have += p.blocks
        if have < need:
            return Refusal(need, self.free, self.cached, self.used, self.total - self.headroom)
        return Plan(need, best, best_tokens, tuple(evict))

    # --- verbs ----------------------------------------------------------------------------
    def admit(self, seq_id: object, plan: Plan) -> None:
        """Apply a plan from :meth:`plan` (made against the current state)."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        for handle in plan.evict:
            del self._prefixes[handle]
        if plan.prefix is not None:
            del self._prefixes[plan.prefix]
        self._live[seq_id] = plan.blocks
        assert self.free >= 0, "plan applied to a changed pool"

    def release(self, seq_id: object) -> None:
        """A live sequence ended and its arrays are gone."""
        if seq_id not in self._live:
            raise KeyError(f"unknown sequence {seq_id!r}: never admitted or already released")
        del self._live[seq_id]

    def can_retain(self, seq_id: object, tokens: int) -> bool:
        """Whether a finished sequence's ``tokens`` may be kept as a prefix under the cap."""
        return 0 < self.blocks_for(tokens) <= min(self.cache_cap_blocks, self._live[seq_id])

    def retain(self, seq_id: object, handle: int, tokens: Sequence[int]) -> tuple[int, ...]:
        """Turn a live sequence into a retained prefix; return handles evicted for the cap."""
        if not self.can_retain(seq_id, len(tokens)):
            raise ValueError(f"sequence {seq_id!r} cannot be retained (see can_retain)")
        del self._live[seq_id]
        self._prefixes[handle] = _Prefix(tuple(tokens), self.blocks_for(len(tokens)))
        evicted = []
        while self.cached > self.cache_cap_blocks:
            evicted.append(next(iter(self._prefixes)))
            del self._prefixes[evicted[-1]]
        return tuple(evicted)

    def drop_cached(self) -> tuple[int, ...]:
        """The trip's emergency clear: forget every prefix; return their handles."""
        handles = tuple(self._prefixes)
        self._prefixes.clear()
        return handles
