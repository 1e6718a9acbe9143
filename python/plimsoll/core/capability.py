"""Can this engine serve this model? Model facts against one engine support table (pure).

Checked before anything costs memory: ``plimsoll launch`` before it spawns a worker, the proxy
before it evicts another model for one, the worker before it loads weights, and
``plimsoll admit`` reports it. A refusal names the model, the cache kind (and mlx-lm's cache
class for it) and what would serve it, so nobody learns it from a worker that exits after
reading gigabytes of weights.

:data:`ENGINE_SUPPORT` is the one table of what the worker's engine serves. It describes the
engine in ``plimsoll.engine`` (the block-paged engine, ``engine/core.py``):
full-attention ``KVCache`` in blocks, MLA's latent + rope-key blocks (``engine/latent.py``),
sparse-attention indexer keys, recurrent state of any slot count (``ArraysCache``, gated-delta /
mamba2 layers beside full attention) per sequence, sliding windows (``RotatingKVCache`` with
``keep=0``: a ring of the window per sequence, ``engine/window.py``), and ``CacheList`` layers
of those, each member in its own kind (``engine/composite.py``). A refusal says what runs
the model instead (mlx-lm's own server or generate, unbatched). Change the table, not the
callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_facts import ModelFacts, ModelInspectionError


@dataclass(frozen=True)
class KindSupport:
    what: str  # the kind, in words
    served: bool
    unserved_reason: str = ""  # when not served: why / what would serve it


ENGINE_SUPPORT: dict[str, KindSupport] = {
    "kv": KindSupport("full-attention KV", True),
    "state": KindSupport("recurrent state", True),
    "window": KindSupport("sliding-window layers", True),  # engine/window.py: rings
    "chunked": KindSupport(
        "chunked-attention layers", False,
        "mlx-lm's llama4 builds its chunk mask and attention temperature from one integer "
        "cache offset, so rows at different positions cannot share a batched decode; "
        "mlx_lm.server serves the model unbatched"),
    "latent": KindSupport("multi-head latent attention (MLA)", True),
    "indexer": KindSupport("sparse-attention indexer keys", True),
}
STATE_SLOTS: frozenset[int] | None = None
"""ArraysCache sizes the engine's per-sequence state handles (None: any)."""
SERVES_QUANTIZED_KV = True
"""Quantized KV (``kvDtype`` q8 / q4) for full-attention layers (engine/quantized.py)."""
QUANTIZED_KINDS = frozenset({"kv", "state"})
"""Cache kinds a quantized-KV model may hold (recurrent state is never quantized)."""
SERVES_CACHE_LIST = True  # each member in its own kind (engine/composite.py)
SERVES_STATE_ONLY = False  # a model with no attention KV at all (pure state-space)


@dataclass(frozen=True)
class Unsupported:
    """Why this engine cannot serve a model: ``kind`` and a one-line ``message``."""

    kind: str
    message: str


class UnsupportedModel(ModelInspectionError):
    """Raised by :func:`require_supported`: the engine does not serve one of the model's kinds."""

    def __init__(self, refusal: Unsupported):
        super().__init__(refusal.message)
        self.refusal = refusal


def check(facts: ModelFacts, name: str | None = None) -> Unsupported | None:
    """The first reason this engine cannot serve ``facts``' model, or None if it can."""
    who = f"{name} ({facts.model_type})" if name and name != facts.model_type \
        else facts.model_type
    caches = facts.caches
    if caches and all(c.kind == "state" for c in caches) and not SERVES_STATE_ONLY:
        return Unsupported("state-only", (
            f"{who}: a pure state-space model (every layer holds recurrent state, "
            f"{facts.state_bytes_per_seq} B a sequence; no attention KV to page) is not "
            f"served yet by this engine; mlx_lm.server or mlx_lm.generate run it"))
    for c in caches:
        support = ENGINE_SUPPORT[c.kind]
        if not support.served:
            return Unsupported(c.kind, (
                f"{who}: {support.what} ({c.mlx_cache}, {len(c.layers)} of "
                f"{facts.num_layers} layers) are not served yet by this engine: "
                f"{support.unserved_reason}"))
        if c.kind == "window" and c.keep:
            return Unsupported("window", (
                f"{who}: sliding-window layers that keep their first {c.keep} tokens forever "
                f"(RotatingKVCache(keep={c.keep})) are not served yet by this engine, which "
                f"serves keep=0 windows; mlx_lm.server serves the model unbatched"))
        if c.mlx_cache.startswith("CacheList") and not SERVES_CACHE_LIST:
            return Unsupported("cache-list", (
                f"{who}: layers holding several caches at once ({c.mlx_cache}) are not "
                f"served yet by this engine; mlx_lm.server serves the model unbatched"))
        if c.kind == "state" and STATE_SLOTS is not None and c.state_slots not in STATE_SLOTS:
            return Unsupported("state", (
                f"{who}: recurrent state of {c.state_slots} array(s) a layer "
                f"(ArraysCache(size={c.state_slots}), {len(c.layers)} layers) is not served "
                f"yet by this engine, which batches {sorted(STATE_SLOTS)}-array states; "
                f"mlx_lm.server serves the model unbatched"))
    if facts.kv_bits and not SERVES_QUANTIZED_KV:
        return Unsupported("quantized-kv", (
            f"{who}: quantized KV ({facts.kv_format}) is not served yet by this engine; "
            f"set kvDtype to auto, float16 or bfloat16 (or drop --kv-dtype)"))
    if facts.kv_bits and (other := sorted({c.kind for c in caches} - QUANTIZED_KINDS
                                          | {"CacheList" for c in caches
                                             if c.mlx_cache.startswith("CacheList")})):
        return Unsupported("quantized-kv", (
            f"{who}: quantized KV ({facts.kv_format}) is served for full-attention layers "
            f"only; this model also holds {', '.join(other)} caches: set kvDtype to auto, "
            "float16 or bfloat16 (or drop --kv-dtype)"))
    return None


def require_supported(facts: ModelFacts, name: str | None = None) -> None:
    """Raise :class:`UnsupportedModel` when :func:`check` finds a reason."""
    refusal = check(facts, name)
    if refusal is not None:
        raise UnsupportedModel(refusal)
