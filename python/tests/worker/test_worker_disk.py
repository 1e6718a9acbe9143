"""The disk tier through real ``plimsoll worker`` processes (tiny demo, CPU): a prompt served,
the worker stopped with SIGTERM, a new worker on the same directory serves the prompt plus a
suffix from disk with output equal to a cold worker's; damaged files are deleted and the
request served; the cap holds under eviction; a full filesystem turns the tier off and
serving continues."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import httpx
import pytest
from conftest import Worker

PROMPT = 900  # tokens; block 16: 56 full blocks


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def complete(w: Worker, prompt: list[int], n: int = 8) -> tuple[list[str], int, int]:
    r = httpx.post(w.url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    return (body["choices"][0]["text"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def files(d) -> list:
    return [p for p in d.rglob("*.kvb")]


def test_restart_serves_the_prompt_from_disk(tiny_model, tmp_path):
    d = tmp_path / "kv"
    prompt, suffix = ids(PROMPT, 1), ids(40, 2)
    a = Worker(tiny_model, disk_cache_dir=d)
    try:
        _first, n, cached = complete(a, prompt)
        assert (n, cached) == (PROMPT, 0)
        assert a.status()["disk"]["state"] == "on"
    finally:
        a.stop()
    assert a.proc.returncode in (0, -15)
    stored = files(d)
    assert len(stored) >= PROMPT // 16 - 1

    cold = Worker(tiny_model)
    try:
        expect = complete(cold, prompt + suffix)[0]
        assert cold.status()["disk"] is None
    finally:
        cold.stop()

    b = Worker(tiny_model, disk_cache_dir=d)
    try:
        text, n, cached = complete(b, prompt + suffix)
        assert n == PROMPT + 40 and cached >= 0.9 * PROMPT
        assert text == expect
        disk = b.status()["disk"]
        assert disk["hits"] >= PROMPT // 16 - 1 and disk["bytes_read"] > 0
        assert disk["files"] >= disk["hits"] and 0 < disk["size_bytes"] <= disk["cap_bytes"]
        assert b.status()["prefill_tokens_computed"] == n - cached
    finally:
        b.stop()

    for p in files(d):  # every file damaged: none is loaded, the request is prefilled
        data = bytearray(p.read_bytes())
        data[-3] ^= 0xA5
        p.write_bytes(bytes(data))
    c = Worker(tiny_model, disk_cache_dir=d)
    try:
        text, n, cached = complete(c, prompt + suffix)
        assert cached == 0 and text == expect
        disk = c.status()["disk"]
        assert disk["corrupt"] == 1 and disk["hits"] == 0
    finally:
        c.stop()


def test_the_cap_holds_while_blocks_are_evicted(tiny_model, tmp_path):
    d = tmp_path / "kv"
    cap_gb = 1.5 / 1024  # 1.5 MiB: a few dozen tiny blocks
    w = Worker(tiny_model, disk_cache_dir=d, disk_cache_gb=cap_gb, context=1024,
               max_cache_blocks=80, cache_memory_mb=1, max_tokens=64)
    try:
        for k in range(8):
            complete(w, ids(500, 100 + k), 4)
        s = w.status()["disk"]
        assert s["files_written"] > 0 and s["evicted_files"] > 0
        assert s["size_bytes"] <= s["cap_bytes"] == int(cap_gb * (1 << 30))
    finally:
        w.stop()
    assert sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) <= int(cap_gb * (1 << 30))


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_turns_the_tier_off_and_serving_continues(tiny_model, small_fs):
    w = Worker(tiny_model, disk_cache_dir=small_fs, disk_cache_gb=1, context=1024,
               max_cache_blocks=80, cache_memory_mb=1, max_tokens=64)
    try:
        for k in range(6):
            complete(w, ids(500, 200 + k), 4)
        s = w.status()["disk"]
        assert s["state"] == "off" and "ENOSPC" in s["reason"]
        _text, n, _ = complete(w, ids(300, 999), 4)  # still served
        assert n == 300
        assert httpx.get(w.url + "/health").status_code == 200
    finally:
        w.stop()
