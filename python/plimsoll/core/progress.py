"""Progress for long work: a live status line on a terminal, plain lines otherwise.

Long steps (building a demo model, loading, calibrating) report through a
``Callable[[str], None]``; this module turns that into rich's status spinner when
stderr is a TTY and into timestamped plain lines when it is not (CI logs, launchd).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Reporter = Callable[[str], None]


@contextmanager
def progress(title: str, *, stream=None) -> Iterator[Reporter]:
    """Yield a reporter; on a TTY a spinner shows the latest line, else each line is printed."""
    out = stream if stream is not None else sys.stderr
    start = time.monotonic()
    if getattr(out, "isatty", lambda: False)():
        from rich.console import Console

        console = Console(file=out)
        with console.status(f"{title}…") as status:

            def report(msg: str) -> None:
                status.update(f"{title}: {msg}")
                console.log(msg)

            yield report
        console.log(f"{title}: done in {time.monotonic() - start:.1f} s")
    else:

        def report(msg: str) -> None:
            print(f"[{time.monotonic() - start:6.1f}s] {title}: {msg}", file=out, flush=True)

        yield report
        print(f"[{time.monotonic() - start:6.1f}s] {title}: done", file=out, flush=True)
