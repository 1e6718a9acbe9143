"""Disk tier benchmark, by hand: an agentic session, a worker restart, the next turn.

Phases (one ``plimsoll worker`` at a time, 127.0.0.1, OpenBLAS preloaded, float32 demo):

1. **session**: ``--turns`` turns on a worker with ``--disk-cache-dir``; each turn resends the
   whole conversation plus ``--turn-tokens`` new tokens (a tool result), ``max_tokens`` 8,
   greedy. The worker is then stopped with SIGTERM: its cached blocks go to disk
   (``shutdown_s`` is SIGTERM to exit, the spill included).
2. **restored**: a new worker on the same directory; the next turn (the whole conversation
   plus a new suffix) with ``max_tokens`` 1: its time is the TTFT, ``cached_tokens`` what came
   from disk.
3. **cold**: a worker without the tier; the same request: the TTFT of a cold prefill.

Figures: TTFT restored ÷ cold (the issue's target: ≤ 0.2 on the CPU box), bytes on disk per
token, write throughput (bytes written ÷ shutdown time: a lower bound) and the store's own
write and read throughput on block-sized payloads (fsync per file, as the worker writes).
Writes bench/results/disk_tier-<preset>.{json,md}. Example::

    python bench/disk_tier.py --preset tiny
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from plimsoll.web.serve import free_port

HERE = Path(__file__).resolve().parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


class Worker:
    def __init__(self, model: Path, log: Path, *, context: int, disk: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(model),
                "--model-name", "m", "--port", str(self.port), "--max-cache-blocks",
                str(2 * context // 16 + 64), "--gpu-memory-utilization", "0.9",
                "--cache-memory-mb", "4096", "--max-num-seqs", "1", "--context", str(context),
                "--max-tokens", "64", "--ceiling-bytes", str(16 << 30),
                "--total-ram-bytes", str(24 << 30)]
        if disk is not None:
            argv += ["--disk-cache-dir", str(disk), "--disk-cache-gb", "8"]
        env = dict(os.environ)
        if os.path.exists(OPENBLAS):
            env.setdefault("LD_PRELOAD", OPENBLAS)
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/v1/plimsoll/status", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("worker not ready")

    def status(self) -> dict:
        return httpx.get(self.url + "/v1/plimsoll/status", timeout=30).json()

    def complete(self, prompt: list[int], n: int) -> dict:
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/completions", timeout=3600, json={
            "model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0})
        r.raise_for_status()
        u = r.json()["usage"]
        return {"seconds": round(time.perf_counter() - t0, 4), "prompt": u["prompt_tokens"],
                "cached": u["prompt_tokens_details"]["cached_tokens"]}

    def stop(self) -> float:
        t0 = time.perf_counter()
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(300)
        return round(time.perf_counter() - t0, 3)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def dir_bytes(d: Path) -> tuple[int, int]:
    files = [p for p in d.rglob("*.kvb")]
    return len(files), sum(p.stat().st_size for p in files)


def store_throughput(block_bytes: int, count: int, root: Path) -> dict:
    """The store alone: ``count`` block-sized files written (fsync each), then read back."""
    from plimsoll.worker.disk_tier import DiskStore

    s = DiskStore(root, "bench", 1 << 40, buffer_bytes=64 << 20)
    payload = os.urandom(block_bytes)
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(count)]
    t0 = time.perf_counter()
    for h in hashes:
        s.put(h, payload, wait=True)
    s.flush(None)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for h in hashes:
        assert s.get(h) == payload
    read_s = time.perf_counter() - t0
    s.close()
    mb = block_bytes * count / 1e6
    return {"blocks": count, "block_bytes": block_bytes,
            "write_mb_per_s": round(mb / write_s, 1), "read_mb_per_s": round(mb / read_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "qwen3-0.6b"])
    ap.add_argument("--model", type=Path, help="model dir (default: built under a temp dir)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="disk-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from plimsoll.demo.model import build_demo_model

        model = build_demo_model(work / args.preset, preset=args.preset)
    disk = work / "kv"
    shutil.rmtree(disk, ignore_errors=True)

    convo: list[int] = []
    turns = []
    a = Worker(model, work / "session.log", context=args.context, disk=disk)
    block_bytes = a.status()["block_bytes"]
    for t in range(args.turns):
        convo += ids(args.turn_tokens, t)
        turns.append(a.complete(convo, 8))
    shutdown_s = a.stop()
    files, on_disk = dir_bytes(disk)
    nxt = convo + ids(200, 999)

    b = Worker(model, work / "restored.log", context=args.context, disk=disk)
    restored = b.complete(nxt, 1)
    disk_status = b.status()["disk"]
    b.stop()
    c = Worker(model, work / "cold.log", context=args.context)
    cold = c.complete(nxt, 1)
    c.stop()

    result = {
        "preset": args.preset, "model": str(model), "turns": turns,
        "session_tokens": len(convo), "next_turn_tokens": len(nxt),
        "block_bytes": block_bytes, "files": files, "bytes_on_disk": on_disk,
        "bytes_on_disk_per_token": round(on_disk / (files * 16), 1) if files else None,
        "kv_bytes_per_token": block_bytes // 16,
        "shutdown_s": shutdown_s,
        "shutdown_write_mb_per_s_lower_bound": round(on_disk / 1e6 / shutdown_s, 1),
        "restored": restored, "cold": cold,
        "ttft_restored_over_cold": round(restored["seconds"] / cold["seconds"], 3),
        "restored_disk_status": disk_status,
        "read_mb_per_s_lower_bound": round(disk_status["bytes_read"] / 1e6
                                           / restored["seconds"], 1),
        "store": store_throughput(block_bytes, 256, work / "store"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "bench/disk_tier.py", *sys.argv[1:]]),
    }
    out = HERE / "results"
    (out / f"disk_tier-{args.preset}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"disk_tier-{args.preset}.md").write_text(markdown(result))
    print(json.dumps(result, indent=2))


def markdown(r: dict) -> str:
    st = r["store"]
    return f"""# Disk tier: the next turn after a worker restart ({r['preset']}, CPU, float32)

`{r['command']}` — {r['date']}. Session: {len(r['turns'])} turns to {r['session_tokens']} tokens;
the worker stopped with SIGTERM (cached blocks spilled to disk), a new worker on the same
directory, then the next turn ({r['next_turn_tokens']} tokens, max_tokens 1); a cold worker
(no tier) serves the same request.

| figure | value |
|---|---|
| TTFT restored from disk | {r['restored']['seconds']} s ({r['restored']['cached']} cached tokens) |
| TTFT cold prefill | {r['cold']['seconds']} s |
| **restored ÷ cold** | **{r['ttft_restored_over_cold']}** (target ≤ 0.2 on the CPU box) |
| bytes on disk per token | {r['bytes_on_disk_per_token']} (KV {r['kv_bytes_per_token']} B/token + header) |
| files / bytes on disk | {r['files']} / {r['bytes_on_disk']} |
| shutdown (SIGTERM → exit, spill included) | {r['shutdown_s']} s → ≥ {r['shutdown_write_mb_per_s_lower_bound']} MB/s written |
| read during the restored turn | ≥ {r['read_mb_per_s_lower_bound']} MB/s (bytes read ÷ TTFT) |
| store alone, {st['blocks']} blocks of {st['block_bytes']} B | write {st['write_mb_per_s']} MB/s (fsync per file), read {st['read_mb_per_s']} MB/s |

Session turns (seconds, prompt, cached): {', '.join(f"{t['seconds']} s/{t['prompt']}/{t['cached']}" for t in r['turns'])}
"""


if __name__ == "__main__":
    main()
