"""``plimsoll cluster``: plan a clustered load per rank, or run one on 127.0.0.1 and generate.

Not wired into ``plimsoll.cli`` yet: add ``main.add_command(cluster_group)``.
mlx is never imported here (the rank processes import it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .cli_common import EXIT_REFUSED, UsageFailure

EXIT_RANK_FAILED = 4
GIB = 1 << 30


def _parse_rank(text: str) -> tuple[int, int, int]:
    """``CEILING_GIB[:TOTAL_RAM_GIB[:BUDGET_GIB]]`` → bytes; total and budget default to ceiling."""
    try:
        parts = [float(x) for x in text.split(":")]
    except ValueError:
        raise UsageFailure(f"--rank {text!r}: expected CEILING_GIB[:TOTAL_RAM_GIB[:BUDGET_GIB]]"
                           ) from None
    if not 1 <= len(parts) <= 3 or any(x <= 0 for x in parts):
        raise UsageFailure(f"--rank {text!r}: one to three positive GiB figures")
    ceiling = parts[0]
    total = parts[1] if len(parts) > 1 else ceiling
    budget = parts[2] if len(parts) > 2 else ceiling
    return int(ceiling * GIB), int(total * GIB), int(budget * GIB)


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
                             show_default=True)):
        f = opt(f)
    return f


def _request(**kw):
    from .cluster.plan import ClusterRequest

    return ClusterRequest(**kw)


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
    from .cluster import plan as cp
    from .cluster.weights import read_config, tensor_bytes
    from .model_facts import ModelInspectionError, inspect_model

    request = _request(**request_kw)
    probes = [cp.RankProbe(rank=r, ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b,
                           source="command line")
              for r, (c, t, b) in enumerate(map(_parse_rank, rank_figures))]
    try:
        facts = inspect_model(model)
        plans = cp.plan_cluster(read_config(model), facts, tensor_bytes(model), probes, request)
    except (ModelInspectionError, cp.ClusterPlanError) as err:
        raise UsageFailure(str(err)) from None
    answers = [cp.preflight(p, pr, facts, request) for p, pr in zip(plans, probes, strict=True)]
    # a pure plan has nothing to reserve: an admitted rank counts as reserved
    answers = [a.model_copy(update={"reserved": a.admitted}) for a in answers]
    decision = cp.decide(answers, len(probes))
    if as_json:
        click.echo(json.dumps({"ranks": [a.model_dump() for a in answers],
                               "decision": decision.model_dump()}, indent=2))
    else:
        for a in answers:
            d = a.decision
            click.echo(f"rank {a.rank}: layers {a.plan.layer_start}..{a.plan.layer_end - 1}, "
                       f"weights {a.plan.weights_bytes} B, comm {a.plan.comm_bytes} B, "
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
    """Start every rank on 127.0.0.1 (ring backend), admit two-phase, generate, shut down.

    Exit status: 0 done, 3 refused (rolled back on every rank), 4 a rank failed (every
    rank torn down), 2 bad input. Prints one JSON object.
    """
    from tokenizers import Tokenizer

    from .cluster.runner import Cluster, ClusterError, ClusterRankFailed, ClusterRefused, RankSpec

    specs = [RankSpec(ceiling_bytes=c, total_ram_bytes=t, budget_bytes=b)
             for c, t, b in map(_parse_rank, rank_figures)]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    try:
        with Cluster(model, specs, _request(**request_kw)) as cluster:
            decision = cluster.start(timeout=timeout)
            out = cluster.generate(ids, n_tokens, timeout=timeout)
            ready = cluster.ready
    except ClusterRefused as err:
        click.echo(str(err), err=True)
        raise SystemExit(EXIT_REFUSED) from None
    except ClusterRankFailed as err:
        click.echo(str(err), err=True)
        raise SystemExit(EXIT_RANK_FAILED) from None
    except ClusterError as err:
        click.echo(str(err), err=True)
        raise SystemExit(EXIT_REFUSED) from None
    json.dump({"prompt_tokens": ids, "tokens": out.tokens, "text": tok.decode(out.tokens),
               "tokens_per_s": out.tokens_per_s, "concurrency": decision.concurrency,
               "context": decision.context,
               "ranks": [ready[r] for r in sorted(ready)]}, sys.stdout, indent=2)
    sys.stdout.write("\n")
