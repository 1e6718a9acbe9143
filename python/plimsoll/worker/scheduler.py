"""The worker's scheduler: the one owner of the engine and the KV pool.

Why a thread: MLX compute blocks, so the engine runs on one dedicated thread and the
HTTP side (asyncio) talks to it only through :meth:`Scheduler.submit` and per-request
event sinks. Every engine call and every pool verb happens on that thread, so neither
needs a lock; the only shared state is the submission inbox and a published stats dict.

Each loop iteration: take new submissions into the bounded waiting queue (over the
bound: refused at once), expire waiters past their deadline, check the trip, admit
waiters FIFO while the pool and ``max_num_seqs`` allow (a request reserves
``prompt + max_tokens`` blocks *before* prefill; a retained prefix it extends is moved
into it, so only new tokens are prefilled), run one batched decode step, and finish
sequences that hit ``max_tokens``, EOS or were cancelled (their KV kept as a prefix
when the cache cap allows). Running out is an event (``Refused``) for the HTTP edge to
turn into a 503 with ``Retry-After`` — never a crash, never growth past the pool.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plimsoll.engine.pool import KVPool, Plan, Refusal

log = logging.getLogger("plimsoll.worker")


# --- events delivered to a request's sink (on the scheduler thread; sinks must not block) --
@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Token:
    token_id: int


@dataclass(frozen=True)
class Finished:
    reason: str  # "length" | "eos" | "stop" (constraint done) | "cancelled"
    completion_tokens: int


@dataclass(frozen=True)
class Refused:
    status: int
    message: str
    code: str
    retry_after: int | None = None


Event = Started | Token | Finished | Refused
Sink = Callable[[Event], None]


@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    sink: Sink
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    constraint: Any = None  # a TokenConstraint (engine/work.py): masks every sampled token
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float = 0.0


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_queue: int
    max_wait_s: float
    trip_bytes: int
    retry_after_s: int = 1


class Scheduler:
    """Owns engine + pool on one thread; see the module docstring for the loop."""

    def __init__(self, setup: Callable[[contextlib.ExitStack], tuple[Any, KVPool]],
                 limits: SchedulerLimits, memory_probe: Callable[[], dict[str, int]]):
        """``setup`` runs on the scheduler thread (MLX streams are per thread): it loads the
        engine, enters process-wide limits on the exit stack (restored when the thread
        ends) and returns the engine and its pool."""
        self._setup = setup
        self.limits = limits
        self.memory_probe = memory_probe  # {"mlx_active": …, "rss": …}
        self.engine: Any = None
        self.pool: KVPool | None = None
        self.eos_ids: set[int] = set()
        self.ready = threading.Event()
        self.setup_error: BaseException | None = None
        self._inbox: collections.deque[GenRequest] = collections.deque()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._running: dict[int, GenRequest] = {}
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tripped = ""  # why the worker is over a memory line; "" when it is not
        self.counters: collections.Counter[str] = collections.Counter()
        self.stats: dict[str, Any] = {}

    # --- called from any thread ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plimsoll-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, req: GenRequest) -> None:
        """Queue a request; its sink receives Started/Token…/Finished, or one Refused."""
        req.deadline = time.monotonic() + self.limits.max_wait_s
        with self._wake:
            self._inbox.append(req)
            self._wake.notify()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    # --- the scheduler thread -----------------------------------------------------------
    def _run(self) -> None:
        with contextlib.ExitStack() as stack:
            try:
                self.engine, self.pool = self._setup(stack)
                self.eos_ids = set(self.engine.tokenizer.eos_token_ids or ())
                self._publish()
            except BaseException as err:
                self.setup_error = err
                return
            finally:
                self.ready.set()
            self._loop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:  # a bug must not leave clients hanging: fail everything loudly
                log.exception("scheduler iteration failed; cancelling all requests")
                self._fail_all("internal error in the worker's scheduler")
            with self._wake:
                if not self._inbox and not self._running and not self._stop.is_set():
                    self._wake.wait(timeout=0.25 if self._waiting else None)
        self._fail_all("the worker is shutting down")

    def _iterate(self) -> None:
        self._take_inbox()
        self._expire_waiting()
        self._check_trip()
        self._admit_waiting()
        self._finish_cancelled()
        if self._running:
            self._decode_step()
        self._publish()

    def _take_inbox(self) -> None:
        with self._wake:
            new = list(self._inbox)
            self._inbox.clear()
        for req in new:
            if self.tripped:
                self._refuse(req, 503, f"memory trip: {self.tripped}; the worker refuses new "
                             "work until memory comes back", "memory_trip")
            elif len(self._waiting) >= self.limits.max_queue:
                self._refuse(req, 503, f"the waiting queue is full ({self.limits.max_queue} "
                             "requests): retry later", "queue_full")
            else:
                self._waiting.append(req)

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        kept: collections.deque[GenRequest] = collections.deque()
        for req in self._waiting:
            if req.cancelled.is_set():
                self.counters["cancelled"] += 1
            elif now >= req.deadline:
                # name what it waited for: blocks (the pool) or a sequence slot (the queue)
                plan = self.pool.plan(req.prompt, req.max_tokens)
                blocks = isinstance(plan, Refusal)
                message = plan.message if blocks else (
                    f"all {self.limits.max_num_seqs} sequence slots stayed busy")
                self._refuse(req, 503, f"waited {self.limits.max_wait_s:g} s: {message}",
                             "pool_exhausted" if blocks else "queue_timeout")
            else:
                kept.append(req)
        self._waiting = kept

    def _check_trip(self) -> None:
        over = self._over_trip()
        if over and self.pool.cached:
            for handle in self.pool.drop_cached():
                self.engine.drop_prefix(handle)
            self.engine.clear_cache()
            self.counters["trips"] += 1
            log.warning("trip: %s; dropped cached prefixes", over)
            over = self._over_trip()
        if over and not self.tripped:
            log.error("trip: %s after the emergency clear; refusing new work", over)
        self.tripped = over
        if over:
            self._shed(over)

    def _shed(self, why: str) -> None:
        """Still over after the clear: refuse everyone waiting and abort the newest running
        request (one per iteration, so the oldest work finishes if that is enough)."""
        message = f"memory trip: {why}; request aborted to keep the worker under its line"
        while self._waiting:
            self._refuse(self._waiting.popleft(), 503, message, "memory_trip")
        if self._running:
            req = self._running.pop(max(self._running))
            self.engine.finish(req.id, retain=False)
            self.pool.release(req.id)
            self.engine.clear_cache()
            self._refuse(req, 503, message, "memory_trip")

    def _over_trip(self) -> str:
        """Why memory is over a line ("" when it is not): the trip, or the guard's soft line.

        ``guard_usage``/``guard_soft`` come from the per-process guard (:mod:`plimsoll.guard`:
        the worker's cgroup, or its own footprint): its whole footprint, not only MLX's.
        """
        mem = self.memory_probe()
        for name in ("mlx_active", "rss"):
            if mem.get(name, 0) > self.limits.trip_bytes:
                return f"{name}={mem[name]} B is over the trip at {self.limits.trip_bytes} B"
        soft = mem.get("guard_soft")
        if soft and mem.get("guard_usage", 0) > soft:
            return (f"memory usage {mem['guard_usage']} B is over the guard's soft line "
                    f"at {soft} B")
        return ""

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._running) < self.limits.max_num_seqs:
            if self._running and self._over_trip():  # each prefill can be a spike
                return
            req = self._waiting[0]
            plan = self.pool.plan(req.prompt, req.max_tokens)
            if isinstance(plan, Refusal):
                if plan.never_fits:
                    self._waiting.popleft()
                    self._refuse(req, 503, plan.message, "pool_exhausted")
                    continue
                return  # FIFO: the head waits for blocks; nothing jumps the queue
            self._waiting.popleft()
            self._start(req, plan)

    def _start(self, req: GenRequest, plan: Plan) -> None:
        self.pool.admit(req.id, plan)
        for handle in plan.evict:
            self.engine.drop_prefix(handle)
        try:
            extra = {"constraint": req.constraint} if req.constraint is not None else {}
            res = self.engine.add(req.id, req.prompt, req.max_tokens, prefix=plan.prefix,
                                  temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                  **extra)
        except Exception as err:
            self.pool.release(req.id)
            log.exception("prefill failed")
            self._refuse(req, 500, f"prefill failed: {err}", "engine_error")
            return
        self.counters["admitted"] += 1
        self._running[req.id] = req
        req.sink(Started(len(req.prompt), res.reused_tokens))
        self._emit(req, res.first_token)

    def _decode_step(self) -> None:
        for seq_id, token in self.engine.step():
            self._emit(self._running[seq_id], token)

    def _emit(self, req: GenRequest, token: int) -> None:
        req.sink(Token(token))
        generated = self.engine.generated(req.id)
        if token in self.eos_ids:
            self._finish(req, "eos")
        elif req.constraint is not None and req.constraint.done():
            self._finish(req, "stop")
        elif generated >= req.max_tokens:
            self._finish(req, "length")

    def _finish_cancelled(self) -> None:
        for req in [r for r in self._running.values() if r.cancelled.is_set()]:
            self._finish(req, "cancelled")

    def _finish(self, req: GenRequest, reason: str) -> None:
        generated = self.engine.generated(req.id)
        del self._running[req.id]
        written = self.engine.written_tokens(req.id)
        if self.pool.can_retain(req.id, written):
            prefix = self.engine.finish(req.id, retain=True)
            for handle in self.pool.retain(req.id, prefix.handle, prefix.tokens):
                self.engine.drop_prefix(handle)
        else:
            self.engine.finish(req.id, retain=False)
            self.pool.release(req.id)
        self.counters[reason] += 1
        req.sink(Finished(reason, generated))

    def _refuse(self, req: GenRequest, status: int, message: str, code: str) -> None:
        self.counters[f"refused_{code}"] += 1
        retry = self.limits.retry_after_s if status == 503 else None
        req.sink(Refused(status, message, code, retry))

    def _fail_all(self, message: str) -> None:
        for req in list(self._running.values()):
            try:
                self.engine.finish(req.id, retain=False)
                self.pool.release(req.id)
            except Exception:  # already gone
                log.exception("cleanup of %s failed", req.id)
            req.sink(Refused(500, message, "worker_error"))
        self._running.clear()
        with self._wake:
            pending = list(self._inbox) + list(self._waiting)
            self._inbox.clear()
        self._waiting.clear()
        for req in pending:
            req.sink(Refused(503, message, "worker_stopping", self.limits.retry_after_s))

    def _publish(self) -> None:
        """A consistent snapshot for /v1/plimsoll/status (read from other threads)."""
        self.stats = {
            "pool": self.pool.stats(),
            "running": len(self._running),
            "waiting": len(self._waiting) + len(self._inbox),
            "kv_bytes_held": self.engine.kv_bytes_held(),
            "kv_bytes_peak": self.engine.kv_bytes_peak(),
            "tripped": bool(self.tripped),
            "trip_reason": self.tripped,
            "counters": dict(self.counters),
        }
