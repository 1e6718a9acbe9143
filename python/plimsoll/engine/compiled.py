"""A decode step's forward compiled per shape bucket (``mx.compile``; imports mlx).

Eager, a decode step is built in Python layer by layer (mlx-lm's modules, the paged views,
every op made again) each step. Compiled, the forward is traced once per *bucket* and then
replayed from MLX's tape: the step's host work is the per-step inputs and one call. MLX's
analogue of capturing a CUDA graph per batch size.

**What is compiled** (:func:`eligible`): a step of decode rows only, on an engine whose every
cache layer is a plain full-attention pool (:class:`~plimsoll.engine.paged.FullAttention`:
no recurrent state, window rings, latents, quantized pools or ``CacheList``), every row
sampling. Anything else takes the eager path (:mod:`plimsoll.engine.forward`); so does every
step of a model whose forward fails while it is traced (it reads a value on the host, say:
:attr:`CompiledDecode.refused` says how).

**The function**: ``(tokens, lengths, write slots, read index, *pools) → (logits, *pools)``.
The pools go in and the written pools come out: a compiled function is pure, so the
in-place writes of the eager step are scatters of its inputs. The caller holds no pool
array while the step is queued (the kinds are handed the outputs), and the step is built
while the step before runs but submitted only once that one is done: MLX decides at
dispatch whether a write may reuse its input's buffer, and a read of the step before still
queued holds it (measured on the CPU, pipelined: the last layer's K or V array copied every
step). So each scatter donates its input buffer: no pool copy, as eager. The model's weights are
captured inputs (``inputs=model.state``): replaced weights are read, not the traced ones.

**Buckets** (:func:`width`): the exact row count (padding rows would change the other
rows' matmuls, so outputs would not stay equal) and the tables' width rounded up to
:data:`BUCKET_BLOCKS` blocks (each row reads whole blocks to that width, its padding masked;
admission counts the decode's transient at that width), plus the pools' size (a pool grows
in slabs). A bucket is traced on its second step (its first runs eagerly: rows change at
every step while streams come and go, and a shape met once is not worth a trace). At most
:data:`MAX_BUCKETS` are kept, the least recently used dropped (MLX frees a dropped function's
tape). A traced bucket holds its tape (the graph's nodes, no arrays of its own: the weights
and pools are the engine's).

**Off by default** (``plimsoll worker --compile-decode``, ``Engine(compile_decode=True)`` turns
it on): on the shared 2-core CPU box it cut the host time of a step 1.2-1.8x, but the
qwen3-0.6b-shaped float32 model's whole step took 30-50 % longer at 8 and 32 rows
(bench/results/host-time-cpu-2026-12-02.md); no GPU has run it yet.

**Equal outputs**: every row reads its blocks to the bucket's width with its length's mask,
as eager does for rows of different lengths; a single row is a one-row index rather than a
slice. The decode tests compare compiled and eager greedy tokens.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from plimsoll.core.transients import DECODE_BUCKET_BLOCKS
from plimsoll.engine import forward
from plimsoll.engine.attention import Batch, PagedView
from plimsoll.engine.paged import Read
from plimsoll.engine.sampling import sample
from plimsoll.engine.work import Step, Work

BUCKET_BLOCKS = DECODE_BUCKET_BLOCKS  # a bucket's table width is a multiple of these blocks
MAX_BUCKETS = 24  # traced buckets kept (least recently used dropped)


def width(longest: int, block_tokens: int) -> int:
    """The table width (blocks) of a bucket whose longest row reads ``longest`` positions:
    its blocks rounded up to :data:`BUCKET_BLOCKS`. Pure."""
    blocks = -(-longest // block_tokens)
    return -(-blocks // BUCKET_BLOCKS) * BUCKET_BLOCKS


def eligible(kinds: list) -> bool:
    """Whether an engine of these cache kinds (one per layer) compiles its decode steps."""
    return bool(kinds) and all(k.plain_kv for k in kinds)


class Untraceable(Exception):
    """The model's forward failed while it was traced (the message says how)."""


class CompiledDecode:
    """The engine's compiled decode forwards, one per bucket (see the module docstring)."""

    def __init__(self, eng, max_buckets: int = MAX_BUCKETS):
        self._eng, self.max_buckets = eng, max_buckets
        self._fns: OrderedDict[tuple, object] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # buckets met once, not traced
        self.traced = 0  # buckets traced so far (a bucket dropped and met again counts again)
        self.refused = ""  # why the model's forward cannot be traced (then: eager steps)

    @property
    def buckets(self) -> list[tuple]:
        """The buckets held, least recently used first."""
        return list(self._fns)

    def takes(self, works: tuple[Work, ...]) -> bool:
        """Whether these decode rows run compiled: every one samples, and the model traced."""
        return not self.refused and all(w.sample for w in works)

    def logits(self, works: tuple[Work, ...], tokens: mx.array) -> mx.array | None:
        """The decode rows' logits (rows, vocab), lazy; the pools are handed the written
        arrays. ``tokens`` (rows,) are the rows' inputs. None: the bucket is met for the first
        time (the step runs eagerly)."""
        eng = self._eng
        bt, pools = eng.block_tokens, eng._pools
        starts = [w.start for w in works]
        lengths = [s + 1 for s in starts]
        wide = width(max(lengths), bt)
        read, top = eng._reads.read(tuple(w.seq_id for w in works),
                                    [w.block_table for w in works], lengths, width=wide)
        for p in pools:
            p.ensure(top)
        key = (len(works), wide, pools[0].blocks)
        if key not in self._fns and not self._again(key):
            return None
        write = np.array([w.block_table[s // bt] * bt + s % bt
                          for w, s in zip(works, starts, strict=True)], dtype=np.int32)
        # a trace puts tracers in the model's arrays and does not put them back if it fails
        weights = tree_flatten(eng.model.state) if key not in self._fns else None
        fn = self._fn(key)
        arrays = [a for p in pools for a in (p.keys, p.values)]
        for p in pools:  # the step holds the only references: each write donates its buffer
            p.keys = p.values = None
        try:
            out = fn(tokens, mx.array(lengths, dtype=mx.int32), mx.array(write), read.index,
                     *arrays)
        except Exception as err:
            for j, p in enumerate(pools):
                p.keys, p.values = arrays[2 * j], arrays[2 * j + 1]
            if weights is None:
                raise
            eng.model.update(tree_unflatten(weights))
            self.refused = f"{type(err).__name__}: {err}"  # the model does not trace
            self._fns.clear()
            raise Untraceable(self.refused) from err
        del arrays
        for j, p in enumerate(pools):
            p.keys, p.values = out[1 + 2 * j], out[2 + 2 * j]
        return out[0]

    def _again(self, key: tuple) -> bool:
        """Whether ``key`` was met before (it is traced on its second step: a shape met once,
        rows changing while streams come and go, is not worth a trace); notes it."""
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        while len(self._seen) > 4 * self.max_buckets:
            self._seen.popitem(last=False)
        return False

    def _fn(self, key: tuple):
        fn = self._fns.get(key)
        if fn is not None:
            self._fns.move_to_end(key)
            return fn
        while len(self._fns) >= self.max_buckets:
            self._fns.popitem(last=False)
        fn = mx.compile(_forward(self._eng, key[0], key[1]), inputs=self._eng.model.state)
        self._fns[key] = fn
        self.traced += 1
        return fn

    def clear(self) -> None:
        """Drop every traced bucket."""
        self._fns.clear()


def _forward(eng, rows: int, width: int):
    """The traced function of one bucket: the model over the pools passed in."""
    pools, bt = eng._pools, eng.block_tokens
    span = width * bt

    def forward(tokens, lengths, write, index, *arrays):  # traced once per bucket
        held = [(p.keys, p.values) for p in pools]
        for j, p in enumerate(pools):
            p.keys, p.values = arrays[2 * j], arrays[2 * j + 1]
        try:
            mask = (mx.arange(span, dtype=mx.int32)[None, :] < lengths[:, None])
            batch = Batch(write, Read(index=index, length=span), mask[:, None, None, :],
                          lengths - 1, lengths=lengths, kernel=eng.kernels.decode)
            logits = eng.model(tokens[:, None], cache=[PagedView(p, batch) for p in pools])
            if batch.attended != len(pools):
                raise RuntimeError(f"{type(eng.model).__module__}: attention does not go "
                                   "through mlx_lm.models.base.scaled_dot_product_attention")
            return [logits.reshape(rows, -1), *[a for p in pools for a in (p.keys, p.values)]]
        finally:
            for p, (k, v) in zip(pools, held, strict=True):
                p.keys, p.values = k, v

    return forward


def run(compiled: CompiledDecode, works: tuple[Work, ...]):
    """A decode-only step through ``compiled``, queued as :func:`forward.run` queues one:
    the sampled works and their tokens (lazy), nothing verified."""
    eng = compiled._eng
    try:
        logits = compiled.logits(works, forward.decode_inputs(eng, works))
    except Untraceable:  # this step and every later one are built eagerly
        logits = None
    if logits is None:
        return forward.run(eng, forward.groups_of(eng, Step(decodes=works)))
    tokens = sample(logits, works, eng._keys)
    for row, w in enumerate(works):
        eng._last[w.seq_id] = (tokens, row)
    # Built (the host work overlapped the step before); submitted only once that step is
    # done: a write is dispatched with a check whether its pool's buffer is held, and a read
    # of the step before still queued holds it, so the write would copy the whole pool.
    mx.synchronize(eng._stream)
    mx.async_eval([a for p in eng._pools for a in (p.keys, p.values)] + [tokens])
    return works, tokens, ()
