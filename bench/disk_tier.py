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

Figures: TTFT restored ÷ cold (the target: ≤ 0.2 on the CPU box), bytes on disk per
token, write throughput (bytes written ÷ shutdown time: a lower bound) and the store's own
write and read throughput on block-sized payloads (fsync per file, as the worker writes).
Writes ``--out-dir``/``--name``.{json,md} (default name ``disk-tier-<machine>-<date>-<preset>``).
Example::

    python bench/disk_tier.py --preset tiny
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from lib import report
from lib.servers import OPENBLAS, ServerProcess, free_port, server_env


class Worker:
    """``plimsoll worker`` on a free 127.0.0.1 port, with or without the disk tier."""

    def __init__(self, model: Path, log: Path, *, context: int, disk: Path | None = None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(model),
                "--model-name", "m", "--port", str(port), "--max-cache-blocks",
                str(2 * context // 16 + 64), "--gpu-memory-utilization", "0.9",
                "--cache-memory-mb", "4096", "--max-num-seqs", "1", "--context", str(context),
                "--max-tokens", "64", "--ceiling-bytes", str(16 << 30),
                "--total-ram-bytes", str(24 << 30)]
        if disk is not None:
            argv += ["--disk-cache-dir", str(disk), "--disk-cache-gb", "8"]
        self.server = ServerProcess("worker", argv, server_env(OPENBLAS), port, log).start()
        self.server.wait_ready(300, paths=("/v1/plimsoll/status",))

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
        """SIGTERM to exit (the spill to disk included), seconds."""
        return self.server.stop(grace_s=300)["stop_s"]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "qwen3-0.6b"])
    ap.add_argument("--model", type=Path, help="model dir (default: built under a temp dir)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temp dir)")
    report.output_args(ap, "disk-tier")
    args = ap.parse_args(argv)
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
        "command": report.command(), "host": report.host_facts(),
    }
    result["host"]["loadavg_end"] = report.loadavg()
    report.write(result, args.out_dir,
                 args.name or report.default_name("disk-tier", args.preset), markdown)
    print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    st, restored, cold = r["store"], r["restored"], r["cold"]
    turns = ", ".join(f"{t['seconds']} s/{t['prompt']}/{t['cached']}" for t in r["turns"])
    return "\n".join([
        f"# Disk tier: the next turn after a worker restart ({r['preset']}, CPU, float32)", "",
        f"`{r['command']}` — {r['date']}. Session: {len(r['turns'])} turns to "
        f"{r['session_tokens']} tokens; the worker stopped with SIGTERM (cached blocks spilled "
        f"to disk), a new worker on the same directory, then the next turn "
        f"({r['next_turn_tokens']} tokens, max_tokens 1); a cold worker (no tier) serves the "
        "same request.", "",
        *report.table(["figure", "value"], [
            ["TTFT restored from disk",
             f"{restored['seconds']} s ({restored['cached']} cached tokens)"],
            ["TTFT cold prefill", f"{cold['seconds']} s"],
            ["**restored ÷ cold**",
             f"**{r['ttft_restored_over_cold']}** (target ≤ 0.2 on the CPU box)"],
            ["bytes on disk per token",
             f"{r['bytes_on_disk_per_token']} (KV {r['kv_bytes_per_token']} B/token + header)"],
            ["files / bytes on disk", f"{r['files']} / {r['bytes_on_disk']}"],
            ["shutdown (SIGTERM → exit, spill included)",
             f"{r['shutdown_s']} s → ≥ {r['shutdown_write_mb_per_s_lower_bound']} MB/s written"],
            ["read during the restored turn",
             f"≥ {r['read_mb_per_s_lower_bound']} MB/s (bytes read ÷ TTFT)"],
            [f"store alone, {st['blocks']} blocks of {st['block_bytes']} B",
             f"write {st['write_mb_per_s']} MB/s (fsync per file), read "
             f"{st['read_mb_per_s']} MB/s"]]),
        "", f"Session turns (seconds, prompt, cached): {turns}"]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
