"""Model facts vs the bytes mlx-lm's own cache holds, for every family of issue 15.

Each family (tests/families.py) is built once per session as a real mlx-lm model directory;
``inspect_model`` reads it (config + safetensors headers only), ``mlx_lm.load`` loads it, and a
299-token prefill plus one decode step (300 tokens) runs through ``make_prompt_cache``. Two
comparisons, each within 2 %:

- held: the tokens each mlx-lm cache says it holds (its own offset / window / chunk
  bookkeeping) × the bytes per token of its real arrays, plus every recurrent state array,
  against ``facts.sequence_bytes(300)`` (what a paged engine holding exactly those tokens needs);
- physical: ``sum(c.nbytes)`` against the same layout at mlx-lm's allocation (KV arrays grow
  in steps of 256 tokens; a ChunkedKVCache regrows a step past its chunk after a trim).

Also: greedy output varies (the family weights are scaled for it); the weights figure
equals the bytes of the parameters ``mlx_lm.load`` keeps (MTP
tensors dropped), and quantized KV (q8, q4) equals mlx-lm's QuantizedKVCache.
"""

from __future__ import annotations

import math

import pytest
from families import FAMILIES, has_module

from plimsoll.core.model_facts import inspect_model

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.models import cache as C  # noqa: E402

PROMPT = 299  # prefill; + one decode step = 300 tokens
STEP = 256  # mlx-lm's KVCache / ChunkedKVCache growth step


def _members(cache):
    for c in cache:
        yield from (_members(c.caches) if isinstance(c, C.CacheList) else [c])


def _held_bytes(cache) -> int:
    """Tokens each cache says it holds × bytes per token of its arrays, + state arrays."""
    total = 0
    for c in _members(cache):
        if isinstance(c, C.ArraysCache):
            total += c.nbytes
            continue
        if c.keys is None:
            continue
        keys = c.keys[0] if isinstance(c.keys, tuple) else c.keys
        per_token = c.nbytes / keys.shape[2]
        if isinstance(c, C.RotatingKVCache):
            tokens = min(c.offset, c.max_size)
        elif isinstance(c, C.ChunkedKVCache):
            tokens = c.offset - c.start_position
        else:
            tokens = c.offset
        total += round(per_token * tokens)
    return total


def _allocated_bytes(facts, tokens: int) -> int:
    """facts' layout at mlx-lm's allocation policy for a one-chunk prefill + one decode."""
    total = 0
    for c in facts.caches:
        if c.kind == "state":
            held = 0
        elif c.kind == "window":
            held = min(tokens, c.max_tokens)
        elif c.kind == "chunked":
            held = c.max_tokens + STEP if tokens > c.max_tokens else math.ceil(tokens / STEP) * STEP
        else:
            held = math.ceil((tokens - 1) / STEP) * STEP
        total += len(c.layers) * (c.bytes_per_token * held + c.state_bytes)
    return total


def _prefill(model, cache) -> None:
    prompt = mx.array([[(7 * i) % 500 + 3 for i in range(PROMPT)]])
    mx.eval(model(prompt, cache=cache))
    mx.eval(model(mx.array([[5]]), cache=cache))


def _params_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_facts_match_mlx_lm_cache(name, family_dir):
    fam = FAMILIES[name]
    if not has_module(fam):
        pytest.skip(f"mlx-lm {mlx_lm.__version__} has no models/{fam.module}.py")
    path = family_dir(name)
    facts = inspect_model(path)
    model, _tok = mlx_lm.load(str(path))
    cache = C.make_prompt_cache(model)
    _prefill(model, cache)
    tokens = PROMPT + 1
    held, physical = _held_bytes(cache), sum(c.nbytes for c in cache)
    formula = facts.sequence_bytes(tokens)
    assert held == pytest.approx(formula, rel=0.02), (name, facts.caches)
    assert physical == pytest.approx(_allocated_bytes(facts, tokens), rel=0.02), name
    assert facts.weights_bytes == _params_bytes(model), name
    assert len(set(_greedy(model, 16))) >= 6, name  # scaled weights: greedy output varies


def _greedy(model, n: int) -> list[int]:
    cache = C.make_prompt_cache(model)
    logits, out = model(mx.array([[3, 17, 99, 250, 7, 41]]), cache=cache), []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


@pytest.mark.parametrize("name,bits", [("llama", 8), ("qwen3", 4), ("qwen3_4bit", 8)])
def test_quantized_kv_matches_mlx_lm(name, bits, family_dir):
    path = family_dir(name)
    facts = inspect_model(path, kv_dtype=f"q{bits}")
    assert facts.kv_bits == bits
    model, _tok = mlx_lm.load(str(path))
    cache = [C.QuantizedKVCache(group_size=64, bits=bits) for _ in range(facts.num_layers)]
    _prefill(model, cache)
    assert _held_bytes(cache) == pytest.approx(facts.sequence_bytes(PROMPT + 1), rel=0.02)
    plain = inspect_model(path)
    assert facts.kv_bytes_per_token < plain.kv_bytes_per_token  # counted, not assumed


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_latent_matches_mlx_quantized_cache(bits, family_dir):
    """MLA: mlx-lm's attention cannot read a QuantizedKVCache, so the latent + rope key of
    each layer are stored directly into one, as a quantizing engine would."""
    path = family_dir("deepseek_v3")
    facts = inspect_model(path, kv_dtype=f"q{bits}")
    tokens = PROMPT + 1
    held = 0
    for _ in range(facts.num_layers):
        c = C.QuantizedKVCache(group_size=64, bits=bits)
        latent = mx.random.normal((1, 1, tokens, 64))
        c.update_and_fetch(latent, latent)
        held += _held_bytes([c])
    assert held == pytest.approx(facts.sequence_bytes(tokens), rel=0.02)
