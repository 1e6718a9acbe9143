"""A server under test: started from a command template, waited for, stopped, checked gone.

One :class:`ServerProcess` per server. It starts the command in its own session (so the
whole process group can be signalled), waits for ``GET /v1/models`` or ``GET /health`` to
answer, and on :meth:`ServerProcess.stop` terminates the group, then kills anything left,
including descendants that moved to another group, and reports survivors. Plimsoll and
``mlx_lm.server`` are both just templates (:data:`MLX_LM_SERVER`, :data:`PLIMSOLL_LAUNCH`);
two servers never run together unless a script starts them so.

Templates are split with ``shlex`` after plain replacement of ``{python}`` (this
interpreter), ``{plimsoll}`` (the ``plimsoll`` command), ``{model}``, ``{host}`` and
``{port}``, so JSON in a template survives.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from plimsoll.web.serve import free_port

HOST = "127.0.0.1"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
MLX_LM_SERVER = "{python} -m mlx_lm server --model {model} --host {host} --port {port}"
PLIMSOLL_LAUNCH = "{python} -m plimsoll.cli launch {model} --host {host} --port {port}"

__all__ = ["HOST", "MLX_LM_SERVER", "OPENBLAS", "PLIMSOLL_LAUNCH", "ServerProcess",
           "free_port", "render", "served_model", "server_env", "start", "wait_for_memory"]


def server_env(preload: str, *, strict: bool = False) -> dict[str, str]:
    """This environment with ``LD_PRELOAD=preload`` (OpenBLAS on the CPU box) where the file
    exists; ``strict`` makes a missing one an error instead of a skip."""
    env = dict(os.environ)
    if preload:
        if Path(preload).exists():
            env["LD_PRELOAD"] = preload
        elif strict:
            raise SystemExit(f"--preload {preload} does not exist (pass --preload '' to skip)")
    return env


def render(template: str, values: dict[str, str]) -> str:
    """Fill ``{name}`` placeholders by plain replacement (JSON braces in a template survive)."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def served_model(base_url: str, model_dir: Path) -> str:
    """The model id to send: the id ``/v1/models`` lists for this directory (mlx_lm.server
    lists its resolved path, plimsoll's worker the directory's name), else the only id listed,
    else the path (mlx_lm.server serves its ``--model`` by path)."""
    try:
        listed = httpx.get(base_url + "/v1/models", timeout=10.0).json().get("data") or []
        ids = [m["id"] for m in listed]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        ids = []
    for name in (str(model_dir), model_dir.name):
        if name in ids:
            return name
    return ids[0] if len(ids) == 1 else str(model_dir)


class ServerProcess:
    """A server under test, started from an argv in its own process group."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], port: int,
                 log_path: Path) -> None:
        self.label, self.argv, self.env, self.port = label, argv, env, port
        self.base_url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.aborted: str | None = None  # why the harness killed it early, if it did
        self.known: dict[int, psutil.Process] = {}  # every process of its tree seen so far

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        LIVE.append(self)
        return self

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

    def wait_ready(self, deadline_s: float,
                   paths: tuple[str, ...] = ("/v1/models", "/health")) -> float:
        """Seconds until one of ``paths`` answers 200; raises if it dies or times out."""
        t0 = time.perf_counter()
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() - t0 < deadline_s:
                if not self.alive():
                    raise RuntimeError(f"{self.label} exited with {self.proc.returncode} before "
                                       f"it was ready; log tail:\n{self.log_tail()}")
                self.remember_tree()
                for path in paths:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(self.base_url + path).status_code == 200:
                            return time.perf_counter() - t0
                time.sleep(0.2)
        raise TimeoutError(f"{self.label} not ready after {deadline_s:.0f} s; "
                           f"log tail:\n{self.log_tail()}")

    def remember_tree(self) -> None:
        """Note every descendant now, so stop() can find ones that leave the group or reparent."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                self.known.setdefault(p.pid, p)

    def kill_now(self, reason: str) -> None:
        """Emergency stop (memory floor crossed, signal): SIGKILL the group and every known
        descendant."""
        self.aborted = reason
        self.remember_tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for p in self.known.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def stop(self, grace_s: float = 20.0) -> dict:
        """SIGTERM to the group, SIGKILL after ``grace_s``, every known descendant killed;
        returns the exit code, the pids that survived and ``stop_s`` (SIGTERM to exit)."""
        if self.proc is None:
            return {"returncode": None, "survivors": [], "stop_s": None}
        self.remember_tree()
        t0 = time.perf_counter()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        stop_s = time.perf_counter() - t0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        procs = [p for p in self.known.values() if p.pid != self.pid]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _, alive = psutil.wait_procs(procs, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(ValueError):
            LIVE.remove(self)
        survivors = [p.pid for p in alive]
        if self.proc.poll() is None:
            survivors.insert(0, self.pid)
        return {"returncode": self.proc.returncode, "survivors": survivors,
                "stop_s": round(stop_s, 3)}


LIVE: list[ServerProcess] = []  # started and not yet stopped


def start(label: str, template: str, model: Path, *, preload: str, log_dir: Path,
          strict_preload: bool = False, log_name: str | None = None) -> ServerProcess:
    """Render ``template`` for ``model`` on a free port and start it (not yet ready)."""
    port = free_port()
    values = {"python": sys.executable, "model": str(model), "host": HOST, "port": str(port),
              "plimsoll": shutil.which("plimsoll") or f"{sys.executable} -m plimsoll.cli"}
    argv = shlex.split(render(template, values))
    server = ServerProcess(label, argv, server_env(preload, strict=strict_preload), port,
                           log_dir / f"{log_name or label}-{port}.log")
    print(f"[{label}] starting: {shlex.join(argv)}", flush=True)
    return server.start()


def stop_all_on_sigterm() -> None:
    """On SIGTERM, kill every live server, then raise KeyboardInterrupt in the main thread so
    the script writes what it measured. Killing first matters: threads blocked on a live
    server's requests then fail at once instead of holding the exit until their deadlines."""

    def handler(signum, frame) -> None:
        for server in list(LIVE):
            server.kill_now(f"the benchmark got signal {signum}")
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def wait_for_memory(target: int, timeout_s: float = 60.0) -> int:
    """After a server stops, wait until the host's available memory is back near ``target``."""
    deadline = time.monotonic() + timeout_s
    while (avail := psutil.virtual_memory().available) < target and time.monotonic() < deadline:
        time.sleep(1.0)
    return avail
