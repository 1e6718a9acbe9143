"""Block payloads in and out of the paged pools, one block at a time (imports mlx).

The disk tier (:mod:`plimsoll.worker.disk_tier`) stores a block as one flat byte string:
for every paged pool in order (full attention, MLA latents, a ``CacheList``'s members in
turn: :func:`~plimsoll.engine.composite.flatten`), that block's K slots then its V slots, in the
pool's dtype (``(kv_heads, block_tokens, dim)`` each, C order). Only the engine's public
attributes are used (``layers`` with ``.keys``/``.values``, ``block_tokens``,
``block_bytes``), so the engine itself needs no hook.

Bounded: :func:`export_block` copies one block of one layer at a time to host memory
(``block_bytes`` in all per block), never a whole pool; :func:`import_block` writes one
layer's slice back at a time and evaluates it, so the pool is updated in place.

Hybrid models: a block alone does not carry a recurrent state, so the tier is not used
for them (:func:`supports`): their prefixes fall back to prefill.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np

from plimsoll.engine.composite import flatten
from plimsoll.engine.paged import FullAttention, RecurrentState

_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def supports(engine) -> str:
    """Why the tier cannot serve this engine ("" when it can)."""
    if any(isinstance(k, RecurrentState) for k in flatten(engine.layers)):
        return ("hybrid model: a block carries no recurrent state snapshot, so prefixes "
                "found on disk are prefilled instead")
    if not any(isinstance(k, FullAttention) for k in flatten(engine.layers)):
        return "no paged KV layers"
    return ""


def _pools(engine) -> list[FullAttention]:
    return [k for k in flatten(engine.layers) if isinstance(k, FullAttention)]


def _host(a: mx.array) -> np.ndarray:
    """The raw bytes of ``a`` as a flat uint8 numpy array (bfloat16 included)."""
    raw = a.view(_BITS[a.dtype.size]) if a.dtype not in _BITS.values() else a
    return np.asarray(raw).reshape(-1).view(np.uint8)


def export_block(engine, block_id: int) -> bytes:
    """One block of every layer's K and V pools, as one byte string (``block_bytes``)."""
    bt = engine.block_tokens
    lo, hi = block_id * bt, (block_id + 1) * bt
    out = bytearray()
    for p in _pools(engine):
        if p.keys is None or block_id >= p.blocks:
            raise ValueError(f"block {block_id} was never allocated")
        for arr in (p.keys, p.values):
            out += _host(arr[:, lo:hi]).tobytes()
    return bytes(out)


def export_blocks(engine, block_ids: Iterable[int]) -> list[bytes]:
    """:func:`export_block` for each id, in order (each one bounded to one block)."""
    return [export_block(engine, b) for b in block_ids]


def import_block(engine, block_id: int, payload: bytes | memoryview) -> None:
    """Write ``payload`` (as :func:`export_block` made it) into block ``block_id``."""
    view = memoryview(payload).cast("B")
    if view.nbytes != engine.block_bytes:
        raise ValueError(f"payload of {view.nbytes} B is not one block of "
                         f"{engine.block_bytes} B")
    bt = engine.block_tokens
    lo, hi = block_id * bt, (block_id + 1) * bt
    at = 0
    for p in _pools(engine):
        p.ensure(block_id)
        for name, dim in (("keys", p.k_dim), ("values", p.v_dim)):
            n = p.kv_heads * bt * dim * p.dtype.size
            raw = np.frombuffer(view[at:at + n], dtype=np.uint8).copy()
            at += n
            part = mx.array(raw).view(p.dtype).reshape(p.kv_heads, bt, dim)
            pool = getattr(p, name)
            pool[:, lo:hi] = part
            mx.eval(pool)
