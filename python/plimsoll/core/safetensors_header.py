"""The bytes a model's weights occupy, read from safetensors headers only (no weight byte read).

Reads the 8-byte length and the JSON header of each file mlx-lm would load (the index's
shards, else ``model*.safetensors``); :func:`weights_by_dtype` sums ``end − start`` per dtype,
leaving out the tensors mlx-lm's ``sanitize`` drops at load (multi-token-prediction layers),
so the figure is what ``mlx_lm.load`` keeps resident. :class:`ModelInspectionError` is the one
error of model inspection: every message says what to fix.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
SAFETENSORS_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_LAYER = re.compile(r"^(?:model\.|backbone\.)?layers\.(\d+)\.")


class ModelInspectionError(ValueError):
    """The model directory or config cannot be turned into facts; the message says what to fix."""


def load_json(data: bytes | str, what: str) -> Any:
    """JSON from a file's bytes; any way they fail to decode is a ModelInspectionError.

    Not only ``JSONDecodeError``: bytes that are not UTF-8, an integer past Python's digit
    limit (a plain ``ValueError``) and nesting past the decoder's depth (``RecursionError``)
    are broken files too, and must not escape as a traceback.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ModelInspectionError(f"{what} is not valid JSON (nested too deeply); "
                                   "fix or replace the file") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise ModelInspectionError(f"{what} is not valid JSON ({e}); fix or replace the "
                                   "file") from None


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of one safetensors file and the size of its data region.

    Reads 8 bytes + the header only, so it is fast on multi-GB files.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ModelInspectionError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ModelInspectionError(f"{path}: header length {header_len} is implausible; "
                                       "the file is corrupt or not safetensors")
        try:
            header = load_json(f.read(header_len), "header")
        except ModelInspectionError as e:
            raise ModelInspectionError(f"{path}: unreadable safetensors header "
                                       f"({str(e).removeprefix('header ')}); the file is "
                                       "corrupt, download it again") from None
    if not isinstance(header, dict):
        raise ModelInspectionError(f"{path}: safetensors header is not a JSON object")
    return header, size - 8 - header_len


def tensor_bytes(path: Path) -> dict[str, tuple[str, int]]:
    """``{tensor name: (safetensors dtype, bytes)}`` of one file, from its header only.

    Those are the bytes the tensors occupy once loaded (the header itself is not
    loaded); every tensor must lie inside the file (a truncated download fails).
    """
    header, data_region = read_safetensors_header(path)
    out: dict[str, tuple[str, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            dtype = str(info["dtype"])
        except (TypeError, KeyError, ValueError) as e:
            raise ModelInspectionError(f"{path}: malformed header entry {name!r}") from e
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise ModelInspectionError(f"{path}: malformed header entry {name!r} "
                                       "(data_offsets must be two integers)")
        if not 0 <= start <= end <= data_region:
            raise ModelInspectionError(f"{path}: tensor {name!r} lies past the end of the "
                                       "file; the file is truncated, download it again")
        out[name] = (dtype, end - start)
    return out


def safetensors_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes per safetensors dtype (``end − start`` summed) of one file."""
    by_dtype: dict[str, int] = {}
    for dtype, n in tensor_bytes(path).values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return by_dtype


def dominant_float_dtype(by_dtype: dict[str, int]) -> str | None:
    """The float dtype holding the most bytes: the activation dtype of an mlx-lm model
    (quantized models keep their scales and norms in it)."""
    floats = {k: v for k, v in by_dtype.items() if k in SAFETENSORS_FLOATS}
    return SAFETENSORS_FLOATS[max(floats, key=floats.__getitem__)] if floats else None


def weight_files(model_dir: Path, notes: list[str]) -> list[Path]:
    """The files mlx-lm loads: the index's shards, else ``model*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(load_json(index.read_bytes(), str(index))["weight_map"].values())
        except (ModelInspectionError, KeyError, AttributeError, TypeError) as e:
            raise ModelInspectionError(f"{index}: no readable weight_map ({e})") from e
        if not all(isinstance(name, str) and name for name in names):
            raise ModelInspectionError(f"{index}: weight_map values must be shard file "
                                       "names (strings); fix or regenerate the index")
        files = [model_dir / name for name in sorted(names)]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelInspectionError(f"{model_dir}: shards named in the index are missing: "
                                       f"{missing}; download them")
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    others = sorted(set(model_dir.glob("*.safetensors")) - set(files))
    if not files and others:
        notes.append(f"no model*.safetensors; counted {[p.name for p in others]} "
                     "(mlx-lm itself loads only model*.safetensors)")
        return others
    if others:
        notes.append(f"ignored {[p.name for p in others]}: mlx-lm loads only model*.safetensors")
    if not files:
        raise ModelInspectionError(f"{model_dir}: no *.safetensors weights; point at a "
                                   "directory holding an mlx-lm model")
    return files


def dropped_at_load(name: str, num_layers: int | None) -> bool:
    """True for a tensor mlx-lm's sanitize drops: an MTP head (``mtp.*``, or a layer index
    at or past ``num_hidden_layers``, as glm4_moe / deepseek_v3 / qwen3_next ship them)."""
    if name.startswith(("mtp.", "model.mtp.")):
        return True
    match = _LAYER.match(name)
    return bool(match and num_layers is not None and int(match.group(1)) >= num_layers)


def weights_by_dtype(model_dir: Path, num_layers: int | None,
                     notes: list[str]) -> dict[str, int]:
    """Bytes per safetensors dtype over every file mlx-lm loads, less what it drops at load."""
    return weights_and_dropped(model_dir, num_layers, notes)[0]


def weights_and_dropped(model_dir: Path, num_layers: int | None,
                        notes: list[str]) -> tuple[dict[str, int], int]:
    """:func:`weights_by_dtype`, and the bytes mlx-lm drops at load (an MTP head's)."""
    by_dtype: dict[str, int] = {}
    dropped = 0
    for path in weight_files(model_dir, notes):
        for name, (dtype, n) in tensor_bytes(path).items():
            if dropped_at_load(name, num_layers):
                dropped += n
                continue
            by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    if dropped:
        notes.append(f"{dropped} B of multi-token-prediction tensors not counted: mlx-lm "
                     "drops them at load")
    return by_dtype, dropped
