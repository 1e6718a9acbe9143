"""Each rank's memory cgroup, sized from the same pure plan the ranks make.

A rank's limit is its admitted footprint (:func:`plimsoll.cluster.plan.preflight`) plus the
guard's margin (:func:`plimsoll.guard.process.guard_limit`). :mod:`.runner` makes the
cgroups before it spawns the ranks and removes them once every rank has exited. This
module does not import mlx.
"""

from __future__ import annotations

from pathlib import Path

from plimsoll.cluster import plan as cluster_plan
from plimsoll.cluster.weights import read_config, tensor_bytes
from plimsoll.core.model_facts import ModelInspectionError, inspect_model
from plimsoll.guard.process import WorkerGuard, guard_limit


def rank_limits(model_dir: Path, probes: list[cluster_plan.RankProbe],
                request: cluster_plan.ClusterRequest) -> list[int]:
    """Each rank's cgroup limit: its admitted footprint (the pure plan) + the margin."""
    facts = inspect_model(model_dir)
    plans = cluster_plan.plan_cluster(read_config(model_dir), facts, tensor_bytes(model_dir),
                                      probes, request)
    return [guard_limit(cluster_plan.preflight(p, pr, facts, request).decision.footprint_bytes)
            for p, pr in zip(plans, probes, strict=True)]


def rank_guards(model_dir: Path, probes: list[cluster_plan.RankProbe] | None,
                request: cluster_plan.ClusterRequest,
                cgroup_parent: Path | None) -> tuple[list[WorkerGuard], str]:
    """One guard per rank (rank 0 first) and a note saying what was made, or none and why.

    ``probes`` is None when a rank reads its own probe: there are no figures to size its
    cgroup by. A plan or model the ranks will refuse makes no cgroups (the ranks say why).
    """
    if probes is None:
        return [], "a rank reads its own probe: no figures to size its cgroup by"
    try:
        limits = rank_limits(model_dir, probes, request)
    except (cluster_plan.ClusterPlanError, ModelInspectionError) as err:
        return [], f"no cgroups: {err}"
    guards: list[WorkerGuard] = []
    for rank, limit in enumerate(limits):
        guard, why = WorkerGuard.create(f"rank{rank}", limit, cgroup_parent)
        if guard is None:
            while guards:
                guards.pop().close()
            return [], f"no cgroups: {why}"
        guards.append(guard)
    note = "; ".join(f"rank {r}: memory cgroup {g.cgroup.path} limit {g.limit_bytes} B"
                     for r, g in enumerate(guards))
    return guards, note
