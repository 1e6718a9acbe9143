"""The worker's backend: the engine loaded with the process limits, the pool sized, the scheduler.

:func:`local_backend` is what :func:`plimsoll.worker.app.make_app` opens by default: on the
scheduler thread it loads the model (the engine edge), applies the process-wide MLX limits
(restored at exit), builds the pool the flags describe against the loaded engine's real
figures (:func:`make_pool`, admission's own start-up check) and the step's figures
(:func:`scheduler_limits`: the prefill chunk and the decode batch under the transient
admission counted), then yields what the routes read from ``app.state``. A clustered rank 0
passes a backend of its own (:mod:`plimsoll.cluster.serve`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.concurrency import run_in_threadpool

from plimsoll.core import sizing
from plimsoll.core.transients import decode_transient_bytes, default_prefill_chunk, prefill_chunk
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard.process import SelfGuard, memory_probe_with_guard

from . import speculate
from .events import SchedulerLimits
from .pool import BlockPool
from .scheduler import Scheduler

log = logging.getLogger("plimsoll.worker")


def make_pool(cfg: WorkerConfig, eng: Any, pool_cls: type[BlockPool] = BlockPool) -> BlockPool:
    """The pool the flags describe, sized against the loaded engine's real figures; the
    start-up check is admission's own (:func:`plimsoll.core.sizing.pool_problem`)."""
    facts = eng.facts
    if cfg.block_bytes is not None and eng.block_bytes != cfg.block_bytes:
        raise SystemExit(
            f"--block-bytes {cfg.block_bytes} (what admission counted per block) differs "
            f"from the loaded engine's {eng.block_bytes} B per block of {cfg.block_tokens} "
            f"tokens (KV dtype {facts.kv_format}): pass the --kv-dtype admission used")
    # windows count at min(window, context)
    fixed = sizing.fixed_blocks(facts.fixed_bytes(cfg.context), eng.block_bytes)
    if problem := sizing.pool_problem(cfg.max_cache_blocks, cfg.context, cfg.block_tokens, fixed):
        raise SystemExit(problem)
    return pool_cls(
        total=cfg.max_cache_blocks, block_tokens=cfg.block_tokens,
        cache_cap_blocks=sizing.cache_cap_blocks(cfg.prefix_cache_bytes, eng.block_bytes,
                                            cfg.max_cache_blocks),
        fixed_blocks_per_seq=fixed, hybrid=eng.state_bytes_per_seq > 0,
        extra_key=f"{cfg.model_dir.resolve()}|{facts.kv_format}".encode())


def scheduler_limits(cfg: WorkerConfig, eng: Any) -> SchedulerLimits:
    """The step's figures: the prefill chunk follows the context so its transient stays
    under the bound admission counted, and a sequence joins the running batch only while
    the decode step's transient stays under it too. The chunk's default and its transient
    follow the backend (``eng.fused_prefill``: a fused prefill attention holds no scores)."""
    fused = bool(getattr(eng, "fused_prefill", False))
    most = cfg.prefill_chunk or default_prefill_chunk(fused)
    if prefill_chunk(eng.facts, cfg.context, cfg.transient_bytes,
                     block_tokens=cfg.block_tokens, most=most, fused=fused) <= 0:
        raise SystemExit(
            f"--transient-bytes {cfg.transient_bytes} cannot hold one prefill token at "
            f"--context {cfg.context} (the gather of the context alone passes it): raise "
            "the transient reserve or lower the context")
    decode = chunk_for = None
    if cfg.transient_bytes is not None:
        def decode(rows: int, longest: int) -> int:
            return decode_transient_bytes(eng.facts, rows, longest, cfg.block_tokens,
                                          gathered=getattr(eng, "decode_gathers", True))

        def chunk_for(prompt_tokens: int) -> int:  # short prompts take bigger chunks
            return prefill_chunk(eng.facts, max(1, prompt_tokens), cfg.transient_bytes,
                                 block_tokens=cfg.block_tokens, most=most, fused=fused)
    return SchedulerLimits(cfg.max_num_seqs, cfg.max_queue, cfg.max_wait_s, cfg.trip_bytes,
                           max_batch=cfg.batch_bound, prefill_tokens=most,
                           transient_bytes=cfg.transient_bytes or 0, decode_bytes=decode,
                           chunk_for=chunk_for)


#: What a backend yields for ``app.state``: scheduler, tokenizer, native_max_context,
#: block_bytes, kv_bytes_per_token, applied_limits, engine_memory, rss, guard, and
#: optionally ``status_extra`` (a callable whose dict is merged into the status report).
Backend = Callable[[WorkerConfig], AbstractAsyncContextManager[dict[str, Any]]]


@contextlib.asynccontextmanager
async def local_backend(cfg: WorkerConfig) -> AsyncIterator[dict[str, Any]]:
    """This process's own engine: load it on the scheduler thread, stop it at exit."""
    import psutil

    proc = psutil.Process()
    loaded: dict[str, Any] = {}

    def setup(stack: contextlib.ExitStack):
        """On the scheduler thread: load, apply limits (restored at exit), size the pool."""
        from plimsoll import engine  # the engine edge: the only place mlx is imported

        eng = engine.Engine.load(cfg.model_dir, block_tokens=cfg.block_tokens,
                            max_blocks=cfg.max_cache_blocks, kv_dtype=cfg.kv_dtype,
                            context=cfg.context)
        loaded["applied"] = stack.enter_context(engine.process_limits(
            cfg.allocation_limit_bytes, cfg.mlx_cache_bytes, cfg.wired_limit_bytes))
        loaded["active_memory"] = engine.active_memory
        if cfg.disk_cache_dir is None:
            pool = make_pool(cfg, eng)
        else:
            from plimsoll.worker.disk_restore import SpillingPool, open_tier

            pool = make_pool(cfg, eng, SpillingPool)
            sched.disk = open_tier(cfg.disk_cache_dir, cfg.disk_cache_bytes, cfg.model_dir, eng)
            sched.disk.attach(pool)
        limits = scheduler_limits(cfg, eng)
        if cfg.prompt_lookup:
            sched.drafter = speculate.Drafter(cfg.prompt_lookup, cfg.num_draft_tokens,
                                              eng.speculation_refused)
            if sched.drafter.refused:
                log.warning("--prompt-lookup ignored: %s", sched.drafter.refused)
        if took := engine.warm_up(eng):  # GPU backends only: see engine/warmup
            log.info("warm-up: the GPU backend's first-use compilation took %.2f s", took)
        return eng, pool, limits

    def memory_probe() -> dict[str, int]:
        return {"mlx_active": loaded["active_memory"](), "rss": proc.memory_info().rss}

    self_guard = SelfGuard.find()  # the cgroup limit that binds us, if any
    sched = Scheduler(setup, SchedulerLimits(cfg.max_num_seqs, cfg.max_queue, cfg.max_wait_s,
                                             cfg.trip_bytes),
                      memory_probe_with_guard(memory_probe, self_guard))
    sched.start()
    await run_in_threadpool(sched.ready.wait)
    if sched.setup_error is not None:
        raise sched.setup_error
    eng = sched.engine
    try:
        yield {"scheduler": sched, "tokenizer": eng.tokenizer,
               "native_max_context": eng.facts.native_max_context,
               "block_bytes": eng.block_bytes,
               "kv_bytes_per_token": eng.block_bytes // cfg.block_tokens,
               "kv_dtype": eng.facts.kv_format,  # q8 / q4 when quantized
               "applied_limits": loaded["applied"], "engine_memory": eng.memory,
               "rss": lambda: proc.memory_info().rss, "guard": self_guard,
               "constrained_decoding": True,
               "status_extra": lambda: {"kernels": eng.kernels.report(),
                                        "one_forward": eng.mixers.report(),
                                        **({} if sched.drafter is None else
                                           {"speculative": sched.drafter.report()})}}
    finally:  # the disk tier's shutdown spill runs on the scheduler thread: give it time
        await run_in_threadpool(sched.stop, 10.0 if sched.disk is None else 120.0)
        if sched.disk is not None:
            await run_in_threadpool(sched.disk.close)
