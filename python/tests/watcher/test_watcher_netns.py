"""The link watcher for real: a veth pair across two network namespaces.

The watcher runs inside namespace A (``ip netns exec``) watching its veth end with the
``file:`` backend; the test takes the peer end down and up from namespace B. Addresses are
a private /30 inside the namespaces only; nothing is sent anywhere. With the proxy present
(``plimsoll serve``), a real proxy runs on namespace A's loopback with a demo model loaded
and the downshift order is read from both processes' timestamps.

Memory in use is what the watcher's own probe reads. So that other work on this host
cannot move it, the watcher (and the proxy with its workers) run in their own memory
cgroup, the Linux model of DESIGN.md ("its whole memory world is that figure"): in use is
that cgroup's usage. ``ip netns exec`` remounts /sys, hiding the cgroup mounts, so the
wrapper mounts the memory hierarchy again inside the namespace's private mount namespace.

Every namespace and cgroup is deleted in a ``finally`` (deleting a namespace deletes its
veth end and so the pair); every wait is bounded. Needs root, ``ip netns`` and a writable
memory cgroup; skips otherwise.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import parse_log_line

from plimsoll.core.units import GIB, MIB

IP = shutil.which("ip")
pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and IP and os.geteuid() == 0),
    reason="needs Linux, root and iproute2 (ip netns)",
)
_counter = itertools.count()
STANDALONE_GIB, CLUSTERED_GIB = 3, 6
STANDALONE_MIB, CLUSTERED_MIB = STANDALONE_GIB * 1024, CLUSTERED_GIB * 1024


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=10, check=check)


@dataclass
class Cgroup:
    version: str  # "v1" or "v2"
    path: Path  # its directory in this (the test's) mount namespace

    def remount(self) -> str:
        """Shell to make the memory hierarchy visible again after ``ip netns exec``."""
        if self.version == "v1":
            return ("mount -t tmpfs plimsoll /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/memory"
                    " && mount -t cgroup -o memory plimsoll /sys/fs/cgroup/memory")
        return "mount -t cgroup2 plimsoll /sys/fs/cgroup"


def make_cgroup(name: str, limit_bytes: int) -> Cgroup:
    """A child of this process's memory cgroup with a limit; skip when that is not possible."""
    from plimsoll.probes import linux

    paths = linux.parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    mounts = linux.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    version = "v1" if "v1" in paths else "v2"
    if version not in paths or version not in mounts:
        pytest.skip("no memory cgroup hierarchy mounted")
    parent = Path(linux.cgroup_levels(mounts[version], paths[version])[0][1])
    cg = Cgroup(version, parent / name)
    try:
        cg.path.mkdir()
        limit_file = "memory.limit_in_bytes" if version == "v1" else "memory.max"
        (cg.path / limit_file).write_text(str(limit_bytes))
    except OSError as err:
        if cg.path.exists():
            cg.path.rmdir()
        pytest.skip(f"cannot create a memory cgroup under {parent}: {err}")
    return cg


@dataclass
class Pair:
    a: str  # the watcher's namespace (veth end vA)
    b: str  # the peer's namespace (veth end vB)
    cgroup: Cgroup

    def peer(self, up: bool) -> None:
        ip("-n", self.b, "link", "set", "vB", "up" if up else "down")

    def exec_argv(self, *argv: str) -> list[str]:
        """``argv`` in namespace A and in the cgroup (entered before, remounted inside)."""
        procs = self.cgroup.path / "cgroup.procs"
        inner = ["sh", "-c", f'{self.cgroup.remount()} && exec "$0" "$@"', *argv]
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$0" "$@"',
                IP, "netns", "exec", self.a, *inner]


CGROUP_LIMIT = 16 * GIB  # the test host's whole memory world (≤ MemTotal, above budgets)


@pytest.fixture
def netns() -> Iterator[Pair]:
    tag = f"{os.getpid()}x{next(_counter)}"
    cg = make_cgroup(f"plimsoll-watch-{tag}", CGROUP_LIMIT)
    pair = Pair(f"plimsollA{tag}", f"plimsollB{tag}", cg)
    made: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            r = ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"ip netns add failed: {r.stderr.strip()}")
            made.append(ns)
        ip("link", "add", "vA", "netns", pair.a, "type", "veth", "peer", "name", "vB",
           "netns", pair.b)
        ip("-n", pair.a, "addr", "add", "10.231.77.1/30", "dev", "vA")
        ip("-n", pair.b, "addr", "add", "10.231.77.2/30", "dev", "vB")
        for ns, dev in ((pair.a, "lo"), (pair.a, "vA"), (pair.b, "vB")):
            ip("-n", ns, "link", "set", dev, "up")
        yield pair
    finally:
        for ns in made:
            ip("netns", "del", ns, check=False)
        for _ in range(50):  # its processes are gone (stopped by the dependent fixtures)
            try:
                cg.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def write_policy(path: Path, standalone_gib: float = STANDALONE_GIB,
                 clustered_gib: float = CLUSTERED_GIB, **extra) -> Path:
    path.write_text(json.dumps({
        "schemaVersion": 1, "host": "nsA", "totalRamGb": 64, "osFloorGb": 8,
        "modes": {"standalone": {"maxLocalLlmGb": standalone_gib},
                  "clustered": {"maxLocalLlmGb": clustered_gib}},
        "cluster": {"interface": "vA", "peers": [{"host": "nsB", "address": "10.231.77.2"}]},
        **extra,
    }))
    return path


class WatcherProc:
    """``plimsoll watch-link`` in namespace A, its log in a file; stopped on exit."""

    def __init__(self, pair: Pair, tmp: Path, policy: Path, *flags: str) -> None:
        self.ceiling, self.log_path = tmp / "ceiling", tmp / "watch.log"
        argv = pair.exec_argv(
            sys.executable, "-c",
            "from plimsoll.cli.watch import watch_link_command; watch_link_command()",
            "--policy", str(policy), "--sysctl", f"file:{self.ceiling}", *flags)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def records(self) -> list[dict[str, str]]:
        lines = self.log_path.read_text().splitlines()
        return [r for r in map(parse_log_line, lines) if r is not None]

    def value(self) -> int | None:
        try:
            text = self.ceiling.read_text().strip()
        except OSError:
            return None
        return int(text) if text else None

    def wait_for(self, pred: Callable[[], bool], timeout: float) -> float:
        """Seconds until ``pred`` held; fails after ``timeout``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"watcher exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            if pred():
                return time.monotonic() - t0
            time.sleep(0.02)
        pytest.fail(f"condition not met in {timeout} s; log:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@pytest.fixture
def start_watcher(netns, tmp_path) -> Iterator[Callable[..., WatcherProc]]:
    procs: list[WatcherProc] = []

    def start(policy: Path, *flags: str) -> WatcherProc:
        w = WatcherProc(netns, tmp_path, policy, *flags)
        procs.append(w)
        return w

    try:
        yield start
    finally:
        for w in procs:
            w.stop()


def assert_writes_never_below_in_use(records: list[dict[str, str]]) -> list[dict[str, str]]:
    writes = [r for r in records if r["event"] == "ceiling-write"]
    for r in writes:
        assert int(r["ceiling_bytes"]) == int(r["ceiling_mib"]) * MIB
        assert int(r["ceiling_bytes"]) >= int(r["in_use_bytes"]), r
    return writes


# --- the link alone ---------------------------------------------------------------------


def test_mode_flips_with_the_peer_and_the_ceiling_follows_within_2s(netns, tmp_path,
                                                                     start_watcher):
    w = start_watcher(write_policy(tmp_path / "p.json"), "--proxy", "none",
                      "--settle", "1", "--poll", "0.5")
    w.wait_for(lambda: w.value() == CLUSTERED_MIB, timeout=20)  # start-up (RunAtLoad)

    took = []
    for up, want in ((False, STANDALONE_MIB), (True, CLUSTERED_MIB), (False, STANDALONE_MIB)):
        netns.peer(up)
        took.append(w.wait_for(lambda want=want: w.value() == want, timeout=5))
    assert max(took) <= 2.0, took

    netns.peer(True)
    w.wait_for(lambda: w.value() == CLUSTERED_MIB, timeout=5)
    ip("-n", netns.a, "link", "del", "vA")  # the interface disappears (vB with it): down
    w.wait_for(lambda: w.value() == STANDALONE_MIB, timeout=5)
    # The file changes before the watcher logs its verification: wait for that line too.
    w.wait_for(lambda: [r["event"] for r in w.records()][-1] == "converged", timeout=5)

    recs = w.records()
    settled = [r["mode"] for r in recs if r["event"] == "link"]
    assert settled == ["clustered", "standalone", "clustered", "standalone", "clustered",
                       "standalone"]
    writes = assert_writes_never_below_in_use(recs)
    assert [int(r["ceiling_mib"]) for r in writes] == [CLUSTERED_MIB, STANDALONE_MIB] * 3
    assert [r["direction"] for r in writes] == ["raise", "lower"] * 3
    assert "does not exist" in [r for r in recs if r["event"] == "link"][-1]["detail"]
    verified = [r for r in recs if r["event"] == "ceiling-verified"]
    assert [int(r["read_back_mib"]) for r in verified] == [int(r["ceiling_mib"])
                                                           for r in writes]


def test_a_restart_is_idempotent(netns, tmp_path, start_watcher):
    pol = write_policy(tmp_path / "p.json")
    first = start_watcher(pol, "--proxy", "none", "--once")
    assert first.proc.wait(20) == 0 and first.value() == CLUSTERED_MIB
    again = start_watcher(pol, "--proxy", "none", "--once")
    assert again.proc.wait(20) == 0
    assert [r["event"] for r in again.records()] == ["start", "link", "converged"]


def test_flapping_50_times_in_10s_settles_right_and_never_writes_below_in_use(
        netns, tmp_path, start_watcher):
    w = start_watcher(write_policy(tmp_path / "p.json"), "--proxy", "none",
                      "--settle", "0.3", "--poll", "0.2")
    w.wait_for(lambda: w.value() == CLUSTERED_MIB, timeout=20)

    # 100 changes (50 down/up cycles) over 10 s. Most gaps are far shorter than the settle
    # time and must be absorbed; six are longer, so transitions also complete mid-flap.
    rng = random.Random(6)
    long_at = set(rng.sample(range(99), 6))
    short = [rng.uniform(0.02, 0.12) for _ in range(93)]
    short = [g * (10.0 - 6 * 0.6) / sum(short) for g in short]
    gaps = [0.6 if i in long_at else short.pop() for i in range(99)]
    at = list(itertools.accumulate([0.0, *gaps]))  # when each change is due
    up = True
    t0 = time.monotonic()
    for due in at:
        time.sleep(max(0.0, t0 + due - time.monotonic()))
        up = not up
        netns.peer(up)
    flap_s = time.monotonic() - t0
    assert up is True  # an even number of changes: the link ends up
    assert len(at) == 100 and flap_s < 11.0

    w.wait_for(lambda: w.value() == CLUSTERED_MIB, timeout=3)
    time.sleep(1.0)  # nothing moves once settled
    assert w.value() == CLUSTERED_MIB

    recs = w.records()
    writes = assert_writes_never_below_in_use(recs)
    assert {int(r["ceiling_mib"]) for r in writes} <= {STANDALONE_MIB, CLUSTERED_MIB}
    assert int(writes[-1]["ceiling_mib"]) == CLUSTERED_MIB
    raws = sum(1 for r in recs if r["event"] == "link-raw")
    settled = sum(1 for r in recs if r["event"] == "link") - 1
    assert 3 <= settled <= 6 + 1  # the long gaps settled (the last change may too)
    assert len(writes) - 1 <= settled < raws  # debounced: far fewer than the flaps
    assert [r for r in recs if r["level"] == "ERROR"] == []
    assert [r for r in recs if r["event"] == "converged"][-1]["mode"] == "clustered"


def test_a_standalone_budget_below_in_use_keeps_the_higher_ceiling(netns, tmp_path,
                                                                   start_watcher):
    tiny_gib = 1 / 1024  # 1 MiB: below any Python process's own usage in its cgroup
    w = start_watcher(write_policy(tmp_path / "p.json", standalone_gib=tiny_gib),
                      "--proxy", "none", "--settle", "0.5", "--poll", "0.2")
    w.wait_for(lambda: w.value() == CLUSTERED_MIB, timeout=20)
    netns.peer(False)
    w.wait_for(lambda: any(r["event"] == "held" for r in w.records()), timeout=5)
    time.sleep(1.0)
    assert w.value() == CLUSTERED_MIB  # kept the higher ceiling
    recs = w.records()
    held = [r for r in recs if r["event"] == "held"]
    assert held[0]["level"] == "ERROR" and "below the memory in use" in held[0]["msg"]
    assert all(int(r["ceiling_mib"]) == CLUSTERED_MIB
               for r in assert_writes_never_below_in_use(recs))
    netns.peer(True)  # back up: the clustered ceiling is already right
    w.wait_for(lambda: [r["event"] for r in w.records()][-1] == "converged", timeout=5)


# --- with the real proxy ----------------------------------------------------------------

PROXY_PORT = 18731  # on namespace A's own loopback: nothing else can be bound there


def ns_http(pair: Pair, method: str, path: str, token: str | None = None,
            body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    """One HTTP request from inside namespace A (the proxy listens on A's loopback)."""
    script = (
        "import httpx, json, sys\n"
        "m, url, tok, body, t = sys.argv[1:6]\n"
        "h = {'Authorization': 'Bearer ' + tok} if tok else {}\n"
        "r = httpx.request(m, url, headers=h, json=json.loads(body) if body else None,\n"
        "                  timeout=float(t), trust_env=False)\n"
        "print(json.dumps({'status': r.status_code, 'body': r.json()}))\n"
    )
    argv = [IP, "netns", "exec", pair.a, sys.executable, "-c", script, method,
            f"http://127.0.0.1:{PROXY_PORT}{path}", token or "",
            json.dumps(body) if body else "", str(timeout)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 30)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return out["status"], out["body"]


@pytest.fixture
def proxy(netns, tmp_path, tiny_model) -> Iterator[tuple[str, Path]]:
    """``plimsoll serve`` in namespace A and the cgroup, a demo model in its policy."""
    cli_serve = pytest.importorskip("plimsoll.cli.serve",
                                    reason="the proxy (plimsoll serve) has not landed")
    if not hasattr(cli_serve, "serve_command"):
        pytest.skip("plimsoll.cli.serve has no serve_command")
    from conftest import worker_env

    token_file = tmp_path / "admin-token"
    token_file.write_text("watcher-test-token\n")
    token_file.chmod(0o600)
    # Footprint: 16 sequences × 40960 tokens × 2 KiB/token (fp32, 4 KV layers) ≈ 1.25 GiB
    # of pool, over the 1 GiB standalone envelope and well under the clustered one.
    policy = write_policy(
        tmp_path / "proxy-policy.json", standalone_gib=1, clustered_gib=4,
        listen={"host": "127.0.0.1", "port": PROXY_PORT},
        models={"tiny": {"path": str(tiny_model), "context": 40960, "concurrency": 16,
                         "maxTokens": 64, "defaultMaxTokens": 8}})
    log = (tmp_path / "proxy.log").open("w")
    argv = netns.exec_argv(
        sys.executable, "-c", "from plimsoll.cli.serve import serve_command; serve_command()",
        "--policy", str(policy), "--admin-token-file", str(token_file), "--mode", "standalone",
        "--drain-timeout", "5")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=worker_env())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"proxy exited {proc.returncode}:\n"
                            f"{(tmp_path / 'proxy.log').read_text()}")
            try:
                if ns_http(netns, "GET", "/health", timeout=2)[0] == 200:
                    break
            except (AssertionError, subprocess.TimeoutExpired, json.JSONDecodeError):
                pass
            time.sleep(0.3)
        else:
            pytest.fail("proxy not ready in 60 s")
        yield "watcher-test-token", policy
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()


def test_downshift_evicts_before_the_ceiling_drops_and_upshift_raises_first(
        netns, tmp_path, proxy, start_watcher):
    token, policy = proxy
    w = start_watcher(policy, "--proxy", f"http://127.0.0.1:{PROXY_PORT}",
                      "--admin-token-file", str(tmp_path / "admin-token"),
                      "--settle", "1", "--poll", "0.5")
    # Start-up with the link up: raise, then the proxy goes clustered.
    w.wait_for(lambda: any(r["event"] == "converged" and r["mode"] == "clustered"
                           for r in w.records()), timeout=30)
    assert w.value() == 4096

    status, body = ns_http(netns, "POST", "/v1/chat/completions", body={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    _, running = ns_http(netns, "GET", "/running")
    (worker,) = running["workers"]
    footprint = worker["admitted"]["footprint_bytes"]
    assert worker["state"] == "ready" and footprint > 1 * GIB, worker  # over standalone

    netns.peer(False)
    w.wait_for(lambda: w.value() == 1024, timeout=60)
    netns.peer(True)
    w.wait_for(lambda: w.value() == 4096, timeout=10)
    w.wait_for(lambda: [r["event"] for r in w.records()][-1] == "converged", timeout=10)

    _, ev = ns_http(netns, "GET", "/admin/events", token=token)
    events = ev["events"]
    recs = w.records()
    writes = assert_writes_never_below_in_use(recs)

    def first(kind, **match):
        for e in events:
            if e["kind"] == kind and all(e["detail"].get(k) == v for k, v in match.items()):
                return e["t"]
        pytest.fail(f"no {kind} {match} in the proxy's events: {events}")

    lower = [r for r in writes if r["direction"] == "lower"]
    raise_ = [r for r in writes if r["direction"] == "raise"]
    assert [int(r["ceiling_mib"]) for r in lower] == [1024]
    t_lower = float(lower[0]["ts"])
    t_evict = next(e["t"] for e in events if e["kind"] == "evict" and e["model"] == "tiny")
    t_down = first("mode-change", new="standalone")
    t_exit = min(e["t"] for e in events if e["model"] == "tiny" and e["t"] > t_evict
                 and e["kind"] in ("exit", "release-verified"))
    # Downshift: evicted, its exit seen and the mode changed, all before the ceiling dropped.
    assert t_evict < t_exit <= t_down < t_lower
    # The ceiling was lowered only at a memory in use that fits the standalone ceiling.
    assert int(lower[0]["in_use_bytes"]) <= 1 * GIB
    # Upshift, at start and after the downshift: the ceiling rose before the proxy's mode.
    ups = [e["t"] for e in events
           if e["kind"] == "mode-change" and e["detail"].get("new") == "clustered"]
    assert len(ups) == len(raise_) == 2
    for r, t_up in zip(raise_, ups, strict=True):
        assert float(r["ts"]) < t_up
    assert t_lower < float(raise_[1]["ts"])
    asked = [r for r in recs if r["event"] == "proxy-answer"]
    assert [(r["mode"], r["status"]) for r in asked] == [
        ("clustered", "ok"), ("standalone", "ok"), ("clustered", "ok")]
