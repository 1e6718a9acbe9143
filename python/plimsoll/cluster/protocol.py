"""The ring's lockstep protocol: rank 0 broadcasts one op, then every rank runs it.

Why lockstep: the pipeline's sends, receives and the token's all-sum are collectives, so
every rank must run the same op on the same slot in the same order. Rank 0 (the
:class:`Leader`) decides what happens next — from HTTP through
:class:`plimsoll.cluster.serve.RingScheduler`, or from stdin here — and broadcasts a
fixed-size header of ints; the other ranks (:func:`follow`) only obey.

Ops (header ``[op, slot, n, max_tokens, temperature×1e6, top_p×1e6, seed+1]``):

- ``NEW``: open ``slot`` with an ``n``-token prompt (broadcast next) reserved to
  ``n + max_tokens``; prefill; the first token;
- ``STEP``: the next token of ``slot``;
- ``FREE``: close ``slot`` (its caches go on every rank);
- ``PING``: nothing (an idle leader's liveness check: a dead peer fails the broadcast);
- ``SHUTDOWN``: every rank exits 0.

Up to the committed concurrency of slots are open at once; rank 0 interleaves their
steps (round-robin), so several requests are served at a time, each with its own caches.
This module imports no mlx: the ring and the stage carry it.
"""

from __future__ import annotations

import json
import sys
import time

from plimsoll.cluster.rank import EXIT_OK, as_failure, emit

OP_NEW, OP_STEP, OP_FREE, OP_PING, OP_SHUTDOWN = 1, 2, 3, 4, 5
HEADER = 7
MICRO = 1_000_000
SEED_MOD = (1 << 31) - 2  # seed + 1 must fit an int32


def header(op: int, slot: int = 0, n: int = 0, max_tokens: int = 0, temperature: float = 0.0,
           top_p: float = 1.0, seed: int | None = None) -> list[int]:
    """The broadcast header for one op (pure)."""
    return [op, slot, n, max_tokens, round(temperature * MICRO), round(top_p * MICRO),
            0 if seed is None else seed % SEED_MOD + 1]


def run_op(ring, stage, head: list[int], prompt: list[int] | None = None) -> int | None:
    """Run one broadcast op on this rank; the token for NEW/STEP (the same on every rank)."""
    op, slot, n, max_tokens, temp, top_p, seed = head
    if op == OP_NEW:
        prompt = ring.broadcast_ints(prompt if ring.rank == 0 else None, n)
        return stage.new(slot, prompt, max_tokens, temp / MICRO, top_p / MICRO,
                         seed - 1 if seed else None)
    if op == OP_STEP:
        return stage.step(slot)
    if op == OP_FREE:
        stage.free(slot)
    return None


def follow(ring, stage) -> int:
    """Ranks 1..n-1: obey rank 0's ops until SHUTDOWN (0) or the ring fails (raises)."""
    while True:
        head = ring.broadcast_ints(None, HEADER)
        if head[0] == OP_SHUTDOWN:
            return EXIT_OK
        run_op(ring, stage, head)


class Leader:
    """Rank 0's side: every verb broadcasts its op, then runs it here in lockstep.

    Any error in a verb leaves the ranks out of step, so it is raised as a
    :class:`~plimsoll.cluster.rank.RingFailure` (with the exit code) and the leader is
    ``broken``: every later verb fails at once with the same reason. Not thread-safe:
    one owner (the ring loop) calls it.
    """

    def __init__(self, ring, stage):
        self.ring, self.stage = ring, stage
        self.broken = None
        self.last_op = time.monotonic()

    @property
    def world_size(self) -> int:
        return self.ring.size

    def _do(self, head: list[int], prompt: list[int] | None = None) -> int | None:
        if self.broken is not None:
            raise self.broken
        try:
            self.ring.broadcast_ints(head, HEADER)
            return run_op(self.ring, self.stage, head, prompt)
        except BaseException as err:
            self.broken = as_failure(self.ring.rank, err)
            raise self.broken from err
        finally:
            self.last_op = time.monotonic()

    def new(self, slot: int, prompt: list[int], max_tokens: int, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None) -> int:
        if not prompt:
            raise ValueError("a sequence needs a non-empty prompt")
        return self._do(header(OP_NEW, slot, len(prompt), max_tokens, temperature, top_p,
                               seed), prompt)

    def step(self, slot: int) -> int:
        return self._do(header(OP_STEP, slot))

    def free(self, slot: int) -> None:
        self._do(header(OP_FREE, slot))

    def ping(self) -> None:
        self._do(header(OP_PING))

    def shutdown(self) -> None:
        if self.broken is None:
            self._do(header(OP_SHUTDOWN))

    def kv_bytes_held(self) -> int:
        return self.stage.kv_bytes_held()

    def clear_cache(self) -> None:
        """Return rank 0's freed MLX buffers (local: no op crosses the ring)."""
        self.stage.mx.clear_cache()

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
