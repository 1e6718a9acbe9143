"""The engine's process-wide limits and the trip's clear (plimsoll.engine.limits), on bytes the
OS reports."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from plimsoll.launch.spawn import worker_env

PROBE = """
import psutil, mlx.core as mx
from plimsoll.engine.limits import clear_buffer_cache
rss = lambda: psutil.Process().memory_info().rss
arrays = [mx.ones((256, 1024)) + i for i in range(256)]  # 1 MiB each: heap, not mmap
mx.eval(arrays)
full = rss()
keep = arrays[::64]  # a few survivors pin the heap above the freed ones
del arrays
mx.clear_cache()
cached_cleared = rss()
clear_buffer_cache()
print(full, cached_cleared, rss())
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and ctypes.util.find_library("c")),
                    reason="glibc's malloc_trim is the Linux C library's")
def test_the_trips_clear_gives_freed_heap_memory_back_to_the_os() -> None:
    """Under the worker's malloc settings (1 MiB arrays below the 32 MiB mmap threshold
    live in a glibc heap), MLX's ``clear_cache`` frees 255 MiB of arrays but the process
    keeps them resident; the trip's clear (``clear_buffer_cache``: then ``malloc_trim``)
    hands them back."""
    env = worker_env() | {"PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    full, cached_cleared, trimmed = map(int, out)
    mib = 1 << 20
    assert full - trimmed > 200 * mib, out  # handed back
    assert cached_cleared - trimmed > 200 * mib, out  # by the trim, not by MLX's clear
