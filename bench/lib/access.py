"""A plimsoll worker's access lines, read back from its log: the server's own clock.

Each finished request writes one line (``plimsoll.access``, web/access_log.py) with its times
from arrival: ``parse_s``, ``submit_s``, ``admit_s``, ``ttft_s``, ``total_s`` and ``render_s``
(a duration). A benchmark reads the lines its requests wrote to set the server's TTFT beside
the client's (the client's includes its own work: a connection, encoding the body).
``mlx_lm.server`` writes none: its caller passes no log (None), and gets no lines at once
rather than a wait for lines that never come.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

MARK = 'plimsoll.access access route="POST '
FIELD = re.compile(r"\b([a-z_]+)=([0-9]+(?:\.[0-9]+)?)(?=\s|$)")


def lines(log: Path | None) -> list[dict[str, float]]:
    """Every access line's numeric fields, in the order written."""
    if log is None:
        return []
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [{k: float(v) for k, v in FIELD.findall(x)} for x in text.splitlines() if MARK in x]


def count(log: Path | None) -> int:
    return len(lines(log))


def since(log: Path | None, skip: int, want: int,
          wait_s: float = 3.0) -> list[dict[str, float]]:
    """The lines after the first ``skip``, waiting up to ``wait_s`` for ``want`` of them (a
    line is written as its request ends, a moment after its client saw the end); fewer if
    they do not come (a server that writes none)."""
    if log is None:
        return []
    deadline = time.monotonic() + wait_s
    while True:
        got = lines(log)[skip:]
        if len(got) >= want or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


def ttfts(log: Path | None, skip: int, want: int) -> list[float]:
    """The server's TTFTs of the ``want`` requests that ended after the first ``skip`` lines
    (in the order they ended; empty for a server that writes no access lines)."""
    return [f["ttft_s"] for f in since(log, skip, want) if "ttft_s" in f]
