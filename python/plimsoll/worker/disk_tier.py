"""A bounded disk tier for KV blocks: files keyed by the chained block hash (no mlx).

Cached blocks leaving memory (LRU eviction, the trip's clear, a clean shutdown) are
written here; a later prompt whose block hashes match reads them back instead of
prefilling them (:mod:`plimsoll.worker.disk_restore` does the scheduler side,
:mod:`plimsoll.engine.block_io` the engine side).

- **Key.** A block hash is chained on its parents (:func:`plimsoll.worker.pool.block_hash`),
  so one hash names a whole prefix. What else makes KV reusable — the weights' hash, the
  KV dtype, the block size, the bytes per block and this format's version — is the
  *tier key*: files live in ``root/<tier key>/<block hash>.kvb``, so another model, dtype
  or block size never sees them. The cap bounds that directory.
- **File.** ``MAGIC``, a little-endian u32 header length, a JSON header (tier key, block
  hash, payload length, SHA-256 of the payload), then the payload. A file whose magic,
  header, key, length or checksum is off is never loaded: it is deleted and counted as a
  miss (``corrupt``).
- **Private.** The root and the key's directory are this user's alone
  (:func:`plimsoll.core.paths.private_dir`: created 0700; one another user owns or may reach
  turns the tier off with that reason), so no one else can read what was said or plant a
  block; files are written 0600.
- **Atomic.** Written to a temp file in the same directory, fsynced, then ``os.replace``d:
  a crash leaves a whole file or none (temp files are swept at start).
- **Bounded.** An LRU index in memory (rebuilt from the directory, oldest mtime first,
  at start) evicts the oldest files while the directory holds more than ``cap_bytes``.
- **Bad disks.** ENOSPC, EACCES, EROFS, EDQUOT or EPERM on a write turn the tier off with one
  logged reason (``state``/``reason`` in :meth:`DiskStore.stats`); reads then miss, nothing
  else fails.
- **Writer.** :meth:`DiskStore.put` hands a payload to one writer thread through a queue
  bounded in bytes (``buffer_bytes``): the host memory the tier adds is that buffer plus
  one block being read. A full buffer drops the write (counted) unless ``wait=True``
  (shutdown and the trip's clear wait for room).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import struct
import threading
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from plimsoll.core.paths import private_dir

log = logging.getLogger("plimsoll.worker.disk")

MAGIC = b"PLKVBLK1"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
_HEAD = struct.Struct("<I")
OFF_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT, errno.EPERM}


def tier_key(weights_hash: str, kv_dtype: str, block_tokens: int, block_bytes: int,
             engine_version: str = "") -> str:
    """What makes a stored block reusable, besides its chained hash (hex, 32 chars)."""
    raw = (f"v{FORMAT_VERSION}|{weights_hash}|{kv_dtype}|{block_tokens}|{block_bytes}|"
           f"{engine_version}")
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def encode(key: str, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """One file's bytes: magic, header length, JSON header, payload."""
    view = memoryview(payload).cast("B")
    head = json.dumps({"format": FORMAT_VERSION, "key": key, "hash": block_hash.hex(),
                       "length": view.nbytes, "sha256": hashlib.sha256(view).hexdigest()},
                      sort_keys=True).encode()
    return MAGIC + _HEAD.pack(len(head)) + head + view.tobytes()


def decode(data: bytes, key: str, block_hash: bytes) -> bytes | None:
    """The payload of a file's bytes if every check passes, else None."""
    n = len(MAGIC) + _HEAD.size
    if len(data) < n or data[:len(MAGIC)] != MAGIC:
        return None
    (hlen,) = _HEAD.unpack_from(data, len(MAGIC))
    if n + hlen > len(data):
        return None
    try:
        head = json.loads(data[n:n + hlen])
    except ValueError:
        return None
    payload = data[n + hlen:]
    if (not isinstance(head, dict) or head.get("format") != FORMAT_VERSION
            or head.get("key") != key or head.get("hash") != block_hash.hex()
            or head.get("length") != len(payload)
            or head.get("sha256") != hashlib.sha256(payload).hexdigest()):
        return None
    return payload


class DiskStore:
    """The files of one tier key under ``root``; see the module docstring."""

    def __init__(self, root: str | Path, key: str, cap_bytes: int, *,
                 buffer_bytes: int = 8 << 20, fsync: bool = True):
        self.root = Path(root)
        self.key = key
        self.dir = self.root / key
        self.cap_bytes = int(cap_bytes)
        self.buffer_bytes = int(buffer_bytes)
        self.fsync = fsync
        self.state = "on"
        self.reason = ""
        self.counters = dict.fromkeys(
            ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "files_written",
             "evicted_files", "dropped_writes"), 0)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._size = 0
        self._lock = threading.Lock()  # index, size, counters, state (writer vs scheduler)
        self._room = threading.Condition(self._lock)
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._queued = 0
        self._busy = False
        self._closed = False
        self._tmp = 0
        try:
            private_dir(self.root, "KV blocks (conversations)")
            private_dir(self.dir, "KV blocks (conversations)")
            self._rebuild()
        except OSError as err:
            self._off(f"cannot use {self.dir}: {err}")
        self._writer = threading.Thread(target=self._write_loop, name="plimsoll-disk",
                                        daemon=True)
        self._writer.start()

    # --- the index ----------------------------------------------------------------------
    def _rebuild(self) -> None:
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                h = bytes.fromhex(path.stem)
                st = path.lstat()
            except (ValueError, OSError):
                continue
            if not stat.S_ISREG(st.st_mode):  # a link or a FIFO is no block of ours
                continue
            found.append((st.st_mtime_ns, h, st.st_size))
        for _, h, size in sorted(found):
            self._index[h] = size
            self._size += size
        self._trim()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        return self.state == "on" and block_hash in self._index

    @property
    def size_bytes(self) -> int:
        return self._size

    @property
    def files(self) -> int:
        return len(self._index)

    def _forget(self, block_hash: bytes) -> None:
        size = self._index.pop(block_hash, None)
        if size is not None:
            self._size -= size

    def _trim(self) -> None:
        """Delete the oldest files while the directory is over its cap (lock held)."""
        while self._index and self._size > self.cap_bytes:
            h, size = self._index.popitem(last=False)
            self._size -= size
            self.counters["evicted_files"] += 1
            try:
                self.path(h).unlink(missing_ok=True)
            except OSError as err:
                log.warning("disk tier: cannot delete %s: %s", self.path(h), err)

    def _off(self, reason: str) -> None:
        if self.state == "on":
            self.state, self.reason = "off", reason
            log.error("disk tier off: %s", reason)

    # --- reads (the scheduler thread) -------------------------------------------------------
    def get(self, block_hash: bytes) -> bytes | None:
        """The payload stored for ``block_hash``, or None (a miss). A file that fails any
        check is deleted and counted ``corrupt``."""
        with self._lock:
            if self.state != "on" or block_hash not in self._index:
                self.counters["misses"] += 1
                return None
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        payload = decode(data, self.key, block_hash)
        with self._lock:
            if payload is None:
                self.counters["misses"] += 1
                self.counters["corrupt"] += 1
                self._forget(block_hash)
                log.warning("disk tier: %s failed its checks; deleted", path.name)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                return None
            self.counters["hits"] += 1
            self.counters["bytes_read"] += len(data)
            self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):  # the LRU order survives a restart
            os.utime(path)
        return payload

    def note_miss(self) -> None:
        with self._lock:
            self.counters["misses"] += 1

    # --- writes (queued for the writer thread) ----------------------------------------------
    def put(self, block_hash: bytes, payload: bytes | memoryview, *, wait: bool = False
            ) -> bool:
        """Queue ``payload`` for ``block_hash``; False if the tier is off, the block is
        already stored, or the buffer is full (and not ``wait``)."""
        data = bytes(memoryview(payload).cast("B"))
        with self._lock:
            if self.state != "on" or self._closed or block_hash in self._index:
                return False
            if len(data) > self.cap_bytes:
                return False
            while self._queued and self._queued + len(data) > self.buffer_bytes:
                if not wait:
                    self.counters["dropped_writes"] += 1
                    return False
                self._room.wait()
                if self.state != "on":
                    return False
            self._queue.append((block_hash, data))
            self._queued += len(data)
            self._room.notify_all()
        return True

    def has_room(self, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` would be queued now without waiting."""
        with self._lock:
            return (self.state == "on" and not self._closed
                    and (not self._queued or self._queued + nbytes <= self.buffer_bytes))

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait until every queued write is on disk (or the tier is off)."""
        with self._lock:
            self._room.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._room.notify_all()
        self._writer.join(timeout)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                self._room.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                block_hash, data = self._queue.popleft()
                self._busy = True
            try:
                self._write(block_hash, data)
            finally:
                with self._lock:
                    self._queued -= len(data)
                    self._busy = False
                    self._room.notify_all()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        if self.state != "on":
            return
        blob = encode(self.key, block_hash, payload)
        self._tmp += 1
        tmp = self.dir / f".tmp-{os.getpid()}-{self._tmp}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path(block_hash))
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            with self._lock:
                if err.errno in OFF_ERRNOS:
                    self._off(f"writing {self.dir}: {err.strerror} (errno "
                              f"{errno.errorcode.get(err.errno, err.errno)}); serving "
                              "continues without the disk tier")
                else:
                    log.warning("disk tier: write of %s failed: %s", block_hash.hex(), err)
            return
        with self._lock:
            self._forget(block_hash)
            self._index[block_hash] = len(blob)
            self._size += len(blob)
            self.counters["bytes_written"] += len(blob)
            self.counters["files_written"] += 1
            self._trim()

    # --- status -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self.state, "reason": self.reason, "path": str(self.dir),
                    "files": len(self._index), "size_bytes": self._size,
                    "cap_bytes": self.cap_bytes, "buffer_bytes": self.buffer_bytes,
                    "queued_bytes": self._queued, **self.counters}
