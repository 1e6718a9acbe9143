"""Memory probes: one reading of the host's memory world, whatever the OS.

One module per OS with the same shape (pure parsers, thin readers, ``read_snapshot``),
behind this one call, as psutil does with ``_pslinux``/``_psosx``. The per-OS modules
are imported on demand so a Linux host never loads the libproc/ctypes code and vice
versa.

May import: :mod:`plimsoll.core.units` only (a leaf; ``.importlinter`` checks it). mlx once,
lazily, in :mod:`.darwin` (Metal's recommended working set, macOS only).
"""

from __future__ import annotations

import sys

from plimsoll.probes.snapshot import MemorySnapshot, PressureLevel

__all__ = ["MemorySnapshot", "PressureLevel", "read_snapshot"]


def read_snapshot(pid: int | None = None) -> MemorySnapshot:
    """Read the memory world of ``pid`` (default: this process) on this platform.

    Raises ``ProcessLookupError`` for a pid that does not exist and
    ``NotImplementedError`` on a platform with no probe.
    """
    if sys.platform.startswith("linux"):
        from plimsoll.probes import linux

        return linux.read_snapshot(pid)
    if sys.platform == "darwin":
        from plimsoll.probes import darwin

        return darwin.read_snapshot(pid)
    raise NotImplementedError(f"no memory probe for platform {sys.platform!r}")
