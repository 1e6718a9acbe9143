"""The contrast half of ``plimsoll verify``: ``mlx_lm.server`` under the same line.

The same workload (requests and absolute spike sizes, fixed by plimsoll's run) is driven
against ``python -m mlx_lm server`` in a fresh memory cgroup with the **same hard limit**,
and what happens is recorded per fault kind: HTTP answers, peak usage, OOM kills, exit
status. It has no soft line and no admission, so what stops it is the kernel: expected,
an OOM kill inside its cgroup. The cgroup is what keeps the host safe: the server can
only hurt itself. A server that dies is restarted for the next fault kind (each restart is
recorded), so every kind gets its own answer; it is stopped by pid at the end and its
cgroup removed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from plimsoll.core.units import MIB

from .faults import measured
from .probe import Sampler, probe_for
from .target import Prompts, Target, Workload

READY_TIMEOUT_S = 180.0


def unavailable_reason() -> str | None:
    """Why the contrast cannot run here, or None."""
    if importlib.util.find_spec("mlx_lm") is None:
        return "mlx_lm is not installed"
    from plimsoll.guard import cgroups

    return cgroups.unavailable_reason()


def _served_id(url: str, model_dir: Path) -> str:
    """mlx_lm.server lists the path it loaded; asking for any other id makes it load that."""
    import httpx

    try:
        ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return str(model_dir) if str(model_dir) in ids or not ids else ids[0]


def start_server(model_dir: Path, cgroup, env: dict[str, str] | None,
                 log_path: Path | None) -> tuple[subprocess.Popen, str]:
    """``python -m mlx_lm server`` inside ``cgroup``, on 127.0.0.1; waits (bounded) for
    ``/health``. Raises RuntimeError if it exits or is not ready in time."""
    import httpx

    from plimsoll.web.serve import free_port

    port = free_port()
    argv = [sys.executable, "-m", "plimsoll.guard", "enter", str(cgroup.path), "--",
            sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log_path:
            out.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited with {proc.returncode} before it was "
                               "ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"mlx_lm.server was not ready after {READY_TIMEOUT_S:g} s")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def run_contrast(w: Workload, prompts: Prompts, limit_bytes: int, kinds: tuple[str, ...], *,
                 env: dict[str, str] | None = None, log_path: Path | None = None,
                 report: Callable[[str], None] = lambda _m: None) -> dict:
    """Drive ``kinds`` against mlx_lm.server in a fresh cgroup limited to ``limit_bytes``."""
    from plimsoll.guard.process import WorkerGuard

    wg, why = WorkerGuard.create("contrast-mlx-lm", limit_bytes)
    if wg is None:
        return {"ran": False, "reason": why}
    cg = wg.cgroup
    phases: list[dict] = []
    starts = 0
    proc = sampler = None
    try:
        for kind in kinds:
            if proc is None or proc.poll() is not None:
                report(f"contrast: starting mlx_lm.server under the same {limit_bytes // MIB} "
                       "MiB limit")
                proc, url = start_server(w.model_dir, cg, env, log_path)
                starts += 1
                if sampler:
                    sampler.stop()
                sampler = Sampler(probe_for(proc.pid, cg))
                sampler.start()
                target = Target("mlx_lm.server", url, _served_id(url, w.model_dir), proc, cg,
                                prompts, guarded=False)
            report(f"contrast: {kind}")
            ph = measured(kind, target, w, env, sampler, settle_s=0.5)
            ph.figures["exit_status"] = proc.returncode
            ph.passed = False  # not plimsoll's criterion: the record says what happened
            phases.append(_record(ph))
            report(f"contrast {kind}: alive {ph.target_alive}, OOM kills "
                   f"{ph.figures['oom_kill_delta']}, answers {ph.answers}")
    except RuntimeError as err:
        report(f"contrast: {err}")
        phases.append({"kind": "start", "error": str(err)})
    finally:
        if proc is not None:
            stop(proc)
        if sampler:
            sampler.stop()
        events = cg.events()
        removed = wg.close()
    return {"ran": True, "argv": f"{sys.executable} -m mlx_lm server --model {w.model_dir} "
            "--host 127.0.0.1 --port P", "limit_bytes": limit_bytes, "cgroup": str(cg.path),
            "cgroup_removed": removed, "starts": starts, "oom_kills": events.get("oom_kill", 0),
            "failcnt": events.get("failcnt", 0), "phases": phases}


def _record(ph) -> dict:
    from dataclasses import asdict

    d = asdict(ph)
    d.pop("passed")
    oom = ph.figures.get("oom_kill_delta")
    if not ph.target_alive:
        d["outcome"] = "OOM-killed" if oom else f"exited {ph.figures.get('exit_status')}"
    else:
        d["outcome"] = "survived" + (f" ({oom} OOM kill(s) took a spike helper)" if oom else "")
    return d
