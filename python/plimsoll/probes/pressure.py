"""The pressure probe: one :class:`PressureReading` of how hard the OS is fighting for memory.

Why a probe of its own: the proxy's tripwire polls this every second or so, and needs only
the pressure figures, not a whole :class:`~.snapshot.MemorySnapshot` (cgroups, RSS, the
ceiling). It also needs the raw figures, not a level, because the thresholds are the
policy's (``pressure`` in the policy file) and a page-out *rate* takes two readings.

- Linux: PSI ``some avg10`` and ``full avg10`` from ``/proc/pressure/memory`` (Linux 4.20+)
  and the ``pswpout`` counter of ``/proc/vmstat`` (pages swapped out since boot).
- macOS: ``kern.memorystatus_vm_pressure_level`` (1 normal, 2 warn, 4 critical) and
  ``vm_stat``'s Pageouts + Swapouts (pages that left RAM for disk since boot).

The parsers are :mod:`.linux` and :mod:`.darwin`'s (pure, tested on fixtures); this module
only reads. ``PLIMSOLL_PSI_PATH`` / ``PLIMSOLL_VMSTAT_PATH`` point the Linux reader at other
files (also on macOS: a set PSI path selects the file reader), so a test can drive a real
proxy into pressure by writing a file in the kernel's format.

Invariant: a reading never raises for a missing or unreadable source; it says what it could
not read in ``error`` and leaves the figure ``None`` (the tripwire is a backstop and must not
take the proxy down with it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import darwin, linux

PSI_PATH_ENV = "PLIMSOLL_PSI_PATH"
VMSTAT_PATH_ENV = "PLIMSOLL_VMSTAT_PATH"
PSI_PATH = "/proc/pressure/memory"
VMSTAT_PATH = "/proc/vmstat"

Clock = Callable[[], float]


@dataclass(frozen=True)
class PressureReading:
    """Raw pressure figures at one instant (``mono``: ``time.monotonic()``).

    ``page_outs`` is cumulative since boot (a rate needs two readings); ``None`` where the
    source was unreadable, with the reason in ``error``.
    """

    platform: Literal["linux", "darwin"]
    mono: float
    some_avg10: float | None = None
    full_avg10: float | None = None
    darwin_level: int | None = None
    page_outs: int | None = None
    source: str = ""
    error: str | None = None

    @property
    def has_signal(self) -> bool:
        """True when at least one pressure figure (PSI or the macOS level) was read."""
        return self.some_avg10 is not None or self.darwin_level is not None

    def describe(self) -> str:
        """The figures as one line, e.g. 'PSI memory some avg10=60.00 full avg10=0.00'."""
        parts = []
        if self.some_avg10 is not None:
            full = "n/a" if self.full_avg10 is None else f"{self.full_avg10:.2f}"
            parts.append(f"PSI memory some avg10={self.some_avg10:.2f} full avg10={full}")
        if self.darwin_level is not None:
            parts.append(f"kern.memorystatus_vm_pressure_level={self.darwin_level}")
        if self.page_outs is not None:
            parts.append(f"page-outs since boot {self.page_outs}")
        if self.error:
            parts.append(self.error)
        return "; ".join(parts) or "no reading"


def _read_text(path: str) -> tuple[str | None, str | None]:
    try:
        return Path(path).read_text(), None
    except OSError as err:  # missing (Linux < 4.20, CONFIG_PSI=n), EOPNOTSUPP (psi=0)
        return None, f"cannot read {path}: {err.strerror or err}"


def read_linux(psi_path: str | None = None, vmstat_path: str | None = None,
               clock: Clock = time.monotonic) -> PressureReading:
    """PSI and ``pswpout`` from the given files (default: the env overrides, else /proc)."""
    psi_path = psi_path or os.environ.get(PSI_PATH_ENV) or PSI_PATH
    vmstat_path = vmstat_path or os.environ.get(VMSTAT_PATH_ENV) or VMSTAT_PATH
    errors: list[str] = []
    some = full = None
    text, err = _read_text(psi_path)
    if text is not None:
        try:
            psi = linux.parse_psi(text)
            some, full = psi.some_avg10, psi.full_avg10
        except ValueError as exc:  # a half-written file, or not PSI at all
            err = f"{psi_path}: {exc}"
    if err:
        errors.append(err)
    page_outs = None
    text, err = _read_text(vmstat_path)
    if text is not None:
        page_outs = linux.parse_vmstat_pswpout(text)
    elif err:
        errors.append(err)
    return PressureReading("linux", clock(), some_avg10=some, full_avg10=full,
                           page_outs=page_outs, source=f"{psi_path}, {vmstat_path} pswpout",
                           error="; ".join(errors) or None)


def read_darwin(run: darwin.Runner = darwin.run_command,
                clock: Clock = time.monotonic) -> PressureReading:
    """``sysctl kern.memorystatus_vm_pressure_level`` and ``vm_stat`` page-outs."""
    errors: list[str] = []
    level = darwin.read_sysctl("kern.memorystatus_vm_pressure_level", run)
    if level is None:
        errors.append("sysctl kern.memorystatus_vm_pressure_level gave no value")
    page_outs = None
    vm_text = run([darwin.VM_STAT])
    if vm_text is None:
        errors.append("vm_stat failed")
    else:
        try:
            vm = darwin.parse_vm_stat(vm_text)
            # Pageouts (dirty file pages written back) + Swapouts (compressed pages to swap),
            # as in the snapshot: either way memory left RAM for disk.
            page_outs = vm.pageouts + vm.swapouts
        except ValueError as exc:
            errors.append(str(exc))
    return PressureReading("darwin", clock(), darwin_level=level, page_outs=page_outs,
                           source="sysctl kern.memorystatus_vm_pressure_level, vm_stat",
                           error="; ".join(errors) or None)


def read_pressure() -> PressureReading:
    """One reading on this platform (a set ``PLIMSOLL_PSI_PATH`` selects the file reader)."""
    if sys.platform == "darwin" and not os.environ.get(PSI_PATH_ENV):
        return read_darwin()
    return read_linux()
