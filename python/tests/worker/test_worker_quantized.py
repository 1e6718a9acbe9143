"""Quantized KV end to end: the policy's ``kvDtype`` q8 through ``plimsoll launch`` (which
verifies the worker's block bytes against admission's), and ``plimsoll worker --kv-bits 4``:
real processes over HTTP on loopback, a tiny random-weight qwen3 (head_dim 64, float32)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import Worker, worker_env
from test_launch import launch, policy_file

pytest.importorskip("mlx.core")

# qwen3 family: 4 layers × 2 KV heads × head_dim 64; a vector is 64 values (float32 base)
LAYERS, HEADS, DIM, BLOCK = 4, 2, 64, 16
VECTOR = {8: DIM + 2 * 4, 4: DIM // 2 + 2 * 4}  # packed values + scale & bias (float32)


def quantized_block_bytes(bits: int) -> int:
    return 2 * LAYERS * HEADS * VECTOR[bits] * BLOCK  # K and V


def _chat(url: str, content: str, n: int = 6) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"model": "tiny", "max_tokens": n, "temperature": 0,
                         "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_policy_q8_reaches_the_worker_and_launch_verifies_its_bytes(family_dir, tmp_path):
    from conftest import free_port

    port = free_port()
    proc = launch("tiny", "--policy", policy_file(tmp_path, 1, family_dir("qwen3"),
                                                  kvDtype="q8"), "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", proc.stderr.read()
        status = httpx.get(f"{url}/v1/plimsoll/status", timeout=10).json()
        assert status["kv_dtype"] == "q8"
        assert status["block_bytes"] == quantized_block_bytes(8)
        assert status["kv_bytes_bound"] == status["pool"]["total"] * quantized_block_bytes(8)
        with ThreadPoolExecutor(2) as ex:  # two at once: one batched decode
            outs = list(ex.map(lambda c: _chat(url, c), ["hello there", "write a poem"]))
        assert all(o["usage"]["completion_tokens"] > 0 for o in outs)
        after = httpx.get(f"{url}/v1/plimsoll/status", timeout=10).json()
        held = after["kv_bytes_held"]
        assert held > 0 and held % quantized_block_bytes(8) == 0
        # physical truth: the pool arrays really allocated are whole slabs of quantized blocks
        assert after["kv_bytes_allocated"] % quantized_block_bytes(8) == 0
        assert after["kv_bytes_allocated"] >= held
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_worker_kv_bits_4_answers_and_reports_quantized_bytes(family_dir):
    w = Worker(family_dir("qwen3"), kv_bits=4, max_cache_blocks=256, context=1024,
               max_tokens=128, block_bytes=quantized_block_bytes(4))
    try:
        out = _chat(w.url, "tell me about the sea", 8)
        assert out["usage"]["completion_tokens"] > 0
        status = w.wait_idle()
        assert status["kv_dtype"] == "q4" and status["block_bytes"] == quantized_block_bytes(4)
        assert status["kv_bytes_per_token"] == quantized_block_bytes(4) // BLOCK
        assert status["kv_bytes_held"] == \
            (status["pool"]["used"] + status["pool"]["cached"]) * quantized_block_bytes(4)
        assert status["kv_bytes_allocated"] % quantized_block_bytes(4) == 0
    finally:
        w.stop()


def test_kv_bits_and_kv_dtype_that_disagree_are_a_usage_error(family_dir):
    argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(family_dir("qwen3")),
            "--max-cache-blocks", "64", "--gpu-memory-utilization", "0.5", "--max-num-seqs",
            "1", "--context", "512", "--kv-bits", "8", "--kv-dtype", "q4"]
    r = subprocess.run(argv, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--kv-bits 8 and --kv-dtype q4 disagree" in r.stderr
