"""One rank of a clustered load: the process that joins the group, admits two-phase, serves.

Started once per host, by :mod:`plimsoll.cluster.runner` (or by ``mlx.launch --backend
B``, which sets the same environment: :func:`plimsoll.cluster.backend.launches`). Every rank:

1. joins the group on the request's backend (``mx.distributed.init(backend=B,
   strict=True)``); under ``mlx.launch`` with no backend in ``--request``, the one its
   environment was set up for (:func:`plimsoll.cluster.backend.backend_from_env`). A
   backend MLX does not report available here, or one that cannot run this many ranks,
   ends the rank with exit 2 and a reason that says what to change;
2. reads its *own* memory figures (command-line overrides, else its own probe) and
   all-gathers them, so every rank computes the same pure plan
   (:func:`plimsoll.cluster.plan.plan_cluster`);
3. **preflight and reserve**: admits its own share; if admitted, reserves by lowering its
   MLX allocation limit to its admitted allocation limit; all-gathers the answers;
4. **commit all or roll back all** (:func:`plimsoll.cluster.plan.decide`, identical on every
   rank): on rollback it restores its limit, loads nothing and exits 3; on commit it loads
   only its own tensors (lazy load, foreign layers dropped before evaluation) and
   all-gathers what it loaded (so rank 0 can report every rank);
5. serves up to the committed concurrency of sequences at once, each in its own slot with
   its own per-layer caches on every rank (:mod:`plimsoll.cluster.protocol`): rank 0
   broadcasts one op at a time (new/step/free/ping/shutdown), the pipeline passes
   activations rank → rank + 1, and the last rank's token is all-summed back to every rank.
   Rank 0 takes its requests from HTTP (``--serve-port``: the worker's own API, through
   :mod:`plimsoll.cluster.serve`) or, without it, one JSON request per line on stdin.
   With ``stage: "engine"`` in the request, every rank runs its layers on the worker's
   engine instead (:mod:`plimsoll.cluster.engine_stage`: paged pools of the decision's
   common block count, batched decodes, chunked prefills), and rank 0's scheduler is the
   worker's own with a sharing pool, making every engine call on every rank in turn.

Events are JSON lines on stdout (``{"event": ...}``); the supervisor reads them. A lost
peer (mlx raises ``[ring] connection to a peer was lost``) ends the rank with exit 4 and a
reasoned ``error`` event, so one rank's death tears the ring down; a supervisor that dies
takes its ranks with it (parent watchdog).

Running out is checked by the rank itself before every forward that yields a token (mlx's
memory limit is soft on the CPU backend): active memory past the admitted allocation limit
ends the rank with exit 6, which ends the ring for every peer. Each slot's KV is sized once
to its reservation (``prompt + max_tokens``, whole blocks: :class:`plimsoll.cluster.slots.SlotKV`),
so it never grows past what rank 0's pool admitted.

Exit codes: 0 shutdown, 2 cannot join the group, 3 rolled back, 4 peer lost, 5 other error,
6 ran out of its admitted memory. (The group is called "the ring" below whatever its
backend: the protocol only ever talks to a neighbour.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from plimsoll.cluster.exits import (
    EXIT_INIT,
    EXIT_OTHER,
    EXIT_ROLLBACK,
    as_failure,
    emit,
)
from plimsoll.cluster.stage import MemoryCheck, Ring, load_stage
from plimsoll.core.sizing import DEFAULT_OUTPUT_TOKENS


def _parent_watchdog(period: float = 0.5) -> None:
    """Exit when the process that started this rank goes away (no orphan ranks)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                os._exit(EXIT_OTHER)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def _own_probe(args, rank: int):
    """This rank's figures: ``--figures-by-rank`` [rank], else flags, else its own probe.

    The budget is the clustered ``maxLocalLlmGb`` of this host's policy (``--policy``),
    else the default policy for the probed machine, else the ceiling.
    """
    from plimsoll.cluster.plan import RankProbe

    figures = {"ceiling_bytes": args.ceiling_bytes, "total_ram_bytes": args.total_ram_bytes,
               "budget_bytes": args.budget_bytes}
    sources = []
    if args.figures_by_rank:
        mine = json.loads(args.figures_by_rank)[rank]
        figures.update({k: v for k, v in mine.items() if k in figures})
        sources.append(f"--figures-by-rank[{rank}]")
    elif figures["ceiling_bytes"] is not None:
        sources.append("command line")
    snap = None
    if figures["ceiling_bytes"] is None or figures["total_ram_bytes"] is None:
        from plimsoll.probes import read_snapshot

        snap = read_snapshot()
        sources.append(f"probe: {snap.ceiling_source}")
        figures["ceiling_bytes"] = figures["ceiling_bytes"] or snap.ceiling_bytes
        figures["total_ram_bytes"] = figures["total_ram_bytes"] or snap.total_ram_bytes
    if figures["budget_bytes"] is None:
        if args.policy:
            from plimsoll.core.policy import load_policy

            pol = load_policy(args.policy)
            figures["budget_bytes"] = pol.budget_bytes("clustered")
            sources.append(f"budget: policy {pol.host} clustered")
        elif snap is not None:
            from plimsoll.launch.defaults import default_policy

            figures["budget_bytes"] = default_policy(snap).budget_bytes("clustered")
            sources.append("budget: default clustered policy")
        else:
            figures["budget_bytes"] = figures["ceiling_bytes"]
            sources.append("budget: the ceiling")
    return RankProbe(rank=rank, host=args.host, source=", ".join(sources), **figures)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m plimsoll.cluster.rank")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--host", default="", help="This rank's host name (for its reasons).")
    p.add_argument("--ceiling-bytes", type=int)
    p.add_argument("--total-ram-bytes", type=int)
    p.add_argument("--budget-bytes", type=int)
    p.add_argument("--figures-by-rank", help="JSON list, indexed by rank, of {ceiling_bytes, "
                   "total_ram_bytes, budget_bytes}: one command line for every rank, as "
                   "mlx.launch needs, with each rank's own figures")
    p.add_argument("--policy", type=Path, help="This host's policy (clustered budget).")
    p.add_argument("--request", default="{}", help="ClusterRequest as JSON (same on every rank)")
    p.add_argument("--backend", choices=["ring", "jaccl", "nccl"],
                   help="Overrides the request's backend (default: the request's, else the "
                        "one this process's environment was launched for, else ring).")
    for flag in ("--concurrency", "--context", "--max-tokens", "--block-tokens"):
        p.add_argument(flag, type=int, help="Overrides the same field of --request.")
    s = p.add_argument_group("HTTP on rank 0 (the worker API); without --serve-port, stdin")
    s.add_argument("--serve-port", type=int, help="Rank 0 serves HTTP on this port.")
    s.add_argument("--serve-host", default="127.0.0.1")
    s.add_argument("--model-name", help="The name clients use (default: the directory name).")
    s.add_argument("--default-max-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS)
    s.add_argument("--max-queue", type=int, default=64)
    s.add_argument("--max-wait", type=float, default=30.0)
    s.add_argument("--trip-offset", type=float, default=0.05)
    return p.parse_args(argv)


def _request(args):
    from plimsoll.cluster.backend import backend_from_env
    from plimsoll.cluster.plan import ClusterRequest

    base = json.loads(args.request)
    for name in ("concurrency", "context", "max_tokens", "block_tokens", "backend"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    if "backend" not in base:
        base["backend"] = backend_from_env(os.environ) or "ring"
    return ClusterRequest.model_validate(base)


def _join(mx, request):
    """The group on the request's backend (a singleton when no launcher set one up);
    raises ValueError with what to change when it cannot run here."""
    from plimsoll.cluster.backend import availability_of, backend_from_env, choose, world_refusal

    launched = backend_from_env(os.environ)
    if launched is None:
        return mx.distributed.init()  # one rank: no group to join
    backend = request.backend
    if launched != backend:
        raise ValueError(f"the request's backend is {backend!r} but this process was launched "
                         f"for {launched!r}: give both the same (--backend)")
    choice = choose(backend, availability_of(mx), setting="the cluster backend")
    if choice.backend is None:
        raise ValueError(choice.reason)
    group = mx.distributed.init(backend=backend, strict=True)
    if why := world_refusal(backend, group.size()):
        raise ValueError(why)
    return group


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    _parent_watchdog()

    import mlx.core as mx

    from plimsoll.cluster import plan as cluster_plan
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.core.model_facts import inspect_model

    try:
        request = _request(args)
        group = _join(mx, request)
    except Exception as e:
        emit("error", rank=int(os.environ.get("MLX_RANK", 0)), phase="init",
             reason=f"cannot join the group: {e}")
        return EXIT_INIT
    ring = Ring(mx, group, request.backend)
    try:
        probe = _own_probe(args, ring.rank)
        probes = [cluster_plan.RankProbe.model_validate(x)
                  for x in ring.all_gather_json(probe.model_dump())]
        config, facts = read_config(args.model), inspect_model(args.model)
        request = cluster_plan.resolve_parallel(request, config, facts, ring.size)
        plans = cluster_plan.plan_cluster(config, facts, tensor_bytes(args.model), probes, request)
        answer = cluster_plan.preflight(plans[ring.rank], probe, facts, request)
        previous_limit = None
        if answer.admitted:  # reserve: this rank may allocate no more than it was admitted
            previous_limit = mx.set_memory_limit(answer.decision.allocation_limit_bytes)
            answer = answer.model_copy(update={"reserved": True})
        emit("preflight", rank=ring.rank, answer=answer.model_dump())
        answers = [cluster_plan.Preflight.model_validate(x)
                   for x in ring.all_gather_json(answer.model_dump())]
        decision = cluster_plan.decide(answers, ring.size)
        emit("decision", rank=ring.rank, decision=decision.model_dump())
        if decision.action == "rollback":
            if previous_limit is not None:
                mx.set_memory_limit(previous_limit)
            return EXIT_ROLLBACK
        # the MLX buffer cache is capped too (invariant 4): half the transient reserve
        reserve = answer.decision.transient_reserve_bytes
        mx.set_cache_limit(cluster_plan.cache_limit_mib(reserve) << 20)
        plan, limit = plans[ring.rank], answer.decision.allocation_limit_bytes
        if request.stage == "engine":
            engine, check, loaded_bytes = _engine_rank(mx, ring, args.model, plan, request,
                                                       decision, facts, limit)
        else:
            stage = load_stage(mx, ring, args.model, plan, request)
            stage.check_memory.limit_bytes, loaded_bytes = limit, stage.loaded_bytes
        mine = {"rank": ring.rank, "pid": os.getpid(), "host": probe.host,
                "loaded_bytes": loaded_bytes,
                "planned_weights_bytes": plan.weights_bytes,
                "active_memory_bytes": mx.get_active_memory(),
                "memory_limit_applied_bytes": mx.get_memory_limit(),
                "layers": [plan.layer_start, plan.layer_end],
                "backend": ring.backend, "stage": request.stage, "parallel": request.parallel,
                "messages": "all-sum" if ring.collective else "send/recv"}
        loaded = ring.all_gather_json(mine)  # also the barrier: every rank loaded
        emit("ready", **mine, concurrency=decision.concurrency, context=decision.context)
        from plimsoll.cluster import protocol
        from plimsoll.cluster.serve import ClusterFacts, serve_http

        def cluster_facts(tokenizer) -> ClusterFacts:
            return ClusterFacts(model_dir=args.model, request=request, decision=decision,
                                answers=answers, loaded=loaded, facts=facts, tokenizer=tokenizer)

        if request.stage == "engine":
            from plimsoll.cluster import engine_stage

            tensor = request.parallel == "tensor"
            if ring.rank != 0:
                return engine_stage.follow(ring, engine, check, tensor=tensor)
            leader = engine_stage.StageEngine(ring, engine, facts, check, tensor=tensor,
                                              micro_batches=request.micro_batches)
            if args.serve_port is None:
                from plimsoll.cluster.engine_serve import serve_stdin

                return serve_stdin(leader, cluster_facts(engine.tokenizer))
            return serve_http(leader, cluster_facts(engine.tokenizer), args, engine=leader)
        if ring.rank != 0:
            return protocol.follow(ring, stage)
        leader = protocol.Leader(ring, stage)
        if args.serve_port is None:
            return protocol.serve_stdin(leader, decision.context)
        return serve_http(leader, cluster_facts(_load_tokenizer(args.model, config)), args)
    except Exception as e:
        failure = as_failure(ring.rank, e)
        emit("error", rank=ring.rank, phase="run", reason=failure.reason)
        return failure.code


def _engine_rank(mx, ring, model_dir: Path, plan, request, decision, facts, limit: int):
    """This rank's layers on the worker's engine: ``(engine, memory check, loaded bytes)``.
    Every rank's pool holds the decision's common number of blocks (the same block ids)."""
    from plimsoll.cluster import engine_stage
    from plimsoll.cluster.rank_facts import stage_facts, tensor_facts
    from plimsoll.cluster.stage import load_slice

    if request.parallel == "tensor":
        model, config, params = engine_stage.load_sharded(mx, ring, model_dir)
        engine = engine_stage.build_tensor_engine(
            model, tensor_facts(facts, ring.size, plan.weights_bytes),
            _load_tokenizer(model_dir, config) if ring.rank == 0 else None,
            block_tokens=request.block_tokens, max_blocks=decision.pool_blocks,
            context=decision.context)
        return engine, MemoryCheck(mx, ring.rank, limit), sum(v.nbytes for v in params)
    model, config, templates, params = load_slice(mx, model_dir, plan)
    stage = engine_stage.StageModel(mx, ring, model, plan, templates)
    engine = engine_stage.build_engine(
        mx, ring, stage, stage_facts(facts, plan.layer_start, plan.layer_end,
                                     plan.weights_bytes),
        _load_tokenizer(model_dir, config) if ring.rank == 0 else None,
        block_tokens=request.block_tokens, max_blocks=decision.pool_blocks,
        context=decision.context)
    return (engine, MemoryCheck(mx, ring.rank, limit),
            sum(v.nbytes for v in params))


def _load_tokenizer(model_dir: Path, config: dict):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # do not wait on the ring's background threads
