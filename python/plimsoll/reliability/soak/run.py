"""Running the soak against one server in its own memory cgroup, and what is measured.

Each target (``plimsoll serve`` with a two-model policy, or ``mlx_lm.server``) starts
inside a fresh memory cgroup whose hard limit is the bound (:class:`WorkerGuard`; the
proxy's workers get their own cgroups below it, so the one limit binds them all), then
takes the load of :mod:`.load` for the duration. Meanwhile a sampler reads the cgroup
(usage, working set, fail count, OOM kills) and the target's RSS, and a scanner reads the
OOM-kill count of every cgroup below it (a worker's own guard). A target that exits is
started again on the same port (each death recorded: time, exit status, OOM kills so
far), at most ``MAX_RESTARTS`` times.

When the load stops (no new requests; those in flight finished or were cancelled) a small
request is sent every ``PROBE_EVERY_S`` until one is answered: the time from the load
stopping to that first admitted request is the wedge figure — a guard that mistakes freed
memory for used memory refuses here for as long as it stays confused.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from plimsoll.core.units import GIB, MIB

from ..verify.probe import LinuxProbe, Sampler
from .load import Clients, Shape, run_clients

#: Memory the proxy process itself needs inside the cgroup (Python, Starlette, httpx).
PROXY_RESERVE_BYTES = 384 * MIB
MAX_RESTARTS = 3
PROBE_EVERY_S = 0.25
PROBE_LIMIT_S = 180.0
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Soak:
    """One soak: the two models, the bound, the policy's figures, the load."""

    model_a: Path
    model_b: Path
    limit_bytes: int
    shape: Shape = field(default_factory=Shape)
    context: int = 2048
    concurrency: int = 4
    max_tokens: int = 16
    idle_ttl_s: float = 8.0
    swap_hold_s: float = 1.0  # plimsoll serve --swap-hold
    budget_bytes: int | None = None  # the policy's standalone budget (default: below)
    env: dict[str, str] | None = None

    @property
    def budget(self) -> int:
        """The budget, by default the cgroup's soft line less the proxy's own reserve: a
        worker's guard watches the tightest cgroup above it, this one, and trips at
        ``SOFT_FRACTION`` of its limit, so a budget above that line is admitted to trip."""
        from plimsoll.guard.process import SOFT_FRACTION

        return self.budget_bytes or int(self.limit_bytes * SOFT_FRACTION) - PROXY_RESERVE_BYTES


def soak_policy(soak: Soak, total_ram_bytes: int) -> dict:
    """The policy ``plimsoll serve`` runs under: models "a" and "b", one standalone budget
    (the cgroup's limit is the live ceiling; the budget binds under it)."""
    gib = soak.budget / GIB
    entry = {"context": soak.context, "concurrency": soak.concurrency,
             "maxTokens": soak.max_tokens, "defaultMaxTokens": min(8, soak.max_tokens)}
    return {"schemaVersion": 1, "host": "soak", "totalRamGb": max(total_ram_bytes / GIB,
                                                                  gib + 1),
            "osFloorGb": 0.5, "modes": {"standalone": {"maxLocalLlmGb": round(gib, 3)}},
            "models": {"a": {"path": str(soak.model_a), **entry},
                       "b": {"path": str(soak.model_b), **entry}}}


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_ready(proc: subprocess.Popen, url: str, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready after {timeout_s:g} s")


@dataclass
class Server:
    """How one kind of target starts (argv for a port), is named, and is probed."""

    label: str
    argv: Callable[[int], list[str]]
    models: tuple[str, str]
    ready_path: str


def plimsoll_server(soak: Soak, workdir: Path) -> Server:
    policy = workdir / "soak-policy.json"
    policy.write_text(json.dumps(soak_policy(soak, _mem_total()), indent=2))
    token = workdir / "admin-token"
    token.write_text("soak\n")
    token.chmod(0o600)
    return Server("plimsoll", lambda port: [
        sys.executable, "-m", "plimsoll.cli", "serve", "--policy", str(policy),
        "--admin-token-file", str(token), "--port", str(port), "--idle-ttl",
        f"{soak.idle_ttl_s:g}", "--swap-hold", f"{soak.swap_hold_s:g}", "--quiet"],
        ("a", "b"), "/health")


def mlx_lm_server(soak: Soak) -> Server:
    """``python -m mlx_lm server`` as a user runs it: defaults, the model named by path."""
    return Server("mlx_lm.server", lambda port: [
        sys.executable, "-m", "mlx_lm", "server", "--model", str(soak.model_a),
        "--host", "127.0.0.1", "--port", str(port)],
        (str(soak.model_a), str(soak.model_b)), "/health")


class OomScanner(threading.Thread):
    """The largest OOM-kill and fail counts seen for every cgroup at or below ``root``
    (a worker's cgroup goes with the worker, so its counts are kept from while it lived)."""

    def __init__(self, root: Path, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="plimsoll-soak-oom")
        self.root, self.interval_s = root, interval_s
        self.seen: dict[str, dict[str, int]] = {}
        self._halt = threading.Event()

    def scan(self) -> None:
        for f in self.root.rglob("memory.oom_control"):
            try:
                fields = dict(line.split() for line in f.read_text().splitlines())
                fail = int((f.parent / "memory.failcnt").read_text())
            except (OSError, ValueError):
                continue
            got = self.seen.setdefault(str(f.parent), {"oom_kill": 0, "failcnt": 0})
            got["oom_kill"] = max(got["oom_kill"], int(fields.get("oom_kill", 0)))
            got["failcnt"] = max(got["failcnt"], fail)

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.scan()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.scan()

    def below(self) -> int:
        return sum(v["oom_kill"] for k, v in self.seen.items() if k != str(self.root))


EVENT = re.compile(r"plimsoll\.proxy event (\S+) (\S+)")
RC = re.compile(r"'returncode': (-?\d+)")


def proxy_events(log_text: str) -> dict:
    """Counts of the proxy's events (spawns, evictions, idle unloads, crashes) and the
    exit statuses of its workers, from its log."""
    kinds: dict[str, int] = {}
    killed = 0
    for line in log_text.splitlines():
        m = EVENT.search(line)
        if not m:
            continue
        kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
        rc = RC.search(line)
        if m.group(1) == "exit" and rc and int(rc.group(1)) == -9:
            killed += 1
    return {"events": dict(sorted(kinds.items())), "workers_sigkilled": killed}


async def _first_admitted(url: str, model: str) -> dict:
    """Seconds from now to the first request answered 200 (PROBE_LIMIT_S: a wedge)."""
    t0 = time.monotonic()
    tries, statuses = 0, {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        while time.monotonic() - t0 < PROBE_LIMIT_S:
            tries += 1
            try:
                r = await client.post(url + "/v1/chat/completions", json={
                    "model": model, "max_tokens": 2, "messages": [
                        {"role": "user", "content": "are you there?"}]})
                status: int | str = r.status_code
            except httpx.HTTPError as err:
                status = f"transport:{type(err).__name__}"
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 200:
                return {"seconds": round(time.monotonic() - t0, 3), "tries": tries,
                        "statuses": statuses, "wedged": False}
            await asyncio.sleep(PROBE_EVERY_S)
    return {"seconds": None, "tries": tries, "statuses": statuses, "wedged": True}


def run_target(server: Server, soak: Soak, duration_s: float, log_path: Path,
               report: Callable[[str], None] = lambda _m: None) -> dict:
    """The soak against one server; its figures (see :mod:`.report` for the fields)."""
    from plimsoll.guard.process import WorkerGuard
    from plimsoll.web.serve import free_port

    wg, why = WorkerGuard.create(f"soak-{server.label.split('.')[0]}", soak.limit_bytes)
    if wg is None:
        return {"label": server.label, "ran": False, "reason": why}
    cg = wg.cgroup
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    deaths: list[dict] = []
    procs: list[subprocess.Popen] = []
    t_start = time.monotonic()

    def start() -> subprocess.Popen:
        with log_path.open("ab") as out:
            proc = subprocess.Popen(wg.wrap(server.argv(port)), env=soak.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        _wait_ready(proc, url, server.ready_path, READY_TIMEOUT_S)
        return proc

    report(f"{server.label}: starting under a {soak.limit_bytes // MIB} MiB memory cgroup")
    sampler = scanner = None
    try:
        proc = start()
        sampler = Sampler(LinuxProbe(proc.pid, cg), interval_s=0.25)
        sampler.reset_peak()
        sampler.start()
        scanner = OomScanner(cg.path)
        scanner.start()
        shape = Shape(**{**asdict(soak.shape), "duration_s": duration_s})

        load = Clients()

        async def keep_up() -> None:
            nonlocal proc
            while True:
                await asyncio.sleep(0.5)
                if proc.poll() is None:
                    continue
                ev = cg.events()
                deaths.append({"t_s": round(time.monotonic() - t_start, 1),
                               "exit_status": proc.returncode,
                               "oom_kills_so_far": ev.get("oom_kill", 0)})
                report(f"{server.label}: exited {proc.returncode} at "
                       f"{deaths[-1]['t_s']} s (OOM kills so far {ev.get('oom_kill', 0)})")
                if len(deaths) > MAX_RESTARTS:
                    report(f"{server.label}: not restarted again; the load ends here")
                    load.stop.set()
                    return
                proc = await asyncio.to_thread(start)
                sampler.probe.pid = proc.pid

        async def soak_and_probe() -> tuple[dict, float]:
            watch = asyncio.create_task(keep_up())
            await run_clients(shape, url, server.models, load)
            stopped = time.monotonic()
            if proc.poll() is not None:  # gave up on it: nothing to probe
                return {"seconds": None, "tries": 0, "statuses": {}, "wedged": False,
                        "not_probed": "the server was not running"}, stopped
            after = await _first_admitted(url, server.models[0])
            watch.cancel()
            return after, stopped

        report(f"{server.label}: load for {duration_s:g} s")
        after, stopped = asyncio.run(soak_and_probe())
        alive = proc.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        if sampler is not None:
            sampler.stop()
        if scanner is not None:
            scanner.stop()
        events = cg.events()
        peak = cg.max_usage()
        removed = wg.close()
    window = sampler.window(t_start, time.monotonic()) if sampler else {}
    log_text = log_path.read_text(errors="replace")
    with log_path.with_suffix(".requests.jsonl").open("w") as out:  # beside the log
        for r in load.records:
            out.write(json.dumps({**asdict(r), "t0": round(r.t0 - t_start, 3),
                                  "t1": round(r.t1 - t_start, 3)}) + "\n")
    return {
        "label": server.label, "ran": True, "argv": " ".join(server.argv(port)),
        "models": list(server.models),
        "cgroup": str(cg.path), "cgroup_version": cg.version, "cgroup_removed": removed,
        "limit_bytes": soak.limit_bytes, "duration_s": duration_s,
        "load_ran_s": round(stopped - t_start, 1), "records": [asdict(r) for r in load.records],
        "after_load": after, "alive_at_end": alive, "deaths": deaths,
        "oom_kills": events.get("oom_kill", 0) + (scanner.below() if scanner else 0),
        "oom_kills_in_cgroup": events.get("oom_kill", 0),
        "oom_kills_below": scanner.below() if scanner else 0,
        "failcnt": events.get("failcnt", 0), "max_usage_bytes": peak,
        "peak_working_set_bytes": window.get("peak_working_set_bytes"),
        "peak_rss_bytes": window.get("peak_rss_bytes"),
        "pswpout_delta": window.get("pswpout_delta"),
        **(proxy_events(log_text) if server.label == "plimsoll" else {}),
        "tracebacks": log_text.count("Traceback (most recent call last)"),
    }


NOTE = ("max_usage_in_bytes counts page cache (the model files read at each load and swap), "
        "which the kernel reclaims at the limit instead of OOM-killing for it, so it reaches "
        "the bound for any server that reads more than the bound from disk; the OOM kills and "
        "the working set (usage less inactive file pages) are what show whether the bound "
        "held, and the fail count counts charges that had to reclaim first. Linux only: the "
        "bound is a memory cgroup and the OOM kills are the kernel's. On macOS the same load "
        "would be measured by phys_footprint and the wired limit (there is no cgroup to bound "
        "an unguarded server); this repository has not run the soak on a Mac.")


def run_soak(soak: Soak, workdir: Path, *, contrast: bool = True,
             contrast_duration_s: float | None = None,
             report: Callable[[str], None] = lambda _m: None) -> dict:
    """plimsoll serve under the bound, then (``contrast``) mlx_lm.server the same way; the
    report (:func:`.report.build`)."""
    from plimsoll.guard import cgroups

    from .report import build

    found = cgroups.memory_mount()
    targets = [run_target(plimsoll_server(soak, workdir), soak, soak.shape.duration_s,
                          workdir / "plimsoll.log", report)]
    if contrast:
        targets.append(run_target(mlx_lm_server(soak), soak,
                                  contrast_duration_s or soak.shape.duration_s,
                                  workdir / "mlx_lm-server.log", report))
    meta = {"model_a": str(soak.model_a), "model_b": str(soak.model_b),
            "limit_bytes": soak.limit_bytes, "budget_bytes": soak.budget,
            "cgroup_version": found[0] if found else None, "context": soak.context,
            "concurrency": soak.concurrency, "max_tokens": soak.max_tokens,
            "idle_ttl_s": soak.idle_ttl_s, "swap_hold_s": soak.swap_hold_s,
            **asdict(soak.shape), "host_mem_total_bytes": _mem_total(),
            "host_cpus": os.cpu_count(), "logs": str(workdir), "note": NOTE}
    return build(meta, targets)
