"""One state machine per worker process, and the one writer of its state.

    stopped ──start()──▶ starting ──(verified limits)──▶ ready
       ▲                    │ (launch failed)              │ stop() / crash
       └────────────────────┴───────── stopping ◀──────────┘

``ready`` is the only state that takes requests. ``stopping`` covers the whole way
out: admission to the worker is closed, in-flight requests get a bounded time to finish,
then SIGTERM (SIGKILL after a grace), then the process has exited. Only the methods of
:class:`Worker` write ``state`` (through :meth:`Worker._set`, which refuses any
transition not drawn above); a per-worker lock serialises them, so a crash noticed by
the watcher and a stop asked by the supervisor cannot interleave.

Each start makes a new :class:`Incarnation` (process, config, admitted decision, lease
count, and the secret the process requires on every request,
:mod:`plimsoll.web.worker_secret`): a lease taken on one process can never be counted
against its successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from subprocess import Popen
from typing import Any

from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.policy import ModelEntry
from plimsoll.core.sizing import ReleaseCheck, release_tolerance
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard.process import EXIT_FOOTPRINT
from plimsoll.launch.spawn import release_guard, start_worker, stop_worker
from plimsoll.web.worker_secret import headers, new_secret, secret_env

from .events import EventLog

WATCH_INTERVAL_S = 0.1
SAMPLE_EVERY = 5  # an in-use sample every 0.5 s (one /proc pass: ~2 ms on the CPU box)
STOP_GRACE_S = 10.0


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.READY, State.STOPPED}),
    State.READY: frozenset({State.STOPPING}),
    State.STOPPING: frozenset({State.STOPPED}),
}


class TransitionError(RuntimeError):
    """A transition the state machine does not allow (a bug, never a user error)."""


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        try:
            return f"signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"signal {-returncode}"
    if returncode == EXIT_FOOTPRINT:
        return f"exit status {returncode} (its footprint crossed the guard's hard line)"
    return f"exit status {returncode}"


@dataclass
class Incarnation:
    """One run of the worker process, from spawn to exit."""

    proc: Popen
    cfg: WorkerConfig
    decision: AdmissionDecision
    status: dict[str, Any]
    secret: str | None = None  # what the worker requires on every request (made at spawn)
    ready_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    inflight: int = 0
    alive_in_use: int = 0  # the last in-use reading (see Supervisor.measure) while alive
    alive_held: int = 0  # what the process held (held.held_bytes) at that reading
    stop_reason: str | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request to this worker carries (its secret)."""
        return headers(self.secret)


class Lease:
    """One request's claim on a ready incarnation; release exactly once."""

    def __init__(self, worker: Worker, inc: Incarnation) -> None:
        self.worker, self.inc, self._open = worker, inc, True

    def release(self) -> None:
        if self._open:
            self._open = False
            self.inc.inflight -= 1
            self.inc.last_used = time.monotonic()
            if self.inc.inflight == 0:
                self.inc.idle.set()


OnCrash = Callable[["Worker", ReleaseCheck], Awaitable[None]]


class Worker:
    """A model of the policy and its (at most one) process."""

    def __init__(self, name: str, entry: ModelEntry, events: EventLog,
                 measure: Callable[[int], tuple[int, int]], on_crash: OnCrash) -> None:
        """``measure(pid)`` → (in-use not held by other processes, what ``pid`` holds)."""
        self.name, self.entry, self.events = name, entry, events
        self._measure, self._on_crash = measure, on_crash
        self.state = State.STOPPED
        self.current: Incarnation | None = None
        self.last_exit: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self._watcher: asyncio.Task | None = None

    def _set(self, new: State) -> None:
        if new not in TRANSITIONS[self.state]:
            raise TransitionError(f"{self.name}: {self.state} → {new} is not a transition")
        self.state = new

    # --- requests ---------------------------------------------------------------------
    def try_lease(self) -> Lease | None:
        inc = self.current
        if self.state is not State.READY or inc is None:
            return None
        inc.inflight += 1
        inc.idle.clear()
        inc.last_used = time.monotonic()
        return Lease(self, inc)

    # --- transitions --------------------------------------------------------------------
    async def start(self, cfg: WorkerConfig, decision: AdmissionDecision,
                    timeout_s: float, spawn: Callable[..., Any] | None = None) -> Incarnation:
        """Spawn through the launch wrapper (verified limits); raises LaunchError.

        ``spawn`` replaces :func:`~plimsoll.launch.spawn.start_worker` (same call, same result):
        a sharded model starts as ``plimsoll cluster serve``, still one process here."""
        async with self._lock:
            self._set(State.STARTING)
            self.events.record("spawn", self.name, port=cfg.port,
                               footprint_bytes=decision.footprint_bytes)
            loop = asyncio.get_running_loop()
            launch = spawn or start_worker
            secret = new_secret()  # handed over in the environment, never on the command line
            fut = loop.run_in_executor(None, lambda: launch(
                cfg, timeout_s, footprint_bytes=decision.footprint_bytes,
                env=secret_env(secret)))
            try:
                proc, status = await asyncio.shield(fut)
            except asyncio.CancelledError:  # shutting down: never leave an orphan behind
                with contextlib.suppress(BaseException):
                    proc, _ = await fut
                    await asyncio.to_thread(stop_worker, proc)
                self._set(State.STOPPED)
                raise
            except BaseException as err:
                self._set(State.STOPPED)
                self.events.record("spawn-failed", self.name, error=str(err))
                raise
            inc = Incarnation(proc, cfg, decision, status, secret)
            await self._sample(inc)
            inc.idle.set()
            self.current = inc
            self._set(State.READY)
            self.events.record("ready", self.name, pid=proc.pid, port=cfg.port,
                               held_bytes=inc.alive_held,
                               footprint_bytes=decision.footprint_bytes,
                               context=decision.context, concurrency=decision.concurrency)
            self._watcher = asyncio.create_task(self._watch(inc), name=f"watch-{self.name}")
            return inc

    async def stop(self, reason: str, drain_s: float) -> ReleaseCheck | None:
        """Close admission, drain (bounded), terminate, wait for exit. None if not running.

        Returns what the supervisor must verify before anything replaces this worker.
        """
        async with self._lock:
            inc = self.current
            if self.state is not State.READY or inc is None:
                return None
            self._set(State.STOPPING)
            inc.stop_reason = reason
            self.events.record("drain", self.name, pid=inc.pid, inflight=inc.inflight,
                               reason=reason)
            if inc.inflight:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(inc.idle.wait(), drain_s)
            await self._sample(inc)
            if self._watcher is not None:
                self._watcher.cancel()
            cut = inc.inflight
            rc = await asyncio.to_thread(stop_worker, inc.proc, STOP_GRACE_S)
            return self._exited(inc, rc, reason, expected=True, cut_requests=cut)

    def _exited(self, inc: Incarnation, rc: int | None, reason: str, *, expected: bool,
                cut_requests: int) -> ReleaseCheck:
        self.last_exit = {"pid": inc.pid, "returncode": rc, "exit": describe_exit(rc),
                          "reason": reason, "at": time.time()}
        self.events.record("exit", self.name, pid=inc.pid, returncode=rc,
                           exit=describe_exit(rc), expected=expected, reason=reason,
                           cut_requests=cut_requests)
        release_guard(inc.proc)  # the exited worker's cgroup goes with it
        self.current = None
        self._watcher = None
        self._set(State.STOPPED)
        return ReleaseCheck(self.name, inc.pid, inc.alive_in_use, inc.alive_held,
                            release_tolerance(inc.decision.footprint_bytes, inc.alive_held))

    async def _sample(self, inc: Incarnation) -> None:
        """In-use and the process's held memory, kept only if it was alive throughout."""
        in_use, held = await asyncio.to_thread(self._measure, inc.pid)
        if inc.proc.poll() is None and held > 0:
            inc.alive_in_use, inc.alive_held = in_use, held

    async def _watch(self, inc: Incarnation) -> None:
        """Notice a process that died on its own (crash, OOM kill, kill -9)."""
        tick = 0
        while True:
            # the in-use sample is read before poll(), so it was taken while the process lived
            if tick % SAMPLE_EVERY == 0:
                await self._sample(inc)
            if inc.proc.poll() is not None:
                break
            tick += 1
            await asyncio.sleep(WATCH_INTERVAL_S)
        async with self._lock:
            if self.current is not inc or self.state is not State.READY:
                return
            self._set(State.STOPPING)
            reason = f"the worker exited unexpectedly ({describe_exit(inc.proc.returncode)})"
            inc.stop_reason = reason
            self.events.record("crash", self.name, pid=inc.pid,
                               exit=describe_exit(inc.proc.returncode), inflight=inc.inflight)
            check = self._exited(inc, inc.proc.returncode, reason, expected=False,
                                 cut_requests=inc.inflight)
        await self._on_crash(self, check)

    def snapshot(self) -> dict[str, Any]:
        inc = self.current
        out: dict[str, Any] = {"model": self.name, "state": str(self.state)}
        if inc is not None:
            now = time.monotonic()
            d = inc.decision
            out.update({
                "pid": inc.pid, "port": inc.cfg.port, "url": inc.url, "inflight": inc.inflight,
                "idle_s": round(now - inc.last_used, 3), "up_s": round(now - inc.ready_at, 3),
                "held_bytes": inc.alive_held,
                "admitted": {
                    "decision": d.decision, "footprint_bytes": d.footprint_bytes,
                    "weights_bytes": d.weights_bytes, "pool_blocks": d.pool_blocks,
                    "draft_weights_bytes": d.draft_weights_bytes,
                    "draft_pool_bytes": d.draft_pool_bytes,
                    "pool_bytes": d.pool_bytes, "block_bytes": d.block_bytes,
                    "transient_reserve_bytes": d.transient_reserve_bytes,
                    "resident_bytes": d.resident_bytes, "concurrency": d.concurrency,
                    "context": d.context, "output_reservation": d.output_reservation,
                    "gpu_memory_utilization": d.gpu_memory_utilization,
                    "budget_bytes": d.budget_bytes, "reasons": d.reasons,
                },
            })
        if self.last_exit is not None:
            out["last_exit"] = self.last_exit
        return out
