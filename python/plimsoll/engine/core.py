"""The block-paged engine: runs :class:`~plimsoll.engine.work.Step` s (imports mlx, mlx_lm).

The scheduler owns block ids, tables and reference counts; the engine only executes
what a step names against physical pools (:mod:`plimsoll.engine.paged`), one kind
object per cache layer of the model:

- every step is ONE forward of the model (:mod:`plimsoll.engine.forward`): its decode rows
  and its prefill chunks (at any start, several sequences) flattened into one batch whose
  token-mixing modules run per group (:mod:`plimsoll.engine.mixers`); each layer scatters
  the group's new K/V into its slots and attends over its tables
  (:mod:`plimsoll.engine.attention`); logits only at the tokens that sample;
- recurrent state (hybrid models) is held per sequence (:mod:`plimsoll.engine.state`);
- an MLA layer's view hands the model the gathered latent history and the group's mask, and
  the model's own attention math runs once for the group's rows (:mod:`plimsoll.engine.latent`);
  a ``CacheList`` layer gets one view per member (:mod:`plimsoll.engine.composite`).

Pipelining (as mlx-lm's ``generate_step``): :meth:`Engine.run_async` builds a step and
``mx.async_eval`` s it; a decode ``Work`` with ``tokens=None`` feeds the token sampled
for that sequence in the previous step, still lazy on the device, so the caller can
submit step n+1 before it waits for step n. Within a layer of one forward every group's
pool write waits for the previous group's reads (``FullAttention.fence``), so every pool
write can donate its input buffer (written in place, no pool copy). A constrained row is
never pipelined: its mask needs the previous token, so the engine first settles every
earlier step (which also tells each constraint its token). On MLX's CPU backend
``async_eval`` blocks while too many tasks are queued (measured: a 400-op graph returns
only when nearly done; a decode step is hundreds of ops), so the overlap is small there;
on Metal and CUDA it is what keeps single-stream decode ahead of mlx-lm's server.

Physical truth: :meth:`Engine.kv_bytes_allocated` sums ``nbytes`` of the pool arrays
that exist; :meth:`Engine.state_bytes_held` those of every state and snapshot.
Not thread-safe: one owner calls it from one thread.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from plimsoll.core.capability import ENGINE_SUPPORT
from plimsoll.core.model_facts import ModelFacts, inspect_model, parse_kv_dtype
from plimsoll.core.transients import PREFILL_LAYER_WINDOW
from plimsoll.engine import (
    backend,
    compiled,
    composite,
    decode_write,
    forward,
    kernels,
    linear,
    mixers,
    pool_cuda,
    sampled_rows,
    step_check,
)
from plimsoll.engine import state as seq_state
from plimsoll.engine.attention import fused_prefill, route_attention
from plimsoll.engine.chain import Chains
from plimsoll.engine.decode_index import DecodeReads
from plimsoll.engine.groups import state_index
from plimsoll.engine.limits import backend_env_defaults, clear_buffer_cache
from plimsoll.engine.paged import FullAttention, RecurrentState, mx_dtype
from plimsoll.engine.pending import Pending
from plimsoll.engine.quantized import QuantizedAttention
from plimsoll.engine.sampling import Keys
from plimsoll.engine.window import Rings, WindowAttention, window_kind
from plimsoll.engine.work import Step

# Pool growth step: measured on the H200, a slab of max_blocks / 8 (10 GiB for a 4B model's
# admitted pool) put the first request's peak at 2.3 x weights + KV; 256 MiB keeps the
# excess to one slab while a 30k-token session grows in ~20 steps.
SLAB_BYTES = 256 << 20


class Engine:
    """An mlx-lm model over block-paged KV pools; see the module docstring."""

    def __init__(self, model, tokenizer, facts: ModelFacts, *, block_tokens: int,
                 max_blocks: int, kv_dtype: str | None = None, pipeline: bool = True,
                 slab_blocks: int | None = None, context: int | None = None,
                 kv_bits: int | None = None, compile_decode: bool = False):
        if block_tokens <= 0 or max_blocks <= 0:
            raise ValueError("block_tokens and max_blocks must be positive")
        self.model, self.tokenizer, self.facts = model, tokenizer, facts
        self.block_tokens, self.max_blocks, self.pipeline = block_tokens, max_blocks, pipeline
        self.context = context  # the longest sequence; sliding-window rings hold min(window, it)
        # Compute on a stream of our own, as mlx-lm's generate does (measured ~5-10%
        # faster single-stream decode on the CPU backend than the default stream).
        backend_env_defaults()  # before the stream: its encoder reads the graph cache's
        self._stream = mx.new_stream(mx.default_device())
        route_attention()
        linear.hold(model)  # projections as one graph node where mlx's make four
        self.kv_bits = kv_bits  # 8 / 4: quantized KV pools (engine/quantized.py)
        self.layers = self._kinds(model, kv_dtype, slab_blocks or max_blocks)
        composite.check_bytes(type(model).__module__, self.layers, facts, block_tokens)
        self.block_bytes = sum(k.block_bytes for k in self.layers)
        if slab_blocks is None:  # grow by about SLAB_BYTES: the peak follows what is written
            slab = max(1, min(max_blocks, SLAB_BYTES // max(1, self.block_bytes)))
            for kind in composite.flatten(self.layers):
                if isinstance(kind, FullAttention):
                    kind.slab_blocks = slab
        flat = list(composite.flatten(self.layers))
        # sliding-window rings are per-sequence state too (engine/window.py): a pool with
        # them runs hybrid, so prefixes are reused through ring snapshots
        self._rings = Rings([k for k in flat if isinstance(k, WindowAttention)])
        self.state_bytes_per_seq = sum(k.bytes_per_seq for k in flat
                                       if isinstance(k, RecurrentState)) \
            + self._rings.bytes_per_seq
        self._pools = [k for k in flat if isinstance(k, FullAttention)]
        #: where a prompt chunk that is not its prompt's last should end: a multiple of the
        #: backend's causal grid (engine/attention.causal_on_grid; 0: anywhere), so a whole
        #: chunk's attention is not padded and its shape is one the plan warmer builds
        self.chunk_align = backend.causal_grid()
        #: the backend runs a prefill chunk's attention fused (the worker's chunk follows it);
        #: MLA's prefill attends through the model's own math (engine/latent.py): not counted
        #: as fused, so its transient keeps the scores
        self.fused_prefill = fused_prefill(
            self._compute_dtype, {d for p in self._pools for d in (p.k_dim, p.v_dim)}) \
            and all(p.plain_kv for p in self._pools)
        self._states: dict[int, list[seq_state.Entries]] = {}
        # The last decode's stacked state (its rows, in order): the next decode of the same
        # rows reuses it instead of stacking again (its row views are what _states holds).
        self._batched: tuple[tuple[int, ...], list[seq_state.Entries]] | None = None
        self._snapshots: dict[object, list[seq_state.Entries]] = {}
        self._last: dict[int, tuple[mx.array, int]] = {}  # seq -> (tokens, row), lazy
        self._keys = Keys()
        self._unsettled: list[Pending] = []
        self._reads = DecodeReads(block_tokens)  # the decode's table index, kept across steps
        self.flat_kinds = flat
        self._state_index = state_index(self.layers)
        #: quantized pools attend a sampled chunk's last token to the quantized blocks
        self.attends_tail = any(isinstance(k, QuantizedAttention) for k in flat)
        with mx.stream(self._stream):
            #: the token-mixing modules regrouped for one forward a step (or why not: then
            #: one forward per group)
            self.mixers = mixers.discover(model)
            #: the last layer's output cut to the sampled rows (the lm head sees only them)
            self.select_rows = sampled_rows.rows_selectable(model)
            #: the custom decode kernels checked on this device (used only if they agree
            #: with the reference and are not slower; the verdicts go to the status)
            plain = [p for p in self._pools if p.plain_kv]
            shapes = sorted({(p.kv_heads, p.k_dim, p.v_dim) for p in plain})
            self.kernels = kernels.select(self._compute_dtype, facts.num_attention_heads,
                                          shapes)
            #: pool writes stored in place and contexts gathered by the CUDA kernels that
            #: passed their check (engine/pool_cuda.py: a scatter after a read still in
            #: flight copies the layer's arrays, MLX's gather is slow); verdicts as above
            gather = kernels.check_gather(plain)
            write = kernels.check_write(plain, compile_decode, gather)
            writing = decode_write.check_writing(self.kernels.decode, self._compute_dtype,
                                                 facts.num_attention_heads, shapes, write)
            #: decode-only steps store their new K/V by the decode kernel's launch
            self.decode_writes = writing.used
            self.kernels.verdicts += [write, gather, kernels.check_skinny(model), writing]
            #: quantized pools read by their own decode kernel where it passed its check
            #: (it reads through the block index: a decode's read is never a slice then)
            quantized = [p for p in self._pools if isinstance(p, QuantizedAttention)]
            verdict = kernels.check_quantized(quantized, self._compute_dtype,
                                              facts.num_attention_heads)
            self.quantized_kernel = verdict is not None and verdict.used
            if verdict is not None:
                self.kernels.verdicts.append(verdict)
            for p in quantized if self.quantized_kernel else ():
                p.decode_kernel = kernels.QUANTIZED.decode
            for p in plain if write.used else ():
                p.inplace = pool_cuda.write
            for p in plain if gather.used else ():
                p.fast_gather = pool_cuda.gather
        #: does a decode step gather K/V into a transient? Not where the checked kernel
        #: reads every attention layer in place: plain full-attention pools only (no window
        #: rings, latents or quantized pools) and no attention sinks (the kernel has none)
        self.decode_gathers = not (
            self.kernels.decode is not None and flat
            and all(type(k) in (FullAttention, RecurrentState) for k in flat)
            and not any("sinks" in name for name, _ in tree_flatten(model.parameters())))
        #: decode-only steps compiled per shape bucket where every layer is a plain
        #: full-attention pool (engine/compiled.py); None: every step is built eagerly
        #: (off by default, ``plimsoll worker --compile-decode``: measured on the CPU it cuts
        #: host time but not the step, see engine/compiled.py)
        self.compiled = compiled.CompiledDecode(self) \
            if compile_decode and compiled.eligible(self.layers) else None
        #: the checkpoint's MTP head drafting from this engine's hidden states
        #: (engine/mtp_head.py; set by the worker where it drafts): every step hands it the
        #: last decoder layer's rows, so no step runs compiled meanwhile
        self.mtp = None
        #: layers a heavy step keeps in flight (attention.Pacer, forward._pace; 0: unpaced)
        self.prefill_window = PREFILL_LAYER_WINDOW
        #: the transient bytes admission reserved (set by the worker; None: unknown): a
        #: decode step whose whole forward in flight fits it runs unpaced (forward._pace)
        self.transient_budget: int | None = None
        #: speculating sequences' outcomes kept on the device (engine/chain.py)
        self.chains = Chains()

    @classmethod
    def load(cls, model_dir: str | Path, *, block_tokens: int, max_blocks: int,
             kv_dtype: str | None = None, pipeline: bool = True,
             slab_blocks: int | None = None, context: int | None = None,
             compile_decode: bool = False) -> Engine:
        """Load ``model_dir`` with mlx-lm; refuse cache kinds this engine cannot serve."""
        float_dtype, bits = parse_kv_dtype(kv_dtype)  # "q8" / "q4": the model's dtype, quantized
        facts = inspect_model(model_dir, kv_dtype=kv_dtype)  # refuses head dims off the groups
        backend_env_defaults()
        model, tokenizer = mlx_lm.load(str(model_dir))
        return cls(model, tokenizer, facts, block_tokens=block_tokens, max_blocks=max_blocks,
                   kv_dtype=float_dtype, pipeline=pipeline, slab_blocks=slab_blocks,
                   context=context, kv_bits=bits, compile_decode=compile_decode)

    def _kinds(self, model, kv_dtype: str | None, slab: int) -> list:
        """One kind per cache layer, shapes and dtypes measured by a one-token probe."""
        caches = make_prompt_cache(model)
        self._compute_dtype = mx.float32
        for c in caches:
            for m in composite.members(c):
                if type(m) not in (KVCache, ArraysCache, RotatingKVCache):
                    raise NotImplementedError(
                        f"{type(model).__module__}: cache kind {type(m).__name__} (chunked or "
                        "quantized KV) is not served by the paged engine yet; only "
                        "full-attention KV and MLA latents (KVCache), sliding windows "
                        "(RotatingKVCache) and recurrent state (ArraysCache) are, alone or in "
                        "a CacheList")
        with mx.stream(self._stream):
            model(mx.array([[0]]), cache=caches)
            mx.eval([m.state for c in caches for m in composite.members(c)])

        def kind_of(i: int, c, want: str | None):
            composite.check_member(type(model).__module__, i, c, want)
            if type(c) is KVCache:
                self._compute_dtype = c.keys.dtype  # what the model computes K in
                _, heads, _, k_dim = c.keys.shape
                dtype = mx_dtype(kv_dtype) if kv_dtype else c.keys.dtype
                args = (heads, k_dim, c.values.shape[3], dtype, self.block_tokens,
                        self.max_blocks, slab)
                if self.kv_bits and (want or "kv") == "kv":  # quantized pools (quantized.py)
                    return QuantizedAttention(*args, bits=self.kv_bits)
                return composite.pool_class(want)(*args)
            if type(c) is RotatingKVCache:
                dtype = mx_dtype(kv_dtype) if kv_dtype else c.keys.dtype
                return window_kind(c, dtype, self.max_blocks + 2, 1, self.context)
            return RecurrentState(len(c.cache), seq_state.nbytes([c.cache]))

        kinds: list = []
        for i, c in zip(composite.cache_layers(self.facts, len(caches)), caches, strict=True):
            parts, wants = composite.members(c), composite.layer_kinds(self.facts, i)
            wants = wants if len(wants) == len(parts) else [None] * len(parts)
            built = [kind_of(i, m, w) for m, w in zip(parts, wants, strict=True)]
            kinds.append(built[0] if parts[0] is c else composite.Composite(built))
        for kind in composite.flatten(kinds):  # the one table of what is served says yes to each
            support = ENGINE_SUPPORT.get(kind.table_kind)
            if support is None or not support.served:
                raise NotImplementedError(
                    f"{type(model).__module__}: the engine built a {kind.table_kind!r} layer, "
                    "which the served-kinds table (core/capability.ENGINE_SUPPORT) does not "
                    "serve")
        del caches
        mx.clear_cache()
        return kinds

    # ------------------------------------------------------------------ figures

    @property
    def speculation_refused(self) -> str:
        """Why drafted tokens cannot be verified here ("" when they can): rolling back by
        length is exact only where a position's KV is overwritten in place — plain
        full-attention (or latent) pools. Recurrent state and window rings have consumed
        the rejected tokens; quantized pools attend a chunk otherwise than a decode."""
        kinds = {type(k).__name__ for k in self.flat_kinds
                 if isinstance(k, RecurrentState | WindowAttention | QuantizedAttention)}
        if kinds:
            return ("the model's cache holds " + ", ".join(sorted(kinds)) + " layers, whose "
                    "rejected drafts cannot be rolled back by length")
        return ""

    @property
    def chains_drafts(self) -> bool:
        """Whether a prompt-lookup sequence's next verifying step may be chained on the
        device (engine/chain.py): its Works verify as decode rows (every layer a plain
        full-attention pool) and no MTP head drafts."""
        return not self.speculation_refused and forward.verifies_as_rows(self) \
            and self.mtp is None

    def kv_bytes_allocated(self) -> int:
        """nbytes of every KV pool array actually allocated."""
        return sum(p.nbytes for p in self._pools)

    def blocks_allocated(self) -> int:
        return self._pools[0].blocks if self._pools else 0

    def state_bytes_held(self) -> int:
        """nbytes of every recurrent state and snapshot held."""
        return (sum(seq_state.nbytes(s) for s in self._states.values())
                + sum(seq_state.nbytes(s) for s in self._snapshots.values()) + self._rings.nbytes())

    def memory(self, reset_peak: bool = False) -> dict[str, int]:
        """MLX's own allocator figures, in bytes (``reset_peak``: the peak starts again)."""
        out = {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(),
               "cache": mx.get_cache_memory()}
        if reset_peak:
            mx.reset_peak_memory()
        return out

    def clear_cache(self) -> None:
        """The trip's clear of what the process holds freed: :func:`limits.clear_buffer_cache`."""
        clear_buffer_cache()

    # ------------------------------------------------------------------ sequences

    def free_state(self, seq_id: int) -> None:
        """A sequence ended: drop its recurrent state, last token and random key."""
        self._states.pop(seq_id, None)
        self._rings.free(seq_id)
        self._touched(seq_id)
        self._last.pop(seq_id, None)
        self._keys.drop(seq_id)
        self._reads.forget(seq_id)
        self.chains.drop(seq_id)
        if self.mtp is not None:
            self.mtp.forget(seq_id)

    def snapshot_state(self, seq_id: int, key) -> None:
        """Keep a copy of ``seq_id``'s state (after every step submitted so far) as ``key``."""
        self._snapshots[key] = seq_state.copy(self._states.get(seq_id) or self._fresh_state())
        rings = self._rings.snapshot(seq_id, key) if self._rings else []
        mx.async_eval(seq_state.arrays(self._snapshots[key]) + rings)

    def restore_state(self, key, seq_id: int) -> None:
        """Give ``seq_id`` a copy of snapshot ``key`` (the snapshot stays)."""
        self._states[seq_id] = seq_state.copy(self._snapshots[key])
        if self._rings:
            self._rings.restore(key, seq_id)
        self._touched(seq_id)

    def drop_snapshot(self, key) -> None:
        self._snapshots.pop(key, None)
        self._rings.drop(key)

    def _touched(self, seq_id: int) -> None:
        """``seq_id``'s state changed outside a decode: the stacked batch is stale."""
        if self._batched is not None and seq_id in self._batched[0]:
            self._batched = None

    def _fresh_state(self) -> list[seq_state.Entries]:
        return [seq_state.fresh(k.slots) for k in composite.flatten(self.layers)
                if isinstance(k, RecurrentState)]

    # ------------------------------------------------------------------ steps

    def run(self, step: Step) -> dict[int, int]:
        """Run ``step``; ``{seq_id: token}`` for every Work with ``sample=True``."""
        return self.run_async(step).result()

    def run_async(self, step: Step) -> Pending:
        """Build ``step`` as one forward and queue it (``mx.async_eval``); see
        :mod:`plimsoll.engine.forward` and the module docstring."""
        with mx.stream(self._stream):
            step_check.check(self, step)
            if any(w.constraint is not None and w.tokens is None for w in step.decodes):
                self._settle_until(None)
            if self.compiled is not None and self.mtp is None and step.decodes \
                    and not step.prefills \
                    and self.compiled.takes(step.decodes):
                out = compiled.run(self.compiled, step.decodes)
            else:
                out = forward.run(self, forward.groups_of(self, step)) \
                    if step.decodes or step.prefills else None
            pending = Pending(self, [] if out is None else [out])
            self._unsettled.append(pending)
            if not self.pipeline:
                pending.result()
            return pending

    def _settle_until(self, target: Pending | None) -> None:
        """Settle every submitted step up to ``target`` (all of them for None), in order.
        A ``target`` settled already (a constrained step settled it early) settles nothing
        more: the steps after it keep their overlap, and their constraints are told their
        tokens only when those are read."""
        if target is not None and all(p is not target for p in self._unsettled):
            return
        while self._unsettled:
            p = self._unsettled.pop(0)
            p._settle()
            if p is target:
                return

