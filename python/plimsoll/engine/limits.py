"""Process-wide MLX limits: set in one place, always restored (as mlx-lm's wired_limit does).

Imports mlx; the worker enters :func:`process_limits` once, on its engine thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os

import mlx.core as mx

from plimsoll.engine import backend

#: MLX's CUDA backend keeps cuDNN attention plans and CUDA graphs in LRU caches keyed by
#: shape (or topology) whose *lifetime* miss count is a fuse: past twice the capacity every
#: further miss throws, leaving the stream's encoder unusable — the worker's requests then
#: fail with a 500. Chunked prefill makes a new (chunk, context) shape every chunk, so a long-
#: running worker crosses 512 SDPA misses in a few hundred chunks. Measured on an H200
#: (notes of bench/results/serving-h200-2026-12-01.md): a cuDNN plan build: 40-55 ms, a cached plan
#: 0.15-2 ms. So: no fuse (a miss only costs its plan build) and room for the shapes a
#: worker repeats. Set before MLX reads them (the engine's own stream and first cuDNN call
#: come after); a value already in the environment wins. No effect on CPU or Metal.
BACKEND_ENV_DEFAULTS = {
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    "MLX_CUDA_SDPA_CACHE_SIZE": "1024",
}


def warm_plans_most() -> int:
    """How many attention plans an idle worker builds ahead: half of MLX's SDPA plan cache
    (the rest for the shapes requests make besides), so warming never evicts its own."""
    try:
        return int(os.environ.get("MLX_CUDA_SDPA_CACHE_SIZE",
                                  BACKEND_ENV_DEFAULTS["MLX_CUDA_SDPA_CACHE_SIZE"])) // 2
    except ValueError:
        return 0


def backend_env_defaults() -> dict[str, str]:
    """Apply :data:`BACKEND_ENV_DEFAULTS` where the environment does not set them; returns
    the values in effect. Process-lifetime by nature (MLX reads each once), so never
    restored."""
    return {k: os.environ.setdefault(k, v) for k, v in BACKEND_ENV_DEFAULTS.items()}


def active_memory() -> int:
    """MLX's active (allocated, in use) bytes: what the trip compares with."""
    return mx.get_active_memory()


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    libc = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(libc).malloc_trim if libc else None
    except (OSError, AttributeError):
        return None


def clear_buffer_cache() -> None:
    """Return MLX's cached (freed but kept) buffers to the OS: part of the trip's clear.

    Then glibc's ``malloc_trim(0)``: MLX's CPU backend mallocs every array, and one under the
    worker's mmap threshold (``plimsoll.launch.spawn.MALLOC_MMAP_THRESHOLD``, 32 MiB) goes
    back to a glibc heap when freed, still resident while a live allocation sits above it
    (python/tests/engine/test_limits.py: 255 MiB of freed 1 MiB arrays resident after
    ``mx.clear_cache()``, returned by the trim). On Metal and CUDA it returns the host's
    small allocations only."""
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def process_limits(memory_limit: int, cache_limit: int, wired_limit: int):
    """Set MLX's allocation cap, buffer-cache cap and (on Metal) wired limit; restore on exit.

    Yields what MLX reports back after setting them, so the launch wrapper can verify
    the limits took effect. ``mx.set_memory_limit`` is not enforced by the CPU backend
    (an over-allocation dies with SIGSEGV): the pool and admission are the enforcement;
    this cap is a second line where the backend honours it. ``wired_limit`` 0 wires
    nothing (never MLX's recommended maximum: wiring that much can panic the host).
    ``PLIMSOLL_FAULT_SKIP_MEMORY_LIMIT=1`` skips the memory cap (fault injection for the
    test that the launch wrapper notices a limit that did not take).
    """
    skip = os.environ.get("PLIMSOLL_FAULT_SKIP_MEMORY_LIMIT") == "1"
    prev_memory = None if skip else mx.set_memory_limit(memory_limit)
    prev_cache = mx.set_cache_limit(cache_limit)
    applied_cache = mx.set_cache_limit(cache_limit)  # returns what the first call set
    wired = backend.metal_available() and wired_limit > 0
    prev_wired = mx.set_wired_limit(wired_limit) if wired else None
    try:
        yield {
            "memory_limit_applied_bytes": mx.get_memory_limit(),
            "cache_limit_applied_bytes": applied_cache,
            "wired_limit_applied_bytes": wired_limit if wired else 0,
        }
    finally:
        if prev_wired is not None:
            mx.set_wired_limit(prev_wired)
        mx.set_cache_limit(prev_cache)
        if prev_memory is not None:
            mx.set_memory_limit(prev_memory)
