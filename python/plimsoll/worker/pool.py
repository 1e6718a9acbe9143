"""The worker's block pool: fixed-size KV blocks, reference counts, chained hashes, an LRU.

Why this shape (vLLM v1's ``block_pool.py``, nano-vllm's ``block_manager.py``): the engine
holds KV in one physical pool of ``total`` blocks per layer and a sequence is a *block
table* (physical ids). This module owns which block holds what; the engine only writes
where a table says. Pure: no mlx, no I/O; the scheduler is the only caller.

- A block is **held** while some table references it (``ref > 0``). A *full* block carries
  a hash chained on its parent's (``block_hash(parent, tokens, extra_key)``), registered
  once its KV is written; a prompt whose leading full blocks hash the same maps those
  blocks (``ref += 1``): one physical copy for every sequence sharing a prefix, cached or
  running, with no recompute.
- A freed block with a hash stays **cached** (``ref == 0``) in an LRU queue as a prefix hit,
  the chain's tail first so that the tail is evicted before its parents; it is evicted
  (hash forgotten) the moment a block is needed and no **empty** block is left, or when
  cached blocks pass ``cache_cap_blocks`` (``--cache-memory-mb``).
- **Reservations.** A sequence reserves ``ceil((prompt + max_tokens) / block)`` table
  blocks at admission (plus ``fixed_blocks_per_seq`` for recurrent state the engine keeps
  outside the pool), counted, never more — but physical blocks are taken only as its
  tokens are written, so the reserved-but-unwritten rest can hold cached prefixes until
  needed. Invariant: ``held + outstanding + fixed × live + snapshots ≤ total``, where
  ``outstanding`` is what live sequences may still take; snapshots are reclaimable and
  are dropped first when a reservation needs their room.
- **Hybrid models** (recurrent state): a prefix is usable only up to a block whose end has
  a state snapshot (:meth:`add_snapshot`); each snapshot is charged ``fixed_blocks_per_seq``
  under the cache cap and dropped with its block (the keys to drop are queued in
  :attr:`dropped_snapshots` for the scheduler to tell the engine).

Pairs, as in nano-vllm: :meth:`can_allocate` is the question (changes nothing),
:meth:`allocate` the verb. Running out is a :class:`Refusal` value, never an exception.
Invariant after every verb: ``held + cached + empty == total`` (physical), a shared block
counted once, no reference count below zero.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

ROOT_HASH = b"plimsoll-kv-v1"


def block_hash(parent: bytes | None, tokens: Sequence[int], extra_key: bytes = b"") -> bytes:
    """vLLM v1's chained block hash: the hash of (parent's hash, the block's tokens, extra
    keys). ``extra_key`` names what else makes KV differ (the model, the KV dtype), so two
    pools never mistake each other's blocks."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(extra_key)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_tokens: int, extra_key: bytes = b"",
                 start: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of ``tokens``, chained; ``start`` (already known hashes
    of the leading blocks) is extended, not recomputed."""
    out = list(start)
    for i in range(len(out), len(tokens) // block_tokens):
        out.append(block_hash(out[-1] if out else None,
                              tokens[i * block_tokens:(i + 1) * block_tokens], extra_key))
    return out


@dataclass(frozen=True)
class Refusal:
    """Why a request can't be admitted now: the figures for a 503."""

    asked: int      # blocks this request would commit (its reservation less prefix hits)
    available: int  # blocks neither held nor promised to running sequences
    cached: int     # of those, cached prefixes (reclaimable)
    held: int       # blocks held or promised to running sequences
    total: int

    @property
    def never_fits(self) -> bool:
        return self.asked > self.total

    @property
    def message(self) -> str:
        base = (f"KV pool exhausted: this request needs {self.asked} blocks; "
                f"{self.available} are available ({self.cached} of them cached prefixes) and "
                f"{self.held} are held or reserved by running requests, of {self.total}")
        if self.never_fits:
            return base + ": it can never fit this pool; lower max_tokens or shorten the prompt"
        return base + ": retry when running requests finish"


@dataclass(frozen=True)
class Grant:
    """What :meth:`BlockPool.allocate` would do: map ``hit_blocks``, reserve ``reserve``."""

    reserve: int                 # table blocks reserved: ceil((prompt + max_tokens) / block)
    hit_blocks: tuple[int, ...]  # physical ids of the leading full blocks to map
    snapshot: Hashable | None    # hybrid: the state snapshot at the end of the hit
    hashes: tuple[bytes, ...]    # the prompt's full-block hashes (computed once)

    @property
    def hit_count(self) -> int:
        return len(self.hit_blocks)


@dataclass
class _Seq:
    reserve: int
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of table[:len(hashes)], registered
    snapshots: list[Hashable] = field(default_factory=list)  # taken, not bound to a hash yet
    frozen: tuple[int, ...] | None = None  # tuple(table), kept until the table grows


@dataclass
class BlockPool:
    total: int
    block_tokens: int
    cache_cap_blocks: int
    fixed_blocks_per_seq: int = 0
    hybrid: bool = False    # recurrent state: a hit needs a state snapshot at its end
    extra_key: bytes = b""
    sharing: bool = True    # False: count blocks only (an engine that keeps its own KV)
    dropped_snapshots: list[Hashable] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "evicted_blocks"), 0))

    def __post_init__(self) -> None:
        if self.total < 1 or self.block_tokens < 1:
            raise ValueError("a pool needs at least one block of at least one token")
        self._ref = [0] * self.total
        self._shared = 0  # blocks with more than one reference (kept, not recounted)
        self._hash: list[bytes | None] = [None] * self.total
        self._by_hash: dict[bytes, int] = {}
        self._empty = list(range(self.total))  # a heap: lowest ids first keeps slabs compact
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._seqs: dict[Hashable, _Seq] = {}
        self._snapshots: OrderedDict[bytes, Hashable] = OrderedDict()  # block hash → key, LRU
        self._held = 0
        # snapshots taken but whose block's hash is not registered yet: key → (seq, blocks)
        self._pending_snapshots: dict[Hashable, tuple[Hashable, int]] = {}

    # --- counts ---------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Distinct blocks some table references (a shared block once)."""
        return self._held

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def empty(self) -> int:
        return len(self._empty)

    @property
    def outstanding(self) -> int:
        """Blocks live sequences may still take (reserved, not yet written)."""
        return sum(s.reserve - len(s.table) for s in self._seqs.values())

    @property
    def snapshot_blocks(self) -> int:
        """Blocks charged for state snapshots the engine holds (bound or not yet)."""
        return (len(self._snapshots) + len(self._pending_snapshots)) * self.fixed_blocks_per_seq

    @property
    def committed(self) -> int:
        """Held + promised: what reservations guarantee to running sequences."""
        return self._held + self.outstanding + self.fixed_blocks_per_seq * len(self._seqs)

    @property
    def shared(self) -> int:
        return self._shared

    def blocks_for(self, tokens: int) -> int:
        """Table blocks one sequence of ``tokens`` total context reserves."""
        return math.ceil(tokens / self.block_tokens)

    def table(self, seq_id: Hashable) -> tuple[int, ...]:
        return tuple(self._seqs[seq_id].table)

    def reserved_tokens(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].reserve * self.block_tokens

    def stats(self) -> dict[str, int]:
        return {"total": self.total, "used": self._held, "cached": self.cached,
                "free": self.empty, "reserved": self.outstanding,
                "fixed": self.fixed_blocks_per_seq * len(self._seqs),
                "shared": self.shared, "snapshots": len(self._snapshots),
                "cache_cap": self.cache_cap_blocks, "sequences": len(self._seqs)}

    # --- questions ------------------------------------------------------------------------
    def prompt_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        return chain_hashes(prompt, self.block_tokens, self.extra_key)

    def can_allocate(self, prompt: Sequence[int], max_tokens: int,
                     hashes: Sequence[bytes] | None = None) -> Grant | Refusal:
        """Which leading blocks of ``prompt`` are already held or cached, and whether its
        reservation fits beside every running one; or why not. Changes nothing.

        At least one prompt token is always left to prefill (its logits give the first
        token), so at most ``(len(prompt) − 1) // block`` blocks are mapped."""
        hashes = list(hashes) if hashes is not None else self.prompt_hashes(prompt)
        reserve = self.blocks_for(len(prompt) + max_tokens)
        hits: list[int] = []
        for h in hashes[:(len(prompt) - 1) // self.block_tokens] if self.sharing else ():
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        snapshot = None
        if self.hybrid:  # a recurrent state can't be cut: stop at the last snapshot
            while hits and hashes[len(hits) - 1] not in self._snapshots:
                hits.pop()
            snapshot = self._snapshots[hashes[len(hits) - 1]] if hits else None
        revived = sum(1 for b in hits if self._ref[b] == 0)
        asked = reserve - len(hits) + revived + self.fixed_blocks_per_seq
        room = self.total - self.committed
        if asked > room:
            return Refusal(asked, room, self.cached, self.committed, self.total)
        return Grant(reserve, tuple(hits), snapshot, tuple(hashes))

    # --- verbs ----------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, grant: Grant) -> tuple[int, ...]:
        """Admit a sequence from a :meth:`can_allocate` answer made against this state: map
        its hit blocks, count its reservation. Returns its table so far (the hits)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        seq = _Seq(grant.reserve)
        for block in grant.hit_blocks:
            self._touch(block)
            seq.table.append(block)
        seq.hashes = list(grant.hashes[:grant.hit_count])
        self._seqs[seq_id] = seq
        tokens = grant.hit_count * self.block_tokens
        self.counters["hit_blocks"] += grant.hit_count
        self.counters["hit_tokens"] += tokens
        self.counters["miss_blocks"] += max(0, len(grant.hashes) - grant.hit_count)
        if grant.snapshot is not None:
            self._snapshots.move_to_end(grant.hashes[grant.hit_count - 1])
        self._shrink_snapshots()
        assert self.committed <= self.total, "grant applied to a changed pool"
        return tuple(seq.table)

    def count_prefill(self, tokens: int) -> None:
        """Prompt tokens actually computed (the misses' tokens)."""
        self.counters["miss_tokens"] += tokens

    def grow(self, seq_id: Hashable, tokens: int) -> tuple[int, ...] | None:
        """Give ``seq_id`` physical blocks for its first ``tokens`` positions (evicting
        cached blocks if no empty one is left); ``None`` if that passes its reservation
        (nothing changes: the caller ends the sequence, never the worker)."""
        seq = self._seqs[seq_id]
        frozen = seq.frozen
        if (frozen is not None and len(frozen) == len(seq.table)
                and tokens <= len(frozen) * self.block_tokens):
            return frozen  # covered already (a decode, 15 steps in 16): no block to take
        need = self.blocks_for(tokens)
        if need > seq.reserve:
            return None
        while len(seq.table) < need:
            block = self._take()
            self._ref[block] = 1
            self._held += 1
            seq.table.append(block)
            seq.frozen = None
        if seq.frozen is None or len(seq.frozen) != len(seq.table):
            seq.frozen = tuple(seq.table)  # the same object every step until it grows
        return seq.frozen

    def commit(self, seq_id: Hashable, tokens: Sequence[int], written: int | None = None
               ) -> None:
        """The first ``written`` (default: all) of ``tokens`` are the values at positions
        0.. of ``seq_id`` whose KV is written (or being written by a submitted step):
        register every newly full block's hash so later prompts can map it. A hash another
        block already carries stays with that block."""
        seq = self._seqs[seq_id]
        if not self.sharing:
            return
        n = len(tokens) if written is None else min(written, len(tokens))
        full = min(n // self.block_tokens, len(seq.table))
        if full <= len(seq.hashes):
            return
        seq.hashes = chain_hashes(tokens[:full * self.block_tokens], self.block_tokens,
                                  self.extra_key, seq.hashes)
        for i in range(full):
            h, block = seq.hashes[i], seq.table[i]
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block

    def can_snapshot(self) -> bool:
        """Whether a hybrid sequence's state snapshot fits now (under the cache cap and
        beside every reservation)."""
        f = self.fixed_blocks_per_seq
        return (self.hybrid and self.committed + self.snapshot_blocks + f <= self.total
                and self.cached + self.snapshot_blocks + f <= self.cache_cap_blocks)

    def add_snapshot(self, seq_id: Hashable, key: Hashable) -> None:
        """The engine snapshotted ``seq_id``'s state at the end of its last full block
        (``len(table)`` blocks written): the snapshot becomes a prefix hit once that block's
        hash is registered (:meth:`bind_snapshots`). A sequence keeps every snapshot it
        takes (each reclaimable, LRU), so a later prompt can resume at any of them."""
        seq = self._seqs[seq_id]
        seq.snapshots.append(key)
        self._pending_snapshots[key] = (seq_id, len(seq.table))

    def bind_snapshots(self, seq_id: Hashable) -> None:
        """Bind the sequence's snapshots to their blocks' hashes once those are registered."""
        seq = self._seqs[seq_id]
        for key in list(seq.snapshots):
            _, blocks = self._pending_snapshots[key]
            if len(seq.hashes) < blocks:
                continue
            seq.snapshots.remove(key)
            del self._pending_snapshots[key]
            h = seq.hashes[blocks - 1] if blocks else None
            if h is None or h not in self._by_hash or h in self._snapshots:
                self.dropped_snapshots.append(key)  # a duplicate state, or no block to map
                continue
            self._snapshots[h] = key

    def free(self, seq_id: Hashable) -> None:
        """A sequence ended: drop its references, tail first into the LRU (so a chain's
        tail is evicted before its parents); unhashed blocks become empty."""
        seq = self._seqs.pop(seq_id)
        for key in seq.snapshots:  # never bound to a registered block: useless
            del self._pending_snapshots[key]
            self.dropped_snapshots.append(key)
        for block in reversed(seq.table):
            if self._ref[block] == 2:
                self._shared -= 1
            self._ref[block] -= 1
            assert self._ref[block] >= 0
            if self._ref[block] == 0:
                self._held -= 1
                if self._hash[block] is not None:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._empty, block)
        while self.cached and self.cached + self.snapshot_blocks > self.cache_cap_blocks:
            self._evict(next(iter(self._cached)))
        while self._snapshots and self.snapshot_blocks > self.cache_cap_blocks:
            self.dropped_snapshots.append(self._snapshots.popitem(last=False)[1])
        self._shrink_snapshots()

    def drop_cached(self) -> int:
        """The trip's emergency clear: forget every cached block and snapshot."""
        n = self.cached
        for block in list(self._cached):
            self._evict(block)
        self.dropped_snapshots.extend(self._snapshots.values())
        self._snapshots.clear()
        return n

    def take_dropped_snapshots(self) -> list[Hashable]:
        out, self.dropped_snapshots = self.dropped_snapshots, []
        return out

    # --- internals --------------------------------------------------------------------------
    def _shrink_snapshots(self) -> None:
        """Snapshots are reclaimable: drop the oldest while reservations need their room."""
        while self._snapshots and self.committed + self.snapshot_blocks > self.total:
            _, key = self._snapshots.popitem(last=False)
            self.dropped_snapshots.append(key)

    def _touch(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._cached[block]
            self._held += 1
        self._ref[block] += 1
        if self._ref[block] == 2:
            self._shared += 1

    def _take(self) -> int:
        if self._empty:
            return heapq.heappop(self._empty)
        block = next(iter(self._cached))  # least recently used
        self._evict(block)
        return heapq.heappop(self._empty)

    def _evict(self, block: int) -> None:
        del self._cached[block]
        h = self._hash[block]
        self._hash[block] = None
        if h is not None:
            del self._by_hash[h]
            key = self._snapshots.pop(h, None)
            if key is not None:
                self.dropped_snapshots.append(key)
        self.counters["evicted_blocks"] += 1
        heapq.heappush(self._empty, block)
