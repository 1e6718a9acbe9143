"""The ring's lockstep protocol: rank 0 decides each op, every rank runs it in order.

Why lockstep: the pipeline's sends and receives pair up, so every rank must run the same
op on the same slot in the same order. Rank 0 (the :class:`Leader`) decides what happens
next — from HTTP through :class:`plimsoll.cluster.serve.RingScheduler`, or from stdin
here — and the other ranks (:func:`follow`) only obey.

Every op is one trip around the ring, neighbour to neighbour, with no all-to-all step:
rank 0 sends a fixed header of ints right, each rank forwards it right before it works
(so the next one is already waiting for its activations), the activations follow the
same way, and the last rank sends one int back to rank 0 (its right neighbour): the
sampled token, or 0 as the op's acknowledgement. Per token that is one header and one
activation message per rank boundary plus the reply — the fewest messages a pipeline can
use, which matters because a token of a small model is latency-bound.

Ops (header ``[op, slot, n, max_tokens, temperature×1e6, top_p×1e6, seed+1]``):

- ``NEW``: open ``slot`` with an ``n``-token prompt reserved to ``n + max_tokens``;
  prefill in chunks; the first token;
- ``STEP``: the next token of ``slot``;
- ``FREE``: close ``slot`` (its caches go on every rank);
- ``PING``: nothing (an idle leader's liveness check: a dead peer fails the trip);
- ``SHUTDOWN``: every rank exits 0 once the acknowledgement is back.

Up to the committed concurrency of slots are open at once; rank 0 interleaves their
steps (round-robin), so several requests are served at a time, each with its own caches.
This module imports no mlx: the ring and the stage carry it.
"""

from __future__ import annotations

import json
import sys
import time

from plimsoll.cluster.exits import EXIT_OK, emit, lockstep

OP_NEW, OP_STEP, OP_FREE, OP_PING, OP_SHUTDOWN = 1, 2, 3, 4, 5
HEADER = 7
MICRO = 1_000_000
SEED_MOD = (1 << 31) - 2  # seed + 1 must fit an int32


def header(op: int, slot: int = 0, n: int = 0, max_tokens: int = 0, temperature: float = 0.0,
           top_p: float = 1.0, seed: int | None = None) -> list[int]:
    """The header for one op (pure)."""
    return [op, slot, n, max_tokens, round(temperature * MICRO), round(top_p * MICRO),
            0 if seed is None else seed % SEED_MOD + 1]


def run_op(stage, head: list[int], prompt: list[int] | None = None, y: int = 0) -> int | None:
    """Run one op's work on this rank; the token (last rank only) for NEW/STEP.

    Rank 0 passes the prompt (NEW) and the slot's last token (STEP); a follower needs only
    the header (the prompt's length; it receives activations, never token ids)."""
    op, slot, n, max_tokens, temp, top_p, seed = head
    if op == OP_NEW:
        return stage.new(slot, prompt if prompt is not None else [0] * n, max_tokens,
                         temp / MICRO, top_p / MICRO, seed - 1 if seed else None)
    if op == OP_STEP:
        return stage.step(slot, y)
    if op == OP_FREE:
        stage.free(slot)
    return None


def follow(ring, stage) -> int:
    """Ranks 1..n-1: obey rank 0's ops until SHUTDOWN (0) or the ring fails (raises)."""
    last = ring.rank == ring.size - 1
    while True:
        head = ring.recv_ints(HEADER, ring.left)
        if not last:
            ring.send_ints(head, ring.right)
        token = run_op(stage, head)
        if last:
            ring.send_ints([0 if token is None else token], ring.right)
        if head[0] == OP_SHUTDOWN:
            return EXIT_OK


class Leader:
    """Rank 0's side: every verb sends its op around the ring and runs it here in lockstep.

    Any error in a verb leaves the ranks out of step, so it is raised as a
    :class:`~plimsoll.cluster.exits.RingFailure` (with the exit code) and the leader is
    ``broken``: every later verb fails at once with the same reason. Not thread-safe:
    one owner (the ring loop) calls it.
    """

    def __init__(self, ring, stage):
        self.ring, self.stage = ring, stage
        self.broken = None
        self.last_op = time.monotonic()
        self.pending: dict[int, int] = {}  # slot → its last token (the next step's input)

    @property
    def world_size(self) -> int:
        return self.ring.size

    def _do(self, head: list[int], prompt: list[int] | None = None, y: int = 0) -> int | None:
        ring = self.ring
        with lockstep(self):
            if ring.size > 1:
                ring.send_ints(head, ring.right)
            token = run_op(self.stage, head, prompt, y)
            if ring.size > 1:
                reply = ring.recv_ints(1, ring.left)[0]
                token = reply if head[0] in (OP_NEW, OP_STEP) else None
            return token

    def new(self, slot: int, prompt: list[int], max_tokens: int, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None) -> int:
        if not prompt:
            raise ValueError("a sequence needs a non-empty prompt")
        token = self._do(header(OP_NEW, slot, len(prompt), max_tokens, temperature, top_p,
                                seed), prompt)
        self.pending[slot] = token
        return token

    def step(self, slot: int) -> int:
        token = self._do(header(OP_STEP, slot), y=self.pending[slot])
        self.pending[slot] = token
        return token

    def free(self, slot: int) -> None:
        self.pending.pop(slot, None)
        self._do(header(OP_FREE, slot))

    def ping(self) -> None:
        self._do(header(OP_PING))

    def shutdown(self) -> None:
        if self.broken is None:
            self._do(header(OP_SHUTDOWN))

    def kv_bytes_held(self) -> int:
        return self.stage.kv_bytes_held()

    def clear_cache(self) -> None:
        """The trip's clear on rank 0 (local: no op crosses the ring): the engine's
        :func:`~plimsoll.engine.limits.clear_buffer_cache`."""
        from plimsoll.engine import clear_buffer_cache  # mlx is loaded by now

        clear_buffer_cache()

    def memory(self) -> dict[str, int]:
        return self.stage.memory()

    @property
    def eos(self) -> set[int]:
        return self.stage.eos


def serve_stdin(leader: Leader, context: int, stdin=None) -> int:
    """Rank 0 without HTTP: one JSON request per line (``{"op": "generate", "prompt": [...],
    "max_tokens": N}`` or ``{"op": "shutdown"}``), greedy, one at a time in slot 0; events
    ``token``/``done``/``refused`` on stdout. End of input shuts the ring down."""
    stdin = stdin or sys.stdin
    while True:
        line = stdin.readline()
        req = json.loads(line) if line.strip() else {"op": "shutdown"}
        if req.get("op") != "generate":
            leader.shutdown()
            return EXIT_OK
        prompt = [int(t) for t in req["prompt"]]
        max_tokens = int(req["max_tokens"])
        if not prompt or prompt[0] < 0 or len(prompt) + max_tokens > context:
            emit("refused", reason=f"prompt {len(prompt)} + max_tokens {max_tokens} "
                 f"exceeds the committed context {context} (or the prompt is empty)")
            continue
        start = time.monotonic()
        out = [leader.new(0, prompt, max_tokens)]
        emit("token", id=out[-1])
        while len(out) < max_tokens and out[-1] not in leader.eos:
            out.append(leader.step(0))
            emit("token", id=out[-1])
        leader.free(0)
        elapsed = time.monotonic() - start
        emit("done", tokens=out, seconds=elapsed,
             tokens_per_s=len(out) / elapsed if elapsed > 0 else None)
