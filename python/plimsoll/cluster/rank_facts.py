"""What one rank's engine serves: the model facts of its share of the model, pure.

A rank's :class:`plimsoll.engine.core.Engine` checks the pools it measures from mlx-lm's
cache against the facts it is given (admission sized the pool from them), so a rank is
given the facts of what it holds: its layers alone (:func:`stage_facts`, pipeline) or 1/n
of every layer (:func:`tensor_facts`, tensor parallel).
"""

from __future__ import annotations

from plimsoll.core.cache_layout import CAPPED_KINDS, GROWING_KINDS
from plimsoll.core.model_facts import ModelFacts


class FactsError(ValueError):
    """The model's facts cannot be split so (the message says why)."""


def stage_facts(facts: ModelFacts, start: int, end: int, weights_bytes: int) -> ModelFacts:
    """The facts of layers ``[start, end)`` alone, renumbered from 0 (what a rank's engine
    serves: its caches, its KV per token and per-sequence fixed bytes, its weights share)."""
    if not facts.caches:
        raise FactsError(f"{facts.model_type}: no per-layer cache layout to split")
    caches = tuple(c.model_copy(update={"layers": mine}) for c in facts.caches
                   if (mine := tuple(i - start for i in c.layers if start <= i < end)))
    growing = {i for c in caches if c.kind in GROWING_KINDS for i in c.layers}
    capped = {i for c in caches if c.kind in CAPPED_KINDS for i in c.layers}
    fixed = sum(len(c.layers) * (c.bytes_per_token * (c.max_tokens or 0)
                                 if c.kind in CAPPED_KINDS else 0)
                + len(c.layers) * c.state_bytes for c in caches)
    return ModelFacts.model_validate(facts.model_dump() | {
        "num_layers": end - start, "kv_layers": len(growing),
        "sliding_layers": len(capped - growing), "weights_bytes": weights_bytes,
        "kv_bytes_per_token": sum(len(c.layers) * c.bytes_per_token for c in caches
                                  if c.kind in GROWING_KINDS),
        "per_sequence_fixed_bytes": fixed, "caches": [c.model_dump() for c in caches]})


def tensor_facts(facts: ModelFacts, ranks: int, weights_bytes: int) -> ModelFacts:
    """What one rank's engine serves under the split: 1/n of the heads, of every layer's KV
    per token and of the MLP (:func:`plimsoll.cluster.plan.tensor_refusal` checked that
    they divide)."""
    caches = [c.model_copy(update={"bytes_per_token": c.bytes_per_token // ranks})
              .model_dump() for c in facts.caches]
    return ModelFacts.model_validate(facts.model_dump() | {
        "num_key_value_heads": facts.num_key_value_heads // ranks,
        "num_attention_heads": (facts.num_attention_heads or 0) // ranks or None,
        "intermediate_size": (facts.intermediate_size or 0) // ranks or None,
        "weights_bytes": weights_bytes, "kv_bytes_per_token": facts.kv_bytes_per_token // ranks,
        "caches": caches})
