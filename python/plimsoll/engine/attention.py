"""Attention over block tables: the cache objects mlx-lm's model classes see (imports mlx).

mlx-lm's attention layers call ``cache.update_and_fetch(keys, values)`` and then
``mlx_lm.models.base.scaled_dot_product_attention(..., cache=cache, ...)``. For one
forward the engine hands every full-attention layer a :class:`PagedView` over that
layer's pool; :func:`route_attention` points mlx-lm's entry point at :func:`sdpa`,
which, for a ``PagedView``, runs :meth:`PagedView.attend` and delegates everything else
to mlx-lm's own function. So:

- ``update_and_fetch`` scatters the new K/V into the pool slots of this forward
  (:class:`Batch.write`) and returns them unchanged (nothing reads them but us);
- ``attend`` reads the slots of :class:`Batch.read` — a slice for one table of
  consecutive blocks, otherwise a gather into a transient (rows × longest × heads ×
  dim, one layer at a time) — and runs ``mx.fast.scaled_dot_product_attention`` once
  for all rows, with a boolean padding mask (rows of different lengths) or mlx's
  ``"causal"`` mask (a prefill chunk: queries at ``start ..``, keys ``0 .. start + L``,
  aligned bottom-right). A prefill chunk at position 0 attends to its own fresh K/V.
- ``offset`` is the rope offset: an int for one row, an ``mx.array`` of per-row
  offsets for a decode batch (as mlx-lm's ``BatchKVCache``).

A kind with its own ``attend_read`` (quantized pools, :mod:`plimsoll.engine.quantized`) takes the
whole read itself; a decode kernel that passed its check on this device
(:mod:`plimsoll.engine.kernels`: the CUDA one, :mod:`plimsoll.engine.paged_cuda`) serves the
decode rows of float pools (:attr:`Batch.kernel`), the gather path everything else.

``Batch.attended`` counts the layers that went through :func:`sdpa`; the engine checks
it after every forward, so a model whose attention bypasses mlx-lm's entry point is
refused rather than silently attending to nothing.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as _mlx_base

from plimsoll.engine import backend
from plimsoll.engine.paged import FullAttention, Read

_ORIGINAL_SDPA = _mlx_base.scaled_dot_product_attention


class Batch:
    """What every layer of one forward shares: where to write, what to read, mask, offset."""

    __slots__ = ("attended", "kernel", "lengths", "mask", "offset", "pace", "read", "tail",
                 "write", "writes_in_read")

    def __init__(self, write: mx.array, read: Read | None, mask, offset,
                 lengths: mx.array | None = None, tail: Read | None = None, kernel=None):
        self.write, self.read, self.mask, self.offset = write, read, mask, offset
        self.lengths = lengths  # decode rows' lengths (int32): a decode kernel's bound
        # the decode kernel that passed its check on this device (engine/kernels.py), or None
        self.kernel = kernel
        # a chunk that samples, in an engine whose kinds attend its last token to the
        # pool as mlx-lm's own last-token step does (quantized KV): positions 0 .. its end
        self.tail = tail
        self.attended = 0
        #: a :class:`Pacer` for a long chunk's layers (set by the engine), or None
        self.pace: Pacer | None = None
        #: decode rows alone in their step: a pool written in place stores their K/V by
        #: the decode kernel's own launch (:attr:`~plimsoll.engine.kernels.Kernel.
        #: decode_writing`), given each row's sequence's first new position and the row
        #: holding it, (first, base) — set by the engine; None: written before the read
        self.writes_in_read: tuple[mx.array, mx.array] | None = None


class Pacer:
    """Keeps at most ``window`` layers of one forward in flight on the device.

    A GPU backend keeps every op's inputs alive until the command batch that runs it has
    completed, and encodes far ahead of the device (MLX's CUDA backend: up to 10 graphs of
    ~100 ops, most of a 36-layer forward), so a long prefill chunk holds many layers'
    gathered contexts and activations at once. Called with each layer's attention output,
    it submits it and waits for the one ``window`` layers back: the device always has
    ``window`` layers queued while the host builds the next, and what is live is that many
    layers' transients (:data:`plimsoll.core.transients.PREFILL_LAYER_WINDOW`, counted by
    admission)."""

    __slots__ = ("_queued", "window")

    def __init__(self, window: int):
        self.window, self._queued = window, []

    def __call__(self, out: mx.array) -> mx.array:
        mx.async_eval(out)
        self._queued.append(out)
        if len(self._queued) > self.window:
            mx.eval(self._queued.pop(0))  # already submitted: waits for it to complete
        return out


class PoolCache:
    """What mlx-lm's cache protocol asks of a view over a pool (``self.pool``)."""

    pool: FullAttention

    @property
    def state(self):
        return self.pool.keys, self.pool.values

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False


class Captured(Exception):
    """Raised by a capturing :class:`PagedView` once its module has handed it K/V."""


class PagedView(PoolCache):
    """One full-attention layer's cache for one forward (mlx-lm's cache protocol).

    A step of several groups writes each layer's pool once, before any group reads it
    (:func:`plimsoll.engine.mixers.write_once`): each group's module is first called with
    its view ``capturing`` (``update_and_fetch`` keeps the K/V and raises :class:`Captured`),
    the pool takes all of them in one scatter, then each module runs again and its view
    hands back the K/V it kept (``written``) instead of writing."""

    def __init__(self, pool: FullAttention, batch: Batch):
        self.pool, self.batch = pool, batch
        self.offset = batch.offset
        self._fresh: tuple[mx.array, mx.array] | None = None
        self._unwritten = False  # the fresh K/V are not in the pool yet
        self.capturing = False
        #: the K/V the capture took, written since with the step's other groups
        self.written: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.capturing:
            self.written = (keys, values)
            raise Captured
        if self.written is not None:  # the step's one write of this layer took them
            keys, values = self.written
            self.written = None
        elif self.batch.writes_in_read is not None and self.pool.inplace is not None:
            self._unwritten = True  # attend() stores them: by the kernel, or before it
        else:
            self.pool.write(self.batch.write, keys, values)
        if self.batch.read is None:  # attends to itself: the write must not wait till the end
            keys, values = self.pool.tied(keys, values)
        self._fresh = (keys, values)
        return keys, values

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        self.batch.attended += 1
        # the view lives until the step is submitted: it must not keep this layer's K/V
        # buffers alive once they are evaluated
        read, pool, fresh, self._fresh = self.batch.read, self.pool, self._fresh, None
        if hasattr(pool, "attend_read"):  # a kind that reads its own pool (quantized KV)
            return self._paced(pool.attend_read(queries, scale, sinks, self.batch, fresh))
        kernel, unwritten, self._unwritten = self.batch.kernel, self._unwritten, False
        served = (kernel is not None and read is not None and read.index is not None
                  and self.batch.lengths is not None and sinks is None
                  and kernel.serves(queries, pool.k_dim, pool.v_dim, pool.kv_heads))
        if unwritten:
            if (served and kernel.decode_writing is not None
                    and fresh[0].dtype == pool.dtype == queries.dtype):
                out, pool.token = kernel.decode_writing(
                    queries, pool.keys, pool.values, *fresh, *self.batch.writes_in_read,
                    read.index, self.batch.lengths, read.length, scale, pool.block_tokens,
                    after=pool.token)
                pool.keys, pool.values = mx.depends([pool.keys, pool.values], [pool.token])
                return out
            pool.write(self.batch.write, *fresh)  # the kernel does not write these
        if served:
            return kernel.decode(queries, pool.keys, pool.values, read.index,
                                 self.batch.lengths, read.length, scale, pool.block_tokens,
                                 after=pool.token)
        if self.batch.read is None:
            keys, values = fresh
        else:
            keys, values = self.pool.gather(self.batch.read)
            if keys.dtype != queries.dtype:
                keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
        return self._paced(causal_on_grid(queries, keys, values, scale, self.batch.mask,
                                          sinks, backend.causal_grid()))

    def _paced(self, out: mx.array) -> mx.array:
        return out if self.batch.pace is None else self.batch.pace(out)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None  # the mask is the batch's own, applied in attend()


def causal_on_grid(queries, keys, values, scale: float, mask, sinks, grid: int) -> mx.array:
    """Attention with ``mask``; a causal chunk's shape put on the ``grid`` (0: as it is).

    cuDNN builds a plan per (queries, keys) shape, so both lengths are made multiples of
    ``grid`` (:func:`grid_pads`): queries and keys padded at the end by the same ``back`` (the
    keys reach the grid), then ``front`` dummy queries before the real ones (the queries
    reach it too). Exact: the causal mask is aligned bottom-right, so a real query still sees
    exactly the keys up to its own position; the dummy and padded rows are cut off. The
    inputs are always made contiguous, so a plan's strides do not follow the pool's size
    either, and :class:`~plimsoll.engine.warmup.PlanWarmer` can build the same plans ahead.
    Only without a cast (the gather's second copy is then headroom the transient counts)."""
    if not grid or not (isinstance(mask, str) and mask == "causal") or keys.dtype != queries.dtype:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask, sinks=sinks)
    n = queries.shape[2]
    front, back = grid_pads(n, keys.shape[2], grid)
    _SIGNATURES.setdefault(signature(queries, keys, values, sinks), None)
    if front or back:
        queries = mx.pad(queries, [(0, 0), (0, 0), (front, back), (0, 0)])
        keys, values = (mx.pad(a, [(0, 0), (0, 0), (0, back), (0, 0)]) for a in (keys, values))
    else:
        queries, keys, values = (mx.contiguous(a) for a in (queries, keys, values))
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                               mask=mask, sinks=sinks)
    return out[:, :, front:front + n]


def grid_pads(queries: int, keys: int, grid: int) -> tuple[int, int]:
    """(front, back): ``back`` pads queries and keys at the end to a multiple of ``grid``
    keys, ``front`` dummy queries then make the queries one too — unless the chunk starts
    too early for them (fewer cached keys than ``front``: the queries stay off the grid)."""
    back = (-keys) % grid
    front = (-(queries + back)) % grid
    return (front if front <= keys - queries else 0), back


#: (query heads, dim, KV heads, value dim, dtype, sinks dtype or None) of every causal chunk
#: attention put on the grid in this process: what :func:`build_plan` warms.
_SIGNATURES: dict[tuple, None] = {}


def signature(queries, keys, values, sinks) -> tuple:
    return (queries.shape[1], queries.shape[3], keys.shape[1], values.shape[3], queries.dtype,
            None if sinks is None else sinks.dtype)


def signatures() -> list[tuple]:
    return list(_SIGNATURES)


def build_plan(sig: tuple, queries: int, keys: int) -> None:
    """Run (and so plan) one causal attention of ``queries`` × ``keys`` on zeros, as
    :func:`causal_on_grid` would call it for a chunk of signature ``sig``."""
    heads, dim, kv_heads, v_dim, dtype, sinks_dtype = sig
    q = mx.zeros((1, heads, queries, dim), dtype=dtype)
    k = mx.zeros((1, kv_heads, keys, dim), dtype=dtype)
    v = mx.zeros((1, kv_heads, keys, v_dim), dtype=dtype)
    sinks = None if sinks_dtype is None else mx.zeros((heads,), dtype=sinks_dtype)
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask="causal",
                                                 sinks=sinks))


def fused_prefill(dtype: mx.Dtype, head_dims: set[int]) -> bool:
    """Does this backend run a prefill chunk's attention as a fused kernel (no score matrix
    held)? MLX's CUDA backend uses cuDNN for f16/bf16 with head dims that are multiples of 8
    up to 128; Metal's fused kernel takes head dims 64, 80 and 128; the CPU backend
    materialises the scores. Admission's transient and the default chunk follow it."""
    if not backend.gpu() or not head_dims:
        return False
    if backend.name() == "metal":
        return head_dims <= {64, 80, 128}
    return dtype in (mx.float16, mx.bfloat16) and all(d % 8 == 0 and d <= 128
                                                      for d in head_dims)


def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, paged for a :class:`PagedView`."""
    if isinstance(cache, PagedView):
        return cache.attend(queries, scale, sinks)
    if getattr(cache, "attends_inputs", False):  # MLA (engine.latent): the model's own
        return cache.attend(queries, keys, values, scale, mask)  # keys, values and mask
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask,
                          sinks=sinks)


def route_attention() -> None:
    """Point every loaded mlx-lm model module at :func:`sdpa` (idempotent, delegating)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(
                module, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA:
            module.scaled_dot_product_attention = sdpa
