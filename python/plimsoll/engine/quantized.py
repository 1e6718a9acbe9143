"""Quantized KV pools, 8 and 4 bit, in blocks (mlx-lm ``QuantizedKVCache``'s format; imports mlx).

:class:`QuantizedAttention` is the paged kind of a full-attention layer whose K and V are
stored as ``mx.quantize`` stores them: per pool (K, V) a packed-values array (uint32,
``dim × bits / 32`` words a vector), a scales array and a biases array (``dim / group``
each, in the model's float dtype), all three shaped ``(kv_heads, blocks × block_tokens,
width)`` — the slot axis of :class:`~plimsoll.engine.paged.FullAttention`, so block ``b``
is slots ``[b × B, (b + 1) × B)`` of every array and the scheduler, the tables, the
reads and the growth are the same. Group size 64 (mlx-lm's ``kv_group_size`` default).

- **Writes** quantize only the forward's new K/V (``mx.quantize`` along the head dim,
  group by group, so a vector's quantization never depends on its neighbours) and put the
  three parts into their slots — a slice for consecutive slots, else a scatter.
- **Reads**: :meth:`QuantizedAttention.attend_read` gathers the table's blocks of the three
  arrays (still quantized) once for all rows, then by measurement
  (``bench/engine.py attention``, ``bench/results/engine-attention-cpu-2026-12-01.json``,
  one layer of the qwen3-0.6b shape on the CPU box):

  - **decode** (one query a row): mlx-lm's ``quantized_scaled_dot_product_attention`` (two
    ``mx.quantized_matmul`` s and a softmax, the padding mask) — 1.6-11 × faster than
    dequantizing then the fused op, its transient stays quantized, and it is mlx-lm's own
    arithmetic, so greedy output equals mlx-lm's with its ``QuantizedKVCache``;
  - **prefill chunks** past position 0 (many queries): ``mx.dequantize`` the gathered
    context into the model's dtype, then ``mx.fast.scaled_dot_product_attention``
    (``"causal"``) — 5 × faster than the quantized matmuls at 128-512 queries; the float
    copy of the context is counted in the prefill transient
    (:func:`plimsoll.core.transients.prefill_transient_bytes`).
- A prefill chunk at position 0 attends to its own fresh (float) K/V, as mlx-lm's first
  prefill chunk does before ``maybe_quantize_kv_cache`` converts its cache.
- On CUDA, decode rows read through the paged-decode kernel's quantized variant
  (:func:`plimsoll.engine.paged_cuda.paged_decode_quantized`, :attr:`decode_kernel`: each
  K/V row dequantized in registers as it is read, no gathered copy) where it passed its
  check against :meth:`attend_over` (:func:`plimsoll.engine.kernels.check_quantized`); else,
  and on every other backend, the paths above.

``block_bytes`` / ``nbytes`` are exact: values + scales + biases, K and V, the same
figure as :func:`plimsoll.core.cache_layout.vector_bytes` (the test compares them with
the arrays' ``nbytes``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from plimsoll.engine import backend
from plimsoll.engine.paged import FullAttention, Read, rows_of

GROUP_SIZE = 64
"""mlx-lm's ``QuantizedKVCache`` / ``generate_step(kv_group_size=...)`` default."""
BITS = (8, 4)

QTriple = tuple[mx.array, mx.array, mx.array]  # packed values, scales, biases


class QuantizedAttention(FullAttention):
    """The paged, quantized K/V pools of one full-attention layer (see the module docstring).

    ``keys`` / ``values`` are :data:`QTriple` s (None until the first growth); ``dtype`` is
    the float dtype of the scales and biases (the model's activations).
    """

    kind = "full-quantized"
    plain_kv = False  # packed values, scales and biases: read by its own attend_read

    def __init__(self, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
                 block_tokens: int, max_blocks: int, slab_blocks: int, *, bits: int,
                 group_size: int = GROUP_SIZE):
        if bits not in BITS:
            raise ValueError(f"quantized KV bits must be one of {BITS}, got {bits}")
        for dim in (k_dim, v_dim):
            if dim % group_size:
                raise ValueError(f"quantized KV needs head dims in groups of {group_size}; "
                                 f"this model's are {k_dim} (K) and {v_dim} (V): use a float "
                                 "KV dtype")
        super().__init__(kv_heads, k_dim, v_dim, dtype, block_tokens, max_blocks, slab_blocks)
        self.bits, self.group_size = bits, group_size
        #: the CUDA decode kernel over quantized blocks (engine/paged_cuda.py) where it
        #: passed its check on this device (engine/kernels.py), else None
        self.decode_kernel = None
        self.keys: QTriple | None = None
        self.values: QTriple | None = None

    # ------------------------------------------------------------------ figures

    def _widths(self, dim: int) -> tuple[tuple[int, mx.Dtype], ...]:
        """(last-axis width, dtype) of the packed values, scales and biases of one vector."""
        groups = dim // self.group_size
        return ((dim * self.bits // 32, mx.uint32), (groups, self.dtype), (groups, self.dtype))

    def vector_bytes(self, dim: int) -> int:
        return sum(w * dt.size for w, dt in self._widths(dim))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this layer: K and V, values + scales + biases."""
        return self.block_tokens * self.kv_heads * (self.vector_bytes(self.k_dim)
                                                    + self.vector_bytes(self.v_dim))

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def arrays(self) -> list[mx.array]:
        """Every pool array (for evaluation and the block payloads), K's three then V's."""
        return [] if self.keys is None else [*self.keys, *self.values]

    # ------------------------------------------------------------------ growth
    # (FullAttention.ensure, over these three arrays a vector)

    def _parts(self, stored) -> tuple:
        return stored

    def _stored(self, parts: list[mx.array]):
        return tuple(parts)

    # ------------------------------------------------------------------ writes and reads

    def write(self, slots: mx.array | tuple[int, int], keys: mx.array,
              values: mx.array) -> None:
        """Quantize ``keys``/``values`` (batch, heads, tokens, dim) and put them in ``slots``
        (an index array, or ``(lo, hi)`` for consecutive slots)."""
        k, v = self._fenced(rows_of(keys), rows_of(values))
        for pool, x in ((self.keys, k), (self.values, v)):
            parts = mx.quantize(x.astype(self.dtype), group_size=self.group_size,
                                bits=self.bits)
            for arr, part in zip(pool, parts, strict=True):
                if isinstance(slots, tuple):
                    arr[:, slots[0]:slots[1]] = part
                else:
                    arr[:, slots] = part

    def gather(self, read: Read) -> tuple[QTriple, QTriple]:
        """K and V triples of the positions ``read`` names, as (rows, heads, length, width):
        whole blocks gathered (still quantized), then cut to ``read.length``."""
        if read.span is not None:
            lo, hi = read.span
            return (tuple(a[None, :, lo:hi] for a in self.keys),
                    tuple(a[None, :, lo:hi] for a in self.values))
        rows, nb = read.index.shape
        h, bt = self.kv_heads, self.block_tokens
        out = []
        for pool in (self.keys, self.values):
            parts = []
            for a in pool:
                w = a.shape[-1]
                blocks = a.reshape(h, self.blocks, bt * w)[:, read.index]
                parts.append(blocks.reshape(h, rows, nb * bt, w).transpose(1, 0, 2, 3)
                             [:, :, :read.length])
            out.append(tuple(parts))
        return out[0], out[1]

    def attend_read(self, queries: mx.array, scale: float, sinks: mx.array | None, batch,
                    fresh: tuple[mx.array, mx.array] | None) -> mx.array:
        """Attention of ``queries`` over this forward's read (see the module docstring). A
        chunk that samples (``batch.tail``) attends its last token to the quantized blocks
        of the whole chunk, as mlx-lm's own step for a prompt's last token does."""
        n, read = queries.shape[2], batch.read
        if (self.decode_kernel is not None and n == 1 and sinks is None and read is not None
                and read.index is not None and batch.lengths is not None):  # decode rows
            return self.decode_kernel(queries, self.keys, self.values, read.index,
                                      batch.lengths, read.length, scale, self.block_tokens)
        if batch.tail is None or n == 1:
            return self.attend_over(queries, scale, sinks, batch.read, batch.mask, fresh)
        body = self.attend_over(queries[:, :, :-1], scale, sinks, batch.read, "causal",
                            fresh, cut=1)
        last = self.attend_over(queries[:, :, -1:], scale, sinks, batch.tail, None, None)
        return mx.concatenate([body, last], axis=2)

    def attend_over(self, queries: mx.array, scale: float, sinks, read: Read | None, mask,
                fresh, cut: int = 0) -> mx.array:
        """``queries`` over ``read`` (None: the chunk's own ``fresh`` K/V), its last ``cut``
        positions left out (a chunk's body without its sampled token)."""
        if read is None:  # a chunk at position 0: its own fresh K/V, unquantized
            keys, values = fresh
            if cut:
                keys, values = keys[:, :, :-cut], values[:, :, :-cut]
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                        mask=mask, sinks=sinks)
        if sinks is not None:
            raise NotImplementedError("quantized KV with attention sinks is not served "
                                      "(mlx-lm's quantized attention has no sinks either); "
                                      "use a float KV dtype for this model")
        keys, values = self.gather(read)
        if cut:
            keys = tuple(a[:, :, :-cut] for a in keys)
            values = tuple(a[:, :, :-cut] for a in values)
        if queries.shape[2] == 1 and backend.name() != "cuda":  # decode: quantized matmuls
            return quantized_scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask,
                group_size=self.group_size, bits=self.bits)
        # a prefill chunk past position 0 (and, on CUDA, every read: MLX's CUDA
        # quantized_matmul has no kernel for the attention shapes a decode makes, measured on
        # the H200: "No implementation for problem shape 1x195x128x32" at 8 and 4 bits; the
        # decode transient counts that float copy, engine/work.py): dequantize the gathered
        # context, then the fused op
        g, b = self.group_size, self.bits
        keys = mx.dequantize(*keys, group_size=g, bits=b).astype(queries.dtype)
        values = mx.dequantize(*values, group_size=g, bits=b).astype(queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)

