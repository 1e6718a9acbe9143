"""The supervisor: every worker of the policy, one transition at a time.

It owns the :class:`~.state.Worker` objects, the transition lock, the bounded waiting
queues and the releases still to verify. A request for a model that is not ready joins
that model's queue (over ``max_waiting``: 429 with ``Retry-After``) and awaits one shared
*bring-up* task, which, under the transition lock:

1. waits for every earlier release to be verified (refusing with 503 if one is not);
2. admits the model alone with live inputs (503 with admission's reasons if refused),
   right-sizes its pool (:func:`plimsoll.core.sizing.right_size`);
3. asks the pure :func:`.evict.choose_evictions` which running workers must stop;
   each victim keeps its slot for ``swap_hold_s`` after its load while it is in use
   (so two clients alternating two models swap at most once per hold, not per request),
   then is drained, stopped, and its memory verified released;
4. admits again with the survivors as ``resident_bytes`` and spawns the worker
   through the launch wrapper, which verifies the limits the worker applied.

The bring-up runs as its own task: a waiter that gives up (timeout, client gone) never
cancels a spawn half-way. An admin mode change takes the transition lock ahead of
queued bring-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from plimsoll.core import capability
from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.model_facts import ModelFacts, ModelInspectionError, check_servable
from plimsoll.core.policy import Mode, Policy
from plimsoll.core.sizing import ReleaseCheck, envelope_bytes, right_size
from plimsoll.core.units import fmt_bytes
from plimsoll.launch.live_admission import (
    MemoryFigures,
    MemoryOverrides,
    Wanted,
    memory_figures,
    plan,
)
from plimsoll.launch.spawn import LaunchError, worker_config
from plimsoll.web.serve import free_port

from ..probes.held import (
    descendants_held_bytes,
    held_and_others,
)
from ..probes.snapshot import MemorySnapshot
from .errors import ProxyError
from .events import EventLog, log
from .evict import Resident, choose_evictions
from .lock import TransitionLock
from .release import Releases, unaccounted_bytes
from .settings import Settings
from .state import Lease, State, Worker
from .tripwire import Tripwire, watch

REAP_INTERVAL_S = 0.25


class Supervisor:
    def __init__(self, policy: Policy, mode: Mode, settings: Settings | None = None,
                 read_snapshot: Callable[..., MemorySnapshot] | None = None,
                 events: EventLog | None = None) -> None:
        if read_snapshot is None:
            from ..probes import read_snapshot
        self.policy, self.mode = policy, mode
        self.settings = settings or Settings()
        self.events = events or EventLog()
        self._snapshot = read_snapshot
        self.releases = Releases(self.events, self.unaccounted, self.settings)
        self.workers = {name: Worker(name, entry, self.events, self.measure,
                                     self.releases.crashed)
                        for name, entry in policy.models.items()}
        self.waiting: Counter[str] = Counter()
        self._transitions = TransitionLock()
        self._bringups: dict[str, asyncio.Task] = {}
        self._reaper: asyncio.Task | None = None
        self.pressure = Tripwire(policy.pressure, self.events)  # the memory-pressure backstop
        self._pressure_task: asyncio.Task | None = None

    # --- probes ---------------------------------------------------------------------------
    def in_use(self) -> int:
        return self._snapshot().in_use_bytes

    def unaccounted(self, pid: int = 0) -> int:
        """The in-use figure the release check compares (:func:`.release.unaccounted_bytes`)."""
        return unaccounted_bytes(self._snapshot(), pid)

    def measure(self, pid: int) -> tuple[int, int]:
        """(the release check's in-use figure, what ``pid``'s tree holds), one /proc read."""
        held, others = held_and_others(pid)
        return unaccounted_bytes(self._snapshot(), pid, others), held

    def observed_bytes(self, pid: int) -> int:
        """The worker's footprint: its process's, and what the processes below it (its
        engine process, a sharded worker's ranks) hold that their exit releases."""
        try:
            return (self._snapshot(pid).process_footprint_bytes
                    + descendants_held_bytes(pid))
        except (ProcessLookupError, OSError):
            return 0

    def figures(self, mode: Mode | None = None) -> MemoryFigures:
        return memory_figures(self.policy, mode or self.mode, MemoryOverrides(), self._snapshot)

    def envelope(self, figures: MemoryFigures) -> int:
        p = self.policy
        return envelope_bytes(figures.ceiling_bytes, figures.total_ram_bytes,
                              figures.budget_bytes, p.trip_offset, p.u_margin)

    def residents(self, workers: list[Worker], sized: bool = True) -> list[Resident]:
        """Ready workers as the pure decisions see them; ``sized=False`` leaves the byte
        figures at 0 (the tripwire's choice needs none, and reads no process)."""
        out = []
        for w in workers:
            inc = w.current
            if w.state is State.READY and inc is not None:
                admitted = inc.decision.footprint_bytes if sized else 0
                observed = self.observed_bytes(inc.pid) if sized else 0
                out.append(Resident(w.name, admitted, observed, inc.last_used,
                                    inc.inflight > 0))
        return out

    def sharded(self, w: Worker) -> bool:
        """Served across the cluster now: clustered mode, a sharded entry, ranks given."""
        return self.mode == "clustered" and w.entry.sharded and bool(self.settings.cluster_ranks)

    def spawner(self, w: Worker) -> Callable[..., Any] | None:
        """How ``w`` starts: ``plimsoll cluster serve`` when sharded, else the default."""
        if not self.sharded(w):
            return None
        from ..cluster.launch import sharded_request, start_cluster_worker

        return functools.partial(start_cluster_worker, ranks=self.settings.cluster_ranks,
                                 request=sharded_request(w.entry, self.policy,
                                                         self.settings.cluster_backend))

    def admit(self, w: Worker, figures: MemoryFigures,
              resident: int = 0) -> tuple[ModelFacts, AdmissionDecision]:
        if self.sharded(w):  # every rank's own figures; rank 0's share is accounted here
            from ..cluster.launch import admit_sharded
            from ..cluster.plan import ClusterPlanError

            try:
                facts, dec, _ = admit_sharded(Path(w.entry.path), w.entry, self.policy,
                                              self.settings.cluster_ranks,
                                              self.settings.cluster_backend)
            except (ModelInspectionError, ClusterPlanError) as err:
                raise ProxyError(503, f"model {w.name!r} cannot be sharded: {err}",
                                 "model_unreadable") from None
            return facts, right_size(dec)
        try:
            facts, _req, dec = plan(Path(w.entry.path), w.entry, self.policy, figures,
                                    Wanted(), resident_bytes=resident)
        except ModelInspectionError as err:
            raise ProxyError(503, f"model {w.name!r} cannot be inspected: {err}",
                             "model_unreadable") from None
        return facts, right_size(dec)

    # --- the request path -------------------------------------------------------------------
    async def acquire(self, name: str) -> Lease:
        """A lease on a ready worker for ``name``, loading it if needed (bounded wait)."""
        w = self.workers[name]
        self.check_pressure(f"a request for model {name!r}")
        if lease := w.try_lease():
            return lease
        s = self.settings
        if self.waiting[name] >= s.max_waiting:
            raise ProxyError(429, f"{self.waiting[name]} requests are already waiting for model "
                             f"{name!r} to load (the limit is {s.max_waiting}); retry after "
                             f"{s.retry_after_s} s", "queue_full", retry_after=s.retry_after_s)
        self.waiting[name] += 1
        try:
            async with asyncio.timeout(s.wait_timeout_s):
                while not (lease := w.try_lease()):
                    await self._await_load(w)
            return lease
        except TimeoutError:
            raise ProxyError(503, f"model {name!r} was not ready after waiting "
                             f"{s.wait_timeout_s:g} s", "load_timeout",
                             retry_after=s.retry_after_s) from None
        finally:
            self.waiting[name] -= 1

    def check_pressure(self, what: str) -> None:
        """Refuse ``what`` with a reasoned 503 while the pressure tripwire is tripped."""
        if (r := self.pressure.refusal(what)) is not None:
            raise ProxyError(503, r.message, "memory_pressure", retry_after=r.retry_after,
                             extra=r.extra)

    async def _await_load(self, w: Worker) -> None:
        """Wait for ``w``'s bring-up, unless the tripwire trips first: then a reasoned 503.

        The bring-up is never cancelled by a waiter (a spawn half-way would be an orphan).
        """
        load = asyncio.ensure_future(asyncio.shield(self._bring_up_task(w)))
        tripped = asyncio.ensure_future(self.pressure.closed.wait())
        try:
            done, _ = await asyncio.wait({load, tripped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            tripped.cancel()
            load.cancel()  # cancels the shield only, never the bring-up
        if tripped in done and (r := self.pressure.refusal(
                f"the request waiting for model {w.name!r} to load", "was cancelled")):
            if load.done() and not load.cancelled():
                load.exception()  # seen: the pressure refusal answers this request
            self.pressure.note_cancelled(w.name)
            raise ProxyError(503, r.message, "memory_pressure", retry_after=r.retry_after,
                             extra=r.extra)
        if load.done() and not load.cancelled():
            load.result()  # the bring-up's own refusal, if any

    def _bring_up_task(self, w: Worker) -> asyncio.Task:
        task = self._bringups.get(w.name)
        if task is None or task.done():
            task = asyncio.create_task(self._bring_up(w), name=f"bring-up-{w.name}")
            # a waiter that gave up must not leave "exception never retrieved" behind
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._bringups[w.name] = task
        return task

    def transition(self, admin: bool = False,
                   timeout_s: float | None = None) -> AbstractAsyncContextManager[None]:
        """The transition lock (:class:`.lock.TransitionLock`); admin holders go first."""
        return self._transitions.hold(admin, timeout_s)

    async def _bring_up(self, w: Worker) -> None:
        async with self.transition():
            if w.state is State.READY:
                return
            self.check_pressure(f"loading model {w.name!r}")
            await self.settle_releases()
            figures = self.figures()
            facts, alone = self.admit(w, figures)
            refusal = capability.check(facts, w.name)
            if refusal is not None:  # before anything is evicted for it: the engine's kinds
                raise ProxyError(503, f"model {w.name!r} cannot be served: {refusal.message}",
                                 "model_unsupported", extra={"cache_kind": refusal.kind})
            if not alone.admitted:
                self._refuse(w, alone, figures)
            try:  # before anything is evicted for it: can a worker serve this directory?
                check_servable(w.entry.path)
            except ModelInspectionError as err:
                raise ProxyError(503, f"model {w.name!r} cannot be served: {err}",
                                 "model_unreadable") from None
            env = self.envelope(figures)
            others = [x for x in self.workers.values() if x is not w]
            choice = choose_evictions(alone.footprint_bytes, self.residents(others), env)
            if not choice.fits:
                raise ProxyError(503, f"model {w.name!r} needs {fmt_bytes(alone.footprint_bytes)}"
                                 f", more than the {fmt_bytes(env)} envelope of {self.mode} mode",
                                 "envelope_too_small", extra={"envelope_bytes": env})
            for name in choice.stop:
                victim = self.workers[name]
                await self._hold(victim)
                self.check_pressure(f"loading model {w.name!r}")  # no eviction for a refusal
                self.events.record("evict", name, for_model=w.name, envelope_bytes=env,
                                   needed_bytes=alone.footprint_bytes)
                await self.stop_verified(victim, f"evicted to load {w.name!r}")
            survivors = self.residents(others)
            figures = self.figures()
            facts, dec = self.admit(w, figures, sum(r.bytes for r in survivors))
            if not dec.admitted:
                self._refuse(w, dec, figures)
            cfg = worker_config(Path(w.entry.path), w.name, facts, dec, w.entry, self.policy,
                                port=free_port(), quiet=self.settings.quiet)
            self.check_pressure(f"loading model {w.name!r}")
            try:
                await w.start(cfg, dec, self.settings.spawn_timeout_s, spawn=self.spawner(w))
            except LaunchError as err:
                raise ProxyError(503, f"model {w.name!r} failed to start: {err}",
                                 "worker_start_failed") from None

    def _refuse(self, w: Worker, dec: AdmissionDecision, figures: MemoryFigures) -> None:
        self.events.record("refused", w.name, reasons=dec.reasons)
        raise ProxyError(
            503, f"model {w.name!r} cannot be loaded within the {self.mode} budget: "
            + " ".join(dec.reasons), "admission_refused",
            extra={"admission": {"reasons": dec.reasons, "mode": self.mode,
                                 "budget_bytes": figures.budget_bytes,
                                 "ceiling_bytes": figures.ceiling_bytes,
                                 "resident_bytes": dec.resident_bytes,
                                 "weights_bytes": dec.weights_bytes,
                                 "source": figures.source}})

    async def _hold(self, victim: Worker) -> None:
        """Let a victim in use keep its slot until ``swap_hold_s`` after its load."""
        s = self.settings
        while (inc := victim.current) is not None and victim.state is State.READY:
            now = time.monotonic()
            idle = inc.inflight == 0 and now - inc.last_used >= s.idle_grace_s
            if idle or now >= inc.ready_at + s.swap_hold_s or self.pressure.closed.is_set():
                return
            await asyncio.sleep(0.05)

    # --- stopping and verified release ------------------------------------------------------
    async def stop_verified(self, w: Worker, reason: str, drain_s: float | None = None,
                            deadline_s: float | None = None) -> None:
        """Stop ``w`` and verify its memory came back; 503 with the figures if it does not."""
        check = await w.stop(reason, self.settings.drain_s if drain_s is None else drain_s)
        if check is not None and not await self.verify(check, deadline_s):
            raise await self.releases.unverified(check)

    @property
    def pending(self) -> list[ReleaseCheck]:
        """Releases not yet verified: no spawn until each is (see :mod:`.release`)."""
        return self.releases.pending

    async def verify(self, check: ReleaseCheck, timeout_s: float | None = None) -> bool:
        return await self.releases.verify(check, timeout_s)

    async def settle_releases(self) -> None:
        await self.releases.settle()

    # --- unload, idle TTL, shutdown ---------------------------------------------------------
    async def unload(self, names: list[str]) -> dict[str, Any]:
        """Stop the named workers (drained, verified). Pending checks are re-verified."""
        out: dict[str, Any] = {"unloaded": [], "unverified": []}
        async with self.transition():
            for name in names:
                w = self.workers[name]
                if w.state is not State.READY:
                    continue
                self.events.record("unload", name)
                try:
                    await self.stop_verified(w, "unloaded on request")
                except ProxyError as err:
                    out["unverified"].append(err.extra.get("release"))
                out["unloaded"].append(name)
        return out

    async def reap_idle(self) -> None:
        """Unload workers idle past their model's TTL (0 = never); never dies of one error."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self._reap_once()
            except Exception:
                log.exception("idle unload failed; retrying")

    async def _reap_once(self) -> None:
        for w in self.workers.values():
            inc, ttl = w.current, self.settings.idle_ttl(w.name, w.entry)
            if (ttl <= 0 or w.state is not State.READY or inc is None or inc.inflight
                    or time.monotonic() - inc.last_used < ttl or self._transitions.busy):
                continue
            async with self.transition():
                inc = w.current
                idle = time.monotonic() - inc.last_used if inc is not None else 0.0
                if w.state is not State.READY or inc is None or inc.inflight or idle < ttl:
                    continue
                self.events.record("idle-unload", w.name, idle_s=round(idle, 3), ttl_s=ttl)
                with contextlib.suppress(ProxyError):  # unverified: recorded, stays pending
                    await self.stop_verified(w, f"idle for more than {ttl:g} s", drain_s=0)

    # --- the tripwire's interface (:class:`.tripwire.Host`) --------------------------------
    def ready_residents(self) -> list[Resident]:
        return self.residents(list(self.workers.values()), sized=False)

    async def unload_verified(self, name: str,
                              why: Callable[[], tuple[str, dict[str, Any]] | None], *,
                              event: str, lock_timeout_s: float) -> None:
        try:
            async with self.transition(admin=True, timeout_s=lock_timeout_s):
                w = self.workers[name]
                inc = w.current
                if w.state is not State.READY or inc is None or (wanted := why()) is None:
                    return
                reason, detail = wanted
                self.events.record(event, name, pid=inc.pid, inflight=inc.inflight,
                                   idle_s=round(time.monotonic() - inc.last_used, 3), **detail)
                with contextlib.suppress(ProxyError):  # unverified: recorded, stays pending
                    await self.stop_verified(w, reason)
        except TimeoutError:
            return  # a load or a swap holds the lock; the next critical reading tries again

    def start_background(self) -> None:
        self._reaper = asyncio.create_task(self.reap_idle(), name="reap-idle")
        if self.pressure.enabled:
            self._pressure_task = asyncio.create_task(watch(self.pressure, self),
                                                      name="pressure-tripwire")

    async def shutdown(self) -> None:
        tasks = [t for t in (self._reaper, self._pressure_task, *self._bringups.values())
                 if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop("the proxy is shutting down", 5.0)
                               for w in self.workers.values()), return_exceptions=True)
