"""Measurements for bench/scale.py: memory samplers, status fields, copy bandwidth.

Memory is sampled from outside the server, the same way for both servers in one run:

- ``rss``: RSS of the server's process tree (psutil; a launch wrapper and its worker
  together), with the harness's host-memory floor guard (:func:`harness_server.rss_sampler`);
- ``gpu_used`` (the headline on a GPU): the whole GPU's used memory (NVML in process, else
  ``nvidia-smi``) less its reading before the server started; one server runs at a time, so
  the difference is that server (MLX's CUDA allocator, its cache and the CUDA context);
- ``gpu_proc``: the used GPU memory of the compute processes whose pid is in the server's
  tree (``nvidia-smi``, once a second; absent where the container's pids do not match).

Plimsoll's ``GET /v1/plimsoll/status`` is read defensively: every numeric field is flattened
(``mlx.active_bytes`` ...) and the fields the report uses are looked up by suffix, so the
script works with the current worker and with the block-paged engine's new fields
(``kv_bytes_allocated``, ``prefill_tokens``, prefix hits ...) when they exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import psutil
from harness_server import Sampler, ServerProcess, flatten, rss_sampler

MIB = 1024**2

# figure -> predicate on the flattened, lower-cased key path (first match wins)
STATUS_KEYS: dict[str, Callable[[str], bool]] = {
    "kv_bytes_held": lambda k: k.endswith("kv_bytes_held"),
    "kv_bytes_allocated": lambda k: k.endswith("kv_bytes_allocated"),
    "kv_bytes_bound": lambda k: k.endswith("kv_bytes_bound"),
    "mlx_active": lambda k: "mlx" in k and "active" in k,
    "mlx_peak": lambda k: "mlx" in k and "peak" in k,
    "prefill_tokens": lambda k: k.endswith("prefill_tokens") or k.endswith(
        "prefill_tokens_computed") or k.endswith("prefilled_tokens"),
    "prefix_hits": lambda k: k.endswith("prefix_hits") or k.endswith("hit_blocks")
    or k.endswith("prefix_hit_tokens") or k.endswith("hits"),
    "prefix_misses": lambda k: k.endswith("prefix_misses") or k.endswith("miss_blocks")
    or k.endswith("misses"),
    "cached_tokens": lambda k: k.endswith("cached_tokens"),
    "shared_blocks": lambda k: k.endswith("shared_blocks"),
}
# counters reported as a difference over a phase (after − before)
COUNTERS = ("prefill_tokens", "prefix_hits", "prefix_misses", "cached_tokens")


def numeric(status: dict) -> dict[str, float]:
    return {k: float(v) for k, v in flatten(status).items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def status_figures(status: dict) -> dict[str, float | None]:
    flat = numeric(status)
    return {name: next((v for k, v in flat.items() if match(k)), None)
            for name, match in STATUS_KEYS.items()}


def counter_deltas(before: dict | None, after: dict | None) -> dict[str, float | None]:
    """Difference of every counter-like status field (numeric, name matching COUNTERS or
    containing "hit"/"miss"/"prefill") between two raw snapshots."""
    if not before or not after:
        return {}
    b, a = numeric(before), numeric(after)
    keys = [k for k in a if k in b and (any(w in k for w in ("hit", "miss", "prefill"))
                                        or k.endswith("cached_tokens"))]
    return {k: a[k] - b[k] for k in keys}


def status_sampler(base_url: str, path: str, interval: float) -> tuple[Sampler, dict]:
    raw: dict = {}

    def probe() -> dict[str, float | None]:
        response = httpx.get(base_url + path, timeout=2.0)
        response.raise_for_status()
        snapshot = response.json()
        raw.clear()
        raw.update(snapshot)
        return status_figures(snapshot)

    return Sampler(probe, interval), raw


def get_status(base_url: str, path: str) -> dict | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(base_url + path, timeout=5.0)
        if response.status_code == 200 and isinstance(body := response.json(), dict):
            return body
    return None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class Gpu:
    """GPU memory readings (bytes): the whole device's used memory through NVML (in process,
    cheap enough to sample every 0.1 s) or ``nvidia-smi``; the used memory of given pids
    through ``nvidia-smi`` (a subprocess, so at most once per ``proc_every_s``)."""

    def __init__(self, index: int = 0, proc_every_s: float = 1.0) -> None:
        self.index, self.proc_every_s = index, proc_every_s
        self._nvml = self._handle = None
        self._last_proc, self._procs = 0.0, {}
        self.smi = shutil.which("nvidia-smi") is not None
        with contextlib.suppress(Exception):  # no driver library: nvidia-smi or nothing
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(
                    index, ctypes.byref(handle)) == 0:
                self._nvml, self._handle = lib, handle
        self.present = self.total_used() is not None
        self.source = "nvml" if self._nvml_used() is not None else "nvidia-smi"

    def _nvml_used(self) -> int | None:
        if self._nvml is None:
            return None
        mem = _NvmlMemory()
        if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.used)

    def _query(self, *args: str) -> list[list[str]] | None:
        try:
            out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    def total_used(self) -> int | None:
        if (used := self._nvml_used()) is not None:
            return used
        if not self.smi:
            return None
        rows = self._query("--query-gpu=memory.used", f"--id={self.index}")
        with contextlib.suppress(TypeError, ValueError, IndexError):
            return int(float(rows[0][0]) * MIB)
        return None

    def by_pid(self) -> dict[int, int]:
        if not self.smi:
            return {}
        now = time.monotonic()
        if now - self._last_proc < self.proc_every_s:
            return self._procs
        self._last_proc = now
        rows = self._query("--query-compute-apps=pid,used_memory") or []
        out: dict[int, int] = {}
        for row in rows:
            with contextlib.suppress(ValueError, IndexError):
                out[int(row[0])] = out.get(int(row[0]), 0) + int(float(row[1]) * MIB)
        self._procs = out
        return out


def tree_pids(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {root.pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def memory_sampler(server: ServerProcess, interval: float, min_available: int,
                   gpu: Gpu | None, gpu_baseline: int | None) -> Sampler:
    """RSS of the tree (with the floor guard) and, where there is a GPU, its memory."""
    rss = rss_sampler(server, interval, min_available)
    if gpu is None or not gpu.present:
        return rss
    rss_probe = rss._probe
    lock = threading.Lock()

    def probe() -> dict[str, float | None]:
        reading = rss_probe()
        with lock:  # one nvidia-smi at a time even if mark() races the thread
            per_pid, total = gpu.by_pid(), gpu.total_used()
        mine = tree_pids(server.pid)
        reading["gpu_proc"] = sum(v for p, v in per_pid.items() if p in mine) or None
        reading["gpu_used"] = None if total is None else total - (gpu_baseline or 0)
        return reading

    return Sampler(probe, interval)


def memory_figure(peaks: dict, source: str) -> tuple[float | None, str]:
    """The peak the report divides by "needed": the GPU's used memory less its reading before
    the server started (one server at a time; sampled fast), else the server's processes'
    GPU memory (nvidia-smi, sampled once a second), else the tree's RSS."""
    if source in ("auto", "gpu"):
        if peaks.get("gpu_used"):
            return peaks["gpu_used"], "GPU used − its reading before the server started"
        if peaks.get("gpu_proc"):
            return peaks["gpu_proc"], "nvidia-smi per-process"
        if source == "gpu":
            return None, "no GPU reading"
    return peaks.get("rss"), "RSS of the process tree"


_COPY = r"""
import json, statistics, sys, time
import mlx.core as mx
n = int(float(sys.argv[1]) * 2**30) // 4
reps = int(sys.argv[2])
x = mx.ones((n,), dtype=mx.float32)
mx.eval(x)
y = x + 1
mx.eval(y)  # warm-up: kernel compiled, output buffer allocated once
del y
times = []
for _ in range(reps):
    t = time.perf_counter()
    y = x + 1
    mx.eval(y)
    mx.synchronize()
    times.append(time.perf_counter() - t)
    del y
moved = 2 * x.nbytes  # read + write
print(json.dumps({"device": str(mx.default_device()), "array_bytes": x.nbytes,
                  "bytes_moved_per_copy": moved, "times_s": times,
                  "best_bytes_per_s": moved / min(times),
                  "median_bytes_per_s": moved / statistics.median(times)}))
"""


def copy_bandwidth(gib: float, reps: int, env: dict[str, str], timeout_s: float) -> dict:
    """Elementwise copy bandwidth of MLX's default device, in a subprocess (its memory is
    returned before any server starts): (read + write bytes) ÷ time of ``y = x + 1``."""
    try:
        done = subprocess.run([sys.executable, "-c", _COPY, str(gib), str(reps)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"copy bandwidth probe exceeded {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-800:]}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unreadable output: {done.stdout[-400:]}"}
