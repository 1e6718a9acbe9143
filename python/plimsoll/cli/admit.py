"""``plimsoll admit``: what load-time admission would decide for a model, figure by figure."""

from __future__ import annotations

import json
from pathlib import Path

import click

from plimsoll.cli.common import EXIT_REFUSED, UsageFailure, invalid_figures
from plimsoll.core.policy import PolicyError, load_policy
from plimsoll.launch.live_admission import (
    MemoryOverrides,
    Wanted,
    draft_spec,
    memory_figures,
    mtp_spec,
    plan,
    resolve_model,
)

PIB_IN_GIB = 1 << 20
"""Memory overrides stop at 1 PiB: past it the byte figures overflow a float (1e300 GiB)."""


def _positive(kind, most: float):
    """Positive, and at most ``most`` (the policy's own bounds; 1 PiB for memory)."""
    if kind is float:
        return click.FloatRange(min=0, min_open=True, max=most)
    return click.IntRange(min=1, max=int(most))


@click.command("admit")
@click.argument("model", required=False)
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Host policy (budgets, reserve, block size, model registry).")
@click.option("--mode", type=click.Choice(["standalone", "clustered"]), default="standalone",
              show_default=True, help="Which mode's budget applies.")
@click.option("--budget-gib", type=_positive(float, PIB_IN_GIB),
              help="Override the mode budget (GiB).")
@click.option("--ceiling-mib", type=_positive(int, PIB_IN_GIB * 1024),
              help="Override the live ceiling (MiB, as iogpu.wired_limit_mb).")
@click.option("--total-ram-gib", type=_positive(float, PIB_IN_GIB),
              help="Override total RAM (GiB).")
@click.option("--concurrency", type=_positive(int, 1024), help="Requested concurrent sequences.")
@click.option("--context", type=_positive(int, 4_194_304),
              help="Requested total context per sequence.")
@click.option("--max-tokens", type=_positive(int, 4_194_304),
              help="Output reservation per sequence.")
@click.option("--block-tokens", type=_positive(int, 4096), help="Tokens per KV block.")
@click.option("--kv-dtype", type=click.Choice(["float16", "bfloat16", "float32", "q8", "q4"]),
              help="KV cache dtype (default: the model's); q8/q4: quantized KV, counted as "
                   "values + scales + biases in groups of 64.")
@click.option("--draft-model", metavar="DIR|ORG/NAME",
              help="Count a draft model (speculation): its weights, its KV for every pool "
                   "block and its transient [default: the policy's draftModel, else none].")
@click.option("--mtp/--no-mtp", default=None,
              help="Count the checkpoint's MTP head, which the worker drafts with unless "
                   "--no-mtp: its weights, which mlx-lm drops at load, and one layer's KV for "
                   "every pool block; nothing with a draft model or a checkpoint without one "
                   "[default: the policy's mtp, else on].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every figure.")
def admit_command(model, policy_file, mode, budget_gib, ceiling_mib, total_ram_gib,
                  concurrency, context, max_tokens, block_tokens, kv_dtype, draft_model,
                  mtp, as_json) -> None:
    """Size a worker for MODEL (a directory, or a name in the policy) and decide.

    Without overrides the ceiling and total RAM come from the live probes (macOS:
    iogpu.wired_limit_mb / MLX's recommended working set; Linux: min(cgroup limit,
    MemTotal)). Without MODEL, the embedded demo model is built once and used.
    Exit status: 0 admit or clamp, 3 refuse (memory, or a cache kind the engine does not
    serve), 2 bad input.
    """
    from pydantic import ValidationError

    from plimsoll.core import capability
    from plimsoll.core.model_facts import ModelInspectionError
    from plimsoll.launch.model_source import ModelNotFound
    from plimsoll.probes import read_snapshot

    try:
        pol = load_policy(policy_file) if policy_file else None
    except PolicyError as err:
        raise UsageFailure(str(err)) from None
    if model is None:
        from plimsoll.core.progress import progress
        from plimsoll.launch.defaults import ensure_demo_model

        with progress("demo model") as report:
            model_dir, entry = ensure_demo_model(report=report), None
    else:
        model_dir, entry = resolve_model(model, pol)
    figures = memory_figures(pol, mode, MemoryOverrides(budget_gib, ceiling_mib, total_ram_gib),
                             read_snapshot)
    wanted = Wanted(concurrency, context, max_tokens, block_tokens, kv_dtype, draft_model, mtp)
    try:
        facts, _req, decision = plan(model_dir, entry, pol, figures, wanted)
    except (ModelInspectionError, ModelNotFound) as err:
        raise UsageFailure(str(err)) from None
    except ValidationError as err:
        raise invalid_figures(err) from None
    refusal = capability.check(facts, model_dir.name)
    if as_json:
        out = decision.model_dump()
        out.update(kv_layers=facts.kv_layers, model_dir=str(model_dir), mode=mode,
                   kv_dtype=facts.kv_format, sources=figures.source,
                   cache_kinds=list(facts.cache_kinds),
                   caches=[c.model_dump(mode="json") for c in facts.caches],
                   servable=refusal is None,
                   unsupported=None if refusal is None else {"kind": refusal.kind,
                                                             "message": refusal.message})
        click.echo(json.dumps(out, indent=2))
    else:
        from .report import admission_report

        # a draft model wins over the head; a checkpoint without one counts nothing
        head = mtp_spec(wanted.mtp, entry) and draft_spec(wanted, entry) is None \
            and facts.mtp_weights_bytes > 0
        click.echo(admission_report(facts, decision, str(model_dir), mode, figures.source,
                                    refusal, "MTP head" if head else "draft model"))
    if not decision.admitted or refusal is not None:
        raise SystemExit(EXIT_REFUSED)
