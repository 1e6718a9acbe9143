"""The paged decode kernel alone: how close a layer's decode attention comes to the memory's
bandwidth, beside the gather path it replaced, in one run.

By hand, not a test (MLX's CUDA backend: engine/paged_cuda.py; elsewhere it says so and
stops). For each (rows, context) of ``--shapes``, a Qwen3-4B-shaped layer (8 KV heads, 32
query heads, dim 128, bf16, blocks of 16 tokens scattered through the pool): ``--layers``
distinct pools, one call each, evaluated together as a decode step's layers are (so the
pools do not sit in L2), ``--reps`` times, for the kernel and for the engine's gather path
(``kernels.reference_decode``: the tables gathered, then the fused attention with a padding
mask); the median per call, the K/V bytes read ÷ that time, and that as a fraction of the
copy bandwidth measured in the same run. The kernel is checked against the gather path first.

    python3 bench/decode_kernel.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
from plimsoll.engine import kernels, paged_cuda

from lib import report

KV_HEADS, Q_HEADS, DIM, BT = 8, 32, 128, 16


def copy_bandwidth(gib: float = 2.0, reps: int = 5) -> float:
    """Bytes a second an on-device copy moves (read + write), best of ``reps``."""
    a = mx.zeros((int(gib * 2**30) // 4,), dtype=mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(mx.array(a + 0))
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def pools(rows: int, length: int, layers: int, seed: int) -> list[tuple]:
    """``layers`` problems of ``rows`` rows each ``length`` tokens long (their own pools)."""
    out = []
    for i in range(layers):
        out.append(kernels._problem(rows, length, length, KV_HEADS, Q_HEADS, DIM,
                                    mx.bfloat16, seed + i))
        mx.eval(*out[-1][:5])
    return out


def per_call_s(fn, problems: list[tuple], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn(*p) for p in problems])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(problems)


def measure(args) -> dict:
    if not paged_cuda.available():
        sys.exit("decode_kernel.py needs MLX's CUDA backend (engine/paged_cuda.py)")
    bandwidth = copy_bandwidth()
    rows_out = []
    for rows, length in args.shapes:
        kv_bytes = rows * length * KV_HEADS * DIM * 2 * 2  # K and V, bf16
        layers = max(1, min(args.layers, int(args.pool_gib * 2**30 // max(kv_bytes, 1))))
        problems = pools(rows, length, layers, rows * 7919 + length)
        want = kernels.reference_decode(*problems[0])
        got = paged_cuda.paged_decode(*problems[0])
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        for path, fn in (("kernel", paged_cuda.paged_decode),
                         ("gather", kernels.reference_decode)):
            per_call_s(fn, problems, 2)  # compiles, plans
            t = per_call_s(fn, problems, args.reps)
            row = {"rows": rows, "context": length, "path": path, "layers": layers,
                   "splits": paged_cuda.splits_for(rows, KV_HEADS, length,
                                                   paged_cuda.sm_count()),
                   "us_per_call": t * 1e6, "kv_bytes": kv_bytes,
                   "bytes_per_s": kv_bytes / t, "of_bandwidth": kv_bytes / t / bandwidth,
                   "max_error": err}
            rows_out.append(row)
            print(f"rows {rows:3d} context {length:6d} {path}: {t * 1e6:8.1f} us/call "
                  f"{kv_bytes / t / 1e9:7.1f} GB/s ({kv_bytes / t / bandwidth:.2f} of copy) "
                  f"err {err:.4f}", flush=True)
        del problems, want
        mx.clear_cache()
    return {"copy_bytes_per_s": bandwidth, "sms": paged_cuda.sm_count(), "rows": rows_out}


def markdown(result: dict) -> str:
    out = result["out"]
    kernel = {(r["rows"], r["context"]): r["us_per_call"] for r in out["rows"]
              if r["path"] == "kernel"}
    lines = [*report.heading("The paged decode kernel alone", result),
             f"Copy bandwidth {out['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write); "
             f"{out['sms']} SMs. One call = one layer of a Qwen3-4B-shaped model (8 KV heads, "
             "32 query heads, dim 128, bf16); `gather`: the engine's path without the kernel "
             "(the tables gathered, then the fused attention with a padding mask).", "",
             *report.table(("rows", "context", "path", "splits", "µs per call", "GB/s",
                            "of copy bandwidth", "÷ kernel", "max error"),
                           [(r["rows"], r["context"], r["path"], r["splits"],
                             f"{r['us_per_call']:.1f}", f"{r['bytes_per_s'] / 1e9:.0f}",
                             f"{r['of_bandwidth']:.2f}",
                             report.num(r["us_per_call"] / kernel[(r["rows"], r["context"])]),
                             f"{r['max_error']:.4f}") for r in out["rows"]]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x350,1x4096,1x17000,7x17000,8x2048,32x512,32x4096",
                    type=lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",")],
                    help="ROWSxCONTEXT,... (default %(default)s)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--pool-gib", type=float, default=16.0,
                    help="the most K/V bytes the layers' pools take together (fewer layers "
                         "where one shape's would exceed it)")
    ap.add_argument("--reps", type=int, default=10)
    report.output_args(ap, "decode-kernel")
    args = ap.parse_args(argv)
    return report.measure_and_write(args, "decode-kernel", measure, markdown, key="out")


if __name__ == "__main__":
    raise SystemExit(main())
