"""The three units of the arithmetic, kept apart.

Every budget is GiB (binary, ``× 1024³``); ``iogpu.wired_limit_mb`` is MiB
(binary, ``× 1024²``, exact); Hugging Face model sizes are decimal GB (``× 1e9``).
Conversions live here and nowhere else, so a mixed-up unit is a one-line diff.
"""

from __future__ import annotations

import math

GIB = 1024**3
MIB = 1024**2
KIB = 1024
GB = 10**9


def gib_to_bytes(gib: float) -> int:
    """GiB (a policy budget) to bytes, rounded down so a budget never grows."""
    return math.floor(gib * GIB)


def mib_to_bytes(mib: int) -> int:
    """MiB (``iogpu.wired_limit_mb``) to bytes, exact."""
    return int(mib) * MIB


def bytes_to_mib_floor(n: int) -> int:
    """Bytes to whole MiB, rounded down: a ceiling written to the sysctl never exceeds ``n``."""
    return int(n) // MIB


def fmt_bytes(n: int | float) -> str:
    """Human figure in binary units (the unit every budget is in)."""
    n = float(n)
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
