"""``plimsoll watch-link`` as a process: flags, usage errors, --once, signals.

Run as the lead wires it: the click command object called from ``python -c``. Needs no
root: the loopback interface is always up, an absent interface is down, and the ceiling
goes to a ``file:`` backend.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import parse_log_line

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sysfs")
CMD = "from plimsoll.cli.watch import watch_link_command; watch_link_command()"


# Budgets above this host's RAM: the in-use guard reads host-wide memory here, which other
# work moves; test_watcher_netns.py checks the guard against a cgroup of its own.
S_GIB, C_GIB = 40, 48
S_MIB, C_MIB = S_GIB * 1024, C_GIB * 1024


def policy(tmp_path: Path, standalone: float = S_GIB, clustered: float = C_GIB) -> Path:
    p = tmp_path / "policy.json"
    p.write_text(json.dumps({
        "schemaVersion": 1, "host": "h", "totalRamGb": 128, "osFloorGb": 8,
        "modes": {"standalone": {"maxLocalLlmGb": standalone},
                  "clustered": {"maxLocalLlmGb": clustered}}}))
    return p


def watch(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CMD, *args], capture_output=True, text=True,
                          timeout=timeout)


def records(stderr: str) -> list[dict[str, str]]:
    return [r for r in map(parse_log_line, stderr.splitlines()) if r is not None]


def test_once_on_an_up_link_applies_the_clustered_ceiling(tmp_path):
    ceiling = tmp_path / "ceiling"
    done = watch("--policy", str(policy(tmp_path)), "--interface", "lo", "--sysctl",
                 f"file:{ceiling}", "--proxy", "none", "--once")
    assert done.returncode == 0, done.stderr
    assert ceiling.read_text() == f"{C_MIB}\n"
    recs = records(done.stderr)
    assert [r["event"] for r in recs] == ["start", "link", "ceiling-write", "ceiling-verified",
                                          "converged"]
    write = recs[2]
    assert (write["ceiling_mib"], write["ceiling_bytes"]) == (str(C_MIB), str(C_MIB << 20))
    assert int(write["in_use_bytes"]) > 0 and write["direction"] == "raise"


def test_an_absent_interface_is_down(tmp_path):
    ceiling = tmp_path / "ceiling"
    ceiling.write_text(f"{C_MIB}\n")
    done = watch("--policy", str(policy(tmp_path)), "--interface", "nope0", "--sysctl",
                 f"file:{ceiling}", "--proxy", "none", "--once")
    assert done.returncode == 0, done.stderr
    assert ceiling.read_text() == f"{S_MIB}\n"
    assert "interface does not exist" in done.stderr


def test_once_exits_1_and_keeps_the_ceiling_when_the_budget_is_below_in_use(tmp_path):
    ceiling = tmp_path / "ceiling"
    ceiling.write_text(f"{C_MIB}\n")
    done = watch("--policy", str(policy(tmp_path, standalone=1 / 1024)), "--interface",
                 "nope0", "--sysctl", f"file:{ceiling}", "--proxy", "none", "--once")
    assert done.returncode == 1
    assert ceiling.read_text() == f"{C_MIB}\n"
    held = [r for r in records(done.stderr) if r["event"] == "held"]
    assert held[0]["level"] == "ERROR" and "below the memory in use" in held[0]["msg"]


def test_an_unreachable_proxy_holds_the_higher_ceiling(tmp_path):
    ceiling = tmp_path / "ceiling"
    ceiling.write_text(f"{C_MIB}\n")
    token = tmp_path / "token"
    token.write_text("t\n")
    done = watch("--policy", str(policy(tmp_path)), "--interface", "nope0", "--sysctl",
                 f"file:{ceiling}", "--proxy", "http://127.0.0.1:9", "--admin-token-file",
                 str(token), "--once")
    assert done.returncode == 1
    assert ceiling.read_text() == f"{C_MIB}\n"  # the downshift waits for the proxy
    events = [(r["event"], r.get("status")) for r in records(done.stderr)]
    assert ("proxy-answer", "unreachable") in events and ("held", None) in events
    # it says, at start, what it does without the proxy
    said = [r for r in records(done.stderr) if r["event"] == "proxy-unreachable"]
    assert len(said) == 1 and said[0]["url"] == "http://127.0.0.1:9"
    assert "lowered only once the proxy confirms" in said[0]["msg"]


def test_sigterm_stops_it_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CMD, "--policy", str(policy(tmp_path)),
                             "--interface", "lo", "--sysctl", f"file:{tmp_path / 'c'}",
                             "--proxy", "none", "--poll", "0.1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "c").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert records(err)[-1]["event"] == "stopped"


@pytest.mark.parametrize(("args", "message"), [
    ([], "pass file:PATH"),
    (["--sysctl", "bogus"], "use 'darwin' or 'file:PATH'"),
    (["--sysctl", "file:/no/such/dir/c"], "does not exist"),
    (["--sysctl", "file:{tmp}/c", "--proxy", "http://192.0.2.1:8080", "--admin-token-file",
      "{tmp}/token"], "loopback"),
    (["--sysctl", "file:{tmp}/c", "--proxy", "http://127.0.0.1:8080"], "--admin-token-file"),
    (["--sysctl", "file:{tmp}/c", "--interface", "../x"], "invalid interface name"),
    (["--sysctl", "file:{tmp}/c", "--poll", "2"], "--poll"),
])
def test_usage_errors_exit_2(tmp_path, args, message):
    (tmp_path / "token").write_text("t\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = watch("--policy", str(policy(tmp_path)), *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_a_bad_policy_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = watch("--policy", str(bad), "--sysctl", f"file:{tmp_path / 'c'}")
    assert done.returncode == 2 and "invalid policy" in done.stderr
