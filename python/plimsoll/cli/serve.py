"""``plimsoll serve``: the swapping proxy in front of every model of the policy.

With no ``--policy`` it serves the embedded default: a demo model built once under the
cache directory (with progress) and a policy sized from this machine's live probes, so
a newcomer's first command answers a chat request. ``--model DIR|ORG/NAME`` serves a real
model instead (a directory, or a Hugging Face repository in the local cache — never
downloaded), sized the same way unless ``--context`` / ``--concurrency`` / ``--max-tokens``
say otherwise; with ``--policy`` it is added to the policy's models.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import click

from plimsoll.cli.check import backend_setting, check_serve, with_check
from plimsoll.cli.common import UsageFailure


@click.command("serve")
@with_check(lambda **kw: check_serve(parse_idle_ttls, parse_cluster_ranks, **kw), "plimsoll serve")
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Host policy (JSON). Default: the embedded demo model and a policy sized "
                   "from this machine's live memory figures.")
@click.option("--host", help="Bind address (default: the policy's listen.host, 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535),
              help="Port (default: the policy's listen.port, 8080).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A name besides localhost, loopback addresses and the bind address that "
                   "clients may reach this server by (the Host and a browser's Origin are "
                   "checked against DNS rebinding; '*' turns the check off). Repeatable.")
@click.option("--api-key", envvar="PLIMSOLL_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/*, /api/*, /running and "
                   "/unload.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False, exists=True,
              path_type=Path), help="The admin token for /admin/* (default: generated at "
              "start into a user-only file under the cache directory).")
@click.option("--mode", type=click.Choice(["standalone", "clustered"]), default="standalone",
              show_default=True, help="The mode whose budget binds at start.")
@click.option("--max-waiting", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests per model that may wait for it to load; beyond: 429.")
@click.option("--swap-hold", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds a model in use keeps its slot after loading before it can be "
                   "swapped out (stops two clients alternating two models from thrashing).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds in-flight requests may finish before their worker is stopped.")
@click.option("--release-timeout", type=click.FloatRange(min=0), default=10.0,
              show_default=True,
              help="Seconds a stopped worker's memory has to come back before a load is "
                   "refused with 503.")
@click.option("--idle-ttl", "idle_ttls", multiple=True, metavar="[MODEL=]SECONDS",
              help="Unload a model idle this long (0: never). SECONDS sets the default "
                   "(300); MODEL=SECONDS one model's. Repeatable.")
@click.option("--cluster-rank", "cluster_ranks", multiple=True,
              metavar="CEILING_GIB[:TOTAL_GIB[:BUDGET_GIB]]",
              help="One per rank, rank 0 first: in clustered mode, models marked sharded run "
                   "split across these ranks on this host (`plimsoll cluster serve`).")
@click.option("--cluster-backend", type=click.Choice(["auto", "ring", "jaccl", "nccl"]),
              help="MLX distributed backend of those ranks (default: the policy's "
                   "cluster.backend; auto: what MLX reports available here, ring last). "
                   "A named backend MLX does not offer here is refused at start.")
@click.option("--model", "model_spec", metavar="DIR|ORG/NAME",
              help="Serve this model: a local directory, or a Hugging Face repository id "
                   "resolved from the local cache (HF_HUB_CACHE / HF_HOME; never downloaded). "
                   "Default: the embedded demo model.")
@click.option("--context", type=click.IntRange(min=256),
              help="Total context per sequence for --model (or the demo). Default: the "
                   "largest up to the model's native maximum that the budget admits at the "
                   "concurrency.")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Sequences decoded together for --model (or the demo). Default: 2.")
@click.option("--max-tokens", type=click.IntRange(min=1),
              help="Largest output reservation for --model (or the demo); a request asking "
                   "more is clamped. Default: a quarter of the context (at most 32768).")
@click.option("--prompt-lookup", type=click.IntRange(0, 8),
              help="Speculate by prompt lookup over the last N tokens for --model (or the "
                   "demo): the policy entry's promptLookup. Default: off.")
@click.option("--draft-model", metavar="DIR|ORG/NAME",
              help="Speculate with this draft model for --model (or the demo), resolved as "
                   "--model: the policy entry's draftModel (its weights and KV counted by "
                   "admission; wins over --prompt-lookup). Default: none.")
@click.option("--no-mtp", is_flag=True,
              help="Do not speculate with the checkpoint's MTP head for --model (or the "
                   "demo): the policy entry's mtp false. Default: the head drafts where the "
                   "checkpoint has one (counted by admission).")
@click.option("--quiet", is_flag=True, help="No access-log line per request (proxy and "
              "workers).")
@click.option("--no-ollama-api", is_flag=True, help="Do not serve Ollama's API (/api/chat, "
              "/api/tags, ...) on this port (policy: ollamaApi false).")
def serve_command(policy_file, host, port, allowed_hosts, api_key, admin_token_file, mode,
                  max_waiting, swap_hold, drain_timeout, release_timeout, idle_ttls, cluster_ranks,
                  cluster_backend, model_spec, context, concurrency, max_tokens,
                  prompt_lookup, draft_model, no_mtp, quiet, no_ollama_api) -> None:
    """Serve every model of the policy behind one OpenAI-compatible endpoint.

    Workers start on demand through load-time admission with live inputs; a swap stops
    the old worker and verifies its memory came back before the new one starts.
    """
    from plimsoll.core.paths import cache_dir
    from plimsoll.proxy import Settings, make_app
    from plimsoll.proxy.admin import load_or_create_token
    from plimsoll.web.serve import basic_logging

    basic_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per relayed request
    ranks = parse_cluster_ranks(cluster_ranks)  # bad input fails before anything loads
    from plimsoll.cli.serve_model import served_policy

    pol = served_policy(policy_file, model_spec, context, concurrency, max_tokens,
                        prompt_lookup, draft_model, no_mtp)
    if not pol.models:
        raise UsageFailure(f"{policy_file}: the policy lists no models: add one under 'models'")
    try:
        token, token_path = load_or_create_token(admin_token_file, cache_dir() / "admin-token")
    except (OSError, ValueError) as err:
        raise UsageFailure(f"admin token: {err}") from None
    check_disk_dirs(pol)
    default_ttl, per_model = parse_idle_ttls(idle_ttls, set(pol.models))
    backend = "ring"
    if ranks:  # the ranks' backend, resolved once: a named one unavailable here is refused
        from plimsoll.cli.cluster import resolve_backend

        backend = resolve_backend(cluster_backend or pol.cluster.backend, local=True,
                                  setting=backend_setting(cluster_backend))
    settings = Settings(max_waiting=max_waiting, swap_hold_s=swap_hold, drain_s=drain_timeout,
                        release_timeout_s=release_timeout, default_idle_ttl_s=default_ttl,
                        idle_ttl_s=per_model, cluster_ranks=ranks, cluster_backend=backend,
                        quiet=quiet, ollama_api=not no_ollama_api)
    from plimsoll.web.access_log import set_quiet
    from plimsoll.web.edge import Edge
    from plimsoll.web.graceful import Drain, serve
    from plimsoll.web.local_origin import HostRule, LocalOrigin
    from plimsoll.web.serve import uvicorn_options

    set_quiet(quiet)
    drain = Drain(drain_timeout)
    app = make_app(pol, mode=mode, settings=settings, api_key=api_key, admin_token=token,
                   drain=drain)
    host = host or pol.listen.host
    port = port or pol.listen.port
    click.echo(f"plimsoll serve: http://{host}:{port}/v1 — {mode} mode, models: "
               f"{', '.join(sorted(pol.models))}; admin token in {token_path}", err=True)
    # uvicorn's own bound (a plain 503, no Retry-After) stays behind the Edge's; its
    # graceful timeout is the drain plus a margin (web.graceful.serve). Other sites' pages
    # (DNS rebinding, cross-site POSTs) get a 403 before the app sees them.
    local = LocalOrigin(app, HostRule(host, allowed_hosts))
    serve(Edge(local, limit=1024), drain, host=host, port=port,
          **uvicorn_options(limit_concurrency=2048, graceful_s=0))


def check_disk_dirs(pol) -> None:
    """Every disk tier of the policy in a directory that is this user's alone (created 0700
    now if missing): refused at start, with the reason, rather than off in a worker later."""
    from plimsoll.core.paths import private_dir

    for name, entry in sorted(pol.models.items()):
        if (disk := pol.disk_cache_for(entry)) is None:
            continue
        try:
            private_dir(Path(disk.path).expanduser(), f"model {name!r}'s KV blocks")
        except OSError as err:
            raise UsageFailure(f"diskCache of model {name!r}: {err}") from None


def parse_idle_ttls(values: tuple[str, ...], models: set[str]
                    ) -> tuple[float, tuple[tuple[str, float], ...]]:
    """``("600", "big=60")`` → ``(600.0, (("big", 60.0),))``; bad input is a usage error."""
    default, per_model = 300.0, []
    for value in values:
        name, _, secs = value.rpartition("=")
        try:
            ttl = float(secs)
        except ValueError:
            raise UsageFailure(f"--idle-ttl {value!r}: SECONDS must be a number") from None
        if not 0 <= ttl < math.inf:  # NaN too
            raise UsageFailure(f"--idle-ttl {value!r}: SECONDS must be a finite number, "
                               "0 (never) or more")
        if not name:
            default = ttl
        elif name not in models:
            raise UsageFailure(f"--idle-ttl {value!r}: no model {name!r} in the policy "
                               f"(models: {', '.join(sorted(models))})")
        else:
            per_model.append((name, ttl))
    return default, tuple(per_model)


def parse_cluster_ranks(values: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    """``--cluster-rank`` figures in bytes; bad input is a usage error that says what to write."""
    from plimsoll.cluster.launch import parse_rank_figures

    try:
        return tuple(parse_rank_figures(v) for v in values)
    except ValueError as err:
        raise UsageFailure(f"--cluster-rank {err}") from None
