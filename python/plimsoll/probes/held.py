"""What a process holds that its exit gives back to the host (a probe: reads /proc).

On Linux that is its anonymous resident memory (``RssAnon``): file-backed pages (the
interpreter, shared libraries, the mmapped safetensors) stay in the page cache after
the exit and were never counted in ``MemTotal − MemAvailable``, so VmRSS would ask the
release check for memory that cannot come back. On macOS the probe's per-process
figure is ``phys_footprint``, which already leaves clean file-backed pages out.
"""

from __future__ import annotations

import os
import sys

from ..units import KIB


def parse_rss_anon(status_text: str) -> int | None:
    """``/proc/<pid>/status`` → RssAnon in bytes (None on kernels before 4.5, which lack it)."""
    for line in status_text.splitlines():
        if line.startswith("RssAnon:"):
            value, unit = line.split()[1:3]
            return int(value) * (KIB if unit == "kB" else 1)
    return None


def held_bytes(pid: int) -> int:
    """Memory ``pid`` holds that its exit releases; 0 if it is already gone."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/status") as f:
                text = f.read()
        except OSError:
            return 0
        anon = parse_rss_anon(text)
        if anon is not None:
            return anon
    from . import read_snapshot

    try:
        return read_snapshot(pid).process_footprint_bytes
    except (ProcessLookupError, OSError):
        return 0


def anon_bytes_except(pid: int) -> int:
    """Anonymous memory of every visible process but ``pid`` (Linux; 0 elsewhere)."""
    if not sys.platform.startswith("linux"):
        return 0
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == pid:
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                total += parse_rss_anon(f.read()) or 0
        except OSError:  # exited while we looked
            continue
    return total
