"""Rank 0 serves HTTP: the worker's own API over the ring (no mlx imported here).

Why the worker's code and not a copy: :func:`plimsoll.worker.app.make_app` takes a
backend, and this module gives it one whose scheduler is the worker's own
:class:`~plimsoll.worker.scheduler.Scheduler` driving a :class:`RingEngine` instead of a local
engine. So the routes, OpenAI/Anthropic parsing, chat templates, SSE streaming, the
bounded waiting queue (full → 503 ``queue_full``), per-request admission against the
pool (``prompt + max_tokens`` blocks, over the committed context → 400) and the error
shapes are the same code as a single-process worker's.

Threads: the ring's collectives stay on the main thread, where the rank joined the ring
and loaded its layers: :meth:`RingScheduler.run_here` runs the scheduler's loop there.
uvicorn runs in a thread of its own and talks to the loop only through ``submit`` and
the per-request event sinks (the scheduler's inbox is the bounded queue between them).

The pool on rank 0 counts token blocks for the whole ring: a sequence of ``n`` tokens
holds ``ceil(n / block_tokens)`` blocks on *every* rank, so the binding total is the
smallest pool any rank was admitted with. Prefix retention is off (cache cap 0): every
request prefills its whole prompt.

Failure: an op that fails (a peer lost, this rank ran out) breaks the leader; the loop
then answers every request in flight with a reasoned error (a 500 body or an SSE error
event naming the rank and the cause), stops, and the rank exits with the failure's
code, which tears the ring down. An idle leader pings the ring every
:data:`PING_S` seconds, so a dead peer is noticed without traffic too.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from plimsoll.cluster.exits import EXIT_OK, EXIT_OTHER, RingFailure, emit
from plimsoll.cluster.plan import cache_limit_mib
from plimsoll.core.sizing import DEFAULT_OUTPUT_TOKENS, default_output, fixed_blocks
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.worker.events import SchedulerLimits
from plimsoll.worker.pool import BlockPool
from plimsoll.worker.prompt_pieces import PromptTokenizer
from plimsoll.worker.scheduler import Scheduler

log = logging.getLogger("plimsoll.cluster")
PING_S = 2.0
SERVE_TIMEOUT_S = 60.0


class _Done:
    """A ring step's result: the ring runs each step to completion before it returns."""

    def __init__(self, result: dict[int, int]):
        self._result = result

    def result(self) -> dict[int, int]:
        return self._result


class RingEngine:
    """The engine interface the worker's scheduler drives, over rank 0's ring leader.

    One sequence per slot (the scheduler's ``max_batch`` is the number of slots, so a
    free slot always exists when it admits). The ring prefills a whole prompt at once on
    every rank (``leader.new``), so a prompt's chunks are gathered until its last one, and
    a decode steps its slot once; steps run to completion (no pipelining across ranks).
    The ring keeps its own KV per slot: the scheduler's pool only counts its blocks
    (sharing is off: ``BlockPool(sharing=False)``). Not thread-safe: one owner (the
    scheduler loop, on the main thread).
    """

    def __init__(self, leader, tokenizer, facts, slots: int, block_bytes: int):
        self.leader, self.tokenizer, self.facts = leader, tokenizer, facts
        self.block_bytes = block_bytes
        self.state_bytes_per_seq = 0
        self._free = list(range(slots))
        self._slots: dict[int, int] = {}
        self._prompts: dict[int, list[int]] = {}
        self._max_tokens: dict[int, int] = {}
        self._peak = 0

    def expect(self, seq_id: int, max_tokens: int) -> None:
        """The scheduler admitted ``seq_id`` with this output reservation."""
        self._max_tokens[seq_id] = max_tokens
        self._prompts[seq_id] = []

    def run_async(self, step) -> _Done:
        out: dict[int, int] = {}
        for w in step.prefills:
            self._prompts[w.seq_id].extend(w.tokens)
            if w.sample:
                slot = self._free.pop(0)
                try:
                    out[w.seq_id] = self.leader.new(
                        slot, self._prompts.pop(w.seq_id), self._max_tokens[w.seq_id],
                        w.sampling.temperature, w.sampling.top_p, w.sampling.seed)
                except BaseException:
                    self._free.insert(0, slot)
                    raise
                self._slots[w.seq_id] = slot
        for w in step.decodes:
            out[w.seq_id] = self.leader.step(self._slots[w.seq_id])
        self._note()
        return _Done(out)

    def free_state(self, seq_id: int) -> None:
        self._prompts.pop(seq_id, None)
        self._max_tokens.pop(seq_id, None)
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            if self.leader.broken is None:
                self.leader.free(slot)
            self._free.append(slot)

    def restore_state(self, key, seq_id: int) -> None:
        raise KeyError(f"snapshot {key}: the ring keeps no prefixes")

    def snapshot_state(self, seq_id: int, key) -> None:
        raise KeyError("the ring keeps no prefixes")

    def drop_snapshot(self, key) -> None:
        pass

    def clear_cache(self) -> None:
        self.leader.clear_cache()

    def kv_bytes_allocated(self) -> int:
        return self.leader.kv_bytes_held()

    def state_bytes_held(self) -> int:
        return 0

    def _note(self) -> None:
        self._peak = max(self._peak, self.kv_bytes_allocated())

    @property
    def open_slots(self) -> int:
        return len(self._slots)


class RingScheduler(Scheduler):
    """The worker's scheduler, run on the calling thread, that stops when the ring breaks."""

    def __init__(self, engine: RingEngine, pool: BlockPool, limits: SchedulerLimits,
                 memory_probe):
        super().__init__(lambda _stack: (engine, pool), limits, memory_probe)
        self.fatal: RingFailure | None = None

    def run_here(self) -> RingFailure | None:
        """The scheduler loop on this thread (the ring's), until stopped or the ring fails."""
        beat = threading.Thread(target=self._heartbeat, name="ring-heartbeat", daemon=True)
        beat.start()
        self._run()
        return self.fatal

    def _heartbeat(self) -> None:
        while not self._stop.wait(PING_S / 2):
            self.wake()

    def _admit(self, req, grant):
        self.engine.expect(req.id, req.max_tokens)
        return super()._admit(req, grant)

    def iterate(self) -> None:
        leader = self.engine.leader
        with contextlib.suppress(RingFailure):
            super().iterate()
            if not self._running and time.monotonic() - leader.last_op >= PING_S:
                leader.ping()
        if leader.broken is not None and self.fatal is None:
            self.fatal = leader.broken
            log.error("the ring failed: %s", self.fatal.reason)
            self._fail_all(f"the cluster was torn down: {self.fatal.reason}")
            self._publish()
            self._stop.set()


# ------------------------------------------------------------------ the figures


@dataclass
class ClusterFacts:
    """What rank 0 knows after the commit: every rank's plan, answer and loaded figures."""

    model_dir: Path
    request: Any  # ClusterRequest
    decision: Any  # ClusterDecision
    answers: list  # [Preflight], by rank
    loaded: list[dict]  # every rank's ready figures, by rank
    facts: Any  # ModelFacts of the whole model
    tokenizer: Any = field(repr=False, default=None)

    @property
    def pool_blocks(self) -> int:
        """The ring's pool: the smallest any rank was admitted with (every rank holds every
        sequence's tokens for its layers)."""
        return min(a.decision.pool_blocks for a in self.answers)

    @property
    def fixed_blocks_per_seq(self) -> int:
        return max(fixed_blocks(a.plan.per_sequence_fixed_bytes, a.decision.block_bytes)
                   for a in self.answers)

    @property
    def max_tokens(self) -> int:
        return min(a.decision.output_reservation for a in self.answers)

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank's layers, shares and admission figures (for the status report)."""
        out = []
        for a, got in zip(self.answers, self.loaded, strict=True):
            d, p = a.decision, a.plan
            out.append({
                "rank": a.rank, "pid": got.get("pid"), "host": got.get("host", ""),
                "layers": [p.layer_start, p.layer_end], "weights_bytes": p.weights_bytes,
                "loaded_bytes": got.get("loaded_bytes"), "comm_bytes": p.comm_bytes,
                "backend": got.get("backend"), "transport_bytes": p.transport_bytes,
                "messages": got.get("messages"),
                "kv_bytes_per_token": p.kv_bytes_per_token,
                "per_sequence_fixed_bytes": p.per_sequence_fixed_bytes,
                "pool_blocks": d.pool_blocks, "block_bytes": d.block_bytes,
                "footprint_bytes": d.footprint_bytes,
                "gpu_memory_utilization": d.gpu_memory_utilization,
                "allocation_limit_bytes": d.allocation_limit_bytes,
                "memory_limit_applied_bytes": got.get("memory_limit_applied_bytes"),
                "ceiling_bytes": d.ceiling_bytes, "budget_bytes": d.budget_bytes,
                "concurrency": d.concurrency, "context": d.context,
                "active_memory_at_load_bytes": got.get("active_memory_bytes"),
            })
        return out


def ring_worker_config(cf: ClusterFacts, *, model_name: str | None, host: str, port: int,
                       default_max_tokens: int = DEFAULT_OUTPUT_TOKENS, max_queue: int = 64,
                       max_wait_s: float = 30.0, trip_offset: float = 0.05) -> WorkerConfig:
    """Rank 0's worker configuration: the committed concurrency and context, the ring's
    pool, rank 0's own allocation limit and trip (the memory it can see)."""
    d0 = cf.answers[0].decision
    max_tokens = cf.max_tokens
    return WorkerConfig(
        model_dir=cf.model_dir, model_name=model_name or cf.model_dir.name,
        max_cache_blocks=cf.pool_blocks, gpu_memory_utilization=d0.gpu_memory_utilization,
        cache_memory_mb=0, max_num_seqs=cf.decision.concurrency, context=cf.decision.context,
        block_tokens=cf.request.block_tokens, max_tokens=max_tokens,
        default_max_tokens=default_output(max_tokens, default_max_tokens), max_queue=max_queue,
        max_wait_s=max_wait_s, ceiling_bytes=d0.ceiling_bytes,
        total_ram_bytes=d0.total_ram_bytes, trip_offset=trip_offset,
        mlx_cache_mb=cache_limit_mib(d0.transient_reserve_bytes), host=host, port=port)


def engine_parts(cf: ClusterFacts, cfg: WorkerConfig, *, pipelined: bool = False
                 ) -> tuple[BlockPool, SchedulerLimits]:
    """The scheduler's pool and figures when every rank runs its layers on its engine.

    The pool is a local worker's (sharing on; hybrid when any layer holds state or a
    window, since every rank snapshots its own), with the cluster's common block count
    and the largest per-sequence fixed blocks of any rank; prefix retention stays off
    (cache cap 0), as the cluster admits no prefix cache. A step computes at most the
    request's prefill chunk of prompt tokens (what the plan's activation messages are
    sized by), for up to the committed concurrency of sequences. ``pipelined`` (the
    engine's): the decodes go in alternate halves, so two steps overlap across the ranks."""
    hybrid = any(c.kind in ("state", "window") for c in cf.facts.caches)
    pool = BlockPool(total=cfg.max_cache_blocks, block_tokens=cfg.block_tokens,
                     cache_cap_blocks=0, fixed_blocks_per_seq=cf.fixed_blocks_per_seq,
                     hybrid=hybrid,
                     extra_key=f"{cf.model_dir.resolve()}|{cf.facts.kv_format}".encode())
    limits = SchedulerLimits(cfg.max_num_seqs, cfg.max_queue, cfg.max_wait_s, cfg.trip_bytes,
                             max_batch=cfg.max_num_seqs,
                             prefill_tokens=min(cf.request.prefill_chunk, cfg.context),
                             split_decodes=pipelined)
    return pool, limits


# ------------------------------------------------------------------ serving


def ring_backend(sched: RingScheduler, cf: ClusterFacts, leader, guard):
    """The worker app's backend over a ring scheduler that runs elsewhere (the main thread)."""
    import psutil

    proc = psutil.Process()

    @contextlib.asynccontextmanager
    async def backend(cfg: WorkerConfig) -> AsyncIterator[dict[str, Any]]:
        ready = await run_in_threadpool(sched.ready.wait, SERVE_TIMEOUT_S)
        if not ready or sched.setup_error is not None:
            raise RuntimeError(f"the ring scheduler did not start: {sched.setup_error}")

        tokenizer = PromptTokenizer(cf.tokenizer)

        def status_extra() -> dict[str, Any]:
            return {"prompt_pieces": tokenizer.figures(), "cluster": {
                "world_size": len(cf.answers), "backend": cf.request.backend,
                "stage": cf.request.stage, "parallel": cf.request.parallel,
                "pipelined": bool(getattr(sched.engine, "pipelined", False)),
                "decision": cf.decision.model_dump(), "ranks": cf.ranks(),
                "slots_open": sched.engine.open_slots,
                "failed": sched.fatal.reason if sched.fatal else None}}

        try:
            yield {"scheduler": sched, "tokenizer": tokenizer,
                   "native_max_context": cf.facts.native_max_context,
                   "block_bytes": cf.facts.kv_bytes_per_token * cfg.block_tokens,
                   "kv_bytes_per_token": cf.facts.kv_bytes_per_token,
                   "applied_limits": {
                       "memory_limit_applied_bytes": cf.loaded[0].get(
                           "memory_limit_applied_bytes"),
                       "cache_limit_applied_bytes": cfg.mlx_cache_bytes,
                       "wired_limit_applied_bytes": 0},
                   "engine_memory": leader.memory, "rss": lambda: proc.memory_info().rss,
                   "guard": guard, "status_extra": status_extra}
        finally:
            sched.stop()  # uvicorn is done: the ring loop ends, then the ring shuts down

    return backend


def serve_http(leader, cf: ClusterFacts, args, engine=None) -> int:
    """Rank 0: uvicorn in a thread, the ring loop here; the exit code for the rank.

    ``engine`` (a :class:`plimsoll.cluster.engine_stage.StageEngine`, also the
    ``leader``): the scheduler drives every rank's own engine, with a sharing pool
    (:func:`engine_parts`); without it, the slot leader through :class:`RingEngine`.

    SIGTERM/SIGINT stop uvicorn gracefully (in-flight requests get a bounded time), then
    the loop, then the ring (SHUTDOWN to every rank): exit 0. A ring failure answers every
    request in flight with its reason, stops uvicorn and exits with the failure's code.
    """
    import psutil
    import uvicorn

    from plimsoll.guard.process import SelfGuard, memory_probe_with_guard
    from plimsoll.web.serve import basic_logging, uvicorn_options
    from plimsoll.worker.app import make_app

    basic_logging()
    cfg = ring_worker_config(cf, model_name=args.model_name, host=args.serve_host,
                             port=args.serve_port, default_max_tokens=args.default_max_tokens,
                             max_queue=args.max_queue, max_wait_s=args.max_wait,
                             trip_offset=args.trip_offset)
    if engine is None:
        pool = BlockPool(total=cfg.max_cache_blocks, block_tokens=cfg.block_tokens,
                         cache_cap_blocks=0, fixed_blocks_per_seq=cf.fixed_blocks_per_seq,
                         sharing=False)
        engine = RingEngine(leader, cf.tokenizer, cf.facts, cfg.max_num_seqs,
                            cf.facts.kv_bytes_per_token * cfg.block_tokens)
        limits = SchedulerLimits(cfg.max_num_seqs, cfg.max_queue, cfg.max_wait_s,
                                 cfg.trip_bytes, max_batch=cfg.max_num_seqs,
                                 prefill_tokens=cfg.context)
    else:
        pool, limits = engine_parts(cf, cfg, pipelined=engine.pipelined)
    proc = psutil.Process()
    guard = SelfGuard.find()
    probe = memory_probe_with_guard(
        lambda: {"mlx_active": leader.memory()["active"], "rss": proc.memory_info().rss}, guard)
    sched = RingScheduler(engine, pool, limits, probe)
    app = make_app(cfg, backend=ring_backend(sched, cf, leader, guard))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, **uvicorn_options(
        limit_concurrency=cfg.max_queue + cfg.max_num_seqs + 16, graceful_s=5)))

    def run_server() -> None:
        try:
            server.run()
        finally:
            sched.stop()  # uvicorn ended (stopped, or never bound): end the loop too

    def announce() -> None:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline and web.is_alive() and not server.started:
            time.sleep(0.05)
        if server.started:
            emit("serving", rank=0, url=f"http://{cfg.host}:{cfg.port}", model=cfg.model_name,
                 concurrency=cfg.max_num_seqs, context=cfg.context,
                 pool_blocks=cfg.max_cache_blocks, max_tokens=cfg.max_tokens)
        else:
            emit("error", rank=0, phase="serve",
                 reason=f"HTTP did not start on {cfg.host}:{cfg.port} (port in use?)")
            sched.stop()

    def on_signal(signum, _frame) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    web = threading.Thread(target=run_server, name="uvicorn", daemon=True)
    web.start()
    threading.Thread(target=announce, name="announce", daemon=True).start()
    fatal = sched.run_here()
    server.should_exit = True
    web.join(10.0)
    if fatal is not None:
        emit("error", rank=0, phase="run", reason=fatal.reason)
        return fatal.code
    served = server.started
    try:
        leader.shutdown()
    except RingFailure as err:
        emit("error", rank=0, phase="shutdown", reason=err.reason)
        return err.code
    return EXIT_OK if served else EXIT_OTHER

