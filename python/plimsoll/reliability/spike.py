"""Memory spikes on demand, for ``plimsoll verify`` (fault injection, invariant 7).

``python -m plimsoll.reliability.spike KIND [ARG]`` imports what it needs, prints ``READY``,
reads one line from stdin (so the caller can size the spike against the usage it sees
*now*), makes the spike, prints ``HELD <bytes>`` and holds it until stdin closes.
``plimsoll verify`` runs it inside the worker's own cgroup, so the kernel charges it
where the worker's guard looks. Kinds:

- ``mlx`` / ``numpy``: the line is a size in MiB; an allocation the scheduler did not
  plan (an MLX buffer spike, a numpy copy), every page touched.
- ``mmap PATH``: the line is ignored; PATH is mapped, ``MADV_WILLNEED`` asks for it
  all, and every page is read through (a prefetch of a large file: page cache charged
  to the cgroup, reclaimable, unlike the two above).
- ``load MODEL_DIR``: the line is a number of copies; the model is loaded again with
  mlx-lm that many times (a second model load beside the serving one), weights evaluated.

It lives at the engine edge because it imports mlx and mlx_lm.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

KINDS = ("mlx", "numpy", "mmap", "load")


def _mlx(mib: int) -> tuple[object, int]:
    import mlx.core as mx

    arr = mx.ones(((mib << 20) // 4,), dtype=mx.float32)
    mx.eval(arr)
    return arr, arr.nbytes


def _numpy(mib: int) -> tuple[object, int]:
    import numpy as np

    arr = np.ones(mib << 20, dtype=np.uint8)  # ones, not zeros: every page really touched
    return arr, arr.nbytes


def prefetch(path: str) -> tuple[mmap.mmap, int]:
    """Map ``path``, ask the kernel to read it all ahead, then touch every page.

    Returns the mapping (kept open by the caller, so the pages stay mapped) and the bytes
    read through."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        m.madvise(mmap.MADV_WILLNEED)
    step = mmap.PAGESIZE
    total = 0
    for off in range(0, size, step):
        total += m[off]  # one byte per page faults the whole page in
    return m, size


def load_copies(model_dir: str, copies: int) -> tuple[list, int]:
    """``copies`` more loads of the model (the first with its tokenizer, as mlx_lm.load
    does), weights materialised; returns them and the bytes of their parameters."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import load_model

    held, nbytes = [], 0
    for i in range(copies):
        model = load(model_dir)[0] if i == 0 else load_model(Path(model_dir))[0]
        params = tree_flatten(model.parameters())
        mx.eval([v for _, v in params])
        nbytes += sum(v.nbytes for _, v in params)
        held.append(model)
    return held, nbytes


def hold(kind: str, arg: str | None = None) -> int:
    if kind == "mlx":
        import mlx.core  # noqa: F401  (imported before READY: its cost is not the spike)
    elif kind == "numpy":
        import numpy  # noqa: F401
    elif kind == "load":
        import mlx_lm  # noqa: F401
    elif kind != "mmap":
        raise SystemExit(f"unknown spike kind {kind!r}: one of {', '.join(KINDS)}")
    if kind in ("mmap", "load") and not arg:
        raise SystemExit(f"spike kind {kind} needs a path")
    print("READY", flush=True)
    line = sys.stdin.readline().strip()
    if kind == "mlx":
        obj, held = _mlx(int(line))
    elif kind == "numpy":
        obj, held = _numpy(int(line))
    elif kind == "mmap":
        obj, held = prefetch(arg)
    else:
        obj, held = load_copies(arg, max(1, int(line)))
    print(f"HELD {held}", flush=True)
    sys.stdin.read()
    del obj
    return held


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m plimsoll.reliability.spike {mlx,numpy,mmap PATH,"
                         "load MODEL_DIR}")
    hold(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None)
