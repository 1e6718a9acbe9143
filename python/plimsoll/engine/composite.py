"""Layers holding several caches at once (mlx-lm ``CacheList``), and which kind each cache is.

mlx-lm builds a ``CacheList`` where one layer holds more than one cache: falcon_h1 (mamba
state + full-attention KV), longcat_flash (two MLA sublayers: two latents), deepseek_v32 /
glm_moe_dsa (the MLA latent + the sparse-attention indexer's keys). The model indexes it
(``cache[0]``, ``cache[1]``), so the engine hands it a :class:`CompositeView` of one view
per member, each member in its own kind: a :class:`Composite` groups them, and
:func:`flatten` lists every kind of every layer in order (pools, then states, are taken
from that flat list, so a member is paged or stacked exactly as a layer of its kind).

Which kind a ``KVCache`` is cannot be read from the cache object (a latent, an indexer's
keys and a per-head K/V look alike), so :func:`layer_kinds` reads it from model facts'
layout (:mod:`plimsoll.core.cache_layout`, which follows each model file's ``make_cache``),
member by member, and :func:`check_member` refuses a layout that disagrees with mlx-lm's
own cache.

- :class:`Indexer` (deepseek_v32's indexer keys): the model calls
  ``update_and_fetch(k, k)`` and scores its own top-k over the returned history, so it is a
  :class:`~plimsoll.engine.latent.Latent` pool (keys in both pools, as mlx-lm holds them,
  which is what facts count); its "attention" is the model's own scoring, so its view
  counts as attended when it hands the history back.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from plimsoll.core.model_facts import ModelFacts
from plimsoll.engine.attention import PagedView
from plimsoll.engine.latent import Latent, LatentView
from plimsoll.engine.paged import FullAttention


class Indexer(Latent):
    """The paged indexer keys of one sparse-attention (deepseek_v32) layer."""

    kind = "indexer"
    table_kind = "indexer"


class IndexerView(LatentView):
    """The indexer's cache for one forward: the history, counted as this layer's read."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.batch.attended += 1
        return super().update_and_fetch(keys, values)


class Composite:
    """One layer's several caches (mlx-lm ``CacheList``), one kind per member."""

    kind = "composite"
    plain_kv = False

    def __init__(self, parts: list):
        self.parts = tuple(parts)

    @property
    def block_bytes(self) -> int:
        return sum(p.block_bytes for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class CompositeView:
    """A ``CacheList`` of views for one forward (the model indexes it)."""

    def __init__(self, views: list):
        self.caches = tuple(views)

    def __getitem__(self, idx: int):
        return self.caches[idx]

    @property
    def attends_inputs(self) -> bool:
        return any(getattr(c, "attends_inputs", False) for c in self.caches)

    def attend(self, queries, keys, values, scale: float, mask):
        """deepseek_v32 passes the whole CacheList to the attention: its latent attends."""
        latent = next(c for c in self.caches if getattr(c, "attends_inputs", False))
        return latent.attend(queries, keys, values, scale, mask)

    def make_mask(self, *args, **kwargs):
        """The mask a module asks of the whole CacheList: its first member's (deepseek_v32's
        latent; the model makes its own from that member too)."""
        first = self.caches[0]
        return first.make_mask(*args, **kwargs) if hasattr(first, "make_mask") else None

    @property
    def state(self):
        return [c.state for c in self.caches]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False


def flatten(layers: list) -> Iterator:
    """Every kind of every layer, composites' members in order."""
    for kind in layers:
        if isinstance(kind, Composite):
            yield from kind.parts
        else:
            yield kind


def view_of(kind, batch, states: Iterator):
    """The cache object the model sees for ``kind`` in one forward; state kinds take the
    next of ``states`` (the sequence rows' state caches, in :func:`flatten` order)."""
    if isinstance(kind, Composite):
        return CompositeView([view_of(k, batch, states) for k in kind.parts])
    if isinstance(kind, Indexer):
        return IndexerView(kind, batch)
    if isinstance(kind, Latent):
        return LatentView(kind, batch)
    if isinstance(kind, FullAttention):
        return PagedView(kind, batch)
    return next(states)


def members(cache) -> tuple:
    """The caches of one layer: a ``CacheList``'s members, or the cache itself."""
    inner = getattr(cache, "caches", None)
    return tuple(inner) if type(cache).__name__ == "CacheList" else (cache,)


def cache_layers(facts: ModelFacts, n: int) -> list[int | None]:
    """The model layer of each of the ``n`` entries of ``make_prompt_cache`` (layers without
    a cache, as nemotron_h's MLP blocks, have no entry); None each where facts' layout does
    not account for exactly ``n`` cached layers (then kinds follow the cache classes)."""
    layers = sorted({i for c in facts.caches for i in c.layers})
    return layers if len(layers) == n else [None] * n


def layer_kinds(facts: ModelFacts, layer: int | None) -> list[str]:
    """Facts' cache kinds of ``layer``, member by member (a layer listed twice in one group,
    as longcat_flash's two latents, holds two caches of that kind)."""
    if layer is None:
        return []
    return [c.kind for c in facts.caches for _ in range(c.layers.count(layer))]


def pool_class(want: str | None) -> type[FullAttention]:
    """The pool kind of a ``KVCache`` member facts call ``want`` (None: facts say nothing)."""
    return {"latent": Latent, "indexer": Indexer}.get(want or "kv", FullAttention)


def check_member(model: str, layer: int, member, want: str | None) -> None:
    """Refuse a facts layout whose kind for a member disagrees with mlx-lm's cache class."""
    is_state = type(member).__name__ == "ArraysCache"
    if want is not None and (want == "state") != is_state:
        raise NotImplementedError(
            f"{model}: layer {layer} holds {type(member).__name__} where model facts say "
            f"{want!r}; the paged engine cannot tell which cache is which")


def check_bytes(model: str, layers: list, facts: ModelFacts, block_tokens: int) -> None:
    """Refuse where the pools (measured from mlx-lm's own cache) disagree with what model
    facts count: admission sized the pool from facts, so a model whose layout plimsoll
    misreads (an MLA layer counted as per-head K/V, say) must not be served on it. Layer by
    layer where facts' layers map onto the cache entries, else in total."""
    if not facts.caches:
        return
    where = cache_layers(facts, len(layers))
    rows = []
    for i, kind in zip(where, layers, strict=True):
        pools = [k for k in (kind.parts if isinstance(kind, Composite) else (kind,))
                 if isinstance(k, FullAttention)]
        counted = None if i is None else sum(  # windows are rings, held as state
            c.bytes_per_token * c.layers.count(i)
            for c in facts.caches if c.kind not in ("state", "window"))
        rows.append((i, pools, counted))
    if any(i is None for i, _, _ in rows):
        rows = [("all", [k for _, p, _ in rows for k in p], facts.kv_bytes_per_token)]
    for i, pools, counted in rows:
        held = sum(k.block_bytes for k in pools) // block_tokens
        if held != counted:
            raise NotImplementedError(
                f"{model}: layer {i} holds {held} B a token in mlx-lm's cache "
                f"({', '.join(k.kind for k in pools) or 'nothing'}) but model facts count "
                f"{counted} B; plimsoll misreads this model's cache layout and will not serve "
                "it on a pool sized from that figure")
