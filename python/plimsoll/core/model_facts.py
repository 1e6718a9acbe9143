"""What a model costs in memory, read from its ``config.json`` and safetensors headers.

Admission needs three architecture facts and nothing else: the bytes the weights
occupy, the bytes each token adds to the KV cache, and the bytes each sequence
holds whatever its length. This module derives them without importing mlx (it
runs in the admission wrapper before any worker exists) and without reading a
single weight byte: only the JSON config and the safetensors headers.

The arithmetic (DESIGN.md, "The arithmetic") lives in :func:`facts_from_config`,
a pure function of a config dict; :func:`inspect_model` only reads files.

Invariants of every :class:`ModelFacts`:

- ``kv_bytes_per_token == 2 × kv_layers × num_key_value_heads × head_dim × kv_dtype_bytes``
  (enforced by a validator, so hand-built facts cannot drift from the contract);
- ``kv_layers + sliding_layers <= num_layers`` (the rest are linear/recurrent layers);
- wherever the config is ambiguous the figure errs high (a layer of unknown kind
  counts as full attention) and ``notes`` says so: over-reserving is a smaller
  failure than paging.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}
_FULL_KINDS = {"full_attention", "attention", "global", "global_attention"}
_SLIDING_KINDS = {"sliding_attention", "sliding", "local", "local_attention"}
_LINEAR_KINDS = {"linear_attention", "mamba", "mamba2", "ssm", "recurrent", "conv"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_SAFETENSORS_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class ModelInspectionError(ValueError):
    """The model directory or config cannot be turned into facts; the message says what to fix."""


def _load_json(data: bytes | str, what: str) -> Any:
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


class ModelFacts(BaseModel):
    """Memory-relevant architecture facts of one model (see the module docstring for invariants)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: str
    num_layers: int = Field(gt=0)
    kv_layers: int = Field(ge=0)
    sliding_layers: int = Field(ge=0)
    sliding_window: int | None = None
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    kv_dtype: str
    kv_dtype_bytes: int = Field(gt=0)
    weights_bytes: int = Field(ge=0)
    native_max_context: int | None = None
    kv_bytes_per_token: int = Field(ge=0)
    per_sequence_fixed_bytes: int = Field(ge=0)
    # Activation shape (the engine's prefill transient); None where config.json lacks it.
    num_attention_heads: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_arithmetic(self) -> ModelFacts:
        expected = 2 * self.kv_layers * self.num_key_value_heads * self.head_dim
        if self.kv_bytes_per_token != expected * self.kv_dtype_bytes:
            raise ValueError("kv_bytes_per_token must equal 2 × kv_layers × "
                             "num_key_value_heads × head_dim × kv_dtype_bytes")
        if self.kv_layers + self.sliding_layers > self.num_layers:
            raise ValueError("kv_layers + sliding_layers exceeds num_layers")
        return self


# ---------------------------------------------------------------- pure arithmetic


def _lookup(cfg: dict, key: str, default: Any = None) -> Any:
    """A field of the text model: ``text_config`` (multimodal wrappers) wins over the top level."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and text.get(key) is not None:
        return text[key]
    value = cfg.get(key)
    return default if value is None else value


def _require_int(cfg: dict, key: str) -> int:
    value = _lookup(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelInspectionError(
            f"config.json: `{key}` is missing or not a positive integer (got {value!r}); "
            "add it (at the top level or under text_config)")
    return value


def _optional_int(cfg: dict, key: str) -> int | None:
    value = _lookup(cfg, key)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def normalize_dtype(name: str) -> str:
    """Map ``torch.bfloat16`` / ``bf16`` / ``bfloat16`` to the canonical name in DTYPE_BYTES."""
    key = str(name).strip().lower().removeprefix("torch.").removeprefix("mx.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ModelInspectionError(
            f"KV dtype {name!r} is not one of {sorted(DTYPE_BYTES)}; pass one of those")
    return key


def _kv_dtype(cfg: dict, explicit: str | None, notes: list[str]) -> str:
    """Explicit argument, else the activation dtype (``torch_dtype``/``dtype``), else float32.

    Quantized models keep their KV cache in the activation dtype, not the weight
    bits, so ``quantization`` never enters here.
    """
    if explicit is not None:
        return normalize_dtype(explicit)
    declared = _lookup(cfg, "torch_dtype") or _lookup(cfg, "dtype")
    if declared is not None:
        return normalize_dtype(declared)
    notes.append("config declares no torch_dtype/dtype: KV dtype assumed float32 "
                 "(the widest, so the figure errs high); pass kv_dtype to override")
    return "float32"


def _kinds_from_layer_types(types: list, n: int, window: Any, notes: list[str]) -> list[str]:
    if len(types) != n:
        raise ModelInspectionError(f"config.json: layer_types has {len(types)} entries but "
                                   f"num_hidden_layers is {n}; make them agree")
    if not all(isinstance(t, str) for t in types):
        raise ModelInspectionError("config.json: layer_types must list one layer kind (a "
                                   'string such as "full_attention") per layer; fix it')
    capped = isinstance(window, int)
    kinds = ["sliding" if t in _SLIDING_KINDS and capped else "linear" if t in _LINEAR_KINDS
             else "full" for t in types]
    unknown = sorted({str(t) for t in types} - _FULL_KINDS - _SLIDING_KINDS - _LINEAR_KINDS)
    if unknown:
        notes.append(f"unknown layer types {unknown} counted as full attention")
    if not capped and _SLIDING_KINDS & set(types):
        notes.append("sliding layers without an integer sliding_window: counted as full")
    return kinds


def _layer_kinds(cfg: dict, n: int, notes: list[str]) -> list[str]:
    """One of "full" / "sliding" / "linear" per layer, from the first rule the config matches.

    A window is honoured only where the config places it (``layer_types`` or a
    gemma/exaone ``sliding_window_pattern``); a bare ``sliding_window`` counts as
    full attention, since mlx-lm may not cap it.
    """
    window, types = _lookup(cfg, "sliding_window"), _lookup(cfg, "layer_types")
    if isinstance(types, list):
        return _kinds_from_layer_types(types, n, window, notes)
    interval = _lookup(cfg, "full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]
    pattern = _lookup(cfg, "sliding_window_pattern")
    if isinstance(window, int) and isinstance(pattern, int) and pattern > 0:
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
    if isinstance(window, int) and isinstance(pattern, str) and pattern:
        return ["sliding" if pattern[i % len(pattern)] == "L" else "full" for i in range(n)]
    if window is not None and _lookup(cfg, "use_sliding_window") is not False:
        notes.append(f"sliding_window={window} but no layer_types or pattern says which "
                     "layers use it: all layers counted as full attention")
    return ["full"] * n


def _linear_state_bytes(cfg: dict, act_bytes: int, notes: list[str]) -> int:
    """Bytes of one linear-attention layer's per-sequence state (gated delta net).

    mlx-lm's GatedDeltaNet (qwen3_next, qwen3_5) keeps two arrays per sequence:
    the recurrent state ``Hv × Dv × Dk`` in float32 (``mamba_ssm_dtype`` if set)
    and the conv state ``(K − 1) × (2·Hk·Dk + Hv·Dv)`` in the activation dtype,
    where Hv/Hk = linear_num_value/key_heads, Dv/Dk = linear_value/key_head_dim,
    K = linear_conv_kernel_dim. Neither grows with tokens.
    """
    keys = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")
    hv, hk, dk, dv, k = (_lookup(cfg, key) for key in keys)
    if not all(isinstance(x, int) for x in (hv, hk, dk, dv, k)):
        notes.append("linear-attention layers of an unrecognised kind: their recurrent "
                     "state is NOT included in per_sequence_fixed_bytes")
        return 0
    if not all(x > 0 for x in (hv, hk, dk, dv, k)):
        raise ModelInspectionError("config.json: linear_num_value_heads, linear_num_key_heads, "
                                   "linear_key_head_dim, linear_value_head_dim and "
                                   "linear_conv_kernel_dim must be positive integers; fix them")
    state_bytes = DTYPE_BYTES[normalize_dtype(_lookup(cfg, "mamba_ssm_dtype", "float32"))]
    return hv * dv * dk * state_bytes + (k - 1) * (2 * hk * dk + hv * dv) * act_bytes


def _native_max_context(cfg: dict, notes: list[str]) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = _lookup(cfg, key)
        if isinstance(value, int) and value > 0:
            return value
    notes.append("config declares no max_position_embeddings: native context unknown")
    return None


def facts_from_config(config: dict, weights_bytes: int, kv_dtype: str | None = None) -> ModelFacts:
    """The arithmetic: a config dict (as in config.json) and the weight bytes to ModelFacts.

    ``per_sequence_fixed_bytes`` = sliding layers at their full window
    (``2 × sliding_layers × kv_heads × head_dim × kv_dtype_bytes × sliding_window``)
    + linear layers' state (:func:`_linear_state_bytes`). It is an upper bound on
    steady state; a RotatingKVCache transiently holds ``window + prompt − 1``
    tokens while prefilling one chunk, which the transient reserve must absorb.
    """
    if not isinstance(config, dict):
        raise ModelInspectionError("config.json must hold a JSON object")
    notes: list[str] = []
    n = _require_int(config, "num_hidden_layers")
    heads = _require_int(config, "num_attention_heads")
    kv_heads = _lookup(config, "num_key_value_heads", heads)
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ModelInspectionError(f"config.json: num_key_value_heads={kv_heads!r} is not a "
                                   "positive integer; per-layer head counts are not supported")
    head_dim = _lookup(config, "head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        head_dim = _require_int(config, "hidden_size") // heads
    if head_dim <= 0:
        raise ModelInspectionError(f"config.json: head_dim is {head_dim} (from head_dim, or "
                                   "hidden_size // num_attention_heads); it must be a positive "
                                   "integer: fix head_dim")
    if _lookup(config, "kv_lora_rank") is not None:
        notes.append("multi-head latent attention (kv_lora_rank): mlx-lm caches a compressed "
                     "latent, so the per-head formula used here overstates KV bytes")
    dtype = _kv_dtype(config, kv_dtype, notes)
    nbytes = DTYPE_BYTES[dtype]
    kinds = _layer_kinds(config, n, notes)
    kv_layers, sliding, linear = (kinds.count(k) for k in ("full", "sliding", "linear"))
    window = _lookup(config, "sliding_window") if sliding else None
    if sliding and window <= 0:
        raise ModelInspectionError(f"config.json: sliding_window is {window}; a window must "
                                   "be a positive number of tokens: fix sliding_window")
    fixed = 2 * sliding * kv_heads * head_dim * nbytes * (window or 0)
    if linear:
        fixed += linear * _linear_state_bytes(config, nbytes, notes)
    model_type = config.get("model_type") or _lookup(config, "model_type")
    if not isinstance(model_type, str):
        raise ModelInspectionError("config.json: `model_type` is missing; add it")
    try:
        return ModelFacts(
            model_type=model_type, num_layers=n, kv_layers=kv_layers, sliding_layers=sliding,
            sliding_window=window, num_key_value_heads=kv_heads, head_dim=head_dim,
            kv_dtype=dtype, kv_dtype_bytes=nbytes, weights_bytes=weights_bytes,
            native_max_context=_native_max_context(config, notes),
            kv_bytes_per_token=2 * kv_layers * kv_heads * head_dim * nbytes,
            per_sequence_fixed_bytes=fixed,
            num_attention_heads=_optional_int(config, "num_attention_heads"),
            hidden_size=_optional_int(config, "hidden_size"),
            intermediate_size=_optional_int(config, "intermediate_size"), notes=notes)
    except ValidationError as e:  # a figure the arithmetic cannot hold: name the first one
        first = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "config"
        raise ModelInspectionError(f"config.json gives an impossible {field} "
                                   f"({first['msg']}); fix the config") from None


# ---------------------------------------------------------------- file reading


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
            header = _load_json(f.read(header_len), "header")
        except ModelInspectionError as e:
            raise ModelInspectionError(f"{path}: unreadable safetensors header "
                                       f"({str(e).removeprefix('header ')}); the file is "
                                       "corrupt, download it again") from None
    if not isinstance(header, dict):
        raise ModelInspectionError(f"{path}: safetensors header is not a JSON object")
    return header, size - 8 - header_len


def safetensors_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes per safetensors dtype (``end − start`` summed) of one file, from its header only.

    Those are the bytes the tensors occupy once loaded (the header itself is not
    loaded); every tensor must lie inside the file (a truncated download fails).
    """
    header, data_region = read_safetensors_header(path)
    by_dtype: dict[str, int] = {}
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
        by_dtype[dtype] = by_dtype.get(dtype, 0) + end - start
    return by_dtype


def _dominant_float_dtype(by_dtype: dict[str, int]) -> str | None:
    """The float dtype holding the most bytes: the activation dtype of an mlx-lm model
    (quantized models keep their scales and norms in it)."""
    floats = {k: v for k, v in by_dtype.items() if k in _SAFETENSORS_FLOATS}
    return _SAFETENSORS_FLOATS[max(floats, key=floats.__getitem__)] if floats else None


def _weight_files(model_dir: Path, notes: list[str]) -> list[Path]:
    """The files mlx-lm loads: the index's shards, else ``model*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(_load_json(index.read_bytes(), str(index))["weight_map"].values())
        except (ModelInspectionError, KeyError, AttributeError, TypeError) as e:
            raise ModelInspectionError(f"{index}: no readable weight_map ({e})") from e
        if not all(isinstance(name, str) and name for name in names):
            raise ModelInspectionError(f"{index}: weight_map values must be shard file "
                                       "names (strings); fix or regenerate the index")
        names = sorted(names)
        files = [model_dir / name for name in names]
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


def inspect_model(path: str | Path, kv_dtype: str | None = None) -> ModelFacts:
    """ModelFacts of the model directory at ``path`` (config.json + safetensors headers)."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ModelInspectionError(f"{model_dir} is not a directory; pass a model directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelInspectionError(f"{model_dir} has no config.json; pass the directory "
                                   "that holds config.json and the *.safetensors files")
    try:
        config = _load_json(config_path.read_bytes(), str(config_path))
        if not isinstance(config, dict):
            raise ModelInspectionError(f"{config_path} must hold a JSON object")
        notes: list[str] = []
        by_dtype: dict[str, int] = {}
        for weight_file in _weight_files(model_dir, notes):
            for dtype, n in safetensors_tensor_bytes(weight_file).items():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    except OSError as e:  # unreadable, a directory where a file should be, a dangling link
        raise ModelInspectionError(f"cannot read {e.filename or model_dir}: "
                                   f"{e.strerror or e}; fix the model directory") from None
    declared = _lookup(config, "torch_dtype") or _lookup(config, "dtype")
    if kv_dtype is None and declared is None and _dominant_float_dtype(by_dtype):
        kv_dtype = _dominant_float_dtype(by_dtype)
        notes.append(f"config declares no torch_dtype: KV dtype {kv_dtype} taken from the "
                     "dominant float dtype of the weights")
    facts = facts_from_config(config, sum(by_dtype.values()), kv_dtype)
    return facts.model_copy(update={"notes": notes + facts.notes}) if notes else facts


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""Any one of these lets mlx-lm (transformers' AutoTokenizer) build the model's tokenizer."""


def check_servable(path: str | Path) -> None:
    """Refuse, before a worker process loads anything, a directory mlx-lm cannot serve.

    Admission needs only the config and the safetensors headers (:func:`inspect_model`);
    serving also needs a tokenizer. Checked up front so a broken download is a one-line
    error naming the missing file, not an engine traceback after the weights are read.
    """
    model_dir = Path(path).expanduser()
    inspect_model(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelInspectionError(f"{model_dir} has no tokenizer (none of "
                                   f"{', '.join(TOKENIZER_FILES)}); copy the model's tokenizer "
                                   "files into it")
