"""Physical pools, one "kind" object per cache layer of the model (imports mlx).

A *kind* owns the arrays of one layer and knows how its tokens (or its per-sequence
state) are laid out; the engine builds one per entry of mlx-lm's
``make_prompt_cache(model)``:

- :class:`FullAttention` (mlx-lm ``KVCache``): a K pool and a V pool shaped
  ``(kv_heads, blocks × block_tokens, head_dim)``. Block ``b`` is the slot range
  ``[b × B, (b + 1) × B)`` of axis 1, so the token at position ``p`` of a table is slot
  ``table[p // B] × B + p % B``. Head-major means a block is one contiguous run of
  ``B × dim`` per head, so a gather moves whole blocks (long runs) and comes out as
  ``(heads, rows, positions, dim)`` whose last two axes are contiguous; a run of
  consecutive blocks is a plain slice (a view, no copy at all).
- :class:`RecurrentState` (mlx-lm ``ArraysCache``, any slot count): no blocks; each
  sequence holds its own arrays (see :mod:`plimsoll.engine.state`).

The other kinds build on the same pools: a sliding-window layer keeps a
ring of its window per sequence in a ``FullAttention`` whose "block" is one ring
(:mod:`plimsoll.engine.window`); an MLA latent kind (:mod:`plimsoll.engine.latent`) is one
"head" whose K pool holds the ``kv_lora_rank`` latent and V pool the ``qk_rope_head_dim``
rope key; a quantized kind keeps, per pool, the values plus scales and biases arrays of
mlx-lm's group size on the same slot axis — each kind reports its own ``block_bytes`` and
``nbytes``, and the engine only sums them.

Growth: pools are never preallocated whole. They grow in slabs of ``slab_blocks`` up to
``max_blocks`` when a block id past the allocated range is written; each array is
grown (concatenated) and evaluated before the next, so the transient of a growth is
one array of one layer. Nothing ever grows past ``max_blocks``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def mx_dtype(name: str) -> mx.Dtype:
    """The mlx dtype of a KV dtype name (float16, bfloat16, float32)."""
    if name not in DTYPES:
        raise ValueError(f"kv_dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


class FullAttention:
    """The paged K/V pools of one full-attention layer."""

    kind = "full"
    table_kind = "kv"  # its row of the served-kinds table (core/capability.ENGINE_SUPPORT)
    #: a capability, not a type: the pool is float K/V arrays (heads, slots, dim) that attend
    #: one query row as a chunk's causal row does — what the CUDA kernels, the compiled
    #: decode, verifying rows and the one-scatter write serve (a subclass that stores or
    #: attends otherwise sets it False)
    plain_kv = True

    def __init__(self, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
                 block_tokens: int, max_blocks: int, slab_blocks: int):
        self.kv_heads, self.k_dim, self.v_dim, self.dtype = kv_heads, k_dim, v_dim, dtype
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self.slab_blocks = max(1, min(slab_blocks, max_blocks))
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.blocks = 0  # blocks allocated
        self._after: list[mx.array] | None = None  # see fence()
        #: a write that stores through the pool's own buffer (engine/pool_cuda.write,
        #: set by the engine once it passed its check here), or None: MLX's scatter
        #: (only with ``fast_gather``: every read of a pool written in place takes ``token``)
        self.inplace: Callable[..., mx.array] | None = None
        #: a gather that copies the blocks' rows itself (engine/pool_cuda.gather, set once it
        #: passed its check here), or None: MLX's gather
        self.fast_gather: Callable[..., mx.array] | None = None
        #: the last in-place write's token (None: none yet), an input of every read of the
        #: pool so that MLX's CUDA graph runs the read after the write (engine/pool_cuda.py)
        self.token: mx.array | None = None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this layer (K and V), from the pool dtype."""
        return self.block_tokens * self.kv_heads * (self.k_dim + self.v_dim) * self.dtype.size

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _slab_target(self, highest_block: int) -> int | None:
        """The block count that holds ``highest_block``, grown in slabs and never past
        ``max_blocks`` (an id outside the pool is an error); None when it exists already."""
        if highest_block < self.blocks:
            return None
        if highest_block >= self.max_blocks:
            raise ValueError(f"block id {highest_block} is outside the pool of "
                             f"{self.max_blocks} blocks")
        return min(self.max_blocks,
                   math.ceil((highest_block + 1) / self.slab_blocks) * self.slab_blocks)

    def _widths(self, dim: int) -> tuple[tuple[int, mx.Dtype], ...]:
        """(last-axis width, dtype) of each array a cached vector of ``dim`` is stored in:
        one float array here (a kind that stores a vector in several overrides it)."""
        return ((dim, self.dtype),)

    def _parts(self, stored) -> tuple:
        """``keys`` or ``values`` as the tuple of arrays :meth:`_widths` describes."""
        return (stored,)

    def _stored(self, parts: list[mx.array]):
        """The inverse of :meth:`_parts`."""
        return parts[0]

    def ensure(self, highest_block: int) -> None:
        """Grow (in slabs, never past ``max_blocks``) so ``highest_block`` exists; one array
        is grown and evaluated at a time, so the growth transient is one array's old size."""
        if (want := self._slab_target(highest_block)) is None:
            return
        extra = (want - self.blocks) * self.block_tokens
        for name, dim in (("keys", self.k_dim), ("values", self.v_dim)):
            old = getattr(self, name)
            olds = None if old is None else self._parts(old)
            parts = []
            for i, (width, dtype) in enumerate(self._widths(dim)):
                zeros = mx.zeros((self.kv_heads, extra, width), dtype)
                new = zeros if olds is None else mx.concatenate([olds[i], zeros], axis=1)
                mx.eval(new)
                parts.append(new)
            setattr(self, name, self._stored(parts))
            del old, olds
        self.blocks = want

    def write(self, slots: mx.array | tuple[int, int], keys: mx.array,
              values: mx.array) -> None:
        """Scatter ``keys``/``values`` (batch, heads, tokens, dim) into ``slots``: an index
        array, or ``(lo, hi)`` for consecutive slots (measured on MLX's CUDA backend: a
        slice update of one decode token is ~2x cheaper a step than the scatter)."""
        k, v = self._fenced(rows_of(keys).astype(self.dtype), rows_of(values).astype(self.dtype))
        if self.inplace is not None:  # the checked CUDA kernel (engine/pool_cuda.py)
            at = _slots(slots)
            self.token = self.inplace(self.values, v, at, self.inplace(self.keys, k, at,
                                                                        self.token))
            self.keys, self.values = mx.depends([self.keys, self.values], [self.token])
            return
        if isinstance(slots, tuple):  # a run of consecutive slots: a slice update, in place
            lo, hi = slots
            self.keys[:, lo:hi] = k
            self.values[:, lo:hi] = v
            return
        self.keys[:, slots] = k
        self.values[:, slots] = v

    def write_all(self, parts: list[tuple[mx.array | tuple[int, int], mx.array, mx.array]]
                  ) -> None:
        """One scatter of several groups' ``(slots, keys, values)`` (:meth:`write`'s
        arguments): a step's groups write a layer once, before any of them reads it. On
        MLX's CUDA backend a write encoded while an earlier read of the same pool is still
        in flight cannot update the buffer in place and copies the layer's whole array
        (measured on an H200: 4.5-6.3 GiB above the pool for 4-5 chunks at a 16.6k prefix)."""
        slots = mx.concatenate([_slots(s).astype(mx.int32) for s, _, _ in parts])
        self.write(slots, mx.concatenate([rows_of(k) for _, k, _ in parts], axis=1)[None],
                   mx.concatenate([rows_of(v) for _, _, v in parts], axis=1)[None])

    def arrays(self) -> list[mx.array]:
        """Every pool array (K then V), as they are now."""
        return [] if self.keys is None else [self.keys, self.values]

    def tied(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``keys``/``values`` (just written) made to depend on the pool after the write.
        A forward that attends to its own fresh K/V (a chunk at position 0, a window chunk)
        reads nothing back, so MLX would run every layer's write at the end of the graph and
        hold every layer's K/V until then (measured on the CPU: untied, a 512-token chunk's
        peak grows by one layer's K/V per layer); tied, each write runs before the next
        layer."""
        keys, values = mx.depends([keys, values], self.arrays())
        return keys, values

    def fence(self, after: list[mx.array]) -> None:
        """The next write into this pool waits for ``after`` (what the reads of the pool as
        it is now produce). MLX updates a buffer in place only when nothing else still holds
        it; with several writes of one pool in one graph (a step's groups, a ring read before
        its chunk's write) this makes the order certain: every read of a version runs before
        the write that replaces it, so that write donates the buffer (no pool copy). The
        dependency goes on the written values, not on the pool: a pool passed through
        ``mx.depends`` is a sibling output, which MLX never donates (measured: that copies
        one layer's array in a mixed step)."""
        self._after = list(after)

    def _fenced(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        after, self._after = self._after, None
        if after:
            keys, values = mx.depends([keys, values], after)
        return keys, values

    def gather(self, read: Read) -> tuple[mx.array, mx.array]:
        """K and V of the positions ``read`` names, as (rows, heads, length, dim).

        Whole blocks are gathered (a block is one contiguous run of ``B × dim`` per
        head, so the copy moves long runs), then cut to ``read.length``.
        """
        if read.span is not None:
            lo, hi = read.span
            if self.inplace is None:
                return self.keys[None, :, lo:hi], self.values[None, :, lo:hi]
            # a slice could not wait for an in-place write: the run's blocks, gathered
            read = Read(index=_run(lo // self.block_tokens, -(-(hi - lo) // self.block_tokens)),
                        length=hi - lo)
        if self.fast_gather is not None:  # the checked CUDA kernel (engine/pool_cuda.py)
            bt, after = self.block_tokens, self.token
            return (self.fast_gather(self.keys, read.index, read.length, bt, after),
                    self.fast_gather(self.values, read.index, read.length, bt, after))
        rows, nb = read.index.shape
        h, b = self.kv_heads, self.block_tokens
        out = []
        for pool, dim in ((self.keys, self.k_dim), (self.values, self.v_dim)):
            blocks = pool.reshape(h, self.blocks, b * dim)[:, read.index]
            out.append(blocks.reshape(h, rows, nb * b, dim).transpose(1, 0, 2, 3)
                       [:, :, :read.length])
        return out[0], out[1]


class RecurrentState:
    """A layer whose cache is per-sequence state arrays (mlx-lm ``ArraysCache``).

    It has no blocks: ``slots`` is the cache's own entry count (read from
    ``make_prompt_cache``, not assumed), ``bytes_per_seq`` what one sequence's
    entries hold (measured at load).
    """

    kind = "state"
    table_kind = "state"
    plain_kv = False
    block_bytes = 0
    nbytes = 0

    def __init__(self, slots: int, bytes_per_seq: int):
        self.slots = slots
        self.bytes_per_seq = bytes_per_seq


class Read:
    """Which positions one forward's attention reads: a slice of the pool (``span``), or
    ``index`` (rows, blocks) of block ids cut to ``length`` positions."""

    __slots__ = ("index", "length", "span")

    def __init__(self, index: mx.array | None = None, length: int = 0,
                 span: tuple[int, int] | None = None):
        self.index, self.length, self.span = index, length, span


def slots_of(table: tuple[int, ...], start: int, stop: int, block_tokens: int) -> np.ndarray:
    """Pool slots of positions ``start .. stop - 1`` of ``table`` (int32)."""
    pos = np.arange(start, stop, dtype=np.int64)
    blocks = np.asarray(table, dtype=np.int64)[pos // block_tokens]
    return (blocks * block_tokens + pos % block_tokens).astype(np.int32)


def rows_of(a: mx.array) -> mx.array:
    """(batch, heads, tokens, dim) as the (heads, batch × tokens, dim) rows a write stores
    (one batch row: a view, where ``a[0]`` would be a gather and a copy each layer)."""
    b, h, n, d = a.shape
    return a.squeeze(0) if b == 1 else a.transpose(1, 0, 2, 3).reshape(h, b * n, d)


@functools.lru_cache(maxsize=256)
def _run(first: int, blocks: int) -> mx.array:
    """The index (1, blocks) of the consecutive blocks from ``first``."""
    return mx.arange(first, first + blocks, dtype=mx.int32)[None]


def _slots(slots: mx.array | tuple[int, int]) -> mx.array:
    """A write's slots as an index array (``(lo, hi)``: the consecutive run)."""
    return _consecutive(*slots) if isinstance(slots, tuple) else slots


@functools.lru_cache(maxsize=64)
def _consecutive(lo: int, hi: int) -> mx.array:
    """The slots ``lo .. hi - 1``: one array for every layer's write of a step (a step's
    layers write the same slots), not one each."""
    return mx.arange(lo, hi, dtype=mx.int32)


def write_of(slots: np.ndarray) -> mx.array | tuple[int, int]:
    """What :meth:`FullAttention.write` takes for ``slots``: ``(lo, hi)`` when they are
    consecutive (one decode row, a chunk inside consecutive blocks), else an index."""
    lo = int(slots[0])
    if (slots == lo + np.arange(slots.size)).all():
        return lo, lo + int(slots.size)
    return mx.array(slots)


def read_of(tables: list[tuple[int, ...]], lengths: list[int], block_tokens: int) -> Read:
    """The read of positions ``0 .. length - 1`` of every table, padded to the longest.

    One table whose blocks are consecutive ids is a slice (no gather copy at all);
    otherwise the block ids of every row, padded with the row's first block (the
    caller masks positions past a row's length).
    """
    longest = max(lengths)
    nb = math.ceil(longest / block_tokens)
    if len(tables) == 1:
        t = np.asarray(tables[0][:nb], dtype=np.int64)
        if (t == t[0] + np.arange(nb)).all():
            lo = int(t[0]) * block_tokens
            return Read(span=(lo, lo + longest))
    index = np.empty((len(tables), nb), dtype=np.int32)
    for row, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        n = math.ceil(length / block_tokens)
        index[row, :n] = table[:n]
        index[row, n:] = table[0]
    return Read(index=mx.array(index), length=longest)
