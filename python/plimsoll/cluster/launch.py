"""A sharded model as one worker of the proxy: ``plimsoll cluster serve`` is its process.

The proxy treats the whole ring as one worker. In clustered mode, a model marked
``sharded`` in the policy is admitted here on every rank's own figures (the same pure
plan and two-phase decision the ranks make, so a refusal is known before anything
starts), and started as ``plimsoll cluster serve`` — one process that starts every rank,
whose rank 0 serves the worker API on the worker's port and which tears every rank down
when it is stopped (SIGTERM) or when any rank dies (then it exits non-zero: the proxy sees
a worker crash and restarts it on the next request).

The proxy's own accounting of the sharded worker is rank 0's share (its weights, its
pool): that is what the worker's process tree holds beyond the
other ranks, and on real hosts the only share that is local. Ranks given on the proxy's
command line (``--cluster-rank CEILING_GIB[:TOTAL_GIB[:BUDGET_GIB]]``) all run on this
host; ranks on other hosts use ``mlx.launch`` (README).
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time
from pathlib import Path

from plimsoll.cluster import plan as cluster_plan
from plimsoll.cluster.backend import Backend
from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.model_facts import ModelFacts, inspect_model
from plimsoll.core.policy import ModelEntry, Policy
from plimsoll.core.sizing import blocks_for
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.launch.spawn import LaunchError, stop_worker, wait_ready, worker_env
from plimsoll.web.worker_secret import SECRET_ENV

GIB = 1 << 30
RankFigures = tuple[int, int, int]  # ceiling, total RAM, clustered budget (bytes)


def parse_rank_figures(text: str) -> RankFigures:
    """``CEILING_GIB[:TOTAL_RAM_GIB[:BUDGET_GIB]]`` → bytes; total and budget default to the
    ceiling. Raises ValueError with what to write instead."""
    try:
        parts = [float(x) for x in text.split(":")]
    except ValueError:
        raise ValueError(f"{text!r}: expected CEILING_GIB[:TOTAL_RAM_GIB[:BUDGET_GIB]]"
                         ) from None
    if not 1 <= len(parts) <= 3 or any(not x > 0 or x == float("inf") for x in parts):
        raise ValueError(f"{text!r}: one to three positive, finite GiB figures")
    ceiling = parts[0]
    total = parts[1] if len(parts) > 1 else ceiling
    budget = parts[2] if len(parts) > 2 else ceiling
    return int(ceiling * GIB), int(total * GIB), int(budget * GIB)


def sharded_request(entry: ModelEntry, policy: Policy, backend: Backend = "ring"
                    ) -> cluster_plan.ClusterRequest:
    """What every rank is asked: the entry's sizes, the policy's blocks and reserve, and the
    backend (resolved already: :func:`plimsoll.cluster.backend.choose`)."""
    return cluster_plan.ClusterRequest(
        concurrency=entry.concurrency, context=entry.context, max_tokens=entry.max_tokens,
        block_tokens=policy.block_tokens, transient_reserve=policy.transient_reserve,
        min_context=policy.min_context, backend=backend)


def admit_sharded(model_dir: Path, entry: ModelEntry, policy: Policy,
                  ranks: tuple[RankFigures, ...], backend: Backend = "ring"
                  ) -> tuple[ModelFacts, AdmissionDecision, cluster_plan.ClusterDecision]:
    """Every rank's plan and preflight (pure, from the header bytes), and the decision.

    Returns the model's facts, rank 0's admission with the cluster's committed concurrency
    and context (what the proxy accounts and configures), and the cluster decision (a
    rollback carries every rank's reasons; rank 0's decision is then not admitted).
    """
    from plimsoll.cluster.weights import read_config, tensor_bytes

    request = sharded_request(entry, policy, backend)
    probes = [cluster_plan.RankProbe(rank=r, ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b,
                           source="plimsoll serve --cluster-rank")
              for r, (c, t, b) in enumerate(ranks)]
    facts = inspect_model(model_dir)
    plans = cluster_plan.plan_cluster(read_config(model_dir), facts, tensor_bytes(model_dir),
                                      probes, request)
    answers = [cluster_plan.preflight(p, pr, facts, request)
               for p, pr in zip(plans, probes, strict=True)]
    # a pure plan has nothing to reserve: an admitted rank counts as reserved
    answers = [a.model_copy(update={"reserved": a.admitted}) for a in answers]
    decision = cluster_plan.decide(answers, len(ranks))
    d0 = answers[0].decision
    if decision.action == "commit":
        d0 = d0.model_copy(update={
            "concurrency": decision.concurrency, "context": decision.context,
            "blocks_per_seq": blocks_for(decision.context, d0.block_tokens,
                                         d0.fixed_blocks_per_seq),
            "reasons": [*d0.reasons, f"sharded over {len(ranks)} ranks: rank 0's share "
                        f"(layers {plans[0].layer_start}..{plans[0].layer_end - 1}) is "
                        "accounted here"]})
    else:
        d0 = d0.model_copy(update={"decision": "refuse",
                                   "reasons": decision.explain().splitlines()})
    return facts, d0, decision


def cluster_serve_argv(cfg: WorkerConfig, ranks: tuple[RankFigures, ...],
                       request: cluster_plan.ClusterRequest) -> list[str]:
    """``plimsoll cluster serve`` for this worker: its port and name, every rank's figures."""
    argv = [sys.executable, "-m", "plimsoll.cli", "cluster", "serve", str(cfg.model_dir),
            "--host", cfg.host, "--port", str(cfg.port), "--model-name", cfg.model_name,
            "--concurrency", str(request.concurrency), "--context", str(request.context),
            "--max-tokens", str(request.max_tokens), "--block-tokens", str(request.block_tokens),
            "--transient-reserve", repr(request.transient_reserve),
            "--min-context", str(request.min_context), "--backend", request.backend,
            "--default-max-tokens", str(cfg.default_max_tokens),
            "--max-queue", str(cfg.max_queue), "--max-wait", repr(cfg.max_wait_s)]
    for c, t, b in ranks:
        argv += ["--rank", f"{c / GIB!r}:{t / GIB!r}:{b / GIB!r}"]
    return argv


def cluster_mismatches(cfg: WorkerConfig, status: dict) -> list[str]:
    """What rank 0 reports against what the proxy admitted (committed, every limit applied)."""
    cluster = status.get("cluster") or {}
    bad = []
    if (cluster.get("decision") or {}).get("action") != "commit":
        bad.append(f"cluster decision: {cluster.get('decision')}")
    for name, want, got in (("context", cfg.context, status.get("context", {}).get("configured")),
                            ("max_num_seqs", cfg.max_num_seqs, status.get("max_num_seqs"))):
        if want != got:
            bad.append(f"{name}: admitted {want}, rank 0 reports {got}")
    for r in cluster.get("ranks", []):
        if r.get("memory_limit_applied_bytes") != r.get("allocation_limit_bytes"):
            bad.append(f"rank {r.get('rank')}: memory limit applied "
                       f"{r.get('memory_limit_applied_bytes')}, admitted "
                       f"{r.get('allocation_limit_bytes')}")
    return bad


def _tee(stream, tail: collections.deque) -> None:
    """Relay the supervisor's stderr to ours and keep its last lines for a launch error."""
    for line in stream:
        tail.append(line.rstrip("\n"))
        sys.stderr.write(line)
        sys.stderr.flush()


def start_cluster_worker(cfg: WorkerConfig, timeout_s: float, stdout=None, *,
                         ranks: tuple[RankFigures, ...], request: cluster_plan.ClusterRequest,
                         footprint_bytes: int | None = None,
                         env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    """Start ``plimsoll cluster serve``, wait for rank 0's status, check it; or stop it.

    The same contract as :func:`plimsoll.launch.spawn.start_worker`: ``(process, status)``, or a
    :class:`~plimsoll.launch.spawn.LaunchError` with the reasons (a refusal's every-rank reasons).
    """
    argv = cluster_serve_argv(cfg, ranks, request)
    proc = subprocess.Popen(argv, env=worker_env() | (env or {}), stdout=stdout,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    threading.Thread(target=_tee, args=(proc.stderr, tail), daemon=True,
                     name=f"cluster-{cfg.port}-stderr").start()

    def exited() -> str:
        time.sleep(0.2)  # let the tee take the last lines
        return (f"plimsoll cluster serve exited with status {proc.returncode} before it was "
                "ready: " + " | ".join(line.strip() for line in tail))

    try:
        status = wait_ready(proc, cfg, timeout_s, "the clustered worker", exited,
                            (env or {}).get(SECRET_ENV))
        bad = cluster_mismatches(cfg, status)
        if bad:
            raise LaunchError("the clustered worker did not apply what was admitted: "
                              + "; ".join(bad))
    except BaseException:
        stop_worker(proc)
        raise
    return proc, status
