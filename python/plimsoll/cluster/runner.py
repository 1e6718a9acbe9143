"""The supervisor of a clustered load: starts the rank processes, speaks the protocol, tears down.

It does what ``mlx.launch --backend B`` does for one host (each rank's environment for the
request's backend, :func:`plimsoll.cluster.backend.launches`: for ring the hostfile JSON in
``MLX_HOSTFILE`` and ``MLX_RANK``; for nccl rank 0's address in ``NCCL_HOST_IP``/``NCCL_PORT``
and ``MLX_WORLD_SIZE``; for jaccl the coordinator and the RDMA devices file) and what it
does not: ``mlx.launch`` exits 0 even when ranks fail, so this class watches every rank
itself. Every rank's environment carries its own backend's variables only (any the
supervisor inherited are dropped).

- :meth:`Cluster.start` waits (bounded) for every rank's preflight answer and the common
  decision. A rollback raises :class:`ClusterRefused` with every rank's reasons, after
  every rank process has exited (or been killed) — nothing is left holding memory.
- With a :class:`ServeSpec`, rank 0 serves the worker's HTTP API (:mod:`.serve`) and
  :meth:`Cluster.start` also waits for it to listen; :meth:`Cluster.watch` then follows
  every rank until asked to stop or until one dies (then every rank is torn down and
  :class:`ClusterRankFailed` carries every rank's reasons).
- Without one, :meth:`Cluster.generate` sends one request to rank 0's stdin and waits for
  its tokens; if any rank exits or the wait runs out, every other rank is killed (by pid)
  and :class:`ClusterRankFailed` names which rank died, how, and what its peers said.
- :meth:`Cluster.close` shuts the ring down cleanly (stdin EOF, or SIGTERM to a serving
  rank 0, which drains HTTP then broadcasts the shutdown), then kills what is left.

With ``guard`` (root and a writable memory controller, as for a worker) every rank runs in
its own memory cgroup from its first instruction, limited to its own admitted footprint
plus the guard's margin (:mod:`.rank_cgroups`, from the same pure plan the ranks make);
the cgroups are removed once the ranks have exited. Without them it logs why
and goes on (the ranks still check their own memory before every token).

Every wait is bounded; all traffic is on the addresses given (127.0.0.1 by default).
This module does not import mlx. Ranks on other hosts (ssh) are out of scope here: for
real hosts, use ``mlx.launch --hostfile`` with ``python -m plimsoll.cluster.rank``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from plimsoll.cluster.backend import BACKEND_ENV, launches, ring_hostfile
from plimsoll.cluster.exits import (
    EXIT_NAMES,
    EXIT_PEER,
    ClusterError,
    ClusterRankFailed,
    ClusterRefused,
)
from plimsoll.cluster.plan import ClusterDecision, ClusterRequest, RankProbe
from plimsoll.core.sizing import DEFAULT_OUTPUT_TOKENS
from plimsoll.web.serve import free_port


@dataclass
class RankSpec:
    """One rank's own figures (None: the rank reads its own probe) and environment."""

    ceiling_bytes: int | None = None
    total_ram_bytes: int | None = None
    budget_bytes: int | None = None
    ip: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServeSpec:
    """Rank 0 serves the worker's HTTP API on ``host:port`` (127.0.0.1 by default)."""

    port: int
    host: str = "127.0.0.1"
    model_name: str | None = None
    default_max_tokens: int = DEFAULT_OUTPUT_TOKENS
    max_queue: int = 64
    max_wait_s: float = 30.0

    def argv(self) -> list[str]:
        out = ["--serve-port", str(self.port), "--serve-host", self.host,
               "--default-max-tokens", str(self.default_max_tokens),
               "--max-queue", str(self.max_queue), "--max-wait", repr(self.max_wait_s)]
        return out + (["--model-name", self.model_name] if self.model_name else [])


@dataclass
class Generation:
    tokens: list[int]
    seconds: float
    tokens_per_s: float | None


__all__ = ["Cluster", "ClusterError", "ClusterRankFailed", "ClusterRefused", "RankSpec",
           "ServeSpec", "ring_hostfile"]


class Cluster:
    """One clustered load of ``model_dir`` over ``ranks`` (rank 0 first)."""

    def __init__(self, model_dir: str | Path, ranks: list[RankSpec],
                 request: ClusterRequest | None = None, *, python: str = sys.executable,
                 env: dict[str, str] | None = None, workdir: str | Path | None = None,
                 serve: ServeSpec | None = None, guard: bool = False,
                 cgroup_parent: Path | None = None,
                 rdma_devices: list[list[str | None]] | None = None):
        if not ranks:
            raise ValueError("a cluster needs at least one rank")
        self.model_dir = Path(model_dir)
        self.ranks = ranks
        self.request = request or ClusterRequest()
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="plimsoll-cluster-")
        self.workdir = Path(workdir or self._tmp.name)
        self.procs: list[subprocess.Popen] = []
        self.events: queue.Queue[tuple[int, dict | None]] = queue.Queue()
        self.said: dict[int, list[str]] = {}
        self.ready: dict[int, dict] = {}
        self.decision: ClusterDecision | None = None
        self.serve = serve
        self.serving: dict | None = None
        self.guard, self.cgroup_parent = guard, cgroup_parent
        self.guards: list = []  # plimsoll.guard.process.WorkerGuard per rank (when made)
        self.guard_note = ""
        self.rdma_devices = rdma_devices  # jaccl: the device linking each pair of ranks

    # ------------------------------------------------------------ processes

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _argv(self, rank: int, spec: RankSpec) -> list[str]:
        argv = [self.python, "-m", "plimsoll.cluster.rank", "--model", str(self.model_dir),
                "--host", spec.ip, "--request", self.request.model_dump_json()]
        if rank == 0 and self.serve is not None:
            argv += self.serve.argv()
        for flag, value in (("--ceiling-bytes", spec.ceiling_bytes),
                            ("--total-ram-bytes", spec.total_ram_bytes),
                            ("--budget-bytes", spec.budget_bytes)):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    def _reader(self, rank: int, stream) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                self.events.put((rank, event))
        self.events.put((rank, None))

    def _make_guards(self) -> None:
        from plimsoll.cluster.rank_cgroups import rank_guards

        figures = [(s.ceiling_bytes, s.total_ram_bytes, s.budget_bytes) for s in self.ranks]
        probes = None if any(None in f for f in figures) else [
            RankProbe(rank=r, ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b)
            for r, (c, t, b) in enumerate(figures)]
        self.guards, self.guard_note = rank_guards(self.model_dir, probes, self.request,
                                                   self.cgroup_parent)

    def _release_guards(self) -> None:
        """Remove the ranks' cgroups (every rank has exited)."""
        while self.guards:
            self.guards.pop().close()

    def _spawn(self) -> None:
        if self.guard:
            self._make_guards()
        inherited = {name for names in BACKEND_ENV.values() for name in names} | {"MLX_RANK"}
        visible = [d for d in self.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        plans = launches(self.request.backend, [(s.ip, free_port(s.ip)) for s in self.ranks],
                         rdma_devices=self.rdma_devices, visible_devices=visible)
        for rank, (spec, launch) in enumerate(zip(self.ranks, plans, strict=True)):
            env = {k: v for k, v in self.env.items() if k not in inherited}
            env |= launch.env | spec.env
            for name, content in launch.files.items():
                path = self.workdir / f"{name.lower()}.json"
                path.write_text(content)
                env[name] = str(path)
            log = (self.workdir / f"rank{rank}.log").open("wb")
            stdin = subprocess.PIPE if rank == 0 and self.serve is None else subprocess.DEVNULL
            argv = self._argv(rank, spec)
            if self.guards:
                argv = self.guards[rank].wrap(argv)
            proc = subprocess.Popen(
                argv, env=env, stdin=stdin, stdout=subprocess.PIPE,
                stderr=log, text=True, start_new_session=True)
            log.close()
            self.procs.append(proc)
            threading.Thread(target=self._reader, args=(rank, proc.stdout), daemon=True,
                             name=f"rank{rank}-events").start()

    def _note(self, rank: int, event: dict) -> None:
        kind = event.get("event")
        if kind == "error":
            self.said.setdefault(rank, []).append(f"{event.get('phase')}: {event.get('reason')}")
        elif kind == "preflight":
            self.said.setdefault(rank, []).extend(event["answer"].get("reasons", []))
        elif kind == "ready":
            self.ready[rank] = event
        elif kind == "serving" and rank == 0:
            self.serving = event
        elif kind == "decision" and rank == 0:
            self.decision = ClusterDecision.model_validate(event["decision"])

    def _next(self, deadline: float) -> tuple[int, dict | None] | None:
        """The next event, or None at the deadline; raises if a rank died meanwhile."""
        while time.monotonic() < deadline:
            try:
                rank, event = self.events.get(timeout=min(0.2, max(deadline - time.monotonic(),
                                                                    0.001)))
            except queue.Empty:
                self._check_alive()
                continue
            if event is not None:
                self._note(rank, event)
            return rank, event
        return None

    def _check_alive(self) -> None:
        dead = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            self._fail(dead, "mid-request" if self.ready else "during load")

    def _fail(self, dead: list[tuple[int, int]], when: str) -> None:
        self._drain(1.0)
        first = {r for r, _ in dead}
        dead += [(r, p.returncode) for r, p in enumerate(self.procs)
                 if r not in first and p.poll() is not None]
        self.kill()
        reasons = {r: list(lines) for r, lines in self.said.items()}
        for rank, code in dead:
            how = (f"killed by signal {-code}" if code < 0 else
                   f"exited {code} ({EXIT_NAMES.get(code, 'unknown')})")
            reasons.setdefault(rank, []).insert(0, f"rank process {how} {when}")
        # A rank that only lost its peer (exit 4) is a consequence, not the cause.
        cause = sorted(r for r, code in dead if code != EXIT_PEER) or sorted(first)
        raise ClusterRankFailed(
            f"rank(s) {cause} stopped {when}; every rank was torn down", reasons)

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                rank, event = self.events.get(timeout=0.05)
            except queue.Empty:
                if all(p.poll() is not None for p in self.procs):
                    return
                continue
            if event is not None:
                self._note(rank, event)

    def kill(self, grace: float = 2.0) -> None:
        """Stop every rank this object started, by pid: SIGTERM, then SIGKILL after ``grace``."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if all(p.poll() is not None for p in self.procs):
            self._release_guards()

    # ------------------------------------------------------------ protocol

    def start(self, timeout: float = 120.0) -> ClusterDecision:
        """Preflight, decide, and (on commit) wait for every rank to be loaded."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while self.decision is None or (self.decision.action == "commit" and (
                len(self.ready) < len(self.ranks) or (self.serve and self.serving is None))):
            if self.decision is not None and self.decision.action == "rollback":
                break
            try:
                got = self._next(deadline)
            except ClusterRankFailed:
                if self.decision is not None and self.decision.action == "rollback":
                    break
                raise
            if got is None:
                self.kill()
                raise ClusterRankFailed(f"the cluster did not come up within {timeout:.0f} s; "
                                        "every rank was torn down", dict(self.said))
        if self.decision.action == "rollback":
            self._wait_exit(10.0)
            raise ClusterRefused(self.decision)
        return self.decision

    def _wait_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(deadline - time.monotonic(), 0.01))
        self.kill()

    def generate(self, prompt: list[int], max_tokens: int, *, timeout: float = 60.0,
                 on_token: Callable[[int], None] | None = None) -> Generation:
        """Greedy tokens for ``prompt`` from the whole cluster (one request at a time)."""
        done = self._ask({"op": "generate", "prompt": prompt, "max_tokens": max_tokens},
                         timeout, on_token)
        return Generation(done["tokens"], done["seconds"], done["tokens_per_s"])

    def generate_many(self, prompts: list[list[int]], max_tokens: int, *,
                      timeout: float = 60.0, ignore_eos: bool = False) -> dict:
        """Greedy tokens for every prompt, submitted at once (the ranks run their layers on
        the engine, the default stage, so they run concurrently): rank 0's
        ``done`` event (``outputs``: each prompt's tokens; ``most_rows``)."""
        return self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "ignore_eos": ignore_eos}, timeout, None)

    def _ask(self, request: dict, timeout: float,
             on_token: Callable[[int], None] | None) -> dict:
        """One request to rank 0's stdin; its ``done`` event."""
        if self.decision is None or self.decision.action != "commit":
            raise RuntimeError("start() the cluster first")
        self._check_alive()
        stdin = self.procs[0].stdin
        try:
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError):
            self._check_alive()
            raise
        deadline = time.monotonic() + timeout
        while True:
            got = self._next(deadline)
            if got is None:
                self.kill()
                raise ClusterRankFailed(f"no answer within {timeout:.0f} s; every rank was "
                                        "torn down", dict(self.said))
            _, event = got
            if event is None:
                self._check_alive()
                continue
            kind = event.get("event")
            if kind == "token" and on_token is not None:
                on_token(int(event["id"]))
            elif kind == "done":
                return event
            elif kind == "refused":
                raise ClusterError("request refused", {0: [event["reason"]]})
            elif kind == "error":
                self._drain(1.0)
                self._check_alive()

    def watch(self, stop: threading.Event, poll_s: float = 0.2) -> None:
        """Follow every rank until ``stop`` is set; a rank that exits tears every rank down
        (:class:`ClusterRankFailed` with every rank's reasons)."""
        while not stop.is_set():
            self._next(time.monotonic() + poll_s)
            self._check_alive()

    def close(self, timeout: float = 15.0) -> None:
        """Shut the ring down (rank 0 broadcasts shutdown), then kill whatever is left."""
        first = self.procs[0] if self.procs else None
        if first is not None and first.poll() is None:
            if first.stdin:
                try:
                    first.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                    first.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            else:  # serving: uvicorn drains, then rank 0 broadcasts the shutdown
                first.send_signal(signal.SIGTERM)
        self._wait_exit(timeout)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
