"""A rank's slice of the model (a pipeline stage) and the ring it talks on; imports mlx.

:class:`Stage` holds this rank's contiguous layers (and the embeddings or head when the plan
gives it them), one slot of per-layer caches per open sequence, each sized once to its
reservation, and runs one op's forward: embed or receive activations, run its layers, send
them right, or (last rank) pick the token. :class:`Ring` is the group plus the few
point-to-point and gather collectives the protocol needs. ``mx`` is passed in, never
imported at module level, so :mod:`plimsoll.cluster.rank` can parse its arguments first.

Invariant: a stage never allocates past its admitted limit unnoticed: its :class:`MemoryCheck`
runs before every forward that yields a token and raises :class:`RanOut`.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

from plimsoll.cluster.exits import RanOut

#: Fault injection for tests: allocate this many extra bytes at decode step FAULT_AT.
FAULT_BYTES, FAULT_AT = "PLIMSOLL_CLUSTER_FAULT_BYTES", "PLIMSOLL_CLUSTER_FAULT_AT"
#: Pass every message as an all-sum (the nccl path) whatever the backend.
COLLECTIVE = "PLIMSOLL_CLUSTER_COLLECTIVE"


def layer_masks(h, caches: list, linear: list[bool]) -> list:
    """One mask per layer (``linear``: its kind), each built from the first cache of its kind
    (as mlx-lm does)."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    attn = next((c for c, lin in zip(caches, linear, strict=True) if not lin), None)
    ssm = next((c for c, lin in zip(caches, linear, strict=True) if lin), None)
    masks = {False: create_attention_mask(h, attn) if attn is not None else None,
             True: create_ssm_mask(h, ssm) if ssm is not None else None}
    return [masks[lin] for lin in linear]


class MemoryCheck:
    """Running out is checked before every step, not trusted to the allocator: past the
    limit (set once the weights are loaded) it raises :class:`RanOut`, which stops the ring.

    Fault injection (:data:`FAULT_BYTES` at :data:`FAULT_AT`) counts the checks, so the
    spike lands at that step. ``step_name`` is how the message names a step.
    """

    def __init__(self, mx, rank: int, limit_bytes: int | None, step_name: str = "step"):
        self.mx, self.rank, self.limit_bytes, self.step_name = mx, rank, limit_bytes, step_name
        self.steps = 0
        self.held: list = []
        self.fault_bytes = int(os.environ.get(FAULT_BYTES, "0"))
        self.fault_at = int(os.environ.get(FAULT_AT, "0"))

    def __call__(self) -> None:
        mx, step = self.mx, self.steps
        self.steps += 1
        if self.fault_bytes and step == self.fault_at:
            spike = mx.zeros((self.fault_bytes // 4,), dtype=mx.float32)
            mx.eval(spike)
            self.held.append(spike)
        active = mx.get_active_memory()
        if self.limit_bytes is not None and active > self.limit_bytes:
            raise RanOut(f"rank {self.rank} ran out of its admitted memory at {self.step_name} "
                         f"{step}: active {active} B > allocation limit {self.limit_bytes} B")


class Ring:
    """The group and the few collectives the protocol needs (all bounded by the ring's peers).

    Admission all-gathers JSON; serving only ever talks to a neighbour: ``right`` (rank + 1)
    and ``left`` (rank − 1), the last rank's right being rank 0. On a backend without
    send/recv (MLX's nccl) a message is an all-sum that only the sender fills (the
    receiver adds zeros of the same shape): with two ranks every message is between the
    two, so sends and receives still pair (:func:`plimsoll.cluster.backend.world_refusal`
    refuses more). ``PLIMSOLL_CLUSTER_COLLECTIVE=1`` takes that path on any backend (the
    tests run it over ring).
    """

    def __init__(self, mx, group, backend: str = "ring"):
        from plimsoll.cluster.backend import point_to_point

        self.mx, self.group, self.backend = mx, group, backend
        self.rank, self.size = group.rank(), group.size()
        self.collective = (not point_to_point(backend)
                           or os.environ.get(COLLECTIVE) == "1") and self.size > 1

    def all_gather_json(self, obj) -> list:
        mx = self.mx
        data = json.dumps(obj).encode()
        if self.size == 1:
            return [json.loads(data)]
        lengths = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32),
                                            group=self.group)
        width = int(mx.max(lengths).item())
        buf = mx.zeros((width,), dtype=mx.uint8)
        if data:
            buf[: len(data)] = mx.array(list(data), dtype=mx.uint8)
        rows = mx.distributed.all_gather(buf, group=self.group).reshape(self.size, width)
        mx.eval(rows)
        out = []
        for r in range(self.size):
            n = int(lengths[r].item())
            out.append(json.loads(bytes(rows[r, :n].tolist())))
        return out

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.size

    def send(self, x, dst: int):
        """``x`` to neighbour ``dst``, lazily: evaluate the result to send it."""
        if self.collective:
            return self.mx.distributed.all_sum(x, group=self.group)
        return self.mx.distributed.send(x, dst, group=self.group)

    def recv(self, shape: tuple[int, ...], dtype, src: int):
        """A message of ``shape`` from neighbour ``src``, lazily."""
        mx = self.mx
        if self.collective:
            return mx.distributed.all_sum(mx.zeros(shape, dtype=dtype), group=self.group)
        return mx.distributed.recv(shape, dtype, src, group=self.group)

    def send_ints(self, values: list[int], dst: int) -> None:
        """One message to a neighbour (no reply awaited: TCP buffers it)."""
        mx = self.mx
        mx.eval(self.send(mx.array(values, dtype=mx.int32), dst))

    def recv_ints(self, n: int, src: int) -> list[int]:
        got = self.recv((n,), self.mx.int32, src)
        self.mx.eval(got)
        return got.tolist()


class _Slot:
    """One live sequence on this rank: its own caches for this rank's layers."""

    def __init__(self, caches: list, temperature: float, top_p: float, key):
        self.caches = caches
        self.temperature, self.top_p, self.key = temperature, top_p, key


class Stage:
    """This rank's contiguous slice of the model's layers (a pipeline stage), and its slots.

    Every method is one step of the lockstep protocol and runs on every rank in the same
    order (rank 0 broadcasts the op first); a token-producing method returns the same
    token on every rank (the last rank samples, an all-sum carries it).
    """

    def __init__(self, mx, ring: Ring, model, plan, eos: set[int], prefill_chunk: int,
                 cache_templates: list, block_tokens: int):
        from mlx_lm.models.cache import KVCache

        from plimsoll.cluster.slots import SlotKV

        self.mx, self.ring, self.model, self.plan = mx, ring, model, plan
        self.inner = model.model
        self.layers = self.inner.layers[plan.layer_start:plan.layer_end]
        self.templates = cache_templates[plan.layer_start:plan.layer_end]
        self.linear = [bool(getattr(layer, "is_linear", False)) for layer in self.layers]
        self.eos, self.chunk, self.block_tokens = eos, prefill_chunk, block_tokens
        self.first, self.last = ring.rank == 0, ring.rank == ring.size - 1
        self._kv_type, self._slot_kv = KVCache, SlotKV
        self.hidden = model.args.hidden_size
        self.dtype = None
        self.slots: dict[int, _Slot] = {}
        # checked before every token-producing forward (fault injection counts these);
        # its limit is set once the weights are loaded
        self.check_memory = MemoryCheck(mx, ring.rank, None, step_name="decode step")

    def _new_caches(self, capacity: int) -> list:
        """Full-attention KV sized once to the reservation; other kinds as their template."""
        return [self._slot_kv(capacity) if type(t) is self._kv_type else copy.deepcopy(t)
                for t in self.templates]

    def _sample(self, logits, slot: _Slot):
        mx = self.mx
        if slot.temperature <= 0:
            return mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32)
        from mlx_lm.sample_utils import apply_top_p

        row = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[None]
        if 0 < slot.top_p < 1:
            row = apply_top_p(row, slot.top_p)
        sub = None
        if slot.key is not None:
            slot.key, sub = mx.random.split(slot.key)
        return mx.random.categorical(row * (1 / slot.temperature), key=sub).astype(mx.int32)

    def _forward(self, tokens: list[int], slot: _Slot, want_token: bool) -> int | None:
        """One pass of this stage over ``tokens`` (their count is all a follower needs).

        Rank 0 embeds; the others receive the activations from their left neighbour; all but
        the last send theirs right. The last samples: the token (an int) is returned there
        only — the protocol carries it back to rank 0."""
        mx, ring, caches = self.mx, self.ring, slot.caches
        if self.first:
            h = self.inner.embed_tokens(mx.array([tokens]))
        else:
            h = ring.recv((1, len(tokens), self.hidden), self.dtype, ring.left)
        masks = layer_masks(h, caches, self.linear)
        for layer, mask, cache in zip(self.layers, masks, caches, strict=True):
            h = layer(h, mask, cache)
        if not self.last:
            mx.eval(ring.send(h, ring.right))
            return None
        if not want_token:
            mx.eval([c.state for c in caches])
            return None
        h = self.inner.norm(h[:, -1:, :])
        head = getattr(self.model, "lm_head", None)
        logits = head(h) if head is not None else self.inner.embed_tokens.as_linear(h)
        token = self._sample(logits[0, -1], slot)
        mx.eval(token, [c.state for c in caches])
        return int(token.item())

    # ------------------------------------------------------------ the protocol's verbs

    def new(self, slot: int, prompt: list[int], max_tokens: int, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None) -> int | None:
        """Open ``slot``: KV sized to ``prompt + max_tokens``, prefill, the first token (on the
        last rank). A follower passes placeholders of the prompt's length: only rank 0 embeds."""
        if slot in self.slots:
            raise ValueError(f"slot {slot} is already open")
        capacity = math.ceil((len(prompt) + max_tokens) / self.block_tokens) * self.block_tokens
        key = self.mx.random.key(seed) if seed is not None and self.last else None
        s = _Slot(self._new_caches(capacity), temperature, top_p, key)
        self.slots[slot] = s
        head = prompt[:-1]
        for i in range(0, len(head), self.chunk):
            self._forward(head[i:i + self.chunk], s, want_token=False)
        return self._decode(s, prompt[-1])

    def step(self, slot: int, y: int = 0) -> int | None:
        """One more token of ``slot``: ``y`` (rank 0: the last token) in, the next out (last
        rank)."""
        return self._decode(self.slots[slot], y)

    def _decode(self, s: _Slot, y: int) -> int | None:
        self.check_memory()
        return self._forward([y], s, want_token=True)

    def free(self, slot: int) -> None:
        s = self.slots.pop(slot, None)
        if s is not None:
            s.caches.clear()

    def kv_bytes_held(self) -> int:
        return sum(getattr(c, "nbytes", 0) for s in self.slots.values() for c in s.caches)

    def memory(self) -> dict[str, int]:
        mx = self.mx
        return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(),
                "cache": mx.get_cache_memory()}


def load_stage(mx, ring, model_dir: Path, plan, request) -> Stage:
    model, config, templates, params = load_slice(mx, model_dir, plan)
    eos = config.get("eos_token_id", [])
    eos = set(eos if isinstance(eos, list) else [eos])
    stage = Stage(mx, ring, model, plan, eos, request.prefill_chunk, templates,
                  request.block_tokens)
    stage.dtype = params[0].dtype if params else mx.float32
    stage.loaded_bytes = sum(v.nbytes for v in params)
    return stage


def load_slice(mx, model_dir: Path, plan) -> tuple:
    """The model with only this rank's tensors evaluated (lazy load, foreign layers and
    parts dropped first): ``(model, config, cache templates per layer, parameters)``."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(model_dir, lazy=True)
    inner = model.model
    n = len(inner.layers)
    # Empty caches of the right kind per layer (KV, or arrays for linear attention), taken
    # before foreign layers are dropped; each slot makes its own from these.
    if hasattr(model, "make_cache"):
        templates = model.make_cache()
    else:
        from mlx_lm.models.cache import KVCache

        templates = [KVCache() for _ in range(n)]
    for i in range(n):
        if not plan.layer_start <= i < plan.layer_end:
            inner.layers[i] = None
    tied = not hasattr(model, "lm_head")
    if not plan.holds_embeddings and not (plan.holds_head and tied):
        inner.embed_tokens = None
    if not plan.holds_head:
        inner.norm = None
        if not tied:
            model.lm_head = None
    params = [v for _, v in tree_flatten(model.parameters())]
    mx.eval(params)
    return model, config, templates, params
