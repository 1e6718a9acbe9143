"""``plimsoll serve --check`` and ``plimsoll watch-link --check`` as processes: real files,
real policy loading; exit 0 when the command would start, 2 with the reason otherwise, and
nothing started or written either way."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

GIB = 1 << 30


def plimsoll(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plimsoll.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def write_policy(tmp_path: Path, **extra) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    data = {"schemaVersion": 1, "host": "h", "totalRamGb": 96, "osFloorGb": 16,
            "modes": {"standalone": {"maxLocalLlmGb": 72}, "clustered": {"maxLocalLlmGb": 80}},
            "models": {"m": {"path": str(model), "context": 8192}}, **extra}
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(data))
    return p


def token(tmp_path: Path, text: str = "secret\n", mode: int = 0o600) -> Path:
    p = tmp_path / "admin-token"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_serve_check_passes_and_starts_nothing(tmp_path):
    pol = write_policy(tmp_path)
    with socket.socket() as s:  # the policy's port stays free: nothing binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    done = plimsoll("serve", "--check", "--policy", str(pol), "--port", str(port),
                    env={"PLIMSOLL_CACHE": str(cache)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   policy" in done.stdout and "model m:" in done.stdout
    assert done.stdout.rstrip().endswith("check passed: plimsoll serve would start")
    assert not cache.exists()  # the default token file is not written by a check
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_serve_check_with_the_token_file_and_ranks(tmp_path):
    pol = write_policy(tmp_path, models={"big": {"path": str(tmp_path / "absent"),
                                                 "context": 8192, "sharded": True}})
    done = plimsoll("serve", "--check", "--policy", str(pol), "--admin-token-file",
                    str(token(tmp_path)), "--mode", "clustered",
                    "--cluster-rank", "80:96:80", "--cluster-rank", "52:64:52")
    assert done.returncode == 0, done.stdout
    assert "admin token file" in done.stdout and "2 cluster ranks" in done.stdout
    # a model directory that is not there yet is a warning (a 503 at request time)
    assert "warn model big:" in done.stdout and "does not exist" in done.stdout
    assert "sized for other hosts" in done.stdout  # ranks run here: said, not hidden


@pytest.mark.parametrize("make, args, message", [
    (lambda t: write_policy(t, host=None), [], "host"),
    (lambda t: write_policy(t, models={}), [], "the policy lists no models"),
    (write_policy, ["--admin-token-file", "{empty}"], "is empty"),
    (write_policy, ["--admin-token-file", "{writable}"], "writable by group or others"),
    (write_policy, ["--idle-ttl", "nope=5"], "no model 'nope' in the policy"),
    (write_policy, ["--cluster-rank", "80:96:80"], "needs two ranks or more"),
    (write_policy, ["--cluster-rank", "90:96:90", "--cluster-rank", "40"],
     "sized above its clustered budget of 80 GiB"),
    (write_policy, ["--cluster-rank", "80:128:80", "--cluster-rank", "40"],
     "claims 128 GiB of RAM"),
    (write_policy, ["--cluster-rank", "x"], "--cluster-rank"),
])
def test_serve_check_fails_with_the_reason(tmp_path, make, args, message):
    pol = make(tmp_path)
    empty = token(tmp_path, "\n")
    writable = tmp_path / "writable"
    writable.write_text("t")
    writable.chmod(0o666)
    args = [a.format(empty=empty, writable=writable) for a in args]
    done = plimsoll("serve", "--check", "--policy", str(pol), *args)
    assert done.returncode == 2, done.stdout
    assert message in done.stdout
    assert "check failed: plimsoll serve would not start" in done.stdout


def test_serve_check_missing_token_file_is_a_usage_error(tmp_path):
    done = plimsoll("serve", "--check", "--policy", str(write_policy(tmp_path)),
                    "--admin-token-file", str(tmp_path / "nope"))
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_watch_link_check(tmp_path):
    pol = write_policy(tmp_path)
    ceiling = tmp_path / "ceiling"
    done = plimsoll("watch-link", "--check", "--policy", str(pol), "--sysctl",
                    f"file:{ceiling}", "--interface", "lo", "--admin-token-file",
                    str(token(tmp_path)))
    assert done.returncode == 0, done.stdout
    assert "proxy http://127.0.0.1:8080" in done.stdout
    assert "raises the ceiling alone" in done.stdout  # what it does while the proxy is down
    assert not ceiling.exists()  # a check writes no ceiling


@pytest.mark.parametrize("args, message", [
    (["--sysctl", "file:/nonexistent-dir/c"], "directory /nonexistent-dir does not exist"),
    (["--sysctl", "bogus", "--proxy", "none"], "use 'darwin' or 'file:PATH'"),
    (["--sysctl", "file:{tmp}/c"], "--admin-token-file is required"),
    (["--sysctl", "file:{tmp}/c", "--proxy", "http://192.0.2.1:8080",
      "--admin-token-file", "{tmp}/t"], "only talks to the local proxy"),
    (["--sysctl", "file:{tmp}/c", "--admin-token-file", "{tmp}/missing"],
     "No such file or directory"),
])
def test_watch_link_check_fails_with_the_reason(tmp_path, args, message):
    token(tmp_path).rename(tmp_path / "t")
    args = [a.format(tmp=tmp_path) for a in args]
    done = plimsoll("watch-link", "--check", "--policy", str(write_policy(tmp_path)), *args)
    assert done.returncode == 2, done.stdout
    assert message in done.stdout


def test_watch_link_check_bad_policy(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("[1]")
    done = plimsoll("watch-link", "--check", "--policy", str(bad), "--proxy", "none")
    assert done.returncode == 2 and "must be a JSON object" in done.stdout
