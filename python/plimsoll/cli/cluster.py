"""``plimsoll cluster``: plan a clustered load per rank, serve one, or run one and generate.

``plan`` is pure (no process starts); ``serve`` and ``generate`` start every rank on this
host (on 127.0.0.1) through :class:`plimsoll.cluster.runner.Cluster`, on the backend
``--backend`` names (``auto``: what MLX reports available here, ring last; a named one MLX
does not offer here is refused with what to change). mlx is never imported here (the rank
processes import it; availability is read in a child process).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import click

from plimsoll.cli.common import EXIT_RANK_FAILED, EXIT_REFUSED, UsageFailure
from plimsoll.core.sizing import DEFAULT_OUTPUT_TOKENS


def _parse_rank(text: str) -> tuple[int, int, int]:
    """``CEILING_GIB[:TOTAL_RAM_GIB[:BUDGET_GIB]]`` → bytes; total and budget default to ceiling."""
    from plimsoll.cluster.launch import parse_rank_figures

    try:
        return parse_rank_figures(text)
    except ValueError as err:
        raise UsageFailure(f"--rank {err}") from None


_rank_option = click.option(
    "--rank", "rank_figures", multiple=True, required=True,
    help="One per rank, rank 0 first: CEILING_GIB[:TOTAL_RAM_GIB[:BUDGET_GIB]] "
         "(the clustered budget defaults to the ceiling).")


def _request_options(f):
    for opt in (click.option("--concurrency", type=click.IntRange(min=1), default=1,
                             show_default=True),
                click.option("--context", type=click.IntRange(min=1), default=4096,
                             show_default=True),
                click.option("--max-tokens", type=click.IntRange(min=1), default=512,
                             show_default=True, help="Output reservation per sequence."),
                click.option("--block-tokens", type=click.IntRange(min=1), default=16,
                             show_default=True),
                click.option("--transient-reserve", type=click.FloatRange(0, 1), default=0.05,
                             show_default=True, help="Fraction of each rank's budget."),
                click.option("--min-context", type=click.IntRange(min=1), default=1024,
                             show_default=True),
                click.option("--stage", type=click.Choice(["engine", "loop"]),
                             default="engine", show_default=True,
                             help="How each rank runs its layers: the worker's engine (paged "
                                  "KV, batched decodes, prefix sharing), or one slot per "
                                  "sequence (loop)."),
                click.option("--parallel", type=click.Choice(["auto", "pipeline", "tensor"]),
                             default="auto", show_default=True,
                             help="How the model is split: by layers, rank to rank "
                                  "(pipeline), or every layer across every rank, 1/n of each "
                                  "projection and of the KV heads, two all-sums a layer "
                                  "(tensor: llama, qwen2, qwen3; the engine stage). auto: "
                                  "tensor where the backend is nccl or jaccl and the model "
                                  "splits, else pipeline."),
                click.option("--micro-batches", type=click.IntRange(1, 2), default=2,
                             show_default=True,
                             help="Engine stage: 2 pipelines alternate halves of the decodes "
                                  "across the ranks; 1 runs one step at a time."),
                click.option("--backend", type=click.Choice(["auto", "ring", "jaccl", "nccl"]),
                             default="auto", show_default=True,
                             help="MLX distributed backend of the ranks (auto: what MLX "
                                  "reports available here; ring last).")):
        f = opt(f)
    return f


def resolve_backend(wanted: str, *, local: bool, setting: str = "--backend") -> str:
    """The backend to run on; a usage error (with what to change) when there is none.

    ``local``: every rank runs on this host, and a named backend must be available here."""
    from plimsoll.cluster.backend import choose, read_availability

    if not local and wanted != "auto":
        return wanted  # a plan may price a backend this host does not have
    choice = choose(wanted, read_availability(), setting=setting, local=local)
    if choice.backend is None:
        raise UsageFailure(choice.reason)
    return choice.backend


def _request(*, local: bool, backend: str, **kw):
    from plimsoll.cluster.plan import ClusterRequest

    return ClusterRequest(backend=resolve_backend(backend, local=local), **kw)


def _exit_for(err: Exception) -> SystemExit:
    """A cluster failure, said on stderr with every rank's reasons, as the command's exit:
    4 when a rank failed (every rank torn down), 3 for a refusal or a refused request."""
    from plimsoll.cluster.exits import ClusterRankFailed

    click.echo(str(err), err=True)
    return SystemExit(EXIT_RANK_FAILED if isinstance(err, ClusterRankFailed) else EXIT_REFUSED)


@click.group("cluster")
def cluster_group() -> None:
    """Clustered mode: one model split across ranks on MLX's distributed runtime."""


@cluster_group.command("plan")
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@_rank_option
@_request_options
@click.option("--json", "as_json", is_flag=True, help="Print every rank's figures as JSON.")
def plan_command(model, rank_figures, as_json, **request_kw) -> None:
    """Per-rank layer split, weights share, KV and the two-phase decision (no process starts).

    Exit status: 0 commit, 3 rollback (every rank's reasons are printed), 2 bad input.
    """
    from plimsoll.cluster import plan as cluster_plan
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.core.model_facts import ModelInspectionError, inspect_model

    request = _request(local=False, **request_kw)
    probes = [cluster_plan.RankProbe(rank=r, ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b,
                                     source="command line")
              for r, (c, t, b) in enumerate(map(_parse_rank, rank_figures))]
    try:
        facts, config = inspect_model(model), read_config(model)
        request = cluster_plan.resolve_parallel(request, config, facts, len(probes))
        plans = cluster_plan.plan_cluster(config, facts, tensor_bytes(model), probes, request)
    except (ModelInspectionError, cluster_plan.ClusterPlanError) as err:
        raise UsageFailure(str(err)) from None
    answers = [cluster_plan.preflight(p, pr, facts, request)
               for p, pr in zip(plans, probes, strict=True)]
    # a pure plan has nothing to reserve: an admitted rank counts as reserved
    answers = [a.model_copy(update={"reserved": a.admitted}) for a in answers]
    decision = cluster_plan.decide(answers, len(probes))
    if as_json:
        click.echo(json.dumps({"parallel": request.parallel,
                               "ranks": [a.model_dump() for a in answers],
                               "decision": decision.model_dump()}, indent=2))
    else:
        click.echo(f"split: {request.parallel} over {request.backend}")
        for a in answers:
            d = a.decision
            click.echo(f"rank {a.rank}: layers {a.plan.layer_start}..{a.plan.layer_end - 1}, "
                       f"weights {a.plan.weights_bytes} B, comm {a.plan.comm_bytes} B + "
                       f"{request.backend} {a.plan.transport_bytes} B, "
                       f"KV {a.plan.kv_bytes_per_token} B/token, pool {d.pool_blocks} blocks, "
                       f"footprint {d.footprint_bytes} B, u {d.gpu_memory_utilization:.3f}: "
                       f"{d.decision}")
        click.echo(decision.explain())
    if decision.action != "commit":
        raise SystemExit(EXIT_REFUSED)


@cluster_group.command("generate")
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@_rank_option
@_request_options
@click.option("--prompt", required=True, help="Text, encoded with the model's tokenizer.json.")
@click.option("--tokens", "n_tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens to generate (greedy).")
@click.option("--timeout", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds to wait for the load, and again for the answer.")
def generate_command(model, rank_figures, prompt, n_tokens, timeout, **request_kw) -> None:
    """Start every rank on 127.0.0.1, admit two-phase, generate, shut down.

    Exit status: 0 done, 3 refused (rolled back on every rank), 4 a rank failed (every
    rank torn down), 2 bad input. Prints one JSON object.
    """
    from tokenizers import Tokenizer

    from plimsoll.cluster.exits import ClusterError
    from plimsoll.cluster.runner import Cluster, RankSpec

    specs = [RankSpec(ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b)
             for c, t, b in map(_parse_rank, rank_figures)]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    try:
        with Cluster(model, specs, _request(local=True, **request_kw)) as cluster:
            decision = cluster.start(timeout=timeout)
            out = cluster.generate(ids, n_tokens, timeout=timeout)
            ready = cluster.ready
    except ClusterError as err:
        raise _exit_for(err) from None
    json.dump({"prompt_tokens": ids, "tokens": out.tokens, "text": tok.decode(out.tokens),
               "tokens_per_s": out.tokens_per_s, "concurrency": decision.concurrency,
               "context": decision.context,
               "ranks": [ready[r] for r in sorted(ready)]}, sys.stdout, indent=2)
    sys.stdout.write("\n")


class _Interrupted(Exception):
    """SIGTERM/SIGINT while the ranks were still coming up."""


@cluster_group.command("serve")
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@_rank_option
@_request_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Rank 0's HTTP bind address.")
@click.option("--port", type=click.IntRange(1, 65535), default=8090, show_default=True,
              help="Rank 0's HTTP port (the worker API: /v1/chat/completions, ...).")
@click.option("--model-name", help="The model name clients use (default: the directory name).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=DEFAULT_OUTPUT_TOKENS,
              show_default=True, help="Output reservation when a request names none.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a free slot; beyond: 503 queue_full.")
@click.option("--max-wait", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds a request may wait for a slot before a 503.")
@click.option("--timeout", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds to wait for every rank to load and rank 0 to listen.")
@click.option("--guard/--no-guard", default=True, show_default=True,
              help="Each rank in its own memory cgroup (its admitted footprint + margin), "
                   "where the memory controller is writable (root on Linux).")
def serve_command(model, rank_figures, host, port, model_name, default_max_tokens, max_queue,
                  max_wait, timeout, guard, **request_kw) -> None:
    """Serve MODEL split across ranks on this host; rank 0 answers the worker's HTTP API.

    Stays in the foreground as the ranks' supervisor: SIGTERM/SIGINT shut every rank down
    (exit 0); a rank that dies tears every rank down (exit 4, every rank's reasons on
    stderr); a two-phase refusal rolls every rank back (exit 3, every rank's reasons).
    No rank outlives this process. For ranks on other hosts, see ``mlx.launch`` in the
    README.
    """
    from plimsoll.cluster.exits import ClusterError
    from plimsoll.cluster.runner import Cluster, RankSpec, ServeSpec
    from plimsoll.launch.spawn import worker_env

    specs = [RankSpec(ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b)
             for c, t, b in map(_parse_rank, rank_figures)]
    request = _request(local=True, **request_kw)
    name = model_name or model.name
    cluster = Cluster(model, specs, request, env=worker_env(), serve=ServeSpec(
        port=port, host=host, model_name=name, default_max_tokens=default_max_tokens,
        max_queue=max_queue, max_wait_s=max_wait), guard=guard)
    stop = threading.Event()
    starting = True
    asked: list[str] = []

    def on_signal(signum, _frame) -> None:
        asked.append(signal.Signals(signum).name)
        stop.set()
        if starting:
            raise _Interrupted(asked[0])

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            decision = cluster.start(timeout=timeout)
        finally:
            starting = False
        if asked:  # asked while starting, the handler's exception swallowed by Python
            raise _Interrupted(asked[0])  # (inside a weakref callback, e.g. an import lock's)
        layers = ", ".join(f"rank {r}: layers {e['layers'][0]}..{e['layers'][1] - 1}"
                           for r, e in sorted(cluster.ready.items()))
        url = cluster.serving["url"]
        click.echo(f"plimsoll cluster serve: {url}/v1 ready — model {name!r} on "
                   f"{len(specs)} ranks ({layers}); concurrency {decision.concurrency}, "
                   f"context {decision.context}", err=True)
        if cluster.guard_note:
            click.echo(f"plimsoll cluster serve: {cluster.guard_note}", err=True)
        click.echo(json.dumps({"event": "ready", "url": url, "model": name,
                               "pids": cluster.pids, "concurrency": decision.concurrency,
                               "context": decision.context,
                               "ranks": [cluster.ready[r] for r in sorted(cluster.ready)]}))
        sys.stdout.flush()
        cluster.watch(stop)
    except ClusterError as err:
        raise _exit_for(err) from None
    except _Interrupted as why:
        click.echo(f"plimsoll cluster serve: {why} while loading; every rank torn down",
                   err=True)
    finally:
        cluster.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("plimsoll cluster serve: every rank shut down", err=True)
