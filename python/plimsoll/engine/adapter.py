"""The engine adapter: the one module of the worker that imports mlx and mlx_lm.

It runs an mlx-lm model over sequences whose KV arrays map onto blocks the caller
has reserved, so the physical bound of the pool (DESIGN.md, issue 3) holds by
construction rather than by bookkeeping:

- **Sized at admission, written in place.** Each sequence gets, per attention layer,
  a :class:`SlotKV` whose K and V arrays hold exactly ``capacity`` tokens, where
  ``capacity = ceil((prompt + max_tokens) / block_tokens) × block_tokens`` — the
  caller's reservation. Tokens are written into it in place; nothing ever grows,
  so mlx-lm's step-of-256 concatenation (a transient double copy) never happens.
  Writing past the capacity raises :class:`CapacityError` instead of growing.
- **No batch padding.** A decode step runs B sequences together: embeddings,
  projections, MLP and sampling see a (B, 1) batch, but attention runs per
  sequence over that sequence's own keys (views of its slot, no copy). This is
  done by routing mlx-lm's ``scaled_dot_product_attention`` through
  :func:`_sdpa`, which delegates to the original for every cache but a
  :class:`_BatchSlots` (patched once, at :meth:`Engine.load`). Rejected by
  measurement (bench/engine_spike.py): pad-and-stack per layer per step (a
  transient copy of B × longest sequence per layer, not within any reservation)
  and mlx-lm's BatchKVCache (left padding plus 256-token growth by concatenation).
- **One copy of a growing conversation.** :meth:`Engine.finish` with
  ``retain=True`` keeps the used tokens as a :class:`Prefix` compacted to whole
  blocks; :meth:`Engine.add` with that prefix moves it into the new sequence's
  slots and releases it, then prefills only the tokens past it.
- **kv_bytes_held is physical.** :meth:`Engine.kv_bytes_held` sums ``nbytes`` of
  every K/V array of every live sequence and retained prefix; it never reads the
  caller's accounting. :meth:`Engine.kv_bytes_peak` is the same sum sampled after
  every allocation the engine makes (the moments a transient could exceed it).

Precondition of moves (the only transient above the reservations): compacting a
finished sequence, and moving a prefix into a new sequence, copy one array at a
time (one layer's K, then its V) and free the source at once, so at most one
array of the moved prefix is held twice: ``1 / (2 × kv_layers)`` of it rounded up
to blocks, :meth:`Engine.move_headroom_blocks` (1 block for short prefixes, 8 for a
6.7k-token prefix of Qwen3-0.6B). The caller keeps that many blocks free across
``finish(retain=True)`` and ``add(prefix=...)``.

Decode is pipelined like mlx-lm's ``generate_step``: :meth:`Engine.step` queues the
next step (``mx.async_eval``) before it waits for this one. The queued step writes
into the slots already reserved and allocates no KV; :meth:`Engine.finish` waits
for it, so a finished sequence may retain one more token than it returned.

Hybrid models (qwen3_next: gated-delta layers with an ``ArraysCache``) work: the
fixed per-sequence state is held per sequence, stacked for a decode step (a
transient copy of ``B × per_sequence_fixed_bytes``) and reported by
:meth:`Engine.fixed_bytes_held`. A prefix of a hybrid model is reusable only by
a prompt that extends all of its tokens (the recurrent state cannot be cut).
Models with sliding-window or other cache kinds are refused at load.

Everything here is effect; the decisions (which prefix, who is admitted, when a
sequence stops) belong to the caller.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import base as _mlx_base
from mlx_lm.models.cache import ArraysCache, KVCache, create_attention_mask
from mlx_lm.sample_utils import apply_top_p

from plimsoll.core.model_facts import ModelFacts, inspect_model
from plimsoll.engine import plan
from plimsoll.engine.plan import AddResult, CapacityError, Prefix

_ORIGINAL_SDPA = _mlx_base.scaled_dot_product_attention


class SlotKV:
    """One sequence's K/V for one attention layer, sized once to the caller's reservation.

    Implements mlx-lm's cache protocol (``update_and_fetch``, ``offset``,
    ``make_mask``, ``state``, ``nbytes``). The arrays are created on the first write
    (that is when the head count, head size and dtype are known: during the
    admission prefill) at the full capacity and only ever written in place.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _alloc(self, keys: mx.array, values: mx.array) -> None:
        b, h, _, dk = keys.shape
        self.keys = mx.zeros((b, h, self.capacity, dk), keys.dtype)
        self.values = mx.zeros((b, h, self.capacity, values.shape[3]), values.dtype)

    def write(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.offset + n > self.capacity:
            raise CapacityError(f"writing {n} tokens at {self.offset} passes the reserved "
                                f"capacity of {self.capacity} tokens")
        if self.keys is None:
            self._alloc(keys, values)
        self.keys[..., self.offset:self.offset + n, :] = keys
        self.values[..., self.offset:self.offset + n, :] = values
        self.offset += n

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Views of the used part (no copy)."""
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.write(keys, values)
        return self.fetch()

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(n, self.offset, return_array, window_size)

    @property
    def state(self):
        return self.keys, self.values, self.offset

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class _BatchSlots:
    """The cache one attention layer sees in a batched decode step (one token per sequence).

    ``update_and_fetch`` writes each sequence's new K/V into its own slot;
    attention then runs per sequence in :meth:`attend` (called by :func:`_sdpa`),
    so no padded or stacked copy of the keys exists.
    """

    def __init__(self, slots: list[SlotKV]):
        self.slots = slots
        self.offset = mx.array([s.offset for s in slots])
        self.attended = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        for i, slot in enumerate(self.slots):
            slot.write(keys[i:i + 1], values[i:i + 1])
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        self.attended += 1
        outs = [mx.fast.scaled_dot_product_attention(queries[i:i + 1], *slot.fetch(),
                                                     scale=scale, mask=None, sinks=sinks)
                for i, slot in enumerate(self.slots)]
        return mx.concatenate(outs, axis=0)


def _sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, with per-sequence attention for a decode batch."""
    if isinstance(cache, _BatchSlots):
        return cache.attend(queries, scale, sinks)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask,
                          sinks=sinks)


def _route_attention() -> None:
    """Point every loaded mlx-lm model module at :func:`_sdpa` (idempotent, delegating)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(
                module, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA:
            module.scaled_dot_product_attention = _sdpa


@dataclass
class _Seq:
    seq_id: object
    caches: list
    capacity: int
    tokens: list[int]  # tokens whose KV is written
    pending: int  # last sampled token, KV not written yet
    temperature: float
    top_p: float
    key: mx.array | None
    generated: int = 1
    ahead: bool = False  # the KV of ``pending`` is in a step queued by the last step()
    constraint: object | None = None  # a TokenConstraint (engine/work.py): masks each sample


def _constrained(seqs: list[_Seq], logits: mx.array) -> mx.array:
    """``logits`` with the tokens each row's constraint forbids at -inf (rows without one,
    or whose constraint allows anything, untouched). The mask is padded with False or cut to
    the logits' width (a model's vocabulary may be wider than its tokenizer's)."""
    masks = [None if s.constraint is None else s.constraint.allowed() for s in seqs]
    if all(m is None for m in masks):
        return logits
    width = logits.shape[-1]
    rows = np.ones((len(seqs), width), dtype=bool)
    for i, m in enumerate(masks):
        if m is not None:
            rows[i] = False
            rows[i, :min(width, len(m))] = m[:width]
    return mx.where(mx.array(rows), logits, mx.array(-mx.inf, logits.dtype))


def _advance(seqs: list[_Seq], tokens: list[int]) -> None:
    """Tell each constrained sequence the token it sampled."""
    for s, t in zip(seqs, tokens, strict=True):
        if s.constraint is not None:
            s.constraint.advance(t)


def _slots(caches: list) -> list[SlotKV]:
    return [c for c in caches if isinstance(c, SlotKV)]


class Engine:
    """An mlx-lm model plus the KV of its live sequences and retained prefixes.

    Not thread-safe: one owner (the scheduler) calls it from one thread.
    """

    def __init__(self, model, tokenizer, facts: ModelFacts, block_tokens: int,
                 prefill_step: int = 512, pipeline: bool = True):
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.model = model
        self.tokenizer = tokenizer
        self.facts = facts
        self.block_tokens = block_tokens
        self.prefill_step = prefill_step
        self.pipeline = pipeline
        self._ahead: tuple[list[_Seq], mx.array] | None = None
        self._kinds = self._cache_kinds(model)
        self._seqs: dict[object, _Seq] = {}
        self._prefixes: dict[int, Prefix] = {}
        self._next_handle = 0
        self._peak = 0
        # Compute on a stream of our own, as mlx-lm's generate does: on the CPU backend
        # the default stream measured ~5-10% slower for single-stream decode.
        self._stream = mx.new_stream(mx.default_device())
        _route_attention()

    @classmethod
    def load(cls, model_dir: str | Path, block_tokens: int = 16, prefill_step: int = 512,
             pipeline: bool = True) -> Engine:
        """Load ``model_dir`` with mlx-lm; refuse cache kinds the bound cannot cover."""
        model, tokenizer = mlx_lm.load(str(model_dir))
        return cls(model, tokenizer, inspect_model(model_dir), block_tokens, prefill_step,
                   pipeline)

    @staticmethod
    def _cache_kinds(model) -> list[str]:
        kinds = []
        for c in mlx_lm.models.cache.make_prompt_cache(model):
            if type(c) is KVCache:
                kinds.append("kv")
            elif type(c) is ArraysCache:
                kinds.append("state")
            else:
                raise NotImplementedError(
                    f"{type(model).__module__}: cache kind {type(c).__name__} (sliding window, "
                    "chunked or quantized KV) is not supported by the bounded engine; "
                    "only full-attention KV and linear-attention state are")
        return kinds

    # ------------------------------------------------------------- queries (no change)

    def capacity_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens of KV a sequence holds: its reservation rounded up to whole blocks."""
        return plan.capacity_tokens(prompt_tokens, max_tokens, self.block_tokens)

    def move_headroom_blocks(self, prefix_tokens: int) -> int:
        """Blocks held twice while a prefix of ``prefix_tokens`` is moved (one array of it)."""
        return plan.move_headroom_blocks(prefix_tokens, self.facts.kv_layers, self.block_tokens)

    def reusable_tokens(self, prefix: Prefix | int, prompt: list[int]) -> int:
        """Tokens of ``prompt`` that ``prefix`` covers (0 if unusable); at least one is left."""
        return plan.reusable_tokens(self._prefix(prefix).tokens, prompt, "state" in self._kinds)

    def kv_bytes_held(self) -> int:
        """Bytes of every K/V array held, summed from the arrays (live + retained)."""
        groups = [s.caches for s in self._seqs.values()]
        groups += [p.caches for p in self._prefixes.values()]
        return sum(c.nbytes for caches in groups for c in _slots(caches))

    def fixed_bytes_held(self) -> int:
        """Bytes of linear-attention state held (hybrid models), summed from the arrays."""
        groups = [s.caches for s in self._seqs.values()]
        groups += [p.caches for p in self._prefixes.values()]
        return sum(c.nbytes for caches in groups for c in caches if isinstance(c, ArraysCache))

    def kv_bytes_peak(self) -> int:
        """Highest :meth:`kv_bytes_held` seen after any allocation since the last reset."""
        return max(self._peak, self.kv_bytes_held())

    def reset_peak(self) -> None:
        self._peak = self.kv_bytes_held()

    def memory(self) -> dict[str, int]:
        """MLX's own allocator figures, in bytes."""
        return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(),
                "cache": mx.get_cache_memory()}

    @property
    def running(self) -> list:
        return list(self._seqs)

    @property
    def prefixes(self) -> list[int]:
        return list(self._prefixes)

    def written_tokens(self, seq_id) -> int:
        """Tokens of ``seq_id`` whose KV is written (what a retained prefix would cover)."""
        return len(self._seqs[seq_id].tokens)

    def clear_cache(self) -> None:
        clear_buffer_cache()

    def generated(self, seq_id) -> int:
        """Tokens sampled so far for ``seq_id`` (the first comes from :meth:`add`)."""
        return self._seqs[seq_id].generated

    # ------------------------------------------------------------- effects

    def _note(self) -> None:
        self._peak = max(self._peak, self.kv_bytes_held())

    def _prefix(self, prefix: Prefix | int) -> Prefix:
        handle = prefix.handle if isinstance(prefix, Prefix) else prefix
        if handle not in self._prefixes:
            raise KeyError(f"prefix {handle} is not held (dropped or already used)")
        return self._prefixes[handle]

    def _new_caches(self, capacity: int) -> list:
        return [SlotKV(capacity) if k == "kv" else ArraysCache(size=2) for k in self._kinds]

    def _move(self, src: list, dst: list, tokens: int) -> None:
        """Copy ``tokens`` of every array of ``src`` into ``dst``, freeing each source array
        as soon as its copy exists (so at most one array is held twice)."""
        for s, d in zip(src, dst, strict=True):
            if isinstance(s, ArraysCache):
                d.cache, s.cache = s.cache, [None] * len(s.cache)
                continue
            if s.keys is None:
                continue
            for name in ("keys", "values"):
                old = getattr(s, name)
                if d.capacity == old.shape[2] and tokens == s.offset:
                    new = old  # same size: hand the array over, no copy
                else:
                    shape = (*old.shape[:2], d.capacity, old.shape[3])
                    new = mx.zeros(shape, old.dtype)
                    new[..., :tokens, :] = old[..., :tokens, :]
                    mx.eval(new)
                setattr(d, name, new)
                self._note()
                setattr(s, name, None)
                del old
            d.offset = tokens
            s.offset = 0

    def add(self, seq_id, prompt: list[int], max_tokens: int, prefix: Prefix | int | None = None,
            *, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
            keep_prefix: bool = False, constraint: object | None = None) -> AddResult:
        """Admit ``seq_id``: size its KV to ``prompt + max_tokens``, prefill, sample token 1.

        With ``prefix``, the first :meth:`reusable_tokens` of the prompt are taken
        from it (moved, and the prefix released unless ``keep_prefix``, which
        copies instead) and only the rest is prefilled.
        """
        with mx.stream(self._stream):
            return self._add(seq_id, prompt, max_tokens, prefix, temperature, top_p, seed,
                             keep_prefix, constraint)

    def _add(self, seq_id, prompt, max_tokens, prefix, temperature, top_p, seed,
             keep_prefix, constraint=None) -> AddResult:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if not prompt or max_tokens < 1:
            raise ValueError("a sequence needs a non-empty prompt and max_tokens >= 1")
        capacity = self.capacity_tokens(len(prompt), max_tokens)
        caches = self._new_caches(capacity)
        reused = 0
        if prefix is not None:
            p = self._prefix(prefix)
            reused = self.reusable_tokens(p, prompt)
            if reused:
                if keep_prefix:
                    src = self._clone(p.caches)
                else:
                    src = p.caches
                    del self._prefixes[p.handle]
                self._move(src, caches, reused)
        rest = prompt[reused:]
        key = mx.random.key(seed) if seed is not None else None
        seq = _Seq(seq_id, caches, capacity, list(prompt[:reused]), -1, temperature, top_p, key,
                   constraint=constraint)
        self._seqs[seq_id] = seq
        try:
            for start in range(0, len(rest) - 1, self.prefill_step):
                chunk = rest[start:min(start + self.prefill_step, len(rest) - 1)]
                self.model(mx.array(chunk)[None], cache=caches)
                mx.eval([c.state for c in caches])
                seq.tokens.extend(chunk)
                self._note()
            logits = self.model(mx.array(rest[-1:])[None], cache=caches)[:, -1, :]
            seq.tokens.append(rest[-1])
            token = self._sample([seq], logits)[0]
            _advance([seq], [token])
        except Exception:
            del self._seqs[seq_id]
            raise
        self._note()
        seq.pending = token
        return AddResult(token, reused, len(rest), capacity)

    def _clone(self, caches: list) -> list:
        out = []
        for c in caches:
            if isinstance(c, ArraysCache):
                d = ArraysCache(size=len(c.cache))
                d.cache = [None if a is None else mx.array(a) for a in c.cache]
            else:
                d = SlotKV(c.capacity)
                if c.keys is not None:
                    d.keys, d.values, d.offset = mx.array(c.keys), mx.array(c.values), c.offset
            out.append(d)
        return out

    def _pick(self, seqs: list[_Seq], logits: mx.array) -> mx.array:
        """Sampled tokens, shape (B,), still lazy."""
        logits = _constrained(seqs, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(s.temperature == 0 for s in seqs):
            return mx.argmax(logprobs, axis=-1)
        picks = []
        for i, s in enumerate(seqs):
            row = logprobs[i:i + 1]
            if s.temperature == 0:
                picks.append(mx.argmax(row, axis=-1))
                continue
            if 0 < s.top_p < 1:
                row = apply_top_p(row, s.top_p)
            sub = None
            if s.key is not None:
                s.key, sub = mx.random.split(s.key)
            picks.append(mx.random.categorical(row * (1 / s.temperature), key=sub))
        return mx.concatenate(picks)

    def _sample(self, seqs: list[_Seq], logits: mx.array) -> list[int]:
        return self._pick(seqs, logits).tolist()

    @staticmethod
    def _written(s: _Seq) -> int:
        """Tokens of ``s`` whose KV is written or scheduled."""
        return len(s.tokens) + s.ahead

    def _forward(self, seqs: list[_Seq], inputs: mx.array) -> mx.array:
        """Build (lazily) one decode step: write each input token's KV, sample the next."""
        for s in seqs:
            if self._written(s) >= s.capacity:
                raise CapacityError(f"sequence {s.seq_id!r} has used its {s.capacity} reserved "
                                    "tokens; finish it")
        if len(seqs) == 1:
            return self._pick(seqs, self.model(inputs, cache=seqs[0].caches)[:, -1, :])
        batch = []
        for layer, kind in enumerate(self._kinds):
            if kind == "kv":
                batch.append(_BatchSlots([s.caches[layer] for s in seqs]))
            else:
                stacked = ArraysCache(size=2)
                states = [s.caches[layer].cache for s in seqs]
                stacked.cache = [None if st[0] is None else mx.concatenate(st)
                                 for st in zip(*states, strict=True)]
                batch.append(stacked)
        logits = self.model(inputs, cache=batch)[:, -1, :]
        if any(b.attended != 1 for b in batch if isinstance(b, _BatchSlots)):
            raise RuntimeError(f"{type(self.model).__module__}: attention does not go through "
                               "mlx_lm.models.base.scaled_dot_product_attention; batched "
                               "decode is unsupported for this model")
        for layer, b in enumerate(batch):
            if isinstance(b, ArraysCache):
                for i, s in enumerate(seqs):
                    s.caches[layer].cache = [a[i:i + 1] for a in b.cache]
        return self._pick(seqs, logits)

    def step(self) -> list[tuple[object, int]]:
        """One decode step for every running sequence: ``[(seq_id, token), ...]``.

        Pipelined as mlx-lm's ``generate_step`` is: before waiting for this step's
        tokens, the next step is built from them and queued (``mx.async_eval``), so
        the graph building overlaps the compute. That next step writes the KV of the
        tokens returned here, which is why :meth:`finish` may retain one more token.
        Sequences added since the last call get their own forward in the same call.
        """
        with mx.stream(self._stream):
            return self._step()

    def _step(self) -> list[tuple[object, int]]:
        seqs = list(self._seqs.values())
        if not seqs:
            self._ahead = None
            return []
        ready = [s for s in seqs if s.ahead]
        fresh = [s for s in seqs if not s.ahead]
        parts = []
        if ready:
            queued, tokens = self._ahead
            where = {id(s): i for i, s in enumerate(queued)}
            rows = [where[id(s)] for s in ready]
            parts.append(tokens if rows == list(range(len(queued))) else tokens[mx.array(rows)])
        if fresh:
            parts.append(self._forward(fresh, mx.array([[s.pending] for s in fresh])))
        order = ready + fresh
        tokens = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        self._ahead = None
        speculate = self.pipeline and all(self._written(s) < s.capacity for s in order) \
            and not any(s.constraint is not None for s in order)  # next mask needs the token
        for s in order:
            s.tokens.append(s.pending)
            s.ahead = False
        if speculate:
            nxt = self._forward(order, tokens[:, None])
            mx.async_eval(nxt)
            self._ahead = (order, nxt)
        values = tokens.tolist()
        _advance(order, values)
        for s, t in zip(order, values, strict=True):
            s.pending = t
            s.generated += 1
            s.ahead = speculate
        return [(s.seq_id, t) for s, t in zip(order, values, strict=True)]

    def finish(self, seq_id, retain: bool = False) -> Prefix | None:
        """End ``seq_id``; free its arrays, or keep the tokens whose KV is written as a
        :class:`Prefix` compacted to whole blocks (see the module docstring for the move
        headroom). Those tokens are the prompt and every generated token but the last,
        or all of them when :meth:`step` had already queued the next step."""
        with mx.stream(self._stream):
            seq = self._seqs.pop(seq_id)
            if seq.ahead:
                # let the queued step finish, so its graph lets go of this sequence's arrays
                mx.eval(self._ahead[1])
                seq.tokens.append(seq.pending)
                seq.ahead = False
            if not retain or not seq.tokens:
                seq.caches.clear()
                return None
            used = len(seq.tokens)
            caches = self._new_caches(math.ceil(used / self.block_tokens) * self.block_tokens)
            self._seqs[seq_id] = seq  # still counted while it moves
            try:
                self._move(seq.caches, caches, used)
            finally:
                del self._seqs[seq_id]
            prefix = Prefix(self._next_handle, tuple(seq.tokens), caches)
            self._next_handle += 1
            self._prefixes[prefix.handle] = prefix
            return prefix

    def drop_prefix(self, prefix: Prefix | int) -> None:
        """Release a retained prefix's arrays."""
        p = self._prefix(prefix)
        del self._prefixes[p.handle]
        p.caches.clear()


# --------------------------------------------------------------------------------------
# Process-wide MLX limits: set in one place, always restored (as mlx-lm's wired_limit does).

def active_memory() -> int:
    """MLX's active (allocated, in use) bytes: what the trip compares with."""
    return mx.get_active_memory()


def clear_buffer_cache() -> None:
    """Return MLX's cached (freed but kept) buffers to the OS: part of the trip's clear."""
    mx.clear_cache()


def _metal() -> bool:
    try:
        return mx.metal.is_available()
    except AttributeError:  # builds without the metal module (CPU/CUDA)
        return False


@contextlib.contextmanager
def process_limits(memory_limit: int, cache_limit: int, wired_limit: int):
    """Set MLX's allocation cap, buffer-cache cap and (on Metal) wired limit; restore on exit.

    Yields what MLX reports back after setting them, so the launch wrapper can verify
    the limits took effect. ``mx.set_memory_limit`` is not enforced by the CPU backend
    (an over-allocation dies with SIGSEGV): the pool and admission are the enforcement;
    this cap is a second line where the backend honours it. ``wired_limit`` 0 wires
    nothing (never MLX's recommended maximum, the seed's first root cause).
    ``PLIMSOLL_FAULT_SKIP_MEMORY_LIMIT=1`` skips the memory cap (fault injection for the
    test that the launch wrapper notices a limit that did not take).
    """
    skip = os.environ.get("PLIMSOLL_FAULT_SKIP_MEMORY_LIMIT") == "1"
    prev_memory = None if skip else mx.set_memory_limit(memory_limit)
    prev_cache = mx.set_cache_limit(cache_limit)
    applied_cache = mx.set_cache_limit(cache_limit)  # returns what the first call set
    wired = _metal() and wired_limit > 0
    prev_wired = mx.set_wired_limit(wired_limit) if wired else None
    try:
        yield {
            "memory_limit_applied_bytes": mx.get_memory_limit(),
            "cache_limit_applied_bytes": applied_cache,
            "wired_limit_applied_bytes": wired_limit if wired else 0,
        }
    finally:
        if prev_wired is not None:
            mx.set_wired_limit(prev_wired)
        mx.set_cache_limit(prev_cache)
        if prev_memory is not None:
            mx.set_memory_limit(prev_memory)
