"""Readings taken while something runs: memory and CPU of a process tree, GPU memory, MLX memory
in process, copy bandwidth, py-spy profiles.

:class:`Sampler` polls a function in a thread and keeps per-key maxima since the last
:meth:`Sampler.mark`, so a caller can ask "the peak during this turn" without racing the
thread. Memory of a server is sampled from outside, the same way for every server of a run:

- ``rss``: RSS of the server's process tree (a launch wrapper and its worker together), with a
  guard: if the host's available memory falls under a floor the server group is killed at once
  and the reason recorded (:func:`rss_sampler`);
- ``gpu_used``: the whole GPU's used memory (NVML in process, else ``nvidia-smi``) less its
  reading before the server started; one server runs at a time, so the difference is that
  server (MLX's CUDA allocator, its cache and the CUDA context);
- ``gpu_proc``: the GPU memory of the compute processes whose pid is in the server's tree
  (``nvidia-smi``, at most once a second; absent where the container's pids do not match).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from lib.servers import ServerProcess

MIB = 1024**2


class Sampler:
    """Call ``probe()`` every ``interval`` seconds; keep the last reading and per-key maxima."""

    def __init__(self, probe: Callable[[], dict[str, float | None]], interval: float) -> None:
        self.probe, self._interval = probe, interval
        self._lock = threading.Lock()
        self._window: dict[str, float] = {}
        self._overall: dict[str, float] = {}
        self.last: dict[str, float | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample_now(self) -> dict[str, float | None]:
        reading = self.probe()
        with self._lock:
            self.last = reading
            for key, value in reading.items():
                if value is None:
                    continue
                self._window[key] = max(self._window.get(key, value), value)
                self._overall[key] = max(self._overall.get(key, value), value)
        return reading

    def _try_sample(self) -> None:
        # A probe failing once (a status request timing out) must not end sampling.
        with contextlib.suppress(Exception):
            self.sample_now()

    def mark(self) -> None:
        """Start a new window (e.g. a turn): its peaks begin at the current reading."""
        with self._lock:
            self._window = {}
        self._try_sample()

    def window_peaks(self) -> dict[str, float]:
        self._try_sample()
        with self._lock:
            return dict(self._window)

    def overall_peaks(self) -> dict[str, float]:
        with self._lock:
            return dict(self._overall)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._try_sample()


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants; empty if it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of pid plus all descendants, number of processes counted); (0, 0) if gone."""
    total = counted = 0
    for p in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
            counted += 1
    return total, counted


#: The command line of a plimsoll worker's engine process (mlx and the step loop; no HTTP).
ENGINE_PROCESS = "plimsoll.worker.engine_proc"


def tree_cpu(server: ServerProcess) -> tuple[float, float]:
    """CPU seconds (user + system) the server's process tree has used so far, and those of the
    serving process's main thread (the HTTP event loop: uvicorn runs it there). The serving
    process is the busiest of the tree that serves HTTP (a plimsoll engine process does not)."""
    server.remember_tree()
    total, loop, busiest = 0.0, 0.0, -1.0
    for p in server.known.values():
        try:
            t = p.cpu_times()
            if t.user + t.system > busiest and ENGINE_PROCESS not in " ".join(p.cmdline()):
                busiest = t.user + t.system
                loop = sum(th.user_time + th.system_time for th in p.threads()
                           if th.id == p.pid)
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total, loop


def sched_ns(pid: int) -> tuple[int, int]:
    """(on-CPU ns, run-queue wait ns) of a process's live threads, from Linux's schedstat: the
    wait is time a thread was runnable while another one had the core (on a box with fewer
    cores than busy processes, what it loses to the client and the API process). (0, 0) where
    there is no schedstat."""
    cpu = wait = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                on, queued, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            cpu, wait = cpu + int(on), wait + int(queued)
    return cpu, wait


def engine_pid(server: ServerProcess) -> int | None:
    """The pid of a plimsoll worker's engine process among the server's tree, if it has one."""
    server.remember_tree()
    for p in server.known.values():
        with contextlib.suppress(psutil.Error):
            if ENGINE_PROCESS in " ".join(p.cmdline()):
                return p.pid
    return None


def rss_sampler(server: ServerProcess, interval: float, min_available: int) -> Sampler:
    """RSS of the server's process tree; kills the server if host available memory < floor."""

    def probe() -> dict[str, float | None]:
        rss, nprocs = tree_rss(server.pid)
        host = psutil.virtual_memory()
        if server.aborted is None and server.alive() and host.available < min_available:
            server.kill_now(f"host available memory {host.available / 1e9:.2f} GB fell under "
                            f"the floor {min_available / 1e9:.2f} GB; server killed by the "
                            "harness")
        return {"rss": rss, "procs": nprocs, "host_used": host.used}

    return Sampler(probe, interval)


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

    def query(self, *args: str) -> list[list[str]] | None:
        """Rows of ``nvidia-smi ARGS --format=csv,noheader,nounits``; None without it."""
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
        rows = self.query("--query-gpu=memory.used", f"--id={self.index}")
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
        out: dict[int, int] = {}
        for row in self.query("--query-compute-apps=pid,used_memory") or []:
            with contextlib.suppress(ValueError, IndexError):
                out[int(row[0])] = out.get(int(row[0]), 0) + int(float(row[1]) * MIB)
        self._procs = out
        return out


def memory_sampler(server: ServerProcess, interval: float, min_available: int,
                   gpu: Gpu | None, gpu_baseline: int | None) -> Sampler:
    """RSS of the tree (with the floor guard) and, where there is a GPU, its memory."""
    rss = rss_sampler(server, interval, min_available)
    if gpu is None or not gpu.present:
        return rss
    lock = threading.Lock()

    def probe() -> dict[str, float | None]:
        reading = rss.probe()
        with lock:  # one nvidia-smi at a time even if mark() races the thread
            per_pid, total = gpu.by_pid(), gpu.total_used()
        mine = {p.pid for p in tree(server.pid)}
        reading["gpu_proc"] = sum(v for p, v in per_pid.items() if p in mine) or None
        reading["gpu_used"] = None if total is None else total - (gpu_baseline or 0)
        return reading

    return Sampler(probe, interval)


def memory_figure(peaks: dict, source: str) -> tuple[float | None, str]:
    """The peak a report divides by "needed": the GPU's used memory less its reading before
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


def mlx_memory() -> dict[str, int]:
    """MLX's allocator in this process: active, peak and cache bytes."""
    import mlx.core as mx

    return {"mlx_active": mx.get_active_memory(), "mlx_peak": mx.get_peak_memory(),
            "mlx_cache": mx.get_cache_memory()}


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
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"copy bandwidth probe exceeded {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-800:]}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unreadable output: {done.stdout[-400:]}"}


def start_spy(server: ServerProcess, out_dir: Path, name: str):
    """py-spy recording the worker (the newest process of the server's tree: launch's child),
    every thread, raw stacks into ``out_dir/name.txt``; None where py-spy is not installed."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("[py-spy] not installed: no profile", flush=True)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    server.remember_tree()
    path = out_dir / f"{name}.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(max(server.known)), "--threads",
                             "--rate", "250", "--format", "raw", "--nonblocking", "-o",
                             str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc, path


def stop_spy(spy) -> dict:
    proc, path = spy
    proc.send_signal(2)
    proc.wait(timeout=30)
    return {"raw": str(path), "threads": spy_summary(path)} if path.exists() else {}


def spy_summary(path: Path, top: int = 40) -> dict:
    """Per thread: its share of all samples and its heaviest frames (inclusive, share of the
    thread's samples). Idle time in ``select``/``wait`` shows as such."""
    threads: collections.Counter[str] = collections.Counter()
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames, n = stack.split(";"), int(count)
        name = re.sub(r"thread \(\d+\): ?", "", frames[0]) or "unnamed"
        name = "AnyIO worker" if name.startswith("AnyIO") else name
        threads[name] += n
        for frame in dict.fromkeys(re.sub(r":\d+\)", ")", f) for f in frames[1:]):
            incl[name][frame] += n
    total = sum(threads.values()) or 1
    return {name: {"share": n / total,
                   "frames": {f: round(v / n, 3) for f, v in incl[name].most_common(top)}}
            for name, n in threads.most_common()}
