"""Stopping a thread that ran MLX: wait until the OS thread is gone, not only its Python code.

``Thread.join`` returns once the thread's Python function is done and its thread state is
deleted; the native thread then runs its thread-local destructors, and one of MLX's Python
bindings takes the GIL in its own. If the main thread has begun finalizing the interpreter
by then, taking the GIL makes that thread exit inside a ``noexcept`` destructor:
``std::terminate`` ("terminate called without an active exception"), and a worker that
was asked to stop dies with SIGABRT instead of exit status 0 (about one stop in fifteen
here, right after a stream was cut by the drain). :func:`wait_gone` closes the race: after
the join it waits, holding no GIL, for the kernel to report the thread gone
(``/proc/self/task/TID`` on Linux; elsewhere it returns at once).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

POLL_S = 0.002


def wait_gone(thread: threading.Thread, timeout_s: float) -> bool:
    """True once ``thread`` (already joined) has left the OS, False if it is still there
    after ``timeout_s``; True at once where the OS does not show threads."""
    tid = thread.native_id
    tasks = Path("/proc/self/task")
    if tid is None or not tasks.is_dir():
        return True
    deadline = time.monotonic() + timeout_s
    while (tasks / str(tid)).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True
