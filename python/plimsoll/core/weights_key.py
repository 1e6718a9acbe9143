"""What identifies a model's weights and the engine that computes with them (no mlx import).

One home for the key parts that calibration records (:mod:`plimsoll.launch.calibration`)
and the disk tier for KV blocks (:mod:`plimsoll.worker.disk_tier`) are keyed on.
"""

from __future__ import annotations

import hashlib
import struct
from importlib import metadata
from pathlib import Path


def weights_hash(model_dir: Path) -> str:
    """SHA-256 over every ``*.safetensors`` file's name and header (not the tensor bytes)."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files to calibrate")
    for path in files:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            h.update(path.name.encode() + b"\0" + head + f.read(min(n, 100 << 20)))
    return h.hexdigest()


def engine_version() -> str:
    """``mlx=<v>;mlx-lm=<v>`` from package metadata (mlx itself is never imported here)."""
    parts = []
    for dist in ("mlx", "mlx-lm"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=absent")
    return ";".join(parts)
