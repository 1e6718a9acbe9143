"""A memory spike on demand, for ``plimsoll verify`` (fault injection, invariant 7).

``python -m plimsoll.engine.spike {mlx,numpy}`` imports its library, prints ``READY``,
reads a size in MiB from stdin (so the caller can size it against the usage it sees
*now*), allocates and touches it, prints ``HELD <bytes>``, holds it until stdin closes.
``plimsoll verify`` runs it inside the worker's own cgroup, so the kernel charges it
where the worker's guard looks: an allocation the scheduler did not plan (an MLX buffer
spike, a numpy copy). It lives at the engine edge because it imports mlx.
"""

from __future__ import annotations

import sys


def hold(kind: str) -> int:
    if kind == "mlx":
        import mlx.core as mx
    elif kind == "numpy":
        import numpy as np
    else:
        raise SystemExit(f"unknown spike kind {kind!r}: mlx or numpy")
    print("READY", flush=True)
    n = int(sys.stdin.readline()) << 20
    if kind == "mlx":
        arr = mx.ones((n // 4,), dtype=mx.float32)
        mx.eval(arr)
    else:
        arr = np.ones(n, dtype=np.uint8)  # ones, not zeros: every page really touched
    held = arr.nbytes
    print(f"HELD {held}", flush=True)
    sys.stdin.read()
    return held


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m plimsoll.engine.spike {mlx,numpy}")
    hold(sys.argv[1])
