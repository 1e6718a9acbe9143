"""The per-process total-memory guard (docs/DESIGN.md, "The invariants"), Linux side.

MLX's ``set_memory_limit`` bounds MLX's own buffers (and only on Metal); a worker's
whole footprint also holds numpy copies, glibc arenas, tokenizer state and the page
cache it touched. So each worker runs in its own memory cgroup:

- the **soft line** (``soft_fraction`` of the limit, 90 % by default) sits a margin
  (5 %) above what was admitted (footprint + runtime reserve). It is the worker's own:
  crossing it is an extra input to the scheduler's trip check, which drops cached
  prefixes, refuses the waiting, aborts the newest running request and answers new work
  with a reasoned 503 — before the hard line.
- the **hard line** is the cgroup limit (soft line / ``soft_fraction``). The kernel
  enforces it; if it is ever reached, the OOM kill stays inside the worker's cgroup (the
  proxy notices the exit and restarts it later) instead of taking the host down.

The limit is set *before* the worker runs any code: the launch wrapper creates the
cgroup and spawns ``python -m plimsoll.guard enter DIR -- ARGV…``, which writes its own
pid into the cgroup and execs the worker (an argument list, never a shell). Without root
or a writable memory controller the guard is skipped with the reason logged.

Where no cgroup can bind the worker (macOS; Linux without a writable memory controller)
the same lines are kept by the worker itself on its **whole-process footprint**: the
launcher passes the hard line in ``PLIMSOLL_FOOTPRINT_LIMIT_BYTES``; the worker samples
``phys_footprint`` (libproc ``proc_pid_rusage``, what jetsam counts) on macOS, its
anonymous resident memory (``RssAnon``) on Linux. The soft line feeds the scheduler exactly
as the cgroup's does; crossing the hard line ends the worker at once with exit status
:data:`EXIT_FOOTPRINT` (fail closed: the proxy notices the exit and restarts it later) —
before the OS is under pressure.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plimsoll.core.units import MIB

from . import cgroups

log = logging.getLogger("plimsoll.guard")

#: What a worker process holds beyond admission's formula before any model is loaded
#: (interpreter, MLX, tokenizers, HTTP stack): measured ≈ 0.3 GiB on Linux x86_64.
RUNTIME_RESERVE_BYTES = 512 * MIB
MARGIN_FRACTION = 0.05
MIN_MARGIN_BYTES = 64 * MIB
SOFT_FRACTION = 0.90
SOFT_ENV = "PLIMSOLL_GUARD_SOFT_FRACTION"
#: The hard line of a worker that no cgroup binds (set by the launcher, read by the worker).
FOOTPRINT_ENV = "PLIMSOLL_FOOTPRINT_LIMIT_BYTES"
#: The worker's exit status when its own footprint crossed the hard line.
EXIT_FOOTPRINT = 70
#: How often the footprint guard samples the hard line (the soft line is read per step).
FOOTPRINT_PERIOD_S = 0.05
_names = itertools.count()


# --- pure ---------------------------------------------------------------------------------
def guard_limit(footprint_bytes: int, *, runtime_bytes: int = RUNTIME_RESERVE_BYTES,
                margin_fraction: float = MARGIN_FRACTION,
                soft_fraction: float = SOFT_FRACTION) -> int:
    """The hard line, page-aligned, placed so that the *soft* line sits a margin above what
    was admitted (footprint + runtime reserve): a worker using all it was admitted never
    trips, and anything beyond the margin is refused well before the kernel's limit."""
    base = footprint_bytes + runtime_bytes
    soft = base + max(MIN_MARGIN_BYTES, math.ceil(margin_fraction * base))
    limit = math.ceil(soft / soft_fraction)
    return -(-limit // 4096) * 4096


def soft_line(limit_bytes: int, fraction: float = SOFT_FRACTION) -> int:
    """Where admission stops: a fraction of the hard line."""
    if not 0 < fraction <= 1:
        raise ValueError(f"soft fraction {fraction} is not in (0, 1]")
    return math.floor(fraction * limit_bytes)


def soft_fraction_from_env() -> float:
    raw = os.environ.get(SOFT_ENV)
    return float(raw) if raw else SOFT_FRACTION


# --- the launch side: one cgroup per worker -------------------------------------------
@dataclass
class WorkerGuard:
    """A worker's cgroup, owned by whoever spawned the worker; :meth:`close` removes it."""

    cgroup: cgroups.Cgroup
    limit_bytes: int

    @classmethod
    def create(cls, label: str, limit_bytes: int,
               parent: Path | None = None) -> tuple[WorkerGuard | None, str]:
        """A new limited cgroup, or (None, why not) — the caller logs the reason and goes on."""
        reason = cgroups.unavailable_reason(parent)
        if reason is not None:
            return None, reason
        name = f"{label}-{os.getpid()}-{next(_names)}"
        try:
            cg = cgroups.create(name, limit_bytes, parent)
            sweep_stale(cg.path.parent, cg.version)
        except OSError as err:
            return None, f"could not create memory cgroup {name}: {err}"
        return cls(cg, limit_bytes), f"memory cgroup {cg.path} limit {limit_bytes} B"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the cgroup from its first instruction."""
        return [sys.executable, "-m", "plimsoll.guard", "enter", str(self.cgroup.path),
                "--", *argv]

    def stats(self) -> dict:
        return self.cgroup.stats()

    def close(self) -> bool:
        """Remove the cgroup (the worker must have exited); False if the kernel kept it."""
        ok = self.cgroup.remove()
        if not ok:
            log.warning("memory cgroup %s still busy; left in place", self.cgroup.path)
        base = self.cgroup.path.parent
        found = cgroups.memory_mount()
        if ok and base == cgroups.default_parent() and found and base.parent != found[1]:
            # a default base below the creator's own cgroup goes when its last worker does
            # (a cgroup with a child cannot be removed); <mount>/plimsoll stays, as before
            with contextlib.suppress(OSError):
                base.rmdir()
        return ok


def sweep_stale(parent: Path, version: str) -> list[Path]:
    """Remove empty worker cgroups whose creator (the pid in the name) is gone: a proxy that
    was SIGKILLed never ran :meth:`WorkerGuard.close`."""
    removed = []
    for d in parent.glob("*-*-*"):
        try:
            creator = int(d.name.rsplit("-", 2)[1])
        except ValueError:
            continue
        if creator != os.getpid() and not Path(f"/proc/{creator}").exists():
            cg = cgroups.Cgroup(version, d)
            if not cg.pids() and cg.remove(timeout_s=0):
                removed.append(d)
    return removed


# --- the worker side: the soft line as a scheduler input -------------------------------
@dataclass(frozen=True)
class SelfGuard:
    """The cgroup that binds this process, read on the scheduler's hot path.

    The limit is re-read on every probe (one small file): whoever owns the cgroup may
    lower it (a mode downshift) and the soft line follows.
    """

    cgroup: cgroups.Cgroup
    soft_fraction: float

    @classmethod
    def find(cls, soft_fraction: float | None = None, also: Sequence[int] = ()
             ) -> SelfGuard | FootprintGuard | None:
        """The guard that binds this process: its cgroup, else the footprint line the
        launcher passed (armed here: the hard line is watched from now on), else None
        (then only the trip applies). ``also``: the other processes of this worker (the
        engine process passes its API process), whose footprint the line counts too."""
        fraction = soft_fraction_from_env() if soft_fraction is None else soft_fraction
        soft_line(1, fraction)  # validate once, loudly
        cg = cgroups.own() if sys.platform.startswith("linux") else None
        if cg is not None and cg.limit() is not None:
            return cls(cg, fraction)
        raw = os.environ.get(FOOTPRINT_ENV)
        if raw:
            guard = FootprintGuard(int(raw), fraction, *own_footprint_reader(also))
            guard.arm()
            return guard
        return None

    def probe(self) -> dict[str, int]:
        """The scheduler's extra inputs: working-set usage and the soft line."""
        limit = self.cgroup.limit()
        if limit is None:
            return {}
        return {"guard_usage": self.cgroup.working_set() or 0,
                "guard_soft": soft_line(limit, self.soft_fraction)}

    def status(self) -> dict:
        stats = self.cgroup.stats()
        limit = stats["limit_bytes"]
        return {**stats, "kind": "cgroup", "soft_fraction": self.soft_fraction,
                "soft_bytes": soft_line(limit, self.soft_fraction) if limit else None}


def own_footprint_reader(also: Sequence[int] = ()) -> tuple[Callable[[], int], str]:
    """This process's whole footprint (and that of the pids in ``also``, while they live) and
    what it is: ``phys_footprint`` on macOS (what jetsam and Activity Monitor count),
    anonymous resident memory (``RssAnon``) on Linux — clean file pages (a safetensors file
    being read, shared libraries) are reclaimable and never counted, as ``phys_footprint``
    leaves them out — and the resident set elsewhere."""
    pids = [os.getpid(), *also]
    if sys.platform == "darwin":
        from plimsoll.probes.darwin import read_phys_footprint

        def footprint() -> int:
            return sum(_alive_or_0(read_phys_footprint, pid) for pid in pids)

        return footprint, "phys_footprint"
    if sys.platform.startswith("linux"):
        from plimsoll.probes.held import parse_rss_anon

        def one(pid: int) -> int:
            return parse_rss_anon(Path(f"/proc/{pid}/status").read_text()) or 0

        def rss_anon() -> int:
            return sum(_alive_or_0(one, pid) for pid in pids)

        if rss_anon():
            return rss_anon, "RssAnon"
    import psutil

    procs = [psutil.Process(pid) for pid in pids]
    return (lambda: sum(_alive_or_0(lambda p: p.memory_info().rss, p) for p in procs)), "rss"


def _alive_or_0(read: Callable[[Any], int], what: Any) -> int:
    """``read(what)``, or 0 for a process that is gone."""
    import psutil

    try:
        return read(what)
    except (OSError, psutil.Error):
        return 0


@dataclass
class FootprintGuard:
    """Both lines on this process's own footprint, for a worker no cgroup binds.

    Invariant: the soft line (``soft_fraction`` of ``limit_bytes``) is a scheduler input
    like the cgroup's; a sample above ``limit_bytes`` ends the process with
    :data:`EXIT_FOOTPRINT` within one period, whatever the scheduler is doing.
    """

    limit_bytes: int
    soft_fraction: float
    read: Callable[[], int]
    source: str
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        if self.limit_bytes <= 0:
            raise ValueError(f"{FOOTPRINT_ENV}={self.limit_bytes}: the hard line must be a "
                             "positive number of bytes")

    def sample(self) -> int:
        used = self.read()
        self.peak_bytes = max(self.peak_bytes, used)
        return used

    def probe(self) -> dict[str, int]:
        return {"guard_usage": self.sample(),
                "guard_soft": soft_line(self.limit_bytes, self.soft_fraction)}

    def over_hard_line(self) -> str:
        """Why the hard line is crossed ("" when it is not)."""
        used = self.sample()
        if used > self.limit_bytes:
            return (f"{self.source} {used} B crossed the hard line {self.limit_bytes} B "
                    f"({FOOTPRINT_ENV})")
        return ""

    def arm(self, period_s: float = FOOTPRINT_PERIOD_S,
            on_cross: Callable[[str], None] | None = None) -> threading.Thread:
        """Watch the hard line from a daemon thread; on crossing, ``on_cross`` (default: log
        and ``os._exit(EXIT_FOOTPRINT)`` — no clean-up can be trusted to stay under it)."""
        def cross(why: str) -> None:
            log.critical("footprint guard: %s; ending the worker", why)
            logging.shutdown()
            os._exit(EXIT_FOOTPRINT)

        def watch() -> None:
            while True:
                why = self.over_hard_line()
                if why:
                    (on_cross or cross)(why)
                    return
                time.sleep(period_s)

        t = threading.Thread(target=watch, daemon=True, name="footprint-guard")
        t.start()
        return t

    def status(self) -> dict:
        return {"kind": "footprint", "source": self.source, "limit_bytes": self.limit_bytes,
                "usage_bytes": self.sample(), "peak_bytes": self.peak_bytes,
                "soft_fraction": self.soft_fraction,
                "soft_bytes": soft_line(self.limit_bytes, self.soft_fraction)}


def memory_probe_with_guard(base: Callable[[], dict[str, int]],
                            guard: SelfGuard | FootprintGuard | None
                            ) -> Callable[[], dict[str, int]]:
    if guard is None:
        return base
    return lambda: base() | guard.probe()


# --- the exec shim ----------------------------------------------------------------------
def enter_and_exec(cgroup_dir: str, argv: list[str]) -> None:
    """Write our pid into the cgroup, then become ``argv`` (the pid stays the same)."""
    Path(cgroup_dir, "cgroup.procs").write_text(str(os.getpid()))
    os.execv(argv[0], argv)


def main(args: list[str]) -> None:
    if len(args) < 4 or args[0] != "enter" or args[2] != "--":
        raise SystemExit("usage: python -m plimsoll.guard enter CGROUP_DIR -- ARGV…")
    enter_and_exec(args[1], args[3:])


if __name__ == "__main__":
    main(sys.argv[1:])
