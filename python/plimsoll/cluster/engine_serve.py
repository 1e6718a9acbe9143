"""Rank 0 without HTTP, when the ranks run their layers on the engine (no mlx here).

One JSON request per line on stdin, ``{"op": "generate", "prompts": [[ids...], ...],
"max_tokens": N}`` (or one ``"prompt"``), optionally ``"ignore_eos": true``: every prompt
is submitted to the worker's scheduler at once, so they run concurrently (batched decodes,
chunked prefills, shared prefixes) up to the committed concurrency, exactly as HTTP
requests would. Events on stdout: ``token`` (``seq``: the prompt's index), then one
``done`` with every prompt's tokens (``outputs``; ``tokens``: the first's; ``most_rows``:
the most sequences one decode step has batched so far; ``overlapped``: the steps sent
while the one before was still on the next ranks, so far), or ``refused``
with the scheduler's reason. Anything else, or the end of input, shuts the ring down.

The scheduler's loop runs on this (the main) thread, where the rank joined the group;
stdin is read on a thread of its own.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from plimsoll.cluster.exits import EXIT_OK, RingFailure, emit
from plimsoll.cluster.serve import ClusterFacts, RingScheduler, engine_parts, ring_worker_config
from plimsoll.worker.events import Finished, GenRequest, Refused, Token


def _generate(sched: RingScheduler, prompts: list[list[int]], max_tokens: int,
              ignore_eos: bool) -> tuple[list[list[int]], str | None]:
    """Submit every prompt at once; wait for all (or the first refusal)."""
    outs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    refused: list[str] = []

    def sink_for(i: int):
        def sink(event) -> None:
            if isinstance(event, Token):
                outs[i].append(event.token_id)
                emit("token", id=event.token_id, seq=i)
            elif isinstance(event, Refused):
                refused.append(f"{event.code}: {event.message}")
                done[i].set()
            elif isinstance(event, Finished):
                done[i].set()
        return sink

    for i, prompt in enumerate(prompts):
        sched.submit(GenRequest(prompt=list(prompt), max_tokens=max_tokens, sink=sink_for(i),
                                ignore_eos=ignore_eos))
    for event in done:
        event.wait()
    return outs, (refused[0] if refused else None)


def serve_stdin(engine, cf: ClusterFacts, stdin=None) -> int:
    """Rank 0's loop over stdin requests; the rank's exit code."""
    stdin = stdin or sys.stdin
    cfg = ring_worker_config(cf, model_name=None, host="127.0.0.1", port=1)
    pool, limits = engine_parts(cf, cfg, pipelined=engine.pipelined)
    sched = RingScheduler(engine, pool, limits,
                          lambda: {"mlx_active": engine.memory()["active"], "rss": 0})

    def read() -> None:
        try:
            while True:
                line = stdin.readline()
                req = json.loads(line) if line.strip() else {"op": "shutdown"}
                if req.get("op") != "generate":
                    return
                prompts = req.get("prompts") or [req["prompt"]]
                start = time.monotonic()
                outs, refusal = _generate(sched, prompts, int(req["max_tokens"]),
                                          bool(req.get("ignore_eos")))
                if refusal is not None:
                    emit("refused", reason=refusal)
                    continue
                elapsed = time.monotonic() - start
                total = sum(len(o) for o in outs)
                rows = max((len(decoded) for _, decoded, _ in list(sched.step_log)), default=0)
                emit("done", tokens=outs[0], outputs=outs, seconds=elapsed,
                     tokens_per_s=total / elapsed if elapsed > 0 else None, most_rows=rows,
                     overlapped=engine.overlapped)
        finally:
            sched.stop()

    threading.Thread(target=read, name="stdin", daemon=True).start()
    fatal = sched.run_here()
    if fatal is not None:
        emit("error", rank=0, phase="run", reason=fatal.reason)
        return fatal.code
    try:
        engine.shutdown()
    except RingFailure as err:
        emit("error", rank=0, phase="shutdown", reason=err.reason)
        return err.code
    return EXIT_OK
