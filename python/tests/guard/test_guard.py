"""The per-process memory guard: a real worker in a real memory cgroup (as root).

The fault test lowers the worker's soft line just above its idle usage with its whole KV
pool (which grows physically as it is written and keeps its slabs) and sends a burst
of long prompts: the worker must answer 503 ``memory_trip`` with the reason, never be
OOM-killed, and serve again once usage is back under the line.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import OPENBLAS, free_port

from plimsoll.core.units import MIB
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard import cgroups
from plimsoll.guard import process as G
from plimsoll.launch.spawn import (
    MALLOC_MMAP_THRESHOLD,
    MALLOC_TRIM_THRESHOLD,
    SPAWN_HELD,
    StartStopped,
    start_worker,
    stop_worker,
)


@pytest.mark.pure
def test_guard_limit_puts_the_soft_line_a_margin_above_the_admitted() -> None:
    admitted = 1024 * MIB + 512 * MIB  # footprint + runtime reserve
    limit = G.guard_limit(1024 * MIB, runtime_bytes=512 * MIB, margin_fraction=0.05,
                          soft_fraction=0.9)
    assert limit % 4096 == 0
    soft = G.soft_line(limit, 0.9)
    assert admitted * 1.05 - 4096 <= soft <= admitted * 1.05 + 4096
    assert G.guard_limit(0, runtime_bytes=0) >= G.MIN_MARGIN_BYTES


@pytest.mark.pure
def test_soft_line_is_a_fraction_of_the_hard_line() -> None:
    assert G.soft_line(1000, 0.9) == 900
    with pytest.raises(ValueError):
        G.soft_line(1000, 1.5)


def _require_memory_controller() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("cgroups are Linux")
    if os.geteuid() != 0:
        pytest.skip("creating memory cgroups needs root")
    if reason := cgroups.unavailable_reason():
        pytest.skip(reason)


def test_cgroup_create_limit_move_read_remove() -> None:
    _require_memory_controller()
    wg, why = G.WorkerGuard.create("test", 256 * MIB)
    assert wg is not None, why
    child = subprocess.Popen(wg.wrap([sys.executable, "-c",
                                      "import sys; x = bytearray(32 << 20); sys.stdin.read()"]),
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while child.pid not in wg.cgroup.pids() or (wg.cgroup.usage() or 0) < 32 * MIB:
            assert time.monotonic() < deadline, "the child never showed up in its cgroup"
            time.sleep(0.05)
        s = wg.stats()
        assert s["limit_bytes"] == 256 * MIB
        assert 32 * MIB <= s["usage_bytes"] <= s["max_usage_bytes"] <= 256 * MIB
        assert s["oom_kill"] == 0 and s["failcnt"] == 0
        assert cgroups.own(child.pid) == wg.cgroup  # the child's binding limit is ours
    finally:
        child.communicate(b"")
    assert wg.close()
    assert not wg.cgroup.path.exists()


def test_a_worker_cgroup_goes_below_its_creators_own_cgroup() -> None:
    """A creator bound by a cgroup (a proxy: its in-use figure is that cgroup's usage) must
    find its workers inside it: they were made under <mount>/plimsoll, outside the limit
    and unseen by the release check (which then never verified)."""
    _require_memory_controller()
    version, root = cgroups.memory_mount()
    mine = cgroups.own_directory(version, root)
    assert str(os.getpid()) in (mine / "cgroup.procs").read_text().split()  # our own leaf
    wg, why = G.WorkerGuard.create("test", 64 * MIB)
    assert wg is not None, why
    try:
        assert wg.cgroup.path.parent == mine / "plimsoll"
        assert wg.cgroup.path.is_relative_to(mine)
    finally:
        assert wg.close()
    assert not wg.cgroup.path.exists()
    if mine != root:  # an emptied base below our own cgroup goes with its last worker
        assert not (mine / "plimsoll").exists()


def _cfg(model: Path, context: int = 4096) -> WorkerConfig:
    return WorkerConfig(model_dir=model, model_name="tiny", max_cache_blocks=2048,
                        gpu_memory_utilization=0.9, cache_memory_mb=64, max_num_seqs=8,
                        context=context, max_tokens=512, default_max_tokens=16,
                        ceiling_bytes=8 << 30, total_ram_bytes=16 << 30, mlx_cache_mb=64,
                        port=free_port())


ENV = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}


def test_worker_runs_in_its_own_cgroup_and_it_is_removed(tiny_model) -> None:
    _require_memory_controller()
    cfg = _cfg(tiny_model)
    proc, status = start_worker(cfg, footprint_bytes=64 * MIB, env=ENV)
    try:
        wg = proc.plimsoll_guard
        assert wg is not None
        cg = status["cgroup"]
        assert cg["path"] == str(wg.cgroup.path)
        assert cg["limit_bytes"] == G.guard_limit(64 * MIB) == wg.limit_bytes
        assert cg["soft_bytes"] == G.soft_line(cg["limit_bytes"])
        assert 0 < cg["usage_bytes"] < cg["soft_bytes"]
        assert cg["oom_kill"] == 0
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_ARENA_MAX=2" in environ
        assert f"MALLOC_MMAP_THRESHOLD_={MALLOC_MMAP_THRESHOLD}".encode() in environ
        assert f"MALLOC_TRIM_THRESHOLD_={MALLOC_TRIM_THRESHOLD}".encode() in environ
        mine = Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert str(wg.cgroup.path).split("/sys/fs/cgroup/memory", 1)[-1] in mine
        r = httpx.post(f"http://127.0.0.1:{cfg.port}/v1/completions",
                       json={"model": "tiny", "prompt": "hello there", "max_tokens": 8},
                       timeout=60)
        assert r.status_code == 200
    finally:
        stop_worker(proc)
    assert proc.plimsoll_guard is None
    assert not wg.cgroup.path.exists()


def test_unguarded_when_asked(tiny_model) -> None:
    cfg = _cfg(tiny_model)
    proc, status = start_worker(cfg, guard=False, env=ENV)
    try:
        assert proc.plimsoll_guard is None
        assert status["cgroup"] is None  # this test process's own cgroup has no limit
    finally:
        stop_worker(proc)


def test_soft_line_answers_503_not_an_oom_kill(tiny_model) -> None:
    """A soft line lowered under what the worker holds while it runs (the guard's limit moved
    from outside): the emergency clear cannot bring it back (the pool's slabs are held), so
    waiters and running requests are refused 503 ``memory_trip`` — never an OOM kill — and
    new work too, until the line is raised: then the worker serves again."""
    _require_memory_controller()
    cfg = _cfg(tiny_model)
    # A generous hard line to load; the soft line at half of it.
    proc, status = start_worker(cfg, cgroup_limit_bytes=1024 * MIB,
                                env=ENV | {G.SOFT_ENV: "0.5"})
    url = f"http://127.0.0.1:{cfg.port}"
    try:
        wg = proc.plimsoll_guard
        idle = status["cgroup"]["working_set_bytes"]

        def one(i: int) -> httpx.Response:
            prompt = " ".join(f"w{i}x{j}" for j in range(300))  # ≈ 1.4k tokens
            return httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": prompt, "max_tokens": 400,
                                    "ignore_eos": True})

        with cf.ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(one, i) for i in range(8)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(f.done() for f in futures):
                if httpx.get(url + "/v1/plimsoll/status", timeout=10).json()["running"]:
                    break
                time.sleep(0.02)
            # Soft at the idle footprint: the blocks the burst wrote keep the pool's slabs
            # above it whatever the clear frees. Hard at twice that: far above the burst.
            wg.cgroup.set_limit(2 * idle)
            answers = [f.result() for f in futures]
        codes = [r.status_code for r in answers]
        assert set(codes) <= {200, 503}, [r.text for r in answers]
        refused = [r for r in answers if r.status_code == 503]
        assert refused, codes
        for r in refused:
            body = r.json()["error"]
            assert body["code"] == "memory_trip" and "soft line" in body["message"]
        s = httpx.get(url + "/v1/plimsoll/status", timeout=10).json()
        assert proc.poll() is None
        assert s["tripped"] and "soft line" in s["trip_reason"]
        assert s["cgroup"]["oom_kill"] == 0
        assert s["cgroup"]["max_usage_bytes"] <= s["cgroup"]["limit_bytes"]
        assert s["counters"]["refused_memory_trip"] == len(refused)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "memory_trip"
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        # the line raised again: memory is back under it, and a request is served
        wg.cgroup.set_limit(1024 * MIB)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        stop_worker(proc)


# --- the footprint guard: the same lines where no cgroup binds the worker (macOS) -------
def _footprint(limit: int, readings: list[int]) -> G.FootprintGuard:
    it = iter(readings)
    return G.FootprintGuard(limit, 0.9, lambda: next(it), "test")


@pytest.mark.pure
def test_footprint_guard_lines_are_those_of_the_cgroup_guard() -> None:
    g = _footprint(1000, [500, 950, 1001, 10])
    assert g.probe() == {"guard_usage": 500, "guard_soft": 900}
    assert g.probe()["guard_usage"] == 950  # over soft: the scheduler refuses; not the hard
    assert "crossed the hard line 1000 B" in g.over_hard_line()
    assert g.over_hard_line() == ""
    assert g.peak_bytes == 1001
    with pytest.raises(ValueError, match=G.FOOTPRINT_ENV):
        G.FootprintGuard(0, 0.9, lambda: 0, "test")


def test_footprint_guard_hard_line_ends_the_process_before_the_allocation_finishes() -> None:
    code = (
        "import time, numpy as np\n"
        "from plimsoll.guard import process as G\n"
        "read, source = G.own_footprint_reader()\n"
        "g = G.FootprintGuard(read() + (96 << 20), 0.9, read, source)\n"
        "g.arm(period_s=0.01)\n"
        "blocks = []\n"
        "for _ in range(64):\n"  # 16 MiB at a time up to 1 GiB: crosses at about 96 MiB
        "    blocks.append(np.ones(16 << 20, dtype=np.uint8)); time.sleep(0.02)\n"
        "print('SURVIVED', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=os.environ | {"OPENBLAS_NUM_THREADS": "1"})
    assert out.returncode == G.EXIT_FOOTPRINT, out.stderr
    assert "SURVIVED" not in out.stdout
    assert "crossed the hard line" in out.stderr


def test_without_a_cgroup_the_launcher_hands_the_worker_its_footprint_line(
        tiny_model, monkeypatch) -> None:
    monkeypatch.setattr(G.WorkerGuard, "create",
                        classmethod(lambda cls, *a, **k: (None, "no controller here")))
    from plimsoll.launch.spawn import start_guard

    wg, env = start_guard(_cfg(tiny_model), limit_bytes=768 * MIB)
    assert wg is None and env == {G.FOOTPRINT_ENV: str(768 * MIB)}


def test_a_worker_guarding_its_own_footprint_refuses_over_the_soft_line(tiny_model) -> None:
    """A real worker, no cgroup: a soft line far under its resident set → 503 with the reason,
    while the hard line (8 GiB) is never near; the status names the guard."""
    cfg = _cfg(tiny_model)
    proc, status = start_worker(cfg, guard=False, env=ENV | {
        G.FOOTPRINT_ENV: str(8192 * MIB), G.SOFT_ENV: "0.005"})  # soft ≈ 41 MiB
    try:
        assert status["cgroup"] is None
        guard = status["guard"]
        assert guard["kind"] == "footprint" and guard["limit_bytes"] == 8192 * MIB
        assert guard["usage_bytes"] > guard["soft_bytes"]
        r = httpx.post(f"http://127.0.0.1:{cfg.port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "memory_trip" and "soft line" in err["message"]
        assert proc.poll() is None
    finally:
        stop_worker(proc)


def test_a_worker_over_its_footprint_hard_line_fails_closed(tiny_model) -> None:
    """A hard line under what loading needs: the worker ends itself (status 70) and the
    launcher reports it instead of a worker that grew past its line."""
    from plimsoll.launch.spawn import LaunchError

    cfg = _cfg(tiny_model)
    with pytest.raises(LaunchError, match=f"status {G.EXIT_FOOTPRINT}"):
        start_worker(cfg, guard=False, env=ENV | {G.FOOTPRINT_ENV: str(48 * MIB)},
                     timeout_s=90)


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _sigterm_inside_popen(monkeypatch, handler):
    """The spawn's ``Popen`` sends this thread SIGTERM once the child exists (``handler``
    installed meanwhile); yields the children's pids, and kills any left at the end (a
    failure must not leave a worker behind)."""
    real = subprocess.Popen
    children: list[int] = []

    def popen_then_signal(*a, **k):
        child = real(*a, **k)
        children.append(child.pid)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # inside Popen, child exists
        return child

    monkeypatch.setattr("plimsoll.launch.spawn.subprocess.Popen", popen_then_signal)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield children
    finally:
        signal.signal(signal.SIGTERM, previous)
        for pid in children:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_signal_inside_the_spawn_still_stops_the_worker(tiny_model, monkeypatch) -> None:
    """A signal whose handler raises (``plimsoll launch`` stops a start that way) arriving
    between the worker's exec and ``Popen``'s return: the spawn holds it until ``proc`` is
    set, so the start is stopped with its worker, and the worker itself runs with the
    signals unblocked (it inherits the launcher's mask through exec)."""
    def raise_stop(_signum, _frame):
        raise _Stop

    with _sigterm_inside_popen(monkeypatch, raise_stop) as children:
        with pytest.raises(_Stop):
            start_worker(_cfg(tiny_model), guard=False, env=ENV)
        assert children and not psutil.pid_exists(children[0])  # stopped and reaped
        assert not signal.pthread_sigmask(signal.SIG_BLOCK, set()) & SPAWN_HELD


def test_a_stop_whose_exception_python_swallowed_still_stops_the_start(tiny_model,
                                                                       monkeypatch) -> None:
    """CI caught it: ``plimsoll launch``'s handler raised inside an import lock's weakref
    callback, Python printed "Exception ignored" and the start went on. The handler's record
    of the stop is polled: the start ends (:class:`StartStopped`) with its worker stopped,
    not after the worker is ready. (The handler here only records: what is left of one whose
    exception was swallowed.)"""
    asked: list[int] = []
    with _sigterm_inside_popen(monkeypatch, lambda signum, _f: asked.append(signum)) as children:
        with pytest.raises(StartStopped):
            start_worker(_cfg(tiny_model), guard=False, env=ENV,
                         stop_requested=lambda: bool(asked))
        assert asked == [signal.SIGTERM]
        assert children and not psutil.pid_exists(children[0])  # stopped and reaped


def test_a_worker_runs_with_the_spawns_held_signals_unblocked(tiny_model) -> None:
    proc, _status = start_worker(_cfg(tiny_model), guard=False, env=ENV)
    try:
        line = next(x for x in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                    if x.startswith("SigBlk:"))
        blocked = int(line.split()[1], 16)
        assert not any(blocked >> (s - 1) & 1 for s in SPAWN_HELD), line
    finally:
        stop_worker(proc)
