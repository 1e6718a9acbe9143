"""The worker's backend: the engine loaded with the process limits, the pool sized, the scheduler.

:func:`start_scheduler` is what the engine process runs (:mod:`.engine_proc`): on the
scheduler thread it loads the model (the engine edge), applies the process-wide MLX limits
(restored when the thread ends), builds the pool the flags describe against the loaded
engine's real figures (:func:`make_pool`, admission's own start-up check) and the step's
figures (:func:`scheduler_limits`: the prefill chunk and the decode batch under the
transient admission counted). What :func:`plimsoll.worker.app.make_app` opens by default is
:func:`plimsoll.worker.engine_client.process_backend`, the API process's side of that engine
process; a clustered rank 0 passes a backend of its own (:mod:`plimsoll.cluster.serve`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Collection
from contextlib import AbstractAsyncContextManager
from typing import Any

from plimsoll.core import sizing
from plimsoll.core.transients import decode_transient_bytes, default_prefill_chunk, prefill_chunk
from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard.process import FootprintGuard, SelfGuard, memory_probe_with_guard

from . import draft_model, mtp, speculate
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
                           chunk_for=chunk_for, chunk_align=int(getattr(eng, "chunk_align", 0)))


def load_draft(cfg: WorkerConfig, eng: Any, engine_cls: Any) -> Any:
    """The draft model's engine: pools of as many blocks as the model's (addressed by its
    tables), its native KV dtype; refused at load (``SystemExit``, with what to change) when
    its vocabulary is not the model's, its cache cannot roll back by length, or both models
    and pools do not fit the allocation limit."""
    draft = engine_cls.load(cfg.draft_model, block_tokens=cfg.block_tokens,
                            max_blocks=cfg.max_cache_blocks, context=cfg.context)
    if why := draft_model.vocab_problem(eng.tokenizer.get_vocab(), draft.tokenizer.get_vocab(),
                                        str(cfg.draft_model)):
        raise SystemExit(why)
    if draft.speculation_refused:
        raise SystemExit(f"--draft-model {cfg.draft_model}: {draft.speculation_refused}: a "
                         "draft model must hold only full-attention KV; pass another, or "
                         "drop --draft-model")
    if why := draft_model.fit_problem(
            weights=eng.facts.weights_bytes, draft_weights=draft.facts.weights_bytes,
            blocks=cfg.max_cache_blocks, block_bytes=eng.block_bytes,
            draft_block_bytes=draft.block_bytes,
            transient=(cfg.transient_bytes or 0) + cfg.mlx_cache_bytes,
            limit=cfg.allocation_limit_bytes):
        raise SystemExit(why)
    return draft


def draft_drafter(cfg: WorkerConfig, eng: Any, draft: Any) -> draft_model.DraftModel:
    """The proposer over ``draft`` (None: refused, the model cannot speculate); its catch-up
    chunk keeps the draft's prefill transient under the bound admission counted, as the
    model's chunk does."""
    if draft is None:
        return draft_model.DraftModel(0, cfg.num_draft_tokens, eng.speculation_refused,
                                      name=str(cfg.draft_model))
    fused = bool(getattr(draft, "fused_prefill", False))
    most = cfg.prefill_chunk or default_prefill_chunk(fused)
    chunk = most if cfg.transient_bytes is None else prefill_chunk(
        draft.facts, cfg.context, cfg.transient_bytes, block_tokens=cfg.block_tokens,
        most=most, fused=fused)
    vocab = getattr(getattr(eng.model, "args", None), "vocab_size", 0) or 0
    return draft_model.DraftModel(0, cfg.num_draft_tokens, eng.speculation_refused,
                                  engine=draft, chunk=max(1, chunk), vocab=vocab,
                                  name=str(cfg.draft_model))


def mtp_drafter(cfg: WorkerConfig, eng: Any, prefill_tokens: int) -> mtp.MTPDrafter | None:
    """The checkpoint's MTP head as the proposer (None: --no-mtp, the checkpoint has none,
    the model cannot speculate, or the head does not fit beside the pool the flags size).
    Its catch-up takes what the model computes in a step: ``prefill_tokens`` of prompt (one
    layer like the model's, so the model's per-layer transient bounds it) and every decode
    row's verified tokens."""
    if not cfg.mtp or eng.speculation_refused:
        return None
    from plimsoll.engine import mtp_head  # the engine edge

    head, why = mtp_head.attach(eng, cfg.model_dir)
    if head is None:
        log.info("no MTP head: %s", why)
        return None
    if problem := mtp.fit_problem(
            weights=eng.facts.weights_bytes, mtp_weights=head.model.weights_bytes,
            blocks=cfg.max_cache_blocks, block_bytes=eng.block_bytes,
            mtp_block_bytes=head.block_bytes,
            transient=(cfg.transient_bytes or 0) + cfg.mlx_cache_bytes,
            limit=cfg.allocation_limit_bytes):
        eng.mtp = None  # nothing captured for it; its weights go with it
        log.warning("no MTP head: %s", problem)
        return None
    if cfg.prompt_lookup:
        log.info("--prompt-lookup %d unused: the MTP head proposes instead", cfg.prompt_lookup)
    rows = cfg.batch_bound * (cfg.num_draft_tokens + 1)
    return mtp.MTPDrafter(0, cfg.num_draft_tokens, engine=head, hidden=eng.mtp,
                          chunk=prefill_tokens + rows)


#: What a backend yields for ``app.state``: scheduler, tokenizer, native_max_context,
#: block_bytes, kv_bytes_per_token, applied_limits, and either ``live`` (an async callable:
#: the figures of :func:`plimsoll.worker.app.live_figures`) or engine_memory, rss and guard;
#: optionally ``status_extra`` (a callable whose dict is merged into the status report).
Backend = Callable[[WorkerConfig], AbstractAsyncContextManager[dict[str, Any]]]


def start_scheduler(cfg: WorkerConfig, guard: SelfGuard | FootprintGuard | None, *,
                    flush: Callable[[], None] | None = None,
                    also_rss: Collection[int] = ()) -> tuple[Scheduler, dict[str, Any]]:
    """Start the scheduler thread that loads the engine; wait until it is ready.

    Returns the scheduler (``setup_error`` set if loading failed) and what loading gave
    beside it: ``applied`` (the process limits as applied). ``also_rss``: other processes
    of this worker (the API process) whose resident set the trip counts with this one's.
    """
    import psutil

    procs = [psutil.Process(), *(psutil.Process(pid) for pid in also_rss)]
    loaded: dict[str, Any] = {}

    def setup(stack: contextlib.ExitStack):
        """On the scheduler thread: load, apply limits (restored at exit), size the pool."""
        from plimsoll import engine  # the engine edge: the only place mlx is imported

        eng = engine.Engine.load(cfg.model_dir, block_tokens=cfg.block_tokens,
                            max_blocks=cfg.max_cache_blocks, kv_dtype=cfg.kv_dtype,
                            context=cfg.context, compile_decode=cfg.compile_decode)
        eng.transient_budget = cfg.transient_bytes  # a decode that fits it runs unpaced
        draft = None  # a model that cannot speculate holds no draft model (the status says why)
        if cfg.draft_model is not None and not eng.speculation_refused:
            draft = load_draft(cfg, eng, engine.Engine)
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
        if cfg.draft_model is not None:  # the draft model wins over MTP and prompt lookup
            sched.drafter = draft_drafter(cfg, eng, draft)
            if cfg.prompt_lookup:
                log.info("--prompt-lookup %d unused: --draft-model proposes instead",
                         cfg.prompt_lookup)
        elif (drafter := mtp_drafter(cfg, eng, limits.prefill_tokens)) is not None:
            sched.drafter = drafter
        elif cfg.prompt_lookup:
            sched.drafter = speculate.Drafter(cfg.prompt_lookup, cfg.num_draft_tokens,
                                              eng.speculation_refused,
                                              chains=eng.chains_drafts)
        if sched.drafter is not None and sched.drafter.refused:
            log.warning("speculation off: %s", sched.drafter.refused)
        elif sched.drafter is not None:  # its drafts are decode rows (engine/forward)
            limits = dataclasses.replace(limits, decode_rows_per_seq=1 + cfg.num_draft_tokens)
        # GPU backends only (see engine/warmup): the model, and the proposer's engine (a
        # draft model's, or the MTP head's)
        for warmed in (eng, getattr(sched.drafter, "engine", None)):
            if warmed is not None and (took := engine.warm_up(warmed)):
                log.info("warm-up: the GPU backend's first-use compilation took %.2f s", took)
        sched.warmer = engine.plan_warmer(eng, limits.prefill_tokens)  # built while idle
        return eng, pool, limits

    def rss() -> int:
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def memory_probe() -> dict[str, int]:
        return {"mlx_active": loaded["active_memory"](), "rss": rss()}

    sched = Scheduler(setup, SchedulerLimits(cfg.max_num_seqs, cfg.max_queue, cfg.max_wait_s,
                                             cfg.trip_bytes),
                      memory_probe_with_guard(memory_probe, guard), flush=flush)
    sched.start()
    sched.ready.wait()
    return sched, loaded
