"""The engine's process-wide limits and the trip's clear (plimsoll.engine.limits), on bytes the
OS reports."""

from __future__ import annotations

import ctypes.util
import os
import resource
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


STEPS = """
import resource, mlx.core as mx
mx.set_cache_limit(4 << 20)  # capped as the worker caps it, under one step's transients
x = mx.ones((2048, 1024))  # 8 MiB: about a 16-row decode layer's gathered K on qwen3-0.6b
faults = []
for step in range(12):  # a decode step's pattern: the same transients every step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    parts = [x * (step + k) for k in range(3)]
    mx.eval(parts)
    del parts
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults[4:])[4])
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and ctypes.util.find_library("c")),
                    reason="glibc's trim threshold is the Linux C library's")
def test_a_steps_freed_transients_are_not_faulted_in_again_every_step() -> None:
    """Under the worker's malloc settings, the transients a step frees past MLX's capped
    buffer cache stay in the heap for the next step. With the trim threshold glibc keeps
    once the mmap threshold is fixed (128 KiB) they went back to the OS and were faulted in
    again every step (the CPU decode step 1.23 s against 0.99 s)."""
    env = worker_env() | {"PYTHONPATH": os.pathsep.join(sys.path)}

    def faults(extra: dict[str, str]) -> int:
        return int(subprocess.run([sys.executable, "-c", STEPS], env=env | extra,
                                  capture_output=True, text=True, timeout=120,
                                  check=True).stdout)

    trimmed = faults({"MALLOC_TRIM_THRESHOLD_": str(128 << 10)})
    kept = faults({})
    # at least one 8 MiB transient (2,048 pages) a step given back and faulted in again;
    # usually all three (6,112), once in CI, under load, one
    assert trimmed >= (8 << 20) // resource.getpagesize(), trimmed
    assert kept < trimmed / 10, (kept, trimmed)
