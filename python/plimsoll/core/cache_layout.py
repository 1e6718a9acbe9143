"""Which cache each layer of an mlx-lm model holds, and its bytes, read from ``config.json``.

Pure arithmetic over a config dict (no mlx): the model file's ``make_cache`` in mlx-lm
0.32 is the reference for every rule here, and the conformance test
(``tests/core/test_cache_conformance.py``) compares the result with the bytes mlx-lm's own cache
holds after a prefill, family by family.

Cache kinds (:data:`CacheKind`), per layer:

- ``kv``: full-attention K and V (``KVCache``): ``2 × kv_heads × head_dim`` values a token;
- ``window``: sliding-window K and V (``RotatingKVCache(max_size=window, keep)``): the same per
  token, at most ``window`` tokens a sequence (``keep`` sink tokens are inside the window);
- ``chunked``: chunked attention (llama4's ``ChunkedKVCache``): at most ``chunk`` tokens;
- ``latent``: multi-head latent attention (MLA: deepseek_v3, glm4_moe_lite, kimi, mistral4,
  longcat_flash, deepseek_v32): one copy of ``kv_lora_rank + qk_rope_head_dim`` values a token
  (mlx-lm caches the latent and the rope key, not the expanded heads); deepseek_v2,
  minicpm3 and youtu_llm project through a latent too but cache the expanded per-head K
  (qk_nope + qk_rope) and V: ``kv`` of ``heads × (k_dim + v_dim)``; any other model type
  with ``kv_lora_rank`` is refused (its cache is not known);
- ``indexer``: deepseek_v32's sparse-attention indexer keys (``CacheList`` member): mlx-lm holds
  ``index_head_dim`` keys and a zeros array of the same shape as values, so 2 × per token;
- ``state``: recurrent state of a linear-attention / SSM / conv layer (``ArraysCache``): a fixed
  number of bytes a sequence, whatever its length.

A layer may hold several (``CacheList``: falcon_h1 holds state + kv, longcat_flash two latents).
Quantized KV (``kv_bits`` 8 or 4) stores each K/V vector of ``d`` values as mlx-lm's
``QuantizedKVCache`` does: ``d × bits / 8`` bytes of packed values plus a scale and a bias per
group of :data:`KV_GROUP_SIZE` values in the activation dtype. Recurrent state is never
quantized.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .safetensors_header import ModelInspectionError

CacheKind = Literal["kv", "window", "chunked", "latent", "indexer", "state"]
GROWING_KINDS = frozenset({"kv", "latent", "indexer"})
"""Kinds whose bytes grow with every token of the sequence (no cap)."""
CAPPED_KINDS = frozenset({"window", "chunked"})
KV_GROUP_SIZE = 64
"""mlx-lm's QuantizedKVCache default group size (``mx.quantize`` groups along the last axis)."""
KV_BITS = (8, 4)
FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

_FULL = {"full_attention", "attention", "global", "global_attention", "*"}
_SLIDING = {"sliding_attention", "sliding", "local", "local_attention"}
_LINEAR = {"linear_attention", "mamba", "mamba2", "ssm", "recurrent", "conv", "M"}
_NO_CACHE = {"moe", "mlp", "-", "E"}  # nemotron_h blocks without a mixer cache
_MLA_TYPES = {"deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite",
              "kimi_k25", "kimi_k2", "kimi_vl", "mistral4", "longcat_flash", "kimi_linear"}
_EXPANDED_MLA_TYPES = {"deepseek_v2", "minicpm3", "youtu_llm"}
"""Latent projections, but mlx-lm's attention caches the expanded per-head K and V."""


class CacheLayoutError(ModelInspectionError):
    """The config does not say what the cache holds; the message names the field to fix."""


class LayerCache(BaseModel):
    """One cache every layer in ``layers`` holds (identical across them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: CacheKind
    layers: tuple[int, ...]
    bytes_per_token: int = Field(ge=0)  # per layer, per token held
    max_tokens: int | None = Field(default=None, gt=0)  # window / chunk cap
    keep: int = Field(default=0, ge=0)  # RotatingKVCache sink tokens (inside max_tokens)
    state_bytes: int = Field(default=0, ge=0)  # per layer, per sequence
    state_slots: int = Field(default=0, ge=0)  # ArraysCache(size=…) arrays of the state
    mlx_cache: str  # mlx-lm's cache class for it (CacheList members named as such)
    formula: str  # how bytes_per_token / state_bytes were derived, for reports

    def tokens_held(self, tokens: int) -> int:
        """Tokens of a ``tokens``-long sequence this cache holds (capped kinds: the cap)."""
        if self.kind == "state":
            return 0
        return min(tokens, self.max_tokens) if self.max_tokens else tokens

    def bytes_for(self, tokens: int) -> int:
        """Bytes over all its layers for one sequence of ``tokens`` tokens."""
        return len(self.layers) * (self.bytes_per_token * self.tokens_held(tokens)
                                   + self.state_bytes)


# ---------------------------------------------------------------- config access


def lookup(cfg: dict, key: str, default: Any = None) -> Any:
    """A field of the text model: ``text_config`` (multimodal wrappers) wins over the top level."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and text.get(key) is not None:
        return text[key]
    value = cfg.get(key)
    return default if value is None else value


def _int(cfg: dict, key: str, default: Any = None) -> int:
    value = lookup(cfg, key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CacheLayoutError(f"config.json: `{key}` is missing or not a positive integer "
                               f"(got {value!r}); add it (at the top level or under text_config)")
    return value


def vector_bytes(dim: int, act_bytes: int, kv_bits: int | None) -> int:
    """Bytes of one cached vector of ``dim`` values, as (Quantized)KVCache stores it."""
    if kv_bits is None:
        return dim * act_bytes
    if dim % KV_GROUP_SIZE:
        raise CacheLayoutError(f"quantized KV needs cached vectors in groups of {KV_GROUP_SIZE} "
                               f"values; this model caches vectors of {dim}: use a float kvDtype")
    return dim * kv_bits // 8 + 2 * (dim // KV_GROUP_SIZE) * act_bytes


# ---------------------------------------------------------------- layer kinds


def _pattern_kinds(cfg: dict, n: int, notes: list[str]) -> list[str]:
    """"full" / "sliding" / "chunked" / "linear" / "none" per layer, from the layout fields."""
    mtype = str(cfg.get("model_type") or lookup(cfg, "model_type") or "")
    window = lookup(cfg, "sliding_window")
    if mtype in ("mamba", "mamba2"):
        return ["linear"] * n
    if mtype == "falcon_h1":
        return ["linear+full"] * n
    if mtype == "nemotron_h":
        pattern = lookup(cfg, "hybrid_override_pattern") or lookup(cfg, "layers_block_type") \
            or lookup(cfg, "layer_types")
        if pattern is None:
            raise CacheLayoutError("config.json: nemotron_h needs hybrid_override_pattern (or "
                                   "layers_block_type) to say which layers are mamba/attention")
        return [_kind_of(str(t), window, notes) for t in pattern]
    if mtype == "jamba" and lookup(cfg, "layers_block_type") is None:
        period, offset = _int(cfg, "attn_layer_period"), lookup(cfg, "attn_layer_offset", 0)
        return ["full" if i % period == offset else "linear" for i in range(n)]
    if mtype == "kimi_linear":
        kda = (lookup(cfg, "linear_attn_config") or {}).get("kda_layers")
        if not isinstance(kda, list):
            raise CacheLayoutError("config.json: kimi_linear needs linear_attn_config.kda_layers")
        return ["linear" if i + 1 in kda else "full" for i in range(n)]
    for key in ("layer_types", "layers_block_type"):
        types = lookup(cfg, key)
        if isinstance(types, list):
            if len(types) != n:
                raise CacheLayoutError(f"config.json: {key} has {len(types)} entries but "
                                       f"num_hidden_layers is {n}; make them agree")
            return [_kind_of(t, window, notes) for t in types]
    idxs = lookup(cfg, "full_attn_idxs")
    if isinstance(idxs, list):
        return ["full" if i in idxs else "linear" for i in range(n)]
    interval = lookup(cfg, "full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]
    pattern = lookup(cfg, "sliding_window_pattern")
    if isinstance(window, int) and isinstance(pattern, int) and pattern > 0:
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
    if isinstance(window, int) and isinstance(pattern, str) and pattern:
        return ["sliding" if pattern[i % len(pattern)] == "L" else "full" for i in range(n)]
    if isinstance(lookup(cfg, "attention_chunk_size"), int) and mtype.startswith("llama4"):
        return ["full" if (i + 1) % 4 == 0 else "chunked" for i in range(n)]
    if window is not None and lookup(cfg, "use_sliding_window") is not False:
        notes.append(f"sliding_window={window} but no layer_types or pattern says which "
                     "layers use it: all layers counted as full attention (as mlx-lm does)")
    return ["full"] * n


def _kind_of(t: Any, window: Any, notes: list[str]) -> str:
    if not isinstance(t, str):
        raise CacheLayoutError("config.json: layer_types must list one layer kind (a string "
                               'such as "full_attention") per layer; fix it')
    if t in _SLIDING:
        if isinstance(window, int):
            return "sliding"
        notes.append("sliding layers without an integer sliding_window: counted as full")
        return "full"
    if t in _LINEAR:
        return "linear"
    if t in _NO_CACHE:
        return "none"
    if t not in _FULL:
        notes.append(f"unknown layer type {t!r} counted as full attention")
    return "full"


# ---------------------------------------------------------------- per-kind bytes


def _attention(cfg: dict, act: int, bits: int | None) -> tuple[list[tuple[str, int, str]], str]:
    """[(kind, bytes_per_token, formula)] a full-attention layer holds, and its mlx class."""
    mtype = str(cfg.get("model_type") or lookup(cfg, "model_type") or "")
    rank = lookup(cfg, "kv_lora_rank")
    if isinstance(rank, int) and mtype in _MLA_TYPES:
        rope = _int(cfg, "qk_rope_head_dim")
        latent = vector_bytes(rank, act, bits) + vector_bytes(rope, act, bits)
        parts = [("latent", latent, f"kv_lora_rank {rank} + qk_rope_head_dim {rope}")]
        if mtype in ("deepseek_v32", "glm_moe_dsa"):
            dim = _int(cfg, "index_head_dim")
            parts.append(("indexer", 2 * vector_bytes(dim, act, bits),
                          f"2 × index_head_dim {dim} (indexer keys + zeros values)"))
            return parts, "CacheList(KVCache, KVCache)"
        if mtype == "longcat_flash":
            return parts * 2, "CacheList(KVCache, KVCache)"
        return parts, "KVCache"
    if isinstance(rank, int) and mtype in _EXPANDED_MLA_TYPES:
        heads = _int(cfg, "num_attention_heads")
        k_dim = _int(cfg, "qk_nope_head_dim") + _int(cfg, "qk_rope_head_dim")
        v_dim = _int(cfg, "hidden_size") // heads if mtype == "minicpm3" \
            else _int(cfg, "v_head_dim")  # minicpm3's attention derives it
        return ([("kv", heads * (vector_bytes(k_dim, act, bits) + vector_bytes(v_dim, act, bits)),
                  f"{heads} heads × (K qk_nope + qk_rope {k_dim} + V {v_dim}), expanded")],
                "KVCache")
    if isinstance(rank, int):
        raise CacheLayoutError(
            f"config.json: {mtype} has kv_lora_rank (multi-head latent attention), but plimsoll "
            f"does not know whether mlx-lm's {mtype} caches the latent or expanded per-head "
            "K/V (nor its layer layout), so it cannot count its KV: not served yet; "
            "mlx_lm.server serves it unbatched")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = lookup(cfg, "num_key_value_heads", heads)
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0:
        raise CacheLayoutError(f"config.json: num_key_value_heads={kv_heads!r} is not a "
                               "positive integer; per-layer head counts are not supported")
    head_dim = attention_head_dim(cfg, heads)
    return ([("kv", 2 * kv_heads * vector_bytes(head_dim, act, bits),
              f"2 × {kv_heads} KV heads × head_dim {head_dim}")], "KVCache")


def attention_head_dim(cfg: dict, heads: int) -> int:
    head_dim = lookup(cfg, "head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        head_dim = _int(cfg, "hidden_size") // heads
    if head_dim <= 0:
        raise CacheLayoutError(f"config.json: head_dim is {head_dim} (from head_dim, or "
                               "hidden_size // num_attention_heads); it must be a positive "
                               "integer: fix head_dim")
    return head_dim


def _mamba2_state(cfg: dict, act: int, keys: tuple[str, str, str, str, str]) -> tuple[int, str]:
    heads, head_dim, state, groups, kernel = (_int(cfg, k) for k in keys)
    conv_dim = heads * head_dim + 2 * groups * state
    nbytes = (kernel - 1) * conv_dim * act + heads * head_dim * state * act
    return nbytes, (f"conv ({kernel}−1) × {conv_dim} + ssm {heads} heads × {head_dim} × "
                    f"state {state}, activation dtype")


def state_bytes(cfg: dict, act: int) -> tuple[int, int, str] | None:
    """(bytes, ArraysCache slots, formula) of one recurrent layer's state; None if unknown."""
    mtype = str(cfg.get("model_type") or lookup(cfg, "model_type") or "")
    f32 = FLOAT_BYTES["float32"]
    if mtype in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"):
        hv, hk, dk, dv, k = (_int(cfg, key) for key in (
            "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim"))
        conv = (k - 1) * (2 * hk * dk + hv * dv)
        slots = 4 if mtype == "olmo_hybrid" else 2
        return (conv * act + hv * dv * dk * f32, slots,
                f"conv ({k}−1) × (2·{hk}·{dk} + {hv}·{dv}) + delta state {hv}×{dv}×{dk} float32")
    if mtype == "kimi_linear":
        lin = lookup(cfg, "linear_attn_config") or {}
        heads, dim = lin.get("num_heads"), lin.get("head_dim")
        k = lin.get("short_conv_kernel_size", 4)
        if not all(isinstance(x, int) and x > 0 for x in (heads, dim, k)):
            raise CacheLayoutError("config.json: linear_attn_config needs num_heads and head_dim")
        return (3 * (k - 1) * heads * dim * act + heads * dim * dim * f32, 4,
                f"conv 3 × ({k}−1) × {heads}·{dim} + state {heads}×{dim}×{dim} float32")
    if mtype == "lfm2":
        k, hidden = _int(cfg, "conv_L_cache"), _int(cfg, "hidden_size")
        return (k - 1) * hidden * act, 1, f"conv ({k}−1) × hidden {hidden}"
    if mtype == "nemotron_h":
        nbytes, text = _mamba2_state(cfg, act, ("mamba_num_heads", "mamba_head_dim",
                                                "ssm_state_size", "n_groups", "conv_kernel"))
        return nbytes, 2, text
    if mtype in ("granitemoehybrid", "falcon_h1"):
        nbytes, text = _mamba2_state(cfg, act, ("mamba_n_heads", "mamba_d_head", "mamba_d_state",
                                                "mamba_n_groups", "mamba_d_conv"))
        return nbytes, 2, text
    if mtype == "mamba2":
        cfg = {**cfg, "ssm_state_size": lookup(cfg, "ssm_state_size") or lookup(cfg, "state_size")}
        nbytes, text = _mamba2_state(cfg, act, ("num_heads", "head_dim", "ssm_state_size",
                                                "n_groups", "conv_kernel"))
        return nbytes, 2, text
    if mtype in ("jamba", "mamba"):
        hidden = _int(cfg, "hidden_size")
        if mtype == "jamba":
            inner, state, k = _int(cfg, "mamba_expand") * hidden, _int(cfg, "mamba_d_state"), \
                _int(cfg, "mamba_d_conv")
        else:
            inner, state, k = _int(cfg, "intermediate_size"), _int(cfg, "state_size"), \
                _int(cfg, "conv_kernel")
        return ((k - 1) * inner * act + inner * state * act, 2,
                f"conv ({k}−1) × {inner} + ssm {inner} × state {state}, activation dtype")
    return None


# ---------------------------------------------------------------- the layout


def cache_layout(cfg: dict, num_layers: int, act_bytes: int, kv_bits: int | None = None,
                 notes: list[str] | None = None) -> tuple[LayerCache, ...]:
    """Every cache of one sequence, grouped: identical caches of several layers are one entry."""
    notes = [] if notes is None else notes
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise CacheLayoutError(f"kv_bits must be one of {KV_BITS}, got {kv_bits}")
    kinds = _pattern_kinds(cfg, num_layers, notes)
    groups: dict[tuple, list[int]] = {}

    def add(i: int, kind: str, bpt: int, cap: int | None, state: int, mlx: str, text: str,
            slots: int = 0):
        groups.setdefault((kind, bpt, cap, state, slots, mlx, text), []).append(i)

    attention = window = chunk = recurrent = None
    if any("full" in k or k in ("sliding", "chunked") for k in kinds):
        attention = _attention(cfg, act_bytes, kv_bits)
    if "sliding" in kinds:
        window = _int(cfg, "sliding_window")
    if "chunked" in kinds:
        chunk = _int(cfg, "attention_chunk_size")
    if any("linear" in k for k in kinds):
        recurrent = state_bytes(cfg, act_bytes)
        if recurrent is None:
            notes.append("linear/recurrent layers of an unrecognised kind: their state is NOT "
                         "included in per_sequence_fixed_bytes")
    for i, k in enumerate(kinds):
        if "linear" in k and recurrent is not None:
            nbytes, slots, text = recurrent
            mlx = f"ArraysCache(size={slots})"
            add(i, "state", 0, None, nbytes, "CacheList member " + mlx if "+" in k else mlx, text,
                slots)
        if "full" in k:
            parts, mlx = attention
            mlx = "CacheList member KVCache" if "+" in k else mlx
            for kind, bpt, text in parts:
                add(i, kind, bpt, None, 0, mlx, text)
        elif k in ("sliding", "chunked"):
            kind, bpt, text = attention[0][0]
            cap, cls = (window, "RotatingKVCache") if k == "sliding" else (chunk, "ChunkedKVCache")
            add(i, "window" if k == "sliding" else "chunked", bpt, cap, 0, cls,
                f"{text}, at most {cap} tokens")
    return tuple(LayerCache(kind=kind, layers=tuple(idx), bytes_per_token=bpt, max_tokens=cap,
                            state_bytes=state, state_slots=slots, mlx_cache=mlx, formula=text)
                 for (kind, bpt, cap, state, slots, mlx, text), idx in groups.items())


def expanded_mla_bytes_per_token(cfg: dict, act_bytes: int) -> int | None:
    """Per layer per token if MLA's K/V were cached expanded (per head), for comparison."""
    if not isinstance(lookup(cfg, "kv_lora_rank"), int):
        return None
    heads = _int(cfg, "num_attention_heads")
    k = _int(cfg, "qk_nope_head_dim") + _int(cfg, "qk_rope_head_dim")
    return heads * (k + _int(cfg, "v_head_dim")) * act_bytes


def mla_prefill_expansion(cfg: dict) -> int:
    """Values per context token of one layer that an MLA prefill expands the cached latent
    into (a transient, not a cache): per head, the keys (``qk_nope_head_dim``) and values
    (``v_head_dim``) of mlx-lm's prefill path; mistral4 also concatenates the rope keys to
    the keys (``qk_nope + qk_rope`` more). 0 for a model without a cached latent."""
    mtype = str(cfg.get("model_type") or lookup(cfg, "model_type") or "")
    if not isinstance(lookup(cfg, "kv_lora_rank"), int) or mtype not in _MLA_TYPES:
        return 0
    heads, nope = _int(cfg, "num_attention_heads"), _int(cfg, "qk_nope_head_dim")
    per_head = nope + _int(cfg, "v_head_dim")
    if mtype == "mistral4":
        per_head += nope + _int(cfg, "qk_rope_head_dim")
    return heads * per_head


def sequence_bytes(caches: tuple[LayerCache, ...], tokens: int) -> int:
    """Bytes one sequence of ``tokens`` tokens holds over every cache."""
    return sum(c.bytes_for(tokens) for c in caches)
