"""Multi-head latent attention (MLA) over block tables (imports mlx).

mlx-lm's MLA layers (deepseek_v3, glm4_moe_lite, kimi_k25, kimi_linear, mistral4, …) cache
one latent vector (``kv_lora_rank``) and one rope key (``qk_rope_head_dim``) a token, shared
by every head, and do their own attention math on what the cache hands back::

    kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
    pe_scores = (q_pe * scale) @ k_pe.swapaxes(-1, -2)      # positional scores
    pe_scores = mx.where(mask, pe_scores, min)              # mask from cache.make_mask
    out = scaled_dot_product_attention(q, k(kv_latent), v(kv_latent), mask=pe_scores)

So, unlike full attention (:class:`~plimsoll.engine.attention.PagedView`, which attends to
the pool itself), a latent layer's view must hand the model the whole history:

- :class:`Latent` is the pool: a :class:`~plimsoll.engine.paged.FullAttention` of one
  "head" whose K pool holds the latent and whose V pool holds the rope key (its
  ``block_bytes`` is ``B × (kv_lora_rank + qk_rope_head_dim) × dtype``, exactly what model
  facts count);
- :meth:`LatentView.update_and_fetch` writes the fresh latent / rope key into the rows'
  slots and returns the gathered history of every row's table, (rows, 1, length, dim),
  padded to the longest row (a prefill chunk at position 0 gets its own fresh arrays back);
- :meth:`LatentView.make_mask` gives the model the batch's boolean mask as an array: the
  padding mask of a decode batch of different lengths, or the causal mask of a prefill
  chunk, aligned bottom-right (queries at ``start ..``, keys ``0 .. start + L``). The model
  folds it into its positional scores, so the additive mask it passes to
  ``scaled_dot_product_attention`` carries both;
- :meth:`LatentView.attend` (routed there by :func:`~plimsoll.engine.attention.sdpa`) runs
  one fused SDPA on the model's own queries, keys, values and mask, for all rows at once.

One gather per layer per forward, no per-sequence loop.
"""

from __future__ import annotations

import mlx.core as mx

from plimsoll.engine.attention import PoolCache
from plimsoll.engine.paged import FullAttention


class Latent(FullAttention):
    """The paged latent (K pool) and rope-key (V pool) blocks of one MLA layer."""

    kind = "latent"
    table_kind = "latent"
    plain_kv = False  # one compressed vector a token, attended through the model's own math


class LatentView(PoolCache):
    """One MLA layer's cache for one forward (mlx-lm's cache protocol); see the module."""

    attends_inputs = True  # attention.sdpa hands attend() the model's keys, values and mask

    def __init__(self, pool: Latent, batch):
        self.pool, self.batch = pool, batch
        self.offset = batch.offset

    def update_and_fetch(self, latent: mx.array, rope_keys: mx.array):
        self.pool.write(self.batch.write, latent, rope_keys)
        if self.batch.read is None:  # a chunk at position 0: its history is itself
            return self.pool.tied(latent, rope_keys)
        hist_latent, hist_rope = self.pool.gather(self.batch.read)
        if hist_latent.dtype != latent.dtype:
            hist_latent = hist_latent.astype(latent.dtype)
            hist_rope = hist_rope.astype(latent.dtype)
        return hist_latent, hist_rope

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """The batch's mask as a boolean array (the models ``mx.where`` it), or None."""
        mask = self.batch.mask
        if isinstance(mask, str):  # "causal": queries start .. start + n over keys 0 ..
            start = int(self.batch.offset)
            keys = mx.arange(start + n)
            return mx.arange(start, start + n)[:, None] >= keys[None]
        return mask

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               mask) -> mx.array:
        self.batch.attended += 1
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)

    @property
    def keys(self):
        return self.pool.keys

    @keys.setter
    def keys(self, value) -> None:
        """deepseek_v32 chains its caches with ``mx.depends``; the engine evaluates every
        pool itself, so the chained array is dropped (never evaluated)."""

    @property
    def values(self):
        return self.pool.values

    @values.setter
    def values(self, value) -> None:
        """deepseek_v32's indexer sets its values to zeros (mlx-lm's graph trim); dropped."""

