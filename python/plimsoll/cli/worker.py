"""``plimsoll worker`` (one model behind a bounded KV pool) and ``plimsoll launch`` (admission,
then the worker with the derived caps, verified).

``plimsoll worker``'s options are generated from the worker's contract
(:class:`~plimsoll.core.worker_config.WorkerConfig`): one option per setting, its flag, type,
bounds, default and help as declared there.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import click

from plimsoll.cli.common import EXIT_REFUSED, UsageFailure, invalid_figures
from plimsoll.core.sizing import default_output, output_limit
from plimsoll.core.worker_config import SETTINGS, Setting, WorkerConfig


def _click_type(s: Setting) -> Any:
    """The click type of a setting, from its annotation and its pydantic bounds."""
    kind = s.info.annotation
    if get_origin(kind) in (Union, UnionType):  # an optional setting: X | None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Literal:
        return click.Choice(list(get_args(kind)))
    if kind is Path:
        return click.Path(exists=s.spelling.existing, file_okay=False, path_type=Path)
    bounds: dict[str, Any] = {}
    for m in s.info.metadata:
        bounds |= {k: v for k in ("gt", "ge", "lt", "le") if (v := getattr(m, k, None)) is not None}
    if kind is int and bounds:  # an int's open bound is the next integer, closed
        return click.IntRange(
            min=bounds["ge"] if "ge" in bounds else bounds["gt"] + 1 if "gt" in bounds else None,
            max=bounds["le"] if "le" in bounds else bounds["lt"] - 1 if "lt" in bounds else None)
    if kind is float and bounds:
        return click.FloatRange(min=bounds.get("ge", bounds.get("gt")),
                                max=bounds.get("le", bounds.get("lt")),
                                min_open="gt" in bounds, max_open="lt" in bounds)
    return kind


def worker_options(command: Callable) -> Callable:
    """Every :data:`~plimsoll.core.worker_config.SETTINGS` entry as a click option (and each
    alias after its setting), named by the setting, in declaration order."""
    for s in reversed(SETTINGS):
        if (alias := s.spelling.alias) is not None:
            command = click.option(alias.flag, f"{s.name}__alias",
                                   type=click.Choice(list(alias.values)), help=alias.help)(command)
        if s.info.annotation is bool:
            spelling = f"{s.flag}/{s.no_flag}" if s.info.default else s.flag
            command = click.option(spelling, s.name, is_flag=True, default=s.info.default,
                                   show_default=bool(s.info.default),
                                   help=s.info.description)(command)
            continue
        required = s.info.is_required() and not s.spelling.filled
        command = click.option(s.flag, s.name, type=_click_type(s), required=required,
                               default=None if s.info.is_required() else s.info.default,
                               show_default=True, help=s.info.description)(command)
    return command


def merge_aliases(options: dict[str, Any]) -> dict[str, Any]:
    """The options with each alias given turned into its setting's value (an alias that
    disagrees with its setting is a usage error)."""
    values = dict(options)
    for s in SETTINGS:
        if (alias := s.spelling.alias) is None:
            continue
        if (given := values.pop(f"{s.name}__alias", None)) is not None:
            means = alias.values[given]
            if values[s.name] not in (None, means):
                raise UsageFailure(f"{alias.flag} {given} and {s.flag} {values[s.name]} "
                                   f"disagree; pass one of them ({alias.flag} {given} is "
                                   f"{s.flag} {means})")
            values[s.name] = means
    return values


def config_from_options(options: dict[str, Any], read_snapshot: Callable | None = None
                        ) -> WorkerConfig:
    """The configuration ``plimsoll worker``'s parsed options give: an alias merged into its
    setting, what the command line may leave out filled (the name from the directory, the
    output limits by :func:`~plimsoll.core.sizing.output_limit`, the memory figures from the
    live probe), then validated (a bad figure is a usage error)."""
    from pydantic import ValidationError

    values = merge_aliases(options)
    values["model_name"] = values["model_name"] or values["model_dir"].name
    values["max_tokens"] = values["max_tokens"] or output_limit(values["context"])
    values["default_max_tokens"] = default_output(values["max_tokens"],
                                                  values["default_max_tokens"])
    if values["ceiling_bytes"] is None or values["total_ram_bytes"] is None:
        if read_snapshot is None:
            from plimsoll.probes import read_snapshot
        snap = read_snapshot()
        values["ceiling_bytes"] = values["ceiling_bytes"] or snap.ceiling_bytes
        values["total_ram_bytes"] = values["total_ram_bytes"] or snap.total_ram_bytes
    if values["max_tokens"] >= values["context"]:
        raise UsageFailure(f"--max-tokens {values['max_tokens']} must be below --context "
                           f"{values['context']}")
    try:
        return WorkerConfig(**values)
    except ValidationError as err:
        raise UsageFailure(str(err)) from None


@click.command("worker")
@worker_options
def worker_command(**options: Any) -> None:
    """Serve one model (OpenAI-compatible) whose live KV is a bounded pool of blocks.

    Normally started by `plimsoll launch` (or the proxy), which derives every cap from
    live admission and verifies the worker applied them.
    """
    from plimsoll.launch.spawn import SPAWN_HELD

    signal.pthread_sigmask(signal.SIG_UNBLOCK, SPAWN_HELD)  # held by a launcher's spawn
    from plimsoll.core.capability import UnsupportedModel, require_supported
    from plimsoll.core.model_facts import ModelInspectionError, check_servable, inspect_model
    from plimsoll.launch.model_source import ModelNotFound, resolve_model_dir

    values = merge_aliases(options)
    try:  # a broken download is a one-line error here, not an engine traceback at load
        if values.get("draft_model") is not None:  # DIR|ORG/NAME, as --model resolves it
            values["draft_model"] = resolve_model_dir(str(values["draft_model"]),
                                                      "--draft-model")
            check_servable(values["draft_model"])
        check_servable(values["model_dir"])
        require_supported(inspect_model(values["model_dir"], kv_dtype=values["kv_dtype"]),
                          values["model_name"])
    except UnsupportedModel as err:
        click.echo(f"plimsoll worker: REFUSE: {err}", err=True)
        raise SystemExit(EXIT_REFUSED) from None
    except (ModelInspectionError, ModelNotFound) as err:
        raise UsageFailure(str(err)) from None
    cfg = config_from_options(values)
    from plimsoll.worker.app import serve_worker

    serve_worker(cfg)


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
@click.option("--kv-dtype", type=click.Choice(["auto", "float16", "bfloat16", "float32", "q8",
                                               "q4"]),
              help="KV cache dtype, as the policy's kvDtype (q8 / q4: quantized KV, counted "
              "and verified in bytes) [default: the policy's, else the model's].")
@click.option("--disk-cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The disk tier for KV blocks leaving memory (default: the policy's "
              "diskCache, else off).")
@click.option("--disk-cache-gb", type=click.FloatRange(min=0, min_open=True),
              help="Cap on the disk tier's files for this model, GiB (default: the policy's "
              "maxGb, else 10).")
@click.option("--prompt-lookup", type=click.IntRange(0, 8),
              help="Speculate by prompt lookup over the last N tokens (the worker's flag) "
              "[default: the policy's promptLookup, else off].")
@click.option("--num-draft-tokens", type=click.IntRange(1, 16),
              help="Most tokens drafted per sequence and step [default: the policy's "
              "numDraftTokens, else 3].")
@click.option("--draft-model", metavar="DIR|ORG/NAME",
              help="Speculate with this draft model (resolved as MODEL, never downloaded; "
              "its weights and KV counted by admission; wins over --prompt-lookup) "
              "[default: the policy's draftModel, else none].")
@click.option("--mtp/--no-mtp", default=None,
              help="Speculate with the checkpoint's MTP head where it has one (the worker's "
              "flag; admission counts the head) [default: the policy's mtp, else on].")
@click.option("--compile-decode/--no-compile-decode", default=None,
              help="Compile decode-only steps per shape bucket (the worker's flag) "
              "[default: the worker's].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8081, show_default=True,
              help="0 picks a free port.")
def launch_command(model, policy_file, mode, concurrency, context, max_tokens, cache_memory_mb,
                   kv_dtype, disk_cache_dir, disk_cache_gb, prompt_lookup, num_draft_tokens,
                   draft_model, mtp, compile_decode, host, port) -> None:
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
    from plimsoll.launch.model_source import ModelNotFound
    from plimsoll.launch.spawn import (
        LaunchError,
        StartStopped,
        start_worker,
        stop_worker,
        worker_config,
    )
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
                                     Wanted(concurrency, context, max_tokens,
                                            kv_dtype=kv_dtype, draft_model=draft_model,
                                            mtp=mtp))
        check_servable(model_dir)
        require_supported(facts, model_dir.name)  # before any worker (or weight byte) exists
    except UnsupportedModel as err:
        click.echo(f"plimsoll launch: REFUSE: {err}", err=True)
        raise SystemExit(EXIT_REFUSED) from None
    except (ModelInspectionError, ModelNotFound) as err:
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
                        disk_cache_gb=disk_cache_gb, prompt_lookup=prompt_lookup,
                        num_draft_tokens=num_draft_tokens, draft_model=draft_model,
                        mtp=mtp, compile_decode=compile_decode)
    # The worker runs in its own session, so signals to us don't reach it: forward them.
    # The handlers are in place before the worker exists (a SIGTERM right after the ready
    # line would otherwise kill us by the default action and leave the worker running). Until the
    # worker is ready a signal interrupts the start (start_worker stops what it started);
    # after that it only records, and stopping happens below, outside Popen.wait's lock.
    stop: list[bool] = []
    started: list[bool] = []
    proc = None

    def on_signal(_signum, _frame) -> None:
        stop.append(True)
        if not started and len(stop) == 1:  # once: a second signal must not cut the stop
            raise StartStopped

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with progress(f"loading {name}") as report:
            report(f"starting the worker on {host}:{cfg.port} "
                   f"(weights {fmt_bytes(decision.weights_bytes)}, "
                   f"pool {decision.pool_blocks} blocks)")
            proc, status = start_worker(cfg, stop_requested=lambda: bool(stop))
            started.append(True)
            if stop:  # asked before the flag: its exception swallowed (see start_worker), or late
                raise StartStopped
            report(f"ready, pid {proc.pid}: limits verified")
    except StartStopped:
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
