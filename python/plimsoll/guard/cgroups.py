"""Memory cgroups as objects: create one per worker, limit it, read it, remove it.

This is the effect edge of the per-process guard (:mod:`plimsoll.guard`): the kernel
enforces the limit on the worker's *whole* footprint (MLX buffers, numpy copies, glibc
arenas, page cache it touched), and an OOM kill stays inside the worker's cgroup. v1
(``memory.limit_in_bytes``) and v2 (``memory.max``) have different file names and event
formats; :class:`Cgroup` hides that. Reading a missing file gives ``None``, never a guess.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from plimsoll.probes import linux

#: v1 and v2 names of the same figures.
FILES = {
    "v1": {"limit": "memory.limit_in_bytes", "usage": "memory.usage_in_bytes",
           "peak": "memory.max_usage_in_bytes", "procs": "cgroup.procs"},
    "v2": {"limit": "memory.max", "usage": "memory.current", "peak": "memory.peak",
           "procs": "cgroup.procs"},
}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _fields(text: str | None) -> dict[str, int]:
    """``key value`` lines (memory.stat, memory.events, memory.oom_control) as a dict."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True)
class Cgroup:
    """One memory cgroup directory (``version`` says which file names it has)."""

    version: linux.CgroupVersion
    path: Path

    def _file(self, key: str) -> Path:
        return self.path / FILES[self.version][key]

    def _int(self, key: str) -> int | None:
        text = _read(self._file(key))
        if text is None:
            return None
        parse = linux.parse_v1_limit if self.version == "v1" else linux.parse_v2_limit
        return parse(text) if key == "limit" else int(text.strip())

    # --- reading --------------------------------------------------------------------------
    def limit(self) -> int | None:
        """The hard limit in bytes, or None when unlimited."""
        return self._int("limit")

    def usage(self) -> int | None:
        """Everything charged to the cgroup, page cache included."""
        return self._int("usage")

    def max_usage(self) -> int | None:
        """The high-water mark (v1 ``max_usage_in_bytes``; v2 ``memory.peak``, Linux ≥ 5.19)."""
        return self._int("peak")

    def working_set(self) -> int | None:
        """Usage less inactive file pages (what the kernel cannot drop cheaply).

        This is the figure the soft line watches: a worker that has read its weights has
        them in page cache, charged here, and the kernel drops inactive file pages before
        it OOM-kills, so counting them would trip on memory that is not really held.
        """
        usage = self.usage()
        if usage is None:
            return None
        stat = _fields(_read(self.path / "memory.stat"))
        inactive = stat.get("total_inactive_file" if self.version == "v1" else "inactive_file",
                            stat.get("inactive_file", 0))
        return max(0, usage - inactive)

    def events(self) -> dict[str, int]:
        """``failcnt`` (allocations refused at the limit) and ``oom_kill`` counts."""
        if self.version == "v1":
            fail = _read(self.path / "memory.failcnt")
            oom = _fields(_read(self.path / "memory.oom_control"))
            return {"failcnt": int(fail) if fail else 0, "oom_kill": oom.get("oom_kill", 0),
                    "under_oom": oom.get("under_oom", 0)}
        ev = _fields(_read(self.path / "memory.events"))
        return {"failcnt": ev.get("max", 0), "oom_kill": ev.get("oom_kill", 0),
                "under_oom": ev.get("oom", 0)}

    def pids(self) -> list[int]:
        return [int(p) for p in (_read(self._file("procs")) or "").split()]

    def stats(self) -> dict[str, int | str | None]:
        return {"version": self.version, "path": str(self.path), "limit_bytes": self.limit(),
                "usage_bytes": self.usage(), "working_set_bytes": self.working_set(),
                "max_usage_bytes": self.max_usage(), **self.events()}

    # --- effects --------------------------------------------------------------------------
    def set_limit(self, limit_bytes: int) -> None:
        self._file("limit").write_text(str(int(limit_bytes)))

    def add(self, pid: int) -> None:
        """Move ``pid`` in; memory it allocates from now on is charged here."""
        self._file("procs").write_text(str(pid))

    def remove(self, timeout_s: float = 5.0) -> bool:
        """rmdir, retrying while a just-exited task still holds it; False if it stayed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


# --- finding a controller ----------------------------------------------------------------


def memory_mount() -> tuple[linux.CgroupVersion, Path] | None:
    """Where the memory controller is mounted: v1 if a v1 memory hierarchy exists."""
    mounts = linux.parse_mountinfo(_read(Path("/proc/self/mountinfo")) or "")
    if "v1" in mounts:
        return "v1", Path(mounts["v1"].mount_point)
    if "v2" in mounts:
        root = Path(mounts["v2"].mount_point)
        if "memory" in (_read(root / "cgroup.controllers") or "").split():
            return "v2", root
    return None


def own_directory(version: linux.CgroupVersion, root: Path) -> Path:
    """This process's own memory cgroup (its leaf) as a directory under the mount; the
    mount point when it is not visible (a container without a cgroup namespace)."""
    paths = linux.parse_proc_cgroup(_read(Path("/proc/self/cgroup")) or "")
    mounts = linux.parse_mountinfo(_read(Path("/proc/self/mountinfo")) or "")
    if version not in paths or version not in mounts:
        return root
    return Path(linux.cgroup_levels(mounts[version], paths[version])[0][1])


def default_parent() -> Path | None:
    """Where worker cgroups go by default: ``plimsoll`` *below the creator's own cgroup*,
    so every limit that binds the creator (a proxy in a cgroup: its whole memory world is
    that cgroup's usage) binds and counts its workers too. At the root that is the old
    ``<mount>/plimsoll``. (Under cgroup v2 a non-root cgroup with processes in it cannot
    delegate the memory controller: creation fails and the worker, unguarded, stays in
    its creator's cgroup, still bound and counted.)"""
    found = memory_mount()
    if found is None:
        return None
    version, root = found
    return own_directory(version, root) / "plimsoll"


def unavailable_reason(parent: Path | None = None) -> str | None:
    """Why a per-worker cgroup cannot be made here, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/mountinfo").exists():
        return "not Linux (no /proc)"
    found = memory_mount()
    if found is None:
        return "no memory cgroup controller is mounted"
    where = parent if parent is not None else default_parent()
    if not os.access(where if where.exists() else where.parent, os.W_OK):
        return f"{where} is not writable (not root, or a read-only cgroup mount)"
    return None


def create(name: str, limit_bytes: int, parent: Path | None = None) -> Cgroup:
    """Make ``parent``/``name`` (default parent: :func:`default_parent`) with a limit.

    v2 first needs ``+memory`` in the parent's ``cgroup.subtree_control``. Raises OSError
    with the path when the kernel says no; the caller decides whether that is fatal.
    """
    found = memory_mount()
    if found is None:
        raise OSError(errno.ENOENT, "no memory cgroup controller is mounted")
    version, root = found
    base = parent if parent is not None else default_parent()
    base.mkdir(exist_ok=True)
    if version == "v2":
        for d in [*reversed(base.relative_to(root).parents), base.relative_to(root)]:
            ctl = root / d / "cgroup.subtree_control"
            if "memory" not in (_read(ctl) or "").split():
                ctl.write_text("+memory")
    path = base / name
    try:
        path.mkdir()
    except FileNotFoundError:  # the last sibling's close removed an emptied base meanwhile
        base.mkdir(exist_ok=True)
        path.mkdir()
    cg = Cgroup(version, path)
    try:
        cg.set_limit(limit_bytes)
    except OSError:
        cg.remove()
        raise
    return cg


def own(pid: int | None = None) -> Cgroup | None:
    """The cgroup whose limit binds ``pid`` (default: self): its leaf or the tightest ancestor.

    Resolved once (the worker then reads only the usage files on its hot path); None when
    no level has a limit.
    """
    found = memory_mount()
    if found is None:
        return None
    version, _ = found
    paths = linux.parse_proc_cgroup(_read(Path(f"/proc/{pid or 'self'}/cgroup")) or "")
    if version not in paths:
        return None
    mounts = linux.parse_mountinfo(_read(Path("/proc/self/mountinfo")) or "")
    best: tuple[int, Cgroup] | None = None
    for _hier, directory in linux.cgroup_levels(mounts[version], paths[version]):
        cg = Cgroup(version, Path(directory))
        limit = cg.limit()
        if limit is not None and (best is None or limit < best[0]):
            best = (limit, cg)
    return best[1] if best else None
