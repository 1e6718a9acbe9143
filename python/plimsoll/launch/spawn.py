"""The admission wrapper: derive a worker's caps from live figures, start it, verify them.

Passing a flag is not proof it took effect: after the model loads, the worker reports
the limits it actually applied (``GET /v1/plimsoll/status``), and :func:`mismatches`
compares them with what admission derived. Any difference stops the worker.
Spawning uses an argument list, never a shell.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from plimsoll.core import sizing
from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.model_facts import ModelFacts
from plimsoll.core.policy import ModelEntry, Policy
from plimsoll.core.units import MIB
from plimsoll.core.worker_config import WorkerConfig, worker_flags
from plimsoll.guard.process import FOOTPRINT_ENV, WorkerGuard, guard_limit
from plimsoll.launch.live_admission import mtp_spec
from plimsoll.launch.model_source import resolve_model_dir
from plimsoll.web.worker_secret import SECRET_ENV, headers

READY_TIMEOUT_S = 300.0
#: A launched worker's own drain on SIGTERM: its launcher (the proxy) drains first, then
#: waits 10 s for the exit, so what is left ends with an error event well before that.
WORKER_DRAIN_S = 3.0
log = logging.getLogger("plimsoll.launch")


def wired_bytes(choice: str, decision: AdmissionDecision) -> int:
    """What the worker may wire: its admitted footprint, only the weights, or nothing."""
    return {"footprint": decision.footprint_bytes, "weights": decision.weights_bytes,
            "none": 0}[choice]


def worker_config(
    model_dir: Path, name: str, facts: ModelFacts, decision: AdmissionDecision,
    entry: ModelEntry | None, policy: Policy | None, *, port: int, host: str = "127.0.0.1",
    cache_memory_mb: int | None = None, max_queue: int = 64, max_wait_s: float = 30.0,
    drain_s: float = WORKER_DRAIN_S, quiet: bool = False,
    disk_cache_dir: Path | None = None, disk_cache_gb: float | None = None,
    prompt_lookup: int | None = None, num_draft_tokens: int | None = None,
    draft_model: str | None = None, mtp: bool | None = None,
    compile_decode: bool | None = None,
) -> WorkerConfig:
    """The worker's flags from an admitted decision (never from a refused one). The disk
    tier: the flags, else the model's or host's ``diskCache`` in the policy, else off;
    speculation: the flags, else the model's ``promptLookup`` / ``numDraftTokens`` /
    ``draftModel`` (resolved to its local directory as admission resolved it) / ``mtp``."""
    if not decision.admitted:
        raise ValueError("a refused decision has no worker configuration")
    wire = policy.wire if policy else Policy.model_fields["wire"].default
    disk = policy.disk_cache_for(entry) if policy else None
    if disk_cache_dir is None and disk is not None:
        disk_cache_dir = Path(disk.path).expanduser()
    disk_gb = disk_cache_gb or (disk.max_gb if disk is not None else None)
    draft = draft_model or (entry.draft_model if entry else None)
    return WorkerConfig(
        model_dir=model_dir, model_name=name,
        max_cache_blocks=decision.pool_blocks,
        gpu_memory_utilization=decision.gpu_memory_utilization,
        cache_memory_mb=(decision.pool_bytes // MIB if cache_memory_mb is None
                         else cache_memory_mb),
        max_num_seqs=decision.concurrency, context=decision.context,
        block_tokens=decision.block_tokens, max_tokens=decision.output_reservation,
        default_max_tokens=sizing.default_output(decision.output_reservation,
                                                 entry.default_max_tokens if entry else None),
        max_queue=max_queue, max_wait_s=max_wait_s,
        ceiling_bytes=decision.ceiling_bytes, total_ram_bytes=decision.total_ram_bytes,
        trip_offset=policy.trip_offset if policy else Policy.model_fields["trip_offset"].default,
        mlx_cache_mb=sizing.mlx_cache_mb(decision.transient_reserve_bytes),
        wired_limit_bytes=wired_bytes(wire, decision), host=host, port=port,
        kv_dtype=facts.kv_format, block_bytes=decision.block_bytes,
        disk_cache_dir=disk_cache_dir,
        **({"disk_cache_gb": disk_gb} if disk_gb else {}),
        transient_bytes=sizing.compute_transient_bytes(decision.transient_reserve_bytes) or None,
        max_tokens_over_limit=entry.max_tokens_over_limit if entry else "clamp",
        drain_s=drain_s, quiet=quiet,
        prompt_lookup=(prompt_lookup if prompt_lookup is not None
                       else entry.prompt_lookup if entry else 0),
        num_draft_tokens=(num_draft_tokens if num_draft_tokens is not None
                          else entry.num_draft_tokens if entry else 3),
        draft_model=resolve_model_dir(draft, "--draft-model") if draft else None,
        mtp=mtp_spec(mtp, entry),
        **({} if compile_decode is None else {"compile_decode": compile_decode}),
    )


def worker_argv(cfg: WorkerConfig) -> list[str]:
    """``plimsoll worker`` with every cap as an explicit flag (the contract's own spelling:
    :func:`plimsoll.core.worker_config.worker_flags`)."""
    return [sys.executable, "-m", "plimsoll.cli", "worker", *worker_flags(cfg)]


#: Allocations at or above this go straight to mmap and back to the OS on free, instead of
#: sitting in a glibc heap (setting it also stops glibc's dynamic threshold from growing):
#: a pool's slabs, the weights and a long prompt's transients. 32 MiB, glibc's own ceiling
#: for the threshold, not less: MLX's CPU backend allocates every array with malloc, and a
#: decode step's gathered contexts (a few MiB to tens of MiB a layer, the same sizes every
#: step) mapped and faulted in afresh each step made qwen3-0.6b's 32-row step 1.87 s against
#: 1.14 s (1 MiB against 32 MiB; the 32 MiB step equals glibc's defaults; maximum RSS alike;
#: bench/results/overhead-cpu-2026-12-05-qwen3-0.6b-steady.md). On Metal and CUDA the
#: arrays are the device allocator's: this only keeps the host's small ones honest.
MALLOC_MMAP_THRESHOLD = 32 << 20
#: Free memory at a glibc heap's top above this goes back to the OS (``malloc_trim``). Fixing
#: the mmap threshold also fixes this one at glibc's 128 KiB, where its dynamic rule would
#: have raised it to twice the mmap threshold: so every step, once MLX's buffer cache is full
#: (the worker caps it), the freed transients were trimmed and faulted in again: on the CPU
#: box qwen3-0.6b's 32-row step 1.23 s against 0.99 s in process, 105k page faults a step
#: against none; served ÷ in process 1.17 → 1.04
#: (bench/results/overhead-cpu-2026-12-06-qwen3-0.6b-32-{notrim,trim}.md). Twice the mmap
#: threshold, as glibc would: at most that much freed memory stays resident at each arena's
#: top (two arenas: 128 MiB, inside the guard's runtime reserve), and the trip's clear
#: (``engine.limits.clear_buffer_cache``) trims it all.
MALLOC_TRIM_THRESHOLD = 2 * MALLOC_MMAP_THRESHOLD


#: Signals the spawning thread holds while ``Popen`` runs: a handler that raises (``plimsoll
#: launch`` stops a start that way) between the child's exec and ``Popen``'s return would
#: leave a worker nobody can stop. The child inherits the mask through exec, so the worker
#: unblocks them first thing (``plimsoll worker``; a signal sent meanwhile waits, not lost).
SPAWN_HELD = frozenset({signal.SIGTERM, signal.SIGINT})


def worker_env() -> dict[str, str]:
    """The worker's environment: glibc arenas capped so RSS tracks MLX's own figure."""
    env = dict(os.environ)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(MALLOC_TRIM_THRESHOLD))
    return env


def mismatches(cfg: WorkerConfig, status: dict) -> list[str]:
    """Differences between what admission derived and what the worker reports applying."""
    lim = status.get("limits", {})
    wanted = {
        "max_cache_blocks": (cfg.max_cache_blocks, status.get("pool", {}).get("total")),
        "memory limit": (cfg.allocation_limit_bytes, lim.get("memory_limit_applied_bytes")),
        "MLX cache limit": (cfg.mlx_cache_bytes, lim.get("cache_limit_applied_bytes")),
        "trip": (cfg.trip_bytes, lim.get("trip_bytes")),
        "context": (cfg.context, status.get("context", {}).get("configured")),
        "max_num_seqs": (cfg.max_num_seqs, status.get("max_num_seqs")),
    }
    if cfg.block_bytes is not None:  # bytes, not only block counts: the KV dtype took
        wanted["block bytes"] = (cfg.block_bytes, status.get("block_bytes"))
        wanted["pool bytes"] = (cfg.max_cache_blocks * cfg.block_bytes,
                                status.get("kv_bytes_bound"))
    if cfg.kv_dtype is not None:
        wanted["kv dtype"] = (cfg.kv_dtype, status.get("kv_dtype"))
    if cfg.transient_bytes is not None:
        wanted["transient bytes"] = (cfg.transient_bytes, status.get("transient_bytes"))
    return [f"{name}: derived {want}, worker reports {got}"
            for name, (want, got) in wanted.items() if want != got]


class LaunchError(RuntimeError):
    """The worker did not come up with the derived limits; the message has the figures."""


class StartStopped(Exception):
    """A stop was asked for while the worker was starting (what was started is stopped)."""


def start_guard(cfg: WorkerConfig, footprint_bytes: int | None = None,
                cgroup_parent: Path | None = None,
                limit_bytes: int | None = None) -> tuple[WorkerGuard | None, dict[str, str]]:
    """The worker's guard: its own memory cgroup (admitted footprint + margin) and no extra
    environment, or — where no cgroup can be made (macOS, no root) — no cgroup and the
    environment that makes the worker keep the same lines on its own footprint.

    Without a footprint the allocation limit stands in (it bounds the footprint);
    ``limit_bytes`` sets the hard line outright (tests, ``plimsoll verify``)."""
    if limit_bytes is None:
        limit_bytes = guard_limit(cfg.allocation_limit_bytes if footprint_bytes is None
                                  else footprint_bytes)
    guard, why = WorkerGuard.create(f"worker-{cfg.port}", limit_bytes, cgroup_parent)
    if guard is not None:
        log.info("memory guard for %s: %s", cfg.model_name, why)
        return guard, {}
    log.warning("memory guard for %s: no cgroup (%s); the worker guards its own footprint "
                "with a hard line of %d B", cfg.model_name, why, limit_bytes)
    return None, {FOOTPRINT_ENV: str(limit_bytes)}


def start_worker(cfg: WorkerConfig, timeout_s: float = READY_TIMEOUT_S,
                 stdout=None, *, footprint_bytes: int | None = None,
                 cgroup_parent: Path | None = None, cgroup_limit_bytes: int | None = None,
                 guard: bool = True, env: dict[str, str] | None = None,
                 stop_requested: Callable[[], bool] = lambda: False
                 ) -> tuple[subprocess.Popen, dict]:
    """Spawn the worker, wait until it reports its status, verify its limits, or stop it.

    With ``guard`` (and root and a writable memory controller) the worker runs in its own
    cgroup, created under ``cgroup_parent``; ``proc.plimsoll_guard`` holds it and
    :func:`stop_worker` removes it. Without them the worker guards its own footprint
    (:class:`plimsoll.guard.process.FootprintGuard`) against the same hard line.
    ``stop_requested`` is polled while waiting: a caller's signal handler that records a stop
    is heard even where the exception it raised was swallowed (Python ignores exceptions
    raised inside a weakref callback, such as an import lock's) — :class:`StartStopped`.
    """
    wg, guard_env = (start_guard(cfg, footprint_bytes, cgroup_parent, cgroup_limit_bytes)
                     if guard else (None, {}))
    argv = wg.wrap(worker_argv(cfg)) if wg else worker_argv(cfg)
    proc = None
    try:  # one guarded block from the spawn on: a signal's exception right after Popen
        # returns still stops the worker (it runs in its own session: nobody else would)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, SPAWN_HELD)
        try:  # held during Popen: a handler raising inside it would lose the only handle
            proc = subprocess.Popen(argv, env=worker_env() | guard_env | (env or {}),
                                    stdout=stdout, start_new_session=True)
            proc.plimsoll_guard = wg
        finally:  # a signal held meanwhile arrives here, with ``proc`` set
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        status = wait_ready(proc, cfg, timeout_s, "the worker",
                            lambda: f"the worker exited with status {proc.returncode} before "
                            "it was ready (see its log above)", (env or {}).get(SECRET_ENV),
                            stop_requested)
        bad = mismatches(cfg, status)
        if bad:
            raise LaunchError("the worker did not apply the derived limits: " + "; ".join(bad))
    except BaseException:
        if proc is not None:
            proc.plimsoll_guard = wg  # (again: the signal may have come before it was set)
            stop_worker(proc)  # its guard released with it
        elif wg:
            wg.close()
        raise
    return proc, status


def wait_ready(proc: subprocess.Popen, cfg: WorkerConfig, timeout_s: float, what: str,
               exited: Callable[[], str], secret: str | None = None,
               stop_requested: Callable[[], bool] = lambda: False) -> dict:
    """Poll the worker's status (with its ``secret``, if it was given one) until it says
    ready (bounded); LaunchError if the process exits first (``exited()`` says why) or the
    time runs out, StartStopped once ``stop_requested()``. The caller stops it."""
    url = f"http://{cfg.host}:{cfg.port}/v1/plimsoll/status"
    deadline = time.monotonic() + timeout_s
    while True:
        if stop_requested():
            raise StartStopped
        if proc.poll() is not None:
            raise LaunchError(exited())
        try:
            status = httpx.get(url, headers=headers(secret), timeout=2.0).json()
            if status.get("ready"):
                return status
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise LaunchError(f"{what} was not ready after {timeout_s:g} s")
        time.sleep(0.2)


def stop_worker(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    release_guard(proc)
    return proc.returncode


def release_guard(proc: subprocess.Popen) -> None:
    """Remove the exited worker's cgroup (once; a no-op for unguarded workers)."""
    wg = getattr(proc, "plimsoll_guard", None)
    if wg is not None and proc.poll() is not None:
        wg.close()
        proc.plimsoll_guard = None
