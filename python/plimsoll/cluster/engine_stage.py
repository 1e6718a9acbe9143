"""A rank's layers on the worker's engine (imports mlx through ``mx``, and mlx-lm).

Every rank runs its slice of the model through its own
:class:`plimsoll.engine.core.Engine`: block-paged KV pools for its full-attention layers,
per-sequence state for its linear-attention / sliding layers, batched decodes, chunked
prefills — the kinds a local worker serves. The engine is a client's view of a model:
:class:`StageModel` is what it calls (``model(inputs, cache=views)``), and does one
stage's part of the forward: rank 0 embeds the tokens, the others receive the previous
rank's activations; each runs its layers with the engine's cache views; all but the last
send their activations right (evaluated at once, so a forward the engine does not
evaluate itself, a prefill chunk that samples nothing, still sends); the last applies
the final norm and the head and returns the logits the engine samples from. The others
return one-wide placeholder logits: their engine "samples" a token nobody reads.

Rank 0's :class:`StageEngine` is the engine the worker's scheduler drives
(:mod:`plimsoll.cluster.serve`): each call goes to the peers first (:mod:`.wire`), then
runs here, then waits for the last rank's reply (the sampled tokens, or an
acknowledgement), so every rank makes the same engine calls in the same order and the
sends and receives of each forward pair up. The scheduler's block pool, prefix sharing
(hybrid snapshots included: every rank snapshots its own state), batching and bounds are
a local worker's; a sequence's blocks are the same ids on every rank, in pools of the
same size. Steps pipeline across the ranks in two micro-batches (:class:`StageEngine`:
the scheduler decodes alternate halves of its sequences, and rank 0 runs one half's step
while the next rank runs the other's). The peers run :func:`follow`, one op at a time in
the order sent.

**Tensor parallel** (``ClusterRequest(parallel="tensor")``): every rank loads the whole
model split by mlx-lm's ``shard`` (:func:`load_sharded`: 1/n of each projection and of
the KV heads, two all-sums a layer inside the model) and runs it on its engine as a local
worker would (:func:`build_tensor_engine`); the steps carry their token ids (every rank
embeds), the last rank's sampled tokens come back as ever, and the steps are never
pipelined (each forward's all-sums pair the ranks).

Why not mlx-lm's ``pipeline`` model method: its ranks each hold the embeddings and the
head and all-gather the last hidden states, so neither the weight shares nor the messages
the plan admits would hold; and the models without it (qwen3) would need this anyway.
This split serves decoder stacks whose layers take ``(h, mask, cache)`` with the masks
mlx-lm builds per layer kind (qwen2/3, llama-like, qwen3_next), as :mod:`.stage` does.
"""

from __future__ import annotations

import collections
import copy
import itertools
import time

from plimsoll.cluster import wire
from plimsoll.cluster.exits import EXIT_OK, lockstep
from plimsoll.cluster.protocol import OP_PING, OP_SHUTDOWN
from plimsoll.cluster.stage import MemoryCheck, layer_masks


class StageModel:
    """One stage of the model, called by the engine as the whole model would be."""

    def __init__(self, mx, ring, model, plan, templates: list):
        self.mx, self.ring, self.plan = mx, ring, plan
        self.inner = model.model
        self.layers = self.inner.layers[plan.layer_start:plan.layer_end]
        self.templates = templates[plan.layer_start:plan.layer_end]
        self.linear = [bool(getattr(layer, "is_linear", False)) for layer in self.layers]
        self.first, self.last = ring.rank == 0, ring.rank == ring.size - 1
        self.head = getattr(model, "lm_head", None)
        self.hidden = model.args.hidden_size
        self.dtype = mx.float32
        #: messages go over the ring only once every rank's engine is built (the engine
        #: runs one local probe forward while it measures its cache kinds)
        self.linked = False

    def parameters(self) -> dict:
        """This stage's weights as an ``nn.Module`` tree (the engine reads their names: a
        decode kernel is used only where no attention layer has sinks)."""
        tree: dict = {"layers": [layer.parameters() for layer in self.layers]}
        if self.last and self.head is not None:
            tree["lm_head"] = self.head.parameters()
        return tree

    def make_cache(self) -> list:
        """This stage's layers' caches (mlx-lm's ``make_prompt_cache`` asks for them)."""
        return [copy.deepcopy(t) for t in self.templates]

    def __call__(self, inputs, cache=None):
        mx, ring = self.mx, self.ring
        rows, length = inputs.shape
        if self.first:
            h = self.inner.embed_tokens(inputs)
        elif self.linked:
            h = ring.recv((rows, length, self.hidden), self.dtype, ring.left)
        else:
            h = mx.zeros((rows, length, self.hidden), dtype=self.dtype)
        caches = cache if cache is not None else [None] * len(self.layers)
        masks = layer_masks(h, caches, self.linear)
        for layer, mask, c in zip(self.layers, masks, caches, strict=True):
            h = layer(h, mask, c)
        if not self.last:
            if self.linked:
                mx.eval(ring.send(h, ring.right))
            return mx.zeros((rows, length, 1), dtype=mx.float32)
        h = self.inner.norm(h)
        return self.head(h) if self.head is not None else self.inner.embed_tokens.as_linear(h)


def build_engine(mx, ring, stage_model: StageModel, facts, tokenizer, *, block_tokens: int,
                 max_blocks: int, context: int):
    """This rank's engine over ``stage_model`` (``facts``: the stage's own, from
    :func:`plimsoll.cluster.rank_facts.stage_facts`); links the stage once it is built."""
    from plimsoll.engine.core import Engine

    params = [p for layer in stage_model.layers for p in _leaves(layer.parameters())]
    if params:
        stage_model.dtype = params[0].dtype
    engine = Engine(stage_model, tokenizer, facts, block_tokens=block_tokens,
                    max_blocks=max_blocks, context=context)
    stage_model.linked = True
    return engine


def load_sharded(mx, ring, model_dir) -> tuple:
    """The whole model split across the group by mlx-lm's ``shard`` before anything is
    evaluated (a lazy load: each rank reads its 1/n of every projection, one tensor at a
    time): ``(model, config, parameters)``. Raises ValueError where mlx-lm has no split."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(model_dir, lazy=True)
    if not hasattr(model, "shard"):
        raise ValueError(f"{config.get('model_type')}: mlx-lm has no tensor-parallel split for "
                         "this model; use --parallel pipeline")
    if ring.size > 1:
        model.shard(ring.group)
    params = [v for _, v in tree_flatten(model.parameters())]
    mx.eval(params)
    return model, config, params


def build_tensor_engine(model, facts, tokenizer, *, block_tokens: int, max_blocks: int,
                        context: int):
    """This rank's engine over its split of every layer (``facts``:
    :func:`plimsoll.cluster.rank_facts.tensor_facts`). Every rank builds it at the same
    point: its probe forwards' all-sums pair across the ranks."""
    from plimsoll.engine.core import Engine

    return Engine(model, tokenizer, facts, block_tokens=block_tokens, max_blocks=max_blocks,
                  context=context)


def _leaves(tree) -> list:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


class _Reply:
    """A step sent to every rank: its sampled tokens, read from the last rank when asked
    (replies come back in the order the steps went, so reading one reads every older one)."""

    def __init__(self, owner: StageEngine, order: list[int]):
        self._owner, self.order = owner, order
        self.out: dict[int, int] | None = None

    def result(self) -> dict[int, int]:
        if self.out is None:
            self._owner._settle(self)
        return self.out


class StageEngine:
    """Rank 0's engine for the worker's scheduler: every call on every rank, in order.

    **Pipelined** (``micro_batches`` 2, point-to-point messages, more than one rank): a step
    is sent right and run on this rank's layers, and its tokens are read only when the
    scheduler asks (:class:`_Reply`), so the next step, planned over the other half of the
    decodes (``SchedulerLimits.split_decodes``), runs here while the last one runs on the
    next rank. At most two steps are in flight (the scheduler holds one pending); a step
    that names a token still in flight, and every other op, first reads every reply
    outstanding. Without pipelining (one micro-batch, or the all-sum messages of MLX's nccl
    backend, which must pair in the same order on both ranks) each step's reply is read
    before it returns.

    Any failure leaves the ranks out of step, so it is raised as a
    :class:`~plimsoll.cluster.exits.RingFailure` and the engine is ``broken``: every later
    call fails at once with the same reason (the scheduler's ring loop then fails every
    request with it). Figures (``kv_bytes_allocated``, ``memory``...) are rank 0's own.
    Not thread-safe: one owner calls it.
    """

    def __init__(self, ring, engine, whole_facts, check: MemoryCheck, micro_batches: int = 1,
                 tensor: bool = False):
        self.ring, self.engine, self.check = ring, engine, check
        #: tensor parallel: every rank runs every layer (its 1/n), so the steps carry their
        #: token ids, and the all-sums inside each forward pair the ranks: never pipelined
        self.tensor = tensor
        self.facts = whole_facts  # the scheduler's figures are per layer: the whole model's
        self.tokenizer = engine.tokenizer
        self.block_bytes = engine.block_bytes
        self.state_bytes_per_seq = engine.state_bytes_per_seq
        self.fused_prefill = engine.fused_prefill
        self.pipelined = micro_batches > 1 and ring.size > 1 and not ring.collective \
            and not tensor
        self.broken = None
        self.last_op = time.monotonic()
        self.overlapped = 0  # steps sent while the one before was still on the next ranks
        self._tables = wire.Tables()
        self._last: dict[int, int] = {}  # seq → its last sampled token (a pipelined decode's)
        self._inflight: collections.deque[_Reply] = collections.deque()
        self._keys: dict[object, int] = {}
        self._ids = itertools.count(1)

    @property
    def leader(self) -> StageEngine:  # what the ring scheduler watches (broken, ping)
        return self

    @property
    def world_size(self) -> int:
        return self.ring.size

    @property
    def open_slots(self) -> int:
        """Sequences with a block table on the peers."""
        return len(self._tables.tables)

    def expect(self, seq_id: int, max_tokens: int) -> None:
        """The scheduler admitted ``seq_id`` (the pool reserved its blocks: nothing to do)."""

    def _settle(self, upto: _Reply | None = None) -> None:
        """Read the replies in flight, oldest first, through ``upto`` (None: all)."""
        ring = self.ring
        with lockstep(self):
            while self._inflight:
                reply = self._inflight.popleft()
                got = ring.recv_ints(max(1, len(reply.order)), ring.left)
                reply.out = dict(zip(reply.order, got, strict=False)) if reply.order else {}
                self._last.update(reply.out)
                if reply is upto:
                    return

    def _call(self, head: list[int], payload: list[int], here) -> list[int]:
        """Send the op right, run ``here()`` on this rank, read the last rank's reply."""
        self._settle()
        ring = self.ring
        with lockstep(self):
            if ring.size > 1:
                ring.send_ints(head, ring.right)
                if payload:
                    ring.send_ints(payload, ring.right)
            got = here()
            if ring.size > 1:
                return ring.recv_ints(max(1, len(got or ())), ring.left)
            return list(got or ())

    def run_async(self, step) -> _Reply:
        if self._inflight and _needs(step, self._inflight):
            self._settle()
        step = _concrete(step, self._last)
        payload = wire.encode_step(step, self._tables, tokens=self.tensor)
        reply = _Reply(self, wire.sampled(step))
        ring = self.ring
        with lockstep(self):
            if ring.size > 1:
                ring.send_ints(wire.op_header(wire.OP_RUN, n=len(payload)), ring.right)
                ring.send_ints(payload, ring.right)
            self.check()
            result = self.engine.run_async(step).result()  # placeholders: the reply has them
            if ring.size == 1:
                reply.out = {s: result[s] for s in reply.order}
                self._last.update(reply.out)
                return reply
        self.overlapped += bool(self._inflight)
        self._inflight.append(reply)
        if not self.pipelined:
            self._settle(reply)
        return reply

    def free_state(self, seq_id: int) -> None:
        self._tables.forget(seq_id)
        self._last.pop(seq_id, None)
        if self.broken is None:
            self._call(wire.op_header(wire.OP_FREE_STATE, seq_id), [],
                       lambda: self.engine.free_state(seq_id))

    def snapshot_state(self, seq_id: int, key) -> None:
        ident = self._keys.setdefault(key, next(self._ids))
        self._call(wire.op_header(wire.OP_SNAPSHOT, seq_id, key=ident), [],
                   lambda: self.engine.snapshot_state(seq_id, ident))

    def restore_state(self, key, seq_id: int) -> None:
        ident = self._keys[key]  # KeyError: no such snapshot (as a local engine)
        self._call(wire.op_header(wire.OP_RESTORE, seq_id, key=ident), [],
                   lambda: self.engine.restore_state(ident, seq_id))

    def drop_snapshot(self, key) -> None:
        ident = self._keys.pop(key, None)
        if ident is not None and self.broken is None:
            self._call(wire.op_header(wire.OP_DROP, key=ident), [],
                       lambda: self.engine.drop_snapshot(ident))

    def ping(self) -> None:
        self._call(wire.op_header(OP_PING), [], lambda: None)

    def shutdown(self) -> None:
        if self.broken is None:
            self._call(wire.op_header(OP_SHUTDOWN), [], lambda: None)

    # ---- rank 0's own figures
    def clear_cache(self) -> None:
        self.engine.clear_cache()

    def kv_bytes_allocated(self) -> int:
        return self.engine.kv_bytes_allocated()

    def kv_bytes_held(self) -> int:
        return self.engine.kv_bytes_allocated()

    def state_bytes_held(self) -> int:
        return self.engine.state_bytes_held()

    def memory(self) -> dict[str, int]:
        return self.engine.memory()


def _needs(step, inflight) -> bool:
    """Whether ``step`` decodes a sequence whose last token is still in flight."""
    waiting = {seq for reply in inflight for seq in reply.order}
    return any(w.seq_id in waiting for w in step.decodes)


def _concrete(step, last: dict[int, int]):
    """``step`` with every pipelined decode's token filled in from the last reply (rank 0
    does not sample: the last rank does, and its token came back)."""
    from plimsoll.engine.work import Step

    if all(w.tokens is not None for w in step.decodes):
        return step
    decodes = tuple(w if w.tokens is not None else _with_tokens(w, (last[w.seq_id],))
                    for w in step.decodes)
    return Step(decodes=decodes, prefills=step.prefills)


def _with_tokens(w, tokens: tuple[int, ...]):
    import dataclasses

    return dataclasses.replace(w, tokens=tokens)


def follow(ring, engine, check: MemoryCheck, tensor: bool = False) -> int:
    """Ranks 1..n-1: make rank 0's engine calls until SHUTDOWN (0) or the ring fails
    (``tensor``: the steps carry their token ids)."""
    last = ring.rank == ring.size - 1
    tables = wire.Tables()
    while True:
        head = ring.recv_ints(wire.HEADER, ring.left)
        payload = ring.recv_ints(head[2], ring.left) if head[2] else []
        if not last:
            ring.send_ints(head, ring.right)
            if payload:
                ring.send_ints(payload, ring.right)
        op, seq_id, key = head[0], head[1], head[3]
        reply = [0]
        if op == wire.OP_RUN:
            step = wire.decode_step(payload, tables, tokens=tensor)
            check()
            result = engine.run_async(step).result()
            order = wire.sampled(step)
            if order:
                reply = [result[s] for s in order]
        elif op == wire.OP_FREE_STATE:
            tables.forget(seq_id)
            engine.free_state(seq_id)
        elif op == wire.OP_SNAPSHOT:
            engine.snapshot_state(seq_id, key)
        elif op == wire.OP_RESTORE:
            engine.restore_state(key, seq_id)
        elif op == wire.OP_DROP:
            engine.drop_snapshot(key)
        if last:
            ring.send_ints(reply, ring.right)
        if op == OP_SHUTDOWN:
            return EXIT_OK
