"""``plimsoll launch``: admission with live figures, then a verified worker — real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
from conftest import free_port, worker_env


def launch(model, *args, env_extra=None, timeout=180):
    argv = [sys.executable, "-m", "plimsoll.cli", "launch", str(model), *args]
    return subprocess.Popen(argv, env=worker_env() | (env_extra or {}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def policy_file(tmp_path, budget_gib: float, model, **entry) -> str:
    p = tmp_path / "policy.json"
    p.write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": budget_gib},
                  "clustered": {"maxLocalLlmGb": budget_gib}},
        "models": {"tiny": {"path": str(model), "context": 4096, "maxTokens": 256, **entry}},
    }))
    return str(p)


def test_launch_starts_a_verified_worker_and_stops_it(tiny_model, tmp_path):
    port = free_port()
    proc = launch("tiny", "--policy", policy_file(tmp_path, 1, tiny_model), "--port", str(port),
                  "--concurrency", "2")
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
        status = httpx.get(f"http://127.0.0.1:{port}/v1/plimsoll/status", timeout=10).json()
        # the worker's pool is what admission derived from a 1 GiB budget, and applied
        assert status["limits"]["memory_limit_applied_bytes"] == \
            status["limits"]["allocation_limit_bytes"]
        assert status["kv_bytes_bound"] <= 1 << 30
        assert status["max_num_seqs"] == 2 and status["context"]["configured"] == 4096
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0  # a clean stop is a clean exit
    # the worker went with it
    time.sleep(0.5)
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the worker outlived its launcher")
    except httpx.ConnectError:
        pass


def _workers_on(port: int) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "worker" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            out.append(p.pid)
    return out


def test_a_sigterm_right_after_the_ready_line_stops_the_worker_and_exits_0(tiny_model,
                                                                            tmp_path):
    """The race: the handlers were installed after the ready line, so a SIGTERM sent as soon
    as it was read killed the launcher by the default action (-15) and left the worker
    running in its own session."""
    port = free_port()
    proc = launch("tiny", "--policy", policy_file(tmp_path, 1, tiny_model), "--port", str(port))
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
    finally:
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(30)
    assert _workers_on(port) == []  # (checked first: a surviving worker holds our stderr)
    assert rc == 0, proc.stderr.read()


def test_a_sigterm_while_the_worker_loads_stops_it_and_exits_0(tiny_model, tmp_path):
    port = free_port()
    proc = launch("tiny", "--policy", policy_file(tmp_path, 1, tiny_model), "--port", str(port))
    seen = []
    try:
        for _ in range(200):  # the admission report, then "starting the worker"
            line = proc.stderr.readline()
            seen.append(line)
            if "starting the worker" in line or not line:
                break
        assert "starting the worker" in seen[-1], seen
        deadline = time.monotonic() + 60
        while not _workers_on(port) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    assert _workers_on(port) == []  # (checked first: a surviving worker holds our stderr)
    assert rc == 0
    assert "stopped before the worker was ready" in proc.stderr.read()


def test_the_policys_kv_dtype_reaches_the_worker_and_launch_checks_bytes(tiny_model, tmp_path):
    port = free_port()
    proc = launch("tiny", "--policy", policy_file(tmp_path, 1, tiny_model, kvDtype="float16"),
                  "--port", str(port))
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready", proc.stderr.read()
        status = httpx.get(f"http://127.0.0.1:{port}/v1/plimsoll/status", timeout=10).json()
        # tiny: 2 × 4 KV layers × 2 heads × 32 dims × 2 bytes (float16) × 16 tokens
        assert status["kv_dtype"] == "float16" and status["block_bytes"] == 2 * 4 * 2 * 32 * 2 * 16
        assert status["kv_bytes_bound"] == status["pool"]["total"] * status["block_bytes"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_launch_refuses_a_model_that_cannot_hold_one_sequence(tiny_model, tmp_path):
    proc = launch("tiny", "--policy", policy_file(tmp_path, 0.01, tiny_model))
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert "REFUSE" in err and "does not fit" in err
    assert "weights" in err and "envelope" in err  # the figures are named


def test_launch_detects_a_worker_that_did_not_apply_its_limit(tiny_model, tmp_path):
    proc = launch("tiny", "--policy", policy_file(tmp_path, 1, tiny_model), "--port",
                  str(free_port()), env_extra={"PLIMSOLL_FAULT_SKIP_MEMORY_LIMIT": "1"})
    _out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1
    assert "did not apply the derived limits" in err and "memory limit: derived" in err
