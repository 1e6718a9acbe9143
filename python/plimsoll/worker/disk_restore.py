"""The disk tier between the block pool and the engine: spill on the way out, restore on
the way in (the scheduler thread only; mlx only through :mod:`plimsoll.engine.block_io`).

- **Spill.** :class:`SpillingPool` is the scheduler's :class:`~plimsoll.worker.pool.BlockPool`
  with one addition: a cached block is handed to :meth:`DiskTier.spill` the moment it
  leaves memory, before its id can be reused — the LRU eviction under pressure, the cache
  cap, the trip's clear (:meth:`BlockPool.drop_cached`), and at a clean shutdown
  :meth:`DiskTier.spill_all` (which evicts everything cached through the same path). The
  engine export copies one block to host memory; the store's writer thread writes it
  (a queue bounded in bytes).
- **Write-behind.** When a sequence ends, its newly cached blocks are queued for disk at
  once while the buffer has room (:meth:`DiskTier.write_behind`), so a stop — the proxy's
  idle unload gives a worker 10 s — has little left to write, and a crash loses little.
- **Restore.** At admission, after the pool maps what memory still holds, the prompt's next
  block hashes are looked up on disk; each one found is given a block of the request's own
  reservation (:meth:`BlockPool.grow`: admission already counted it), read, checked and
  written into it. The first miss or failed check stops the run: the rest is prefilled.

Hybrid models are not served by the tier (:func:`plimsoll.engine.block_io.supports` says
why in status): their prefixes are prefilled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from plimsoll.worker.disk_tier import DiskStore, tier_key
from plimsoll.worker.pool import BlockPool

log = logging.getLogger("plimsoll.worker.disk")


def open_tier(root: str | Path, cap_bytes: int, model_dir: Path, engine: Any) -> DiskTier:
    """The worker's tier for ``model_dir``: keyed on its weights' hash (the calibration
    records' own), the engine's KV dtype, block size and bytes, mlx/mlx-lm versions."""
    from plimsoll.core.weights_key import engine_version, weights_hash

    return DiskTier.open(root, cap_bytes, engine, weights_hash=weights_hash(model_dir),
                         kv_dtype=str(engine.facts.kv_format), engine_version=engine_version())


class SpillingPool(BlockPool):
    """A block pool that tells ``on_evict(block, hash)`` before a cached block is forgotten,
    and ``on_cached([(block, hash), …])`` when a sequence's freed blocks become cached."""

    on_evict: Callable[[int, bytes], None] | None = None
    on_cached: Callable[[list[tuple[int, bytes]]], None] | None = None

    def free(self, seq_id: Hashable) -> None:
        seq = self._seqs.get(seq_id)
        table = list(seq.table) if seq is not None and self.on_cached is not None else []
        super().free(seq_id)
        cached = [(b, self._hash[b]) for b in table
                  if self._ref[b] == 0 and self._hash[b] is not None]
        if cached:
            try:
                self.on_cached(cached)
            except Exception:
                log.exception("disk tier: writing behind freed blocks failed")

    def _evict(self, block: int) -> None:
        h = self._hash[block]
        if self.on_evict is not None and h is not None:
            try:
                self.on_evict(block, h)
            except Exception:  # the tier must never break the pool
                log.exception("disk tier: spilling block %s failed", block)
        super()._evict(block)


class DiskTier:
    """One worker's disk tier: a :class:`DiskStore` and the engine it reads and writes."""

    def __init__(self, store: DiskStore, engine: Any, unavailable: str = ""):
        self.store, self.engine = store, engine
        self.unavailable = unavailable  # why this engine cannot use the tier ("" = it can)
        self.restored_blocks = 0
        self.spilled_blocks = 0
        self._wait = False

    @classmethod
    def open(cls, root: str | Path, cap_bytes: int, engine: Any, *, weights_hash: str,
             kv_dtype: str, engine_version: str = "",
             buffer_bytes: int | None = None) -> DiskTier:
        from plimsoll.engine.block_io import supports

        key = tier_key(weights_hash, kv_dtype, engine.block_tokens, engine.block_bytes,
                       engine_version)
        buffer = buffer_bytes or max(4 * engine.block_bytes, 8 << 20)
        store = DiskStore(root, key, cap_bytes, buffer_bytes=buffer)
        return cls(store, engine, supports(engine))

    @property
    def usable(self) -> bool:
        return not self.unavailable and self.store.state == "on"

    def attach(self, pool: BlockPool) -> None:
        if isinstance(pool, SpillingPool) and not self.unavailable:
            pool.on_evict = self.spill
            pool.on_cached = self.write_behind

    # --- out ------------------------------------------------------------------------------
    def spill(self, block: int, block_hash: bytes) -> None:
        """A cached block leaves memory: copy it out and queue it for disk."""
        if not self.usable or block_hash in self.store:
            return
        from plimsoll.engine.block_io import export_block

        if self.store.put(block_hash, export_block(self.engine, block), wait=self._wait):
            self.spilled_blocks += 1

    def write_behind(self, blocks: list[tuple[int, bytes]]) -> None:
        """A sequence ended: start writing its newly cached blocks (while the buffer has
        room; the rest go at eviction or shutdown), so a stop has little left to write."""
        if not self.usable:
            return
        from plimsoll.engine.block_io import export_block

        for block, block_hash in blocks:
            if block_hash in self.store:
                continue
            if not self.store.has_room(self.engine.block_bytes):
                return
            if self.store.put(block_hash, export_block(self.engine, block)):
                self.spilled_blocks += 1

    def spill_all(self, pool: BlockPool) -> int:
        """A clean shutdown: every cached block goes to disk (waiting for buffer room)."""
        if not self.usable:
            return 0
        self._wait = True
        try:
            n = pool.drop_cached()
        finally:
            self._wait = False
        self.store.flush()
        return n

    def shutdown(self, pool: BlockPool) -> None:
        """The scheduler stops cleanly: spill, and never let a failure stop the stop."""
        try:
            log.info("disk tier: %d cached blocks written at shutdown", self.spill_all(pool))
        except Exception:
            log.exception("disk tier: the shutdown spill failed")

    # --- in -------------------------------------------------------------------------------
    def restore(self, pool: BlockPool, seq_id: Hashable, hashes: Sequence[bytes],
                mapped: int, prompt_len: int) -> int:
        """Read the prompt's blocks after the ``mapped`` ones from disk into ``seq_id``'s
        reservation; returns the tokens restored (whole blocks; at least one prompt token
        is always left to prefill)."""
        if not self.usable:
            return 0
        from plimsoll.engine.block_io import import_block

        bt = pool.block_tokens
        limit = min(len(hashes), (prompt_len - 1) // bt)
        n = mapped
        while n < limit and hashes[n] in self.store:
            payload = self.store.get(hashes[n])
            if payload is None:
                break
            table = pool.grow(seq_id, (n + 1) * bt)
            if table is None:
                break
            try:
                import_block(self.engine, table[n], payload)
            except ValueError as err:  # a payload of another shape: never used
                log.warning("disk tier: block %s not restored: %s", hashes[n].hex(), err)
                break
            n += 1
        if n < limit and hashes[n] not in self.store:
            self.store.note_miss()  # the block that ended the run (a failed get counts itself)
        self.restored_blocks += n - mapped
        return (n - mapped) * bt

    def close(self) -> None:
        self.store.close()

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        if self.unavailable:
            s["state"], s["reason"] = "off", self.unavailable
        return {**s, "restored_blocks": self.restored_blocks,
                "spilled_blocks": self.spilled_blocks}
