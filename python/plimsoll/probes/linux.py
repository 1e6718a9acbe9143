"""Linux memory probe: ``/proc`` plus the process's memory cgroup.

Why a cgroup: a Linux process has no separate wired ceiling. The hard line it must stay
under is its memory cgroup's limit (an OOM kill inside the cgroup is the Linux analogue of
the macOS panic), else physical RAM; so its whole memory world is
``total_ram = ceiling = min(cgroup limit, MemTotal)`` (docs/DESIGN.md, "The arithmetic").

Shape (psutil's ``_pslinux``): ``parse_*`` are pure functions of file text, tested on
fixtures; ``read_*`` do the I/O under a ``root`` prefix ("/" in production, a fixture tree
in tests); ``read_snapshot`` composes them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from plimsoll.core.units import KIB
from plimsoll.probes.snapshot import MemorySnapshot, PressureLevel

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX × PAGE_SIZE, rounded down to a page:
# 9223372036854771712 with 4 KiB pages, other values with 16/64 KiB pages. Anything this
# large is not a limit anyone set.
V1_NO_LIMIT_FLOOR = 2**62

CgroupVersion = Literal["v1", "v2"]
# Where systemd mounts the hierarchies; used only when mountinfo cannot be read.
DEFAULT_MOUNT: dict[CgroupVersion, str] = {"v1": "/sys/fs/cgroup/memory", "v2": "/sys/fs/cgroup"}
LIMIT_FILE: dict[CgroupVersion, str] = {"v1": "memory.limit_in_bytes", "v2": "memory.max"}
USAGE_FILE: dict[CgroupVersion, str] = {"v1": "memory.usage_in_bytes", "v2": "memory.current"}


class Mount(NamedTuple):
    """A cgroup mount: which directory of the hierarchy (``root``) is visible where."""

    root: str
    mount_point: str


class Psi(NamedTuple):
    some_avg10: float
    full_avg10: float | None


class PsiThresholds(NamedTuple):
    """PSI avg10 percentages at which pressure is called warn or critical.

    Any "full" stall means no task made progress, so its bar is the lowest. The defaults
    are the policy's ``pressure`` defaults (a test holds them equal), so ``plimsoll doctor``
    and the snapshot call a level where the proxy's tripwire would.
    """

    warn_some: float = 10.0
    critical_some: float = 25.0
    critical_full: float = 5.0


DEFAULT_PSI_THRESHOLDS = PsiThresholds()


@dataclass(frozen=True)
class CgroupLimit:
    """The binding limit: the smallest one on the process's cgroup or any ancestor.

    ``path`` is the cgroup that holds the limit; ``leaf`` is the process's own cgroup.
    ``usage_bytes`` is the limiting cgroup's usage, because that is what the kernel
    compares with the limit (it includes siblings under a limited parent).
    """

    version: CgroupVersion
    path: str
    leaf: str
    limit_bytes: int
    usage_bytes: int | None


# --- pure parsers ---------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` → bytes per field ("MemTotal: 24684092 kB" → 25276510208)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        unit = KIB if len(parts) > 1 and parts[1] == "kB" else 1
        out[key.strip()] = int(parts[0]) * unit
    return out


def parse_proc_cgroup(text: str) -> dict[CgroupVersion, str]:
    """``/proc/<pid>/cgroup`` → the memory cgroup path per hierarchy present.

    v1 lines are ``id:controllers:path`` ("4:memory:/a/b", controllers may be a list like
    "cpu,cpuacct"); the v2 line is ``0::/path``. Hybrid hosts have both.
    """
    paths: dict[CgroupVersion, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier_id, controllers, path = parts
        if hier_id == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


def _unescape_mount(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> dict[CgroupVersion, Mount]:
    """``/proc/self/mountinfo`` → the v1 memory mount and the v2 mount (first of each).

    Line: ``id parent maj:min root mount_point opts [optional...] - fstype source super``.
    The optional fields vary in number, so the line is split at the `` - `` separator.
    """
    mounts: dict[CgroupVersion, Mount] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if not sep or len(lf) < 5 or len(rf) < 3:
            continue
        mount = Mount(root=_unescape_mount(lf[3]), mount_point=_unescape_mount(lf[4]))
        if rf[0] == "cgroup" and "memory" in rf[2].split(","):
            mounts.setdefault("v1", mount)
        elif rf[0] == "cgroup2":
            mounts.setdefault("v2", mount)
    return mounts


def parse_v1_limit(text: str) -> int | None:
    """``memory.limit_in_bytes`` → bytes, or None for the "no limit" sentinel."""
    value = int(text.strip())
    return None if value >= V1_NO_LIMIT_FLOOR else value


def parse_v2_limit(text: str) -> int | None:
    """``memory.max`` → bytes, or None for ``max``."""
    value = text.strip()
    return None if value == "max" else int(value)


def parse_psi(text: str) -> Psi:
    """``/proc/pressure/memory`` → the 10-second averages (percent of wall time stalled).

    "some": at least one task stalled on memory; "full": all non-idle tasks stalled.
    """
    avg10: dict[str, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
        if kind in ("some", "full") and "avg10" in fields:
            avg10[kind] = float(fields["avg10"])
    if "some" not in avg10:
        raise ValueError(f"no 'some avg10=' in PSI text: {text!r}")
    return Psi(some_avg10=avg10["some"], full_avg10=avg10.get("full"))


def psi_level(psi: Psi, thresholds: PsiThresholds = DEFAULT_PSI_THRESHOLDS) -> PressureLevel:
    """Map PSI to a level (the tripwire stops admission before the OS reclaims hard)."""
    t = thresholds
    if psi.some_avg10 >= t.critical_some or (psi.full_avg10 or 0.0) >= t.critical_full:
        return "critical"
    return "warn" if psi.some_avg10 >= t.warn_some else "normal"


def parse_vmstat_pswpout(text: str) -> int:
    """``/proc/vmstat`` → ``pswpout`` (pages swapped out since boot).

    Absent without CONFIG_VM_EVENT_COUNTERS; then 0, as nothing can be observed.
    """
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "pswpout":
            return int(value)
    return 0


def parse_status_vmrss(text: str) -> int:
    """``/proc/<pid>/status`` → VmRSS in bytes; 0 for kernel threads, which have none."""
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            return int(value) * (KIB if unit == "kB" else 1)
    return 0


def cgroup_levels(mount: Mount, cgroup_path: str) -> list[tuple[str, str]]:
    """The cgroup and its visible ancestors as (hierarchy path, directory), leaf first.

    The directory is the mount point plus the path relative to the mount's root. In a
    container without a cgroup namespace, /proc/<pid>/cgroup shows the host path
    ("/docker/<id>") while the mount's root is that same path: it maps to the mount point.
    A path outside the mount's root cannot be seen at all; the mount point is the best
    view of it (what the JVM does). Ancestors above the mount root are invisible.
    """
    root = mount.root.rstrip("/")
    if cgroup_path == mount.root or cgroup_path.startswith(root + "/"):
        rel = cgroup_path[len(root) :].strip("/")
    else:
        rel = ""
    parts = rel.split("/") if rel else []
    levels = []
    for depth in range(len(parts), -1, -1):
        sub = "/".join(parts[:depth])
        hier = (root + "/" + sub).rstrip("/") or "/"
        levels.append((hier, os.path.join(mount.mount_point, sub).rstrip("/")))
    return levels


def available_bytes(mem: dict[str, int]) -> int:
    """MemAvailable; Linux < 3.14 lacks it, so then the classic free + buffers + cache."""
    if "MemAvailable" in mem:
        return mem["MemAvailable"]
    return mem.get("MemFree", 0) + mem.get("Buffers", 0) + mem.get("Cached", 0)


def cgroup_ceiling(mem: dict[str, int], cg: CgroupLimit | None) -> tuple[int, str, int]:
    """(ceiling, its source, in use): ``min(cgroup limit, MemTotal)``, clamp named.

    In use is the limiting cgroup's usage when the cgroup binds (what the OOM killer
    compares with the limit), else MemTotal - available.
    """
    mem_total = mem["MemTotal"]
    system_in_use = max(0, mem_total - available_bytes(mem))
    if cg is None:
        return mem_total, "MemTotal (no cgroup memory limit)", system_in_use
    limit_file = f"cgroup {cg.version} {LIMIT_FILE[cg.version]} of {cg.path}"
    if cg.limit_bytes > mem_total:
        return mem_total, f"MemTotal ({limit_file} = {cg.limit_bytes} B; clamped)", system_in_use
    inherited = f" (ancestor of {cg.leaf})" if cg.path != cg.leaf else ""
    in_use = cg.usage_bytes if cg.usage_bytes is not None else system_in_use
    return cg.limit_bytes, limit_file + inherited, in_use


# --- readers (I/O under a root prefix) -----------------------------------------------


def _read(root: str | os.PathLike[str], path: str) -> str | None:
    """Text of ``root``/``path``, or None when it is absent or unreadable."""
    try:
        return (Path(root) / path.lstrip("/")).read_text()
    except OSError:  # missing, EACCES, or EOPNOTSUPP (PSI disabled with psi=0)
        return None


def read_cgroup_limit(pid: int | None = None, root: str = "/") -> CgroupLimit | None:
    """The effective memory limit of ``pid`` (default: self), or None if unlimited.

    The effective limit is the minimum over the cgroup and its ancestors: a child with
    no limit inside a limited parent is limited. (cgroup v1 before Linux 5.11 could turn
    hierarchy off with memory.use_hierarchy=0; the minimum is then conservative.)
    Mount points come from our own mountinfo, since the path in /proc/<pid>/cgroup is
    rendered relative to the reader's cgroup namespace and read through our mounts.
    """
    who = "self" if pid is None else str(pid)
    text = _read(root, f"/proc/{who}/cgroup")
    if text is None:
        if pid is not None:
            raise ProcessLookupError(pid)
        return None  # Linux built without CONFIG_CGROUPS
    paths = parse_proc_cgroup(text)
    # Hybrid hosts list both; memory is enforced by the hierarchy holding the controller,
    # which is v1 whenever a v1 memory line exists.
    version: CgroupVersion = "v1" if "v1" in paths else "v2"
    if version not in paths:
        return None
    mounts = parse_mountinfo(_read(root, "/proc/self/mountinfo") or "")
    mount = mounts.get(version) or Mount("/", DEFAULT_MOUNT[version])
    cg_path = paths[version]
    parse = parse_v1_limit if version == "v1" else parse_v2_limit

    best: CgroupLimit | None = None
    for hier, directory in cgroup_levels(mount, cg_path):
        raw = _read(root, f"{directory}/{LIMIT_FILE[version]}")  # none on the v2 root
        limit = parse(raw) if raw is not None else None
        if limit is None or (best is not None and limit >= best.limit_bytes):
            continue
        usage = _read(root, f"{directory}/{USAGE_FILE[version]}")
        best = CgroupLimit(version, hier, cg_path, limit, int(usage) if usage else None)
    return best


def read_snapshot(
    pid: int | None = None, root: str = "/", thresholds: PsiThresholds = DEFAULT_PSI_THRESHOLDS
) -> MemorySnapshot:
    """One reading of the memory world of ``pid`` (default: this process)."""
    who = "self" if pid is None else str(pid)
    meminfo = _read(root, "/proc/meminfo")
    if meminfo is None:
        raise FileNotFoundError(f"{root}/proc/meminfo")
    ceiling, source, in_use = cgroup_ceiling(parse_meminfo(meminfo), read_cgroup_limit(pid, root))

    psi_text = _read(root, "/proc/pressure/memory")
    pressure: PressureLevel
    if psi_text is None:  # Linux < 4.20, CONFIG_PSI=n, or booted with psi=0
        pressure, detail = "unknown", "no /proc/pressure/memory (Linux < 4.20 or PSI off)"
    else:
        psi = parse_psi(psi_text)
        pressure = psi_level(psi, thresholds)
        full = "n/a" if psi.full_avg10 is None else f"{psi.full_avg10:.2f}"
        detail = f"PSI memory some avg10={psi.some_avg10:.2f} full avg10={full}"

    status = _read(root, f"/proc/{who}/status")
    if status is None and pid is not None:
        raise ProcessLookupError(pid)
    return MemorySnapshot(
        platform="linux",
        total_ram_bytes=ceiling,
        ceiling_bytes=ceiling,
        ceiling_source=source,
        in_use_bytes=in_use,
        process_footprint_bytes=parse_status_vmrss(status or ""),
        pressure=pressure,
        pressure_detail=detail,
        page_outs=parse_vmstat_pswpout(_read(root, "/proc/vmstat") or ""),
    )
