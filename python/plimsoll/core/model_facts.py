"""What a model costs in memory, read from its ``config.json`` and safetensors headers.

Admission needs three architecture facts and nothing else: the bytes the weights
occupy, the bytes each token adds to the caches, and the bytes each sequence
holds whatever its length (window-capped layers at their cap, recurrent state).
This module derives them without importing mlx (it runs in the admission wrapper
before any worker exists) and without reading a single weight byte.

The arithmetic is split in two: :mod:`plimsoll.core.cache_layout` says which cache every
layer holds (full KV, sliding window, chunked, MLA latent, indexer keys, recurrent
state: every layout mlx-lm 0.32 reads) and its bytes; :mod:`plimsoll.core.safetensors_header`
counts the weights. :func:`facts_from_config` is a pure function of a config dict;
:func:`inspect_model` only reads files.

Invariants of every :class:`ModelFacts`:

- ``kv_bytes_per_token`` = Σ over the growing caches (kv, latent, indexer) of
  layers × bytes per token; ``per_sequence_fixed_bytes`` = Σ capped caches at their cap
  + every recurrent state (enforced by a validator, so hand-built facts cannot drift);
- ``sequence_bytes(t)`` is what one sequence of ``t`` tokens holds, cache by cache;
- wherever the config is ambiguous the figure errs high (a layer of unknown kind
  counts as full attention) and ``notes`` says so: over-reserving is a smaller
  failure than paging.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .cache_layout import (
    CAPPED_KINDS,
    FLOAT_BYTES,
    GROWING_KINDS,
    CacheLayoutError,
    LayerCache,
    attention_head_dim,
    cache_layout,
    expanded_mla_bytes_per_token,
    lookup,
    mla_prefill_expansion,
)
from .safetensors_header import (
    ModelInspectionError,
    dominant_float_dtype,
    load_json,
    weights_and_dropped,
)

__all__ = ["DTYPE_BYTES", "KV_QUANT", "ModelFacts", "ModelInspectionError", "check_servable",
           "facts_from_config", "inspect_model", "normalize_dtype", "parse_kv_dtype"]

DTYPE_BYTES = FLOAT_BYTES
KV_QUANT = {"q8": 8, "q4": 4}
"""Quantized-KV spellings (policy ``kvDtype``, ``--kv-dtype``) → bits (mlx-lm group size 64)."""
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}


class ModelFacts(BaseModel):
    """Memory-relevant architecture facts of one model (see the module docstring for invariants)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: str
    num_layers: int = Field(gt=0)
    kv_layers: int = Field(ge=0)  # layers holding an uncapped (growing) cache
    sliding_layers: int = Field(ge=0)  # layers holding a window or chunk-capped cache
    sliding_window: int | None = None
    num_key_value_heads: int = Field(ge=0)  # 0: no attention (pure state-space model)
    head_dim: int = Field(ge=0)
    kv_dtype: str  # float dtype of the cached values (and of the scales when quantized)
    kv_dtype_bytes: int = Field(gt=0)
    kv_bits: int | None = None  # 8 / 4: quantized KV (values + scales + biases), else None
    weights_bytes: int = Field(ge=0)
    native_max_context: int | None = None
    kv_bytes_per_token: int = Field(ge=0)
    per_sequence_fixed_bytes: int = Field(ge=0)
    caches: tuple[LayerCache, ...] = ()
    # Activation shape (the engine's prefill transient); None where config.json lacks it.
    num_attention_heads: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    # MLA: values per context token of one layer a prefill chunk expands the latent into
    # (per-head keys and values, a transient); 0 for other models.
    prefill_expand_per_token: int = Field(default=0, ge=0)
    # An MTP head's tensors (mlx-lm drops them at load; the worker loads them unless --no-mtp)
    mtp_weights_bytes: int = Field(default=0, ge=0)
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_arithmetic(self) -> ModelFacts:
        if self.kv_bits is not None and self.kv_bits not in KV_QUANT.values():
            raise ValueError(f"kv_bits must be one of {sorted(KV_QUANT.values())}")
        if not self.caches:  # hand-built facts without a layout: plain per-head K/V
            expected = 2 * self.kv_layers * self.num_key_value_heads * self.head_dim
            if self.kv_bytes_per_token != expected * self.kv_dtype_bytes:
                raise ValueError("kv_bytes_per_token must equal 2 × kv_layers × "
                                 "num_key_value_heads × head_dim × kv_dtype_bytes")
        else:
            growing = sum(len(c.layers) * c.bytes_per_token for c in self.caches
                          if c.kind in GROWING_KINDS)
            if self.kv_bytes_per_token != growing:
                raise ValueError("kv_bytes_per_token must equal the sum of the growing caches")
            if self.per_sequence_fixed_bytes != self.fixed_bytes(None):
                raise ValueError("per_sequence_fixed_bytes must equal capped caches at their "
                                 "cap plus recurrent state")
        if self.kv_layers + self.sliding_layers > self.num_layers:
            raise ValueError("kv_layers + sliding_layers exceeds num_layers")
        return self

    @property
    def mtp_kv_bytes_per_token(self) -> int:
        """The MTP head's KV per token: one decoder layer's growing cache (0 without one)."""
        if not self.mtp_weights_bytes or not self.kv_layers:
            return 0
        return self.kv_bytes_per_token // self.kv_layers

    @property
    def kv_format(self) -> str:
        """How K/V values are stored: ``q8`` / ``q4`` (quantized) or the float dtype."""
        return f"q{self.kv_bits}" if self.kv_bits else self.kv_dtype

    @property
    def cache_kinds(self) -> tuple[str, ...]:
        """The cache kinds this model holds, sorted ("kv", "latent", "state", "window", ...)."""
        return tuple(sorted({c.kind for c in self.caches})) if self.caches else ("kv",)

    @property
    def state_bytes_per_seq(self) -> int:
        """Recurrent state of one sequence over every state layer."""
        return sum(len(c.layers) * c.state_bytes for c in self.caches)

    def fixed_bytes(self, context: int | None) -> int:
        """Per-sequence bytes that do not grow past ``context`` tokens: capped caches at
        min(cap, context) (the cap when ``context`` is None) + recurrent state."""
        if not self.caches:
            return self.per_sequence_fixed_bytes
        return _fixed_bytes(self.caches, context)

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes one sequence of ``tokens`` tokens holds over every cache."""
        if not self.caches:
            return self.kv_bytes_per_token * tokens + self.per_sequence_fixed_bytes
        return sum(c.bytes_for(tokens) for c in self.caches)


# ---------------------------------------------------------------- pure arithmetic


def _fixed_bytes(caches: tuple[LayerCache, ...], context: int | None) -> int:
    capped = sum(len(c.layers) * c.bytes_per_token * (c.max_tokens if context is None
                                                      else min(c.max_tokens, context))
                 for c in caches if c.kind in CAPPED_KINDS)
    return capped + sum(len(c.layers) * c.state_bytes for c in caches)


def _optional_int(cfg: dict, key: str) -> int | None:
    value = lookup(cfg, key)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def normalize_dtype(name: str) -> str:
    """Map ``torch.bfloat16`` / ``bf16`` / ``bfloat16`` to the canonical name in DTYPE_BYTES."""
    key = str(name).strip().lower().removeprefix("torch.").removeprefix("mx.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ModelInspectionError(
            f"KV dtype {name!r} is not one of {sorted(DTYPE_BYTES) + sorted(KV_QUANT)}; "
            "pass one of those")
    return key


def parse_kv_dtype(name: str | None) -> tuple[str | None, int | None]:
    """``"q8"`` → (None, 8): the model's float dtype, 8-bit; ``"bf16"`` → ("bfloat16", None)."""
    if name is None or name == "auto":
        return None, None
    key = str(name).strip().lower()
    if key in KV_QUANT:
        return None, KV_QUANT[key]
    return normalize_dtype(key), None


def _kv_dtype(cfg: dict, explicit: str | None, notes: list[str]) -> str:
    """Explicit argument, else the activation dtype (``torch_dtype``/``dtype``), else float32.

    Quantized models keep their KV cache in the activation dtype, not the weight
    bits, so ``quantization`` never enters here.
    """
    if explicit is not None:
        return normalize_dtype(explicit)
    declared = lookup(cfg, "torch_dtype") or lookup(cfg, "dtype")
    if declared is not None:
        return normalize_dtype(declared)
    notes.append("config declares no torch_dtype/dtype: KV dtype assumed float32 "
                 "(the widest, so the figure errs high); pass kv_dtype to override")
    return "float32"


def _num_layers(cfg: dict) -> int:
    pattern = lookup(cfg, "hybrid_override_pattern")  # nemotron_h: mlx-lm counts the pattern
    if isinstance(pattern, (str, list)) and pattern:
        return len(pattern)
    for key in ("num_hidden_layers", "num_layers", "n_layer"):
        value = lookup(cfg, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ModelInspectionError(f"config.json: `num_hidden_layers` is missing or not a positive "
                               f"integer (got {lookup(cfg, 'num_hidden_layers')!r}); add it (at "
                               "the top level or under text_config)")


def _native_max_context(cfg: dict, notes: list[str]) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length",
                "model_max_length"):
        value = lookup(cfg, key)
        if isinstance(value, int) and value > 0:
            return value
    notes.append("config declares no max_position_embeddings: native context unknown")
    return None


def facts_from_config(config: dict, weights_bytes: int, kv_dtype: str | None = None,
                      kv_bits: int | None = None) -> ModelFacts:
    """The arithmetic: a config dict (as in config.json) and the weight bytes to ModelFacts.

    ``kv_dtype`` may also be a quantized spelling (``"q8"``, ``"q4"``); ``kv_bits`` says the
    same directly. A sliding window's ``RotatingKVCache`` transiently holds
    ``window + chunk − 1`` tokens while prefilling one chunk; the transient reserve absorbs it.
    """
    if not isinstance(config, dict):
        raise ModelInspectionError("config.json must hold a JSON object")
    notes: list[str] = []
    explicit, bits = parse_kv_dtype(kv_dtype)
    bits = kv_bits if kv_bits is not None else bits
    n = _num_layers(config)
    dtype = _kv_dtype(config, explicit, notes)
    nbytes = DTYPE_BYTES[dtype]
    try:
        caches = cache_layout(config, n, nbytes, bits, notes)
    except CacheLayoutError as e:
        raise ModelInspectionError(str(e)) from None
    attn = [c for c in caches if c.kind in ("kv", "window", "chunked")]
    kv_heads = head_dim = 0
    if attn:
        heads = lookup(config, "num_attention_heads")
        kv_heads = lookup(config, "num_key_value_heads", heads)
        head_dim = attention_head_dim(config, heads)
    elif any(c.kind == "latent" for c in caches):
        kv_heads, head_dim = 1, lookup(config, "kv_lora_rank") + lookup(config, "qk_rope_head_dim")
        expanded = expanded_mla_bytes_per_token(config, nbytes)
        latent = next(c.bytes_per_token for c in caches if c.kind == "latent")
        notes.append(f"multi-head latent attention: mlx-lm caches the latent + rope key, "
                     f"{latent} B per token per layer; the expanded per-head K/V would be "
                     f"{expanded} B ({expanded / latent:.1f} ×)")
    growing = {i for c in caches if c.kind in GROWING_KINDS for i in c.layers}
    capped = {i for c in caches if c.kind in CAPPED_KINDS for i in c.layers}
    window = next((c.max_tokens for c in caches if c.kind == "window"), None)
    model_type = config.get("model_type") or lookup(config, "model_type")
    if not isinstance(model_type, str):
        raise ModelInspectionError("config.json: `model_type` is missing; add it")
    try:
        return ModelFacts(
            model_type=model_type, num_layers=n, kv_layers=len(growing),
            sliding_layers=len(capped - growing), sliding_window=window,
            num_key_value_heads=kv_heads, head_dim=head_dim, kv_dtype=dtype,
            kv_dtype_bytes=nbytes, kv_bits=bits, weights_bytes=weights_bytes,
            native_max_context=_native_max_context(config, notes),
            kv_bytes_per_token=sum(len(c.layers) * c.bytes_per_token for c in caches
                                   if c.kind in GROWING_KINDS),
            per_sequence_fixed_bytes=_fixed_bytes(caches, None), caches=caches,
            num_attention_heads=_optional_int(config, "num_attention_heads"),
            hidden_size=_optional_int(config, "hidden_size"),
            intermediate_size=_optional_int(config, "intermediate_size"),
            prefill_expand_per_token=mla_prefill_expansion(config), notes=notes)
    except ValidationError as e:  # a figure the arithmetic cannot hold: name the first one
        first = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "config"
        raise ModelInspectionError(f"config.json gives an impossible {field} "
                                   f"({first['msg']}); fix the config") from None


# ---------------------------------------------------------------- file reading


def inspect_model(path: str | Path, kv_dtype: str | None = None) -> ModelFacts:
    """ModelFacts of the model directory at ``path`` (config.json + safetensors headers)."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ModelInspectionError(f"{model_dir} is not a directory; pass a model directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelInspectionError(f"{model_dir} has no config.json; pass the directory "
                                   "that holds config.json and the *.safetensors files")
    explicit, bits = parse_kv_dtype(kv_dtype)
    try:
        config = load_json(config_path.read_bytes(), str(config_path))
        if not isinstance(config, dict):
            raise ModelInspectionError(f"{config_path} must hold a JSON object")
        notes: list[str] = []
        layers = lookup(config, "num_hidden_layers") or lookup(config, "num_layers")
        by_dtype, dropped = weights_and_dropped(
            model_dir, layers if isinstance(layers, int) else None, notes)
    except OSError as e:  # unreadable, a directory where a file should be, a dangling link
        raise ModelInspectionError(f"cannot read {e.filename or model_dir}: "
                                   f"{e.strerror or e}; fix the model directory") from None
    declared = lookup(config, "torch_dtype") or lookup(config, "dtype")
    if explicit is None and declared is None and dominant_float_dtype(by_dtype):
        explicit = dominant_float_dtype(by_dtype)
        notes.append(f"config declares no torch_dtype: KV dtype {explicit} taken from the "
                     "dominant float dtype of the weights")
    facts = facts_from_config(config, sum(by_dtype.values()), explicit, bits)
    update: dict = {"mtp_weights_bytes": dropped} if dropped else {}
    if notes:
        update["notes"] = notes + facts.notes
    return facts.model_copy(update=update) if update else facts


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
