"""``plimsoll worker`` (one model behind a bounded KV pool) and ``plimsoll launch`` (admission,
then the worker with the derived caps, verified)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import click

from plimsoll.cli.common import EXIT_REFUSED, UsageFailure, invalid_figures


@click.command("worker")
@click.option("--model", "model_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Local model directory (mlx-lm layout).")
@click.option("--model-name", help="Name clients use (default: the directory's name).")
@click.option("--max-cache-blocks", type=click.IntRange(min=1), required=True,
              help="Hard cap on the global live KV pool, in blocks (all sequences + prefixes).")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True,
              max_open=True), required=True,
              help="u: MLX allocation cap = u × ceiling; trip = min(u + 0.05, 0.99) × RAM.")
@click.option("--cache-memory-mb", type=click.IntRange(min=0), default=0, show_default=True,
              help="Cap on the prefix cache, which lives inside the pool (MiB).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), required=True,
              help="Full-context sequences admission fitted in the pool at once (the "
              "load-time worst case; launch verifies it).")
@click.option("--max-batch", type=click.IntRange(min=1),
              help="Sequences running at once, a runtime bound of its own: shorter requests "
              "fit many more than --max-num-seqs when their reservations fit "
              "[default: max(64, --max-num-seqs)].")
@click.option("--prefill-chunk", type=click.IntRange(min=1),
              help="Prompt tokens computed per step over all prefills, beside every running "
              "decode: a long prompt delays running streams by at most this chunk per step "
              "[default: 2048 on a GPU (fused prefill attention), 512 on a CPU].")
@click.option("--kv-dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              help="KV cache dtype (default: the model's).")
@click.option("--transient-bytes", type=click.IntRange(min=1),
              help="Compute transient admission counted (its reserve less the MLX buffer "
              "cache): the prefill chunk follows the context to stay under it, and a decode "
              "batch grows only while it does [default: unbounded; --prefill-chunk only].")
@click.option("--block-bytes", type=click.IntRange(min=1),
              help="Bytes per KV block admission counted: the worker refuses to start if the "
              "loaded engine's blocks differ (launch passes it).")
@click.option("--context", type=click.IntRange(min=2), required=True,
              help="Configured total context per sequence (prompt + output).")
@click.option("--block-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), help="Largest output reservation.")
@click.option("--default-max-tokens", type=click.IntRange(min=1),
              help="Output reservation when a request names none.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for blocks; beyond it: 503.")
@click.option("--max-wait", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds a request may wait for blocks before a 503.")
@click.option("--ceiling-bytes", type=click.IntRange(min=1),
              help="The ceiling admission used (default: the live probe).")
@click.option("--total-ram-bytes", type=click.IntRange(min=1),
              help="Total RAM admission used (default: the live probe).")
@click.option("--trip-offset", type=click.FloatRange(0, 0.5), default=0.05, show_default=True)
@click.option("--mlx-cache-mb", type=click.IntRange(min=0), default=256, show_default=True,
              help="Cap on MLX's buffer cache (mx.set_cache_limit), MiB.")
@click.option("--wired-limit-bytes", type=click.IntRange(min=0), default=0, show_default=True,
              help="What to wire (Metal only): 0 wires nothing.")
@click.option("--disk-cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep KV blocks leaving memory (eviction, the trip's clear, shutdown) in "
              "this directory and read them back for prompts that match [default: off].")
@click.option("--disk-cache-gb", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Cap on the disk tier's files for this model, GiB.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8081, show_default=True)
@click.option("--max-tokens-over-limit", type=click.Choice(["clamp", "refuse"]),
              default="clamp", show_default=True,
              help="A request's max_tokens over --max-tokens or what the context leaves: "
                   "clamp it (the applied figure is sent in x-plimsoll-max-tokens) or refuse "
                   "it with a 400.")
@click.option("--drain-timeout", "drain_s", type=click.FloatRange(min=0), default=30.0,
              show_default=True, help="Seconds running requests may finish after SIGTERM; "
              "then they end with the protocol's error event.")
@click.option("--quiet", is_flag=True, help="No access-log line per request.")
def worker_command(model_dir, model_name, max_tokens, default_max_tokens, ceiling_bytes,
                   total_ram_bytes, **flags) -> None:
    """Serve one model (OpenAI-compatible) whose live KV is a bounded pool of blocks.

    Normally started by `plimsoll launch` (or the proxy), which derives every cap from
    live admission and verifies the worker applied them.
    """
    from pydantic import ValidationError

    from plimsoll.core.capability import UnsupportedModel, require_supported
    from plimsoll.core.model_facts import ModelInspectionError, check_servable, inspect_model
    from plimsoll.worker.config import WorkerConfig

    try:  # a broken download is a one-line error here, not an engine traceback at load
        check_servable(model_dir)
        require_supported(inspect_model(model_dir), model_name)
    except UnsupportedModel as err:
        click.echo(f"plimsoll worker: REFUSE: {err}", err=True)
        raise SystemExit(EXIT_REFUSED) from None
    except ModelInspectionError as err:
        raise UsageFailure(str(err)) from None
    if ceiling_bytes is None or total_ram_bytes is None:
        from plimsoll.probes import read_snapshot

        snap = read_snapshot()
        ceiling_bytes = ceiling_bytes or snap.ceiling_bytes
        total_ram_bytes = total_ram_bytes or snap.total_ram_bytes
    max_tokens = max_tokens or max(1, flags["context"] // 4)
    try:
        cfg = WorkerConfig(
            model_dir=model_dir, model_name=model_name or model_dir.name,
            max_tokens=max_tokens,
            default_max_tokens=min(default_max_tokens or 512, max_tokens),
            ceiling_bytes=ceiling_bytes, total_ram_bytes=total_ram_bytes,
            max_wait_s=flags.pop("max_wait"), **flags)
    except ValidationError as err:
        raise UsageFailure(str(err)) from None
    if cfg.max_tokens >= cfg.context:
        raise UsageFailure(f"--max-tokens {cfg.max_tokens} must be below --context "
                           f"{cfg.context}")
    from plimsoll.worker.app import serve_worker

    serve_worker(cfg)


class _Interrupted(Exception):
    """SIGTERM/SIGINT while ``plimsoll launch`` is still starting its worker."""


@click.command("launch")
@click.argument("model")
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Host policy (budgets, reserve, registry); default: sized from this host.")
@click.option("--mode", type=click.Choice(["standalone", "clustered"]), default="standalone",
              show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1))
@click.option("--context", type=click.IntRange(min=2))
@click.option("--max-tokens", type=click.IntRange(min=1))
@click.option("--cache-memory-mb", type=click.IntRange(min=0),
              help="Prefix-cache cap inside the pool (default: the whole pool).")
@click.option("--disk-cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The disk tier for KV blocks leaving memory (default: the policy's "
              "diskCache, else off).")
@click.option("--disk-cache-gb", type=click.FloatRange(min=0, min_open=True),
              help="Cap on the disk tier's files for this model, GiB (default: the policy's "
              "maxGb, else 10).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8081, show_default=True,
              help="0 picks a free port.")
def launch_command(model, policy_file, mode, concurrency, context, max_tokens, cache_memory_mb,
                   disk_cache_dir, disk_cache_gb, host, port) -> None:
    """Admit MODEL against live memory, start its worker with the derived caps, verify them.

    Refuses (exit 3, with the figures) a model that cannot hold one sequence; clamps
    concurrency then context loudly; fails (exit 1) if the worker reports limits other
    than those derived. Then stays in the foreground until the worker exits.
    """
    from pydantic import ValidationError

    from plimsoll.core.capability import UnsupportedModel, require_supported
    from plimsoll.core.model_facts import ModelInspectionError, check_servable
    from plimsoll.core.policy import PolicyError, load_policy
    from plimsoll.core.progress import progress
    from plimsoll.core.units import fmt_bytes
    from plimsoll.launch.live_admission import (
        MemoryOverrides,
        Wanted,
        memory_figures,
        plan,
        resolve_model,
    )
    from plimsoll.launch.spawn import LaunchError, start_worker, stop_worker, worker_config
    from plimsoll.probes import read_snapshot
    from plimsoll.web.serve import free_port

    from .report import admission_report

    try:
        pol = load_policy(policy_file) if policy_file else None
    except PolicyError as err:
        raise UsageFailure(str(err)) from None
    model_dir, entry = resolve_model(model, pol)
    figures = memory_figures(pol, mode, MemoryOverrides(), read_snapshot)
    try:
        facts, _req, decision = plan(model_dir, entry, pol, figures,
                                     Wanted(concurrency, context, max_tokens))
        check_servable(model_dir)
        require_supported(facts, model_dir.name)  # before any worker (or weight byte) exists
    except UnsupportedModel as err:
        click.echo(f"plimsoll launch: REFUSE: {err}", err=True)
        raise SystemExit(EXIT_REFUSED) from None
    except ModelInspectionError as err:
        raise UsageFailure(str(err)) from None
    except ValidationError as err:
        raise invalid_figures(err) from None
    click.echo(admission_report(facts, decision, str(model_dir), mode, figures.source),
               err=True)
    if not decision.admitted:
        raise SystemExit(EXIT_REFUSED)
    name = next((n for n, e in (pol.models.items() if pol else []) if e is entry),
                model_dir.name)
    cfg = worker_config(model_dir, name, facts, decision, entry, pol,
                        port=port or free_port(host), host=host,
                        cache_memory_mb=cache_memory_mb, disk_cache_dir=disk_cache_dir,
                        disk_cache_gb=disk_cache_gb)
    # The worker runs in its own session, so signals to us don't reach it: forward them.
    # The handlers are in place before the worker exists (a SIGTERM right after the ready
    # line used to kill us by the default action and leave the worker running). Until the
    # worker is ready a signal interrupts the start (start_worker stops what it started);
    # after that it only records, and stopping happens below, outside Popen.wait's lock.
    stop: list[bool] = []
    started: list[bool] = []
    proc = None

    def on_signal(_signum, _frame) -> None:
        stop.append(True)
        if not started and len(stop) == 1:  # once: a second signal must not cut the stop
            raise _Interrupted

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with progress(f"loading {name}") as report:
            report(f"starting the worker on {host}:{cfg.port} "
                   f"(weights {fmt_bytes(decision.weights_bytes)}, "
                   f"pool {decision.pool_blocks} blocks)")
            proc, status = start_worker(cfg)
            started.append(True)
            report(f"ready, pid {proc.pid}: limits verified")
    except _Interrupted:
        if proc is not None:  # the signal came between start_worker's return and the flag
            stop_worker(proc)
        click.echo("plimsoll launch: stopped before the worker was ready", err=True)
        raise SystemExit(0) from None
    except LaunchError as err:
        click.echo(f"plimsoll launch: {err}", err=True)
        raise SystemExit(1) from None
    click.echo(json.dumps({"event": "ready", "pid": proc.pid, "url": f"http://{host}:{cfg.port}",
                           "limits": status["limits"]}), err=False)
    sys.stdout.flush()
    while proc.poll() is None and not stop:
        time.sleep(0.2)
    if stop:  # asked to stop: a clean stop of the worker is a clean exit of ours
        rc = stop_worker(proc)
        raise SystemExit(0 if rc in (0, -signal.SIGTERM) else 1)
    raise SystemExit(proc.returncode if proc.returncode >= 0 else 1)
