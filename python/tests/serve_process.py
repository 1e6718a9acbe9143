"""``plimsoll serve`` as a real process on 127.0.0.1, for the tests that need one proxy."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import free_port, worker_env

SERVE = "from plimsoll.cli.serve import serve_command; serve_command()"


def tiny_policy(path: Path, model: Path, **entry) -> Path:
    """A policy serving ``model`` as "tiny" (small context, generous budgets)."""
    path.write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 4}, "clustered": {"maxLocalLlmGb": 8}},
        "models": {"tiny": {"path": str(model), "context": 1024, "maxTokens": 64,
                            "concurrency": 2, **entry}}}))
    return path


class Served:
    """One ``plimsoll serve`` with ``args``; its log in ``log``; :meth:`stop` when done."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None,
                 ready_path: str = "/health", timeout_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, *args, "--port", str(self.port)],
            env=worker_env() | (env or {}), stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve not up in time:\n" + log.read_text())
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def worker_headers(pid: int) -> dict[str, str]:
    """The header a proxy-spawned worker wants, read from its environment the way only its
    own user (or root) can: ``/proc/PID/environ`` is readable by no one else."""
    from plimsoll.web.worker_secret import SECRET_ENV, headers

    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    return headers(env.get(SECRET_ENV))
