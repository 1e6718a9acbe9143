"""Process control for bench/agentic.py: start a server from a command template, sample it, stop it.

One :class:`ServerProcess` per server under test. It starts the command in its own session
(so the whole process group can be signalled), waits for ``GET /v1/models`` or ``GET /health``
to answer, and on :meth:`stop` terminates the group, then kills anything left, including
descendants that moved to another group, and checks that nothing survives.

:class:`Sampler` polls a function in a thread and keeps per-key maxima since the last
:meth:`Sampler.mark`, so a caller can ask "the peak during this turn" without racing the
thread. The RSS sampler sums the server's pid and all its descendants (a launch wrapper
and its worker count together). It also guards the machine: if the host's available memory
drops under a floor it kills the server group at once and records why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from plimsoll.web.serve import free_port  # noqa: F401  (the benches' one port picker)

HOST = "127.0.0.1"


def server_env(preload: str, *, strict: bool = False) -> dict[str, str]:
    """This environment with ``LD_PRELOAD=preload`` (OpenBLAS on the CPU box) where it
    exists; ``strict`` makes a missing one an error instead of a skip."""
    env = dict(os.environ)
    if preload:
        if Path(preload).exists():
            env["LD_PRELOAD"] = preload
        elif strict:
            raise SystemExit(f"--preload {preload} does not exist (pass --preload '' to skip)")
    return env


def served_model(base_url: str, model_dir: Path) -> str:
    """The model id to send: the id ``/v1/models`` lists for this directory (mlx_lm.server
    lists its resolved path, plimsoll's worker the directory's name), else the only id listed,
    else the path."""
    try:
        listed = httpx.get(base_url + "/v1/models", timeout=10.0).json().get("data") or []
        ids = [m["id"] for m in listed]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        ids = []
    for name in (str(model_dir), model_dir.name):
        if name in ids:
            return name
    return ids[0] if len(ids) == 1 else str(model_dir)


def render(template: str, values: dict[str, str]) -> str:
    """Fill ``{name}`` placeholders by plain replacement (JSON braces in a template survive)."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of pid plus all descendants, number of processes counted); (0, 0) if gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = counted = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
            counted += 1
    return total, counted


class Sampler:
    """Call ``probe()`` every ``interval`` seconds; keep the last reading and per-key maxima."""

    def __init__(self, probe: Callable[[], dict[str, float | None]], interval: float) -> None:
        self._probe, self._interval = probe, interval
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
        reading = self._probe()
        with self._lock:
            self.last = reading
            for key, value in reading.items():
                if value is None:
                    continue
                self._window[key] = max(self._window.get(key, value), value)
                self._overall[key] = max(self._overall.get(key, value), value)
        return reading

    def _try_sample(self) -> None:
        with contextlib.suppress(Exception):  # a probe failing once must not end sampling
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


class ServerProcess:
    """A server under test, started from an argv in its own process group."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], port: int,
                 log_path: Path) -> None:
        self.label, self.argv, self.env, self.port = label, argv, env, port
        self.base_url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.aborted: str | None = None  # why the harness killed it early, if it did
        self._known: dict[int, psutil.Process] = {}

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, deadline_s: float) -> float:
        """Seconds until /v1/models or /health answers 200; raises if it dies or times out."""
        t0 = time.perf_counter()
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() - t0 < deadline_s:
                if not self.alive():
                    raise RuntimeError(f"{self.label} exited with {self.proc.returncode} before "
                                       f"it was ready; log tail:\n{self.log_tail()}")
                self.remember_tree()
                for path in ("/v1/models", "/health"):
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(self.base_url + path).status_code == 200:
                            return time.perf_counter() - t0
                time.sleep(0.5)
        raise TimeoutError(f"{self.label} not ready after {deadline_s:.0f} s; "
                           f"log tail:\n{self.log_tail()}")

    def remember_tree(self) -> None:
        """Note every descendant now, so stop() can find ones that leave the group or reparent."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                self._known.setdefault(p.pid, p)

    def kill_now(self, reason: str) -> None:
        """Emergency stop (memory floor crossed): SIGKILL the group and every known descendant."""
        self.aborted = reason
        self.remember_tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for p in self._known.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def stop(self, grace_s: float = 20.0) -> dict:
        """Terminate the group, escalate to SIGKILL, and verify that no process survived."""
        if self.proc is None:
            return {"returncode": None, "survivors": []}
        self.remember_tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        procs = [p for p in self._known.values() if p.pid != self.pid]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _, alive = psutil.wait_procs(procs, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        survivors = [p.pid for p in alive]
        if self.proc.poll() is None:
            survivors.insert(0, self.pid)
        return {"returncode": self.proc.returncode, "survivors": survivors}


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


def flatten(obj: object, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; keys lower-cased so field lookup is forgiving."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, object] = {}
    for key, value in obj.items():
        out.update(flatten(value, f"{prefix}.{key}".lower() if prefix else str(key).lower()))
    return out


# Status fields the harness reads, each found by the first flattened key path (lower case)
# for which the predicate holds; the worker may nest them (e.g. "memory.mlx_active_bytes").
STATUS_FIELDS: dict[str, Callable[[str], bool]] = {
    "kv_bytes_held": lambda k: k.endswith("kv_bytes_held"),
    "kv_bytes_bound": lambda k: k.endswith("kv_bytes_bound"),
    "mlx_active": lambda k: "mlx" in k and "active" in k,
    "mlx_peak": lambda k: "mlx" in k and "peak" in k,
    "rss_reported": lambda k: k.rsplit(".", 1)[-1].startswith("rss") or k.endswith(".rss_bytes"),
    "allocation_limit": lambda k: "allocation_limit" in k,
}


def status_fields(status: dict) -> dict[str, float | None]:
    flat = {k: v for k, v in flatten(status).items()
            if isinstance(v, int | float) and not isinstance(v, bool)}
    out: dict[str, float | None] = {}
    for name, matches in STATUS_FIELDS.items():
        out[name] = next((float(v) for k, v in flat.items() if matches(k)), None)
    return out


def status_sampler(base_url: str, path: str, interval: float) -> tuple[Sampler, dict]:
    """A sampler of the server's status endpoint; the dict holds the last raw snapshot."""
    raw: dict = {}

    def probe() -> dict[str, float | None]:
        response = httpx.get(base_url + path, timeout=2.0)
        response.raise_for_status()
        raw.clear()
        raw.update(response.json())
        return status_fields(raw)

    return Sampler(probe, interval), raw


def has_status(base_url: str, path: str) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(base_url + path, timeout=5.0)
        return response.status_code == 200 and isinstance(response.json(), dict)
    return False
