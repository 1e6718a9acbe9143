"""The worker's scheduler: the one owner of the engine and the block pool.

Why a thread: MLX compute blocks, so the engine runs on one thread and the rest (the engine
process's reader of the API's messages, :mod:`.engine_proc`; a clustered rank 0's HTTP side)
talks to it only through :meth:`Scheduler.submit`, :meth:`Scheduler.cancel` and
per-request event sinks. Every engine call and pool verb happens on that thread, so neither
needs a lock; the only shared state is the submission inbox and a published stats dict.

Each loop iteration (vLLM v1's token-budget step, mlx-lm's pipelining):

1. take new submissions into the bounded waiting queue (over the bound: refused at once),
   check the trip, end cancelled sequences;
2. plan one :class:`~plimsoll.engine.work.Step`: a decode for every running sequence (or,
   with ``split_decodes``, for the half with no token in flight: :meth:`Scheduler._decoding`),
   then prompt chunks of prefilling sequences and of waiters admitted now (FIFO, while
   ``max_batch`` and the pool allow: :func:`.waiting.admit_waiting`) up to
   ``prefill_tokens`` per step, so a long prompt delays running streams by at most one chunk
   per step. Admission maps every prompt block already held or cached (a shared prefix: no
   copy, no recompute) and reserves ``ceil((prompt + max_tokens) / block)`` blocks;
   physical blocks are taken as tokens are written;
3. submit it (``engine.run_async``) *before* reading the previous step's tokens, so graph
   building overlaps compute: a running sequence's decode names ``tokens=None`` ("the
   token you sampled last step"); the token a sequence that ended last step samples
   now is dropped (its write lies inside its reservation: positions < prompt + max_tokens).
   A step with prompt chunks reads the previous step's tokens first (its encoding can take
   nearly a whole step's time, which running streams should not wait for);
4. expire waiters past their deadline, telling each what it waited for: blocks, a decode
   slot, or other prompts' prefill (never a vague "slots busy");
5. read the previous step's tokens, emit them, and end sequences that hit ``max_tokens``,
   EOS or a finished constraint. Their full blocks stay cached (hashes registered): no
   compaction, no moves.

Speculation (``--prompt-lookup``, ``--draft-model``, MTP heads) is :mod:`.speculate`'s, called
through :mod:`.speculate_steps` at the points of the loop that module names (the previous
step read first where a sequence's drafts need its tokens, the drafts as Works, a verified
step's tokens settled when read, each iteration timed for the cost of a verifying step).

Running out is an event (``Refused``) for the HTTP edge to turn into a 503 with
``Retry-After`` — never a crash, never growth past the pool. This module is the thread, the
loop and the plan; :mod:`.waiting` is admission's side (intake, which waiters a step admits,
expiry, what a waiter waits for), :mod:`.prefix` what a prompt takes from earlier ones and
leaves for later ones (an admission's hit blocks, the chunks, registered blocks, snapshots),
:mod:`.trip` the memory lines and what a trip sheds, :mod:`.stats` the published figures.
Per step (Python here is decode time lost on a GPU): the memory probe and the status
snapshot run on a cadence; full blocks are hashed only when a block fills; ``Sampling`` is
built once; the pool hands back one table until it grows.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from plimsoll.engine.threads import wait_gone
from plimsoll.engine.work import Step, Work
from plimsoll.worker.pool import BlockPool, Grant
from plimsoll.worker.trace import StepTrace

from . import prefix, speculate
from . import speculate_steps as spec
from .events import Finished, GenRequest, Refused, SchedulerLimits, Started, Token
from .stats import PUBLISH_INTERVAL_S, HostClock, status_figures
from .trip import MemoryLine, shed
from .waiting import Run, admit_waiting, end_reason, expire, hashes, intake, why_waiting

log = logging.getLogger("plimsoll.worker")


class Scheduler:
    """Owns engine + pool on one thread; see the module docstring for the loop."""

    def __init__(self, setup: Callable[[contextlib.ExitStack], tuple[Any, BlockPool]],
                 limits: SchedulerLimits, memory_probe: Callable[[], dict[str, int]],
                 flush: Callable[[], None] | None = None):
        """``setup`` runs on the scheduler thread (MLX streams are per thread): it loads the
        engine, enters process-wide limits on the exit stack (restored when the thread
        ends) and returns the engine and its pool. ``flush``, if given, is called once at
        the end of every pass of the loop: sinks that gather a pass's events (the engine
        process's) send them there as one message."""
        self._setup = setup
        self._flush = flush or (lambda: None)
        self.limits = limits
        self.line = MemoryLine(memory_probe)  # the trip and the guard's soft line
        self.engine: Any = None
        self.pool: BlockPool | None = None
        self.eos_ids: set[int] = set()
        self.ready = threading.Event()
        self.setup_error: BaseException | None = None
        self._inbox: collections.deque[GenRequest] = collections.deque()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._running: dict[int, Run] = {}  # admission order
        self._pending: tuple[Any, int] | None = None  # (Pending, step number)
        self._stale_states: list[tuple[int, int]] = []  # (seq_id, free after step n)
        self._steps = 0
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters: collections.Counter[str] = collections.Counter()
        self.kv_bytes_peak = 0
        #: The last steps as planned: (step, decoded seq ids, {seq id: prefill tokens}).
        self.step_log: collections.deque[tuple[int, tuple[int, ...], dict[int, int]]] = (
            collections.deque(maxlen=4096))
        self.stats: dict[str, Any] = {}
        self._published_at = 0.0  # monotonic time of the last snapshot
        self._dirty = True        # something a reader sees changed besides the step count
        self.disk: Any = None  # the tier under the pool (worker/disk_restore.DiskTier) or None
        self.drafter: speculate.Drafter | None = None  # speculation (worker/speculate) or None: off
        self.warmer: Any = None  # attention plans built while idle (engine.warmup.PlanWarmer)
        self.trace = StepTrace.from_env()  # PLIMSOLL_STEP_TRACE: memory per step (diagnosis)
        self.host = HostClock()  # this thread's time in steady decode, by part (the status)
        self._decode_pass = False  # this pass submitted a step of decode rows only

    @property
    def tripped(self) -> str:
        """Why the worker is over a memory line; "" when it is not."""
        return self.line.tripped

    # --- called from any thread ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plimsoll-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """The loop on the calling thread until :meth:`stop` (what :meth:`start` runs on a
        thread of its own); the engine then belongs to this thread."""
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():  # its native exit too (MLX's TLS: engine.threads)
                wait_gone(self._thread, 2.0)

    def submit(self, req: GenRequest) -> None:
        """Queue a request; its sink receives Started/Token…/Finished, or one Refused."""
        req.deadline = time.monotonic() + self.limits.max_wait_s
        with self._wake:
            self._inbox.append(req)
            self._wake.notify()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    def cancel(self, req: GenRequest) -> None:
        """End ``req`` (a client that left, a stop string, a drain that ran out): its blocks
        are freed at the next pass."""
        req.cancelled.set()
        self.wake()

    # --- the scheduler thread -----------------------------------------------------------
    def _run(self) -> None:
        with contextlib.ExitStack() as stack:
            try:
                parts = self._setup(stack)  # (engine, pool) or (engine, pool, limits)
                self.engine, self.pool = parts[0], parts[1]
                if len(parts) > 2:  # figures that need the loaded engine (its transients)
                    self.limits = parts[2]
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
            self._decode_pass = False
            self.host.begin_pass()
            try:
                self.iterate()
            except Exception:  # a bug must not leave clients hanging: fail everything loudly
                log.exception("scheduler iteration failed; cancelling all requests")
                self._fail_all("internal error in the worker's scheduler")
            with self._wake:
                idle = (not self._inbox and not self._running and self._pending is None
                        and not self._stop.is_set())
            if idle and self.warmer is not None:
                self._flush()  # the last pass's events (a request's end) go out before it
                if self.trace is not None:
                    self.trace.line(self.engine, "warm")
                if self.warmer.step():
                    continue  # one attention plan built ahead; the inbox is looked at first
            if idle:  # fresh figures for whoever reads them while nothing runs
                self._publish()
            self.host.timed("flush", self._flush)
            self.host.end_pass(self._decode_pass)
            with self._wake:
                if (not self._inbox and not self._running and self._pending is None
                        and not self._stop.is_set()):
                    self._wake.wait(timeout=0.25 if self._waiting else None)
        if self._pending is not None:  # the step in flight ends before its blocks are freed
            with contextlib.suppress(Exception):
                self._pending[0].result()
        self._fail_all("the worker is shutting down")
        self._flush()
        if self.disk is not None:  # a clean stop: every cached block goes to disk
            self.disk.shutdown(self.pool)

    def iterate(self) -> None:
        """One step of the loop (public for pure tests that drive it with a fake engine)."""
        began = self.host.now()
        if self.line.due(bool(self._running)):  # before intake: a trip is judged on memory
            self._check_trip()  # now, not refused on a reading from before memory came back
            self.host.part("probe", began)
        self._take_inbox()
        self._end_cancelled()
        spec.begin_step(self.drafter)  # the retry clock
        if self._pending is not None and spec.drafting_waits(self.drafter, self._running):
            previous, self._pending = self._pending, None  # its drafts need its tokens
            self.counters["speculation_unpipelined"] += 1
            self._read(*previous)
        spec.prepare(self.drafter, self.pool, self._running)  # a draft model's batch
        step = self._plan()
        if self.trace is not None and (step.decodes or step.prefills):
            self.trace.line(self.engine, "step", step, self._steps + 1)
        submitted = None
        self.line.spiked = bool(step.prefills)  # a prefill's transient: probe next iteration
        if step.decodes or step.prefills:
            self._steps += 1
            heavy = any(not w.draft for w in step.prefills)  # a prompt chunk, not drafts
            if (heavy and self._pending is not None  # tokens out before heavy work, unless
                    and not spec.planned_ahead(self.drafter, step)):  # planned on them
                previous, self._pending = self._pending, None
                self._read(*previous)
            submitted = (self.host.timed("build", self.engine.run_async, step), self._steps)
            self._decode_pass = not step.prefills
            prefix.after_submit(self.pool, self.engine, self._running, step, self.counters)
        self._expire_waiting()  # after one admission attempt, so --max-wait 0 means "no wait"
        previous, self._pending = self._pending, submitted
        if previous is not None:
            self._read(*previous)
        if submitted is not None:
            spec.timed(self.drafter, step, time.perf_counter() - began[0])
        self._free_stale_states()
        self._maybe_publish()
        self.host.part("iterate", began)

    def _take_inbox(self) -> None:
        with self._wake:
            new = list(self._inbox)
            self._inbox.clear()
        if new:
            self._dirty = True
        for req, message, code in intake(new, self._waiting, self.tripped, self.limits.max_queue):
            self._refuse(req, 503, message, code)

    def _expire_waiting(self) -> None:
        if not self._waiting:
            return
        self._waiting, cancelled, expired = expire(self._waiting, time.monotonic())
        if cancelled:
            self.counters["cancelled"] += cancelled
        for req in expired:
            grant = self.pool.can_allocate(req.prompt, req.max_tokens, hashes(self.pool, req))
            code, why = why_waiting(req, grant, self._running.values(), self.limits)
            self._refuse(req, 503, f"waited {self.limits.max_wait_s:g} s: {why}", code)

    def _end_cancelled(self) -> None:
        for run in [r for r in self._running.values() if r.req.cancelled.is_set()]:
            self._finish(run, "cancelled")
        if self._waiting and any(r.cancelled.is_set() for r in self._waiting):
            self._dirty = True

    # --- planning -----------------------------------------------------------------------
    def _plan(self) -> Step:
        """Every running decode, then prompt chunks up to the per-step prefill budget."""
        decodes, prefills, chunks = [], [], {}
        budget = self.limits.prefill_tokens
        prompts = [run for run in self._running.values() if run.prefilling]
        for run in self._decoding():
            table = self.pool.grow(run.req.id, run.written + 1)
            if table is None:  # past its reservation: cannot happen, never raise for it
                log.error("sequence %s would pass its reservation; ended", run.req.id)
                self._finish(run, "length")
                continue
            if (verify := spec.verify_work(self.drafter, self.pool, run)) is not None:
                (prefills if verify.draft else decodes).append(verify)  # a token planned ahead
                continue
            token = None if run.pending else (run.tokens[-1],)
            decodes.append(Work(run.req.id, token, run.written, table, True,
                                run.sampling, run.req.constraint))
        for run in prompts:  # still prefilling, in admission order
            if budget <= 0:
                break
            budget -= self._chunk(run, budget, prefills, chunks)
        admit_waiting(self._waiting, self._running, self.limits, self.pool, self.line.over,
                      budget, prefills, self._refuse,
                      lambda req, grant, left: self._chunk(self._admit(req, grant), left,
                                                           prefills, chunks))
        self.step_log.append((self._steps + 1, tuple(w.seq_id for w in decodes), chunks))
        return Step(tuple(decodes), tuple(prefills))

    def _decoding(self) -> list[Run]:
        """The running sequences that decode this step: every one past its prompt and short of
        ``max_tokens``. With ``limits.split_decodes`` (a pipeline across ranks) only those with
        no token in flight, at most half of them (rounded up): consecutive steps then take
        disjoint halves, so one step runs on a rank while the step before runs on the next."""
        ready = [run for run in self._running.values()
                 if not run.prefilling and run.generated + run.pending < run.req.max_tokens]
        if not self.limits.split_decodes:
            return ready
        return [run for run in ready if not run.pending][:-(-len(ready) // 2)]

    def _admit(self, req: GenRequest, grant: Grant) -> Run:
        """``req`` joins the running batch (its blocks: :func:`.prefix.admit`)."""
        run = self._running[req.id] = prefix.admit(self.pool, self.engine, self.disk, req, grant)
        self.counters["admitted"] += 1
        self._dirty = True
        req.sink(Started(len(req.prompt), run.cached_tokens))
        return run

    def _chunk(self, run: Run, budget: int, prefills: list[Work], chunks: dict[int, int]) -> int:
        """The next chunk of ``run``'s prompt, planned (:func:`.prefix.chunk`); its size."""
        prefills.append(work := prefix.chunk(self.pool, self.limits.chunk_for, run, budget,
                                             self.limits.chunk_align))
        chunks[run.req.id] = work.length
        return work.length

    # --- after a step -------------------------------------------------------------------
    def _read(self, pending: Any, step: int) -> None:
        """The tokens of step ``step``: emit them, end finished sequences. A token of a
        sequence that ended meanwhile is dropped."""
        for seq_id, out in self.host.timed("wait", pending.result).items():
            run = self._running.get(seq_id)
            if run is None:
                continue
            run.pending -= 1
            for token in spec.settle(self.drafter, run, out):  # drafts: written rolls back
                if self._emit(run, token):
                    break
            else:
                prefix.commit(self.pool, run)

    def _emit(self, run: Run, token: int) -> bool:
        """One token read back for ``run``; True when it ended the sequence."""
        run.generated += 1
        run.tokens.append(token)
        run.req.sink(Token(token))
        if reason := end_reason(run, token, self.eos_ids):
            self._finish(run, reason)
            return True
        return False

    def _finish(self, run: Run, reason: str) -> None:
        self._end(run, reason)
        self.counters[reason] += 1
        run.req.sink(Finished(reason, run.generated, run.req.drafted, run.req.accepted))

    def _end(self, run: Run, reason: str | None) -> None:
        """Release a sequence: its full blocks stay cached (every written token is known)."""
        self._dirty = True
        del self._running[run.req.id]
        if self.drafter is not None:
            self.drafter.forget(run.req.id)
        if reason is not None:
            prefix.commit(self.pool, run)
        self.pool.free(run.req.id)
        prefix.drop_snapshots(self.pool, self.engine)
        # a submitted step may still write for it: drop its state once that step is read
        self._stale_states.append((run.req.id, self._steps))

    def _free_stale_states(self) -> None:
        read_through = self._steps - (1 if self._pending is not None else 0)
        for seq_id, after in self._stale_states:
            if after <= read_through:
                self.engine.free_state(seq_id)
        self._stale_states = [(i, after) for i, after in self._stale_states if after > read_through]

    def _refuse(self, req: GenRequest, status: int, message: str, code: str) -> None:
        self._dirty = True
        self.counters[f"refused_{code}"] += 1
        retry = self.limits.retry_after_s if status == 503 else None
        req.sink(Refused(status, message, code, retry))

    def _fail_all(self, message: str) -> None:
        self._pending = None
        for run in list(self._running.values()):
            try:
                self._end(run, None)
            except Exception:  # already gone
                log.exception("cleanup of %s failed", run.req.id)
            run.req.sink(Refused(500, message, "worker_error"))
        self._running.clear()
        with contextlib.suppress(Exception):
            self._stale_states, stale = [], self._stale_states
            for seq_id, _ in stale:
                self.engine.free_state(seq_id)
        with self._wake:
            pending = list(self._inbox) + list(self._waiting)
            self._inbox.clear()
        self._waiting.clear()
        for req in pending:
            req.sink(Refused(503, message, "worker_stopping", self.limits.retry_after_s))

    # --- the memory lines and the published figures --------------------------------------
    def _check_trip(self) -> None:
        if self.line.check(self.limits.trip_bytes, self.pool, self.engine, self.counters):
            self._dirty = True
        if not self.tripped:
            return
        message, waiters, newest = shed(self.tripped, self._waiting, self._running)
        for req in waiters:
            self._refuse(req, 503, message, "memory_trip")
        if newest is not None:
            self._end(newest, None)
            self.engine.clear_cache()
            self._refuse(newest.req, 503, message, "memory_trip")

    def _maybe_publish(self) -> None:
        """Publish if something a reader acts on changed, or the snapshot is stale."""
        if self._dirty or time.monotonic() - self._published_at >= PUBLISH_INTERVAL_S:
            self.host.timed("publish", self._publish)

    def _publish(self) -> None:
        """A consistent snapshot for /v1/plimsoll/status (read from other threads)."""
        self._dirty = False
        self._published_at = time.monotonic()
        allocated = self.engine.kv_bytes_allocated()
        self.kv_bytes_peak = max(self.kv_bytes_peak, allocated)
        self.stats = status_figures(
            self.pool, self.engine, self._running.values(),
            len(self._waiting) + len(self._inbox), self.limits, self.counters, self._steps,
            self.tripped, self.disk, allocated, self.kv_bytes_peak,
            None if self.warmer is None else self.warmer.figures(), self.host.figures())
