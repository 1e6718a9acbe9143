"""Bytes per tensor name from a model directory's safetensors headers (no weight byte is read).

The pure planner groups these by layer; this module only reads files. It never imports mlx.
"""

from __future__ import annotations

import json
from pathlib import Path

from plimsoll.core.safetensors_header import ModelInspectionError, read_safetensors_header


def _header(path: Path) -> dict:
    return read_safetensors_header(path)[0]


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
