"""Bytes per tensor name from a model directory's safetensors headers (no weight byte is read).

The pure planner groups these by layer; this module only reads files. It never imports mlx.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from plimsoll.model_facts import ModelInspectionError

_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _header(path: Path) -> dict:
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ModelInspectionError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise ModelInspectionError(f"{path}: implausible safetensors header length {n}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelInspectionError(f"{path}: unreadable safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ModelInspectionError(f"{path}: safetensors header is not a JSON object")
    return header


def tensor_bytes(model_dir: str | Path) -> dict[str, int]:
    """``{tensor name: bytes}`` over every ``model*.safetensors`` file (or the index's shards)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({root / n for n in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(root.glob("model*.safetensors"))
    if not files:
        raise ModelInspectionError(f"{root}: no model*.safetensors files")
    out: dict[str, int] = {}
    for path in files:
        for name, info in _header(path).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            out[name] = out.get(name, 0) + int(end) - int(start)
    return out


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
