"""Human-readable explanations: one line per figure, each saying what it is and why.

Pure formatting of values (no I/O), so the CLI stays a thin printer and tests can
check the text without running a command.
"""

from __future__ import annotations

from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.capability import Unsupported
from plimsoll.core.model_facts import ModelFacts
from plimsoll.core.policy import Policy
from plimsoll.core.units import bytes_to_mib_floor, fmt_bytes, gib_to_bytes


def policy_summary(pol: Policy, source: str) -> str:
    lines = [
        f"policy {source}: valid (schema v{pol.schema_version})",
        f"  host            {pol.host}: {pol.total_ram_gb:g} GiB RAM, "
        f"OS floor {pol.os_floor_gb:g} GiB",
    ]
    for mode in ("standalone", "clustered"):
        budget = getattr(pol.modes, mode).max_local_llm_gb
        lines.append(
            f"  {mode:<15} budget {budget:g} GiB (leaves {pol.total_ram_gb - budget:g} GiB), "
            f"wired ceiling {bytes_to_mib_floor(gib_to_bytes(budget))} MiB"
        )
    lines += [
        f"  reserve         {pol.transient_reserve:.0%} of the budget for transients; "
        f"trip offset {pol.trip_offset}; u margin {pol.u_margin}",
        f"  blocks          {pol.block_tokens} tokens per KV block; minimum context "
        f"{pol.min_context}; wire: {pol.wire}",
        f"  listen          {pol.listen.host}:{pol.listen.port}",
        f"  cluster         {pol.cluster.interface} ({pol.cluster.backend}), "
        f"{len(pol.cluster.peers)} peer(s)",
        f"  models          {len(pol.models)}",
    ]
    for name, m in pol.models.items():
        lines.append(
            f"    {name}: {m.path} context {m.context}, concurrency {m.concurrency}, "
            f"max tokens {m.default_max_tokens}/{m.max_tokens}, kv {m.kv_dtype}"
            + (", sharded" if m.sharded else "")
        )
    return "\n".join(lines)


def cache_lines(facts: ModelFacts) -> list[str]:
    """One line per cache group: kind, layers, mlx-lm class, bytes and how they were derived."""
    lines = []
    for c in facts.caches:
        size = (f"{c.state_bytes} B/seq" if c.kind == "state"
                else f"{c.bytes_per_token} B/token" + (f", ≤ {c.max_tokens} tokens"
                                                       if c.max_tokens else ""))
        lines.append(f"    {c.kind:<8} {len(c.layers):>3} layer(s) {c.mlx_cache}: {size} a layer "
                     f"({c.formula})")
    return lines


def capability_line(refusal: Unsupported | None) -> str:
    """What ``plimsoll admit`` says about the engine serving the model's cache kinds."""
    if refusal is None:
        return "  engine          serves every cache kind of this model"
    return f"  engine          REFUSE ({refusal.kind}): {refusal.message}"


def admission_report(
    facts: ModelFacts, d: AdmissionDecision, model_dir: str, mode: str, sources: str,
    refusal: Unsupported | None = None, proposer: str = "draft model",
) -> str:
    """The figures, one a line; ``refusal`` (the capability check) overrides the verdict."""
    verdict = {"admit": "ADMIT", "clamp": "ADMIT (clamped)", "refuse": "REFUSE"}[d.decision]
    if refusal is not None:
        verdict = "REFUSE (engine)"
    lines = [
        f"{verdict}: {model_dir} in {mode} mode",
        f"  inputs          {sources}",
        f"  architecture    {facts.model_type}: {facts.kv_layers} of {facts.num_layers} layers "
        f"hold growing KV, caches {', '.join(facts.cache_kinds)}, KV {facts.kv_format}",
        *cache_lines(facts),
        f"  KV per token    {d.kv_bytes_per_token} B"
        + (f" = 2 × {facts.kv_layers} × {facts.num_key_value_heads} × {facts.head_dim} × "
           f"{facts.kv_dtype_bytes}" if facts.cache_kinds == ("kv",) and not facts.kv_bits
           and d.kv_bytes_per_token == 2 * facts.kv_layers * facts.num_key_value_heads
           * facts.head_dim * facts.kv_dtype_bytes
           else " (the sum of the growing caches above)"),
        f"  block           {d.block_bytes} B = {d.block_tokens} tokens × KV per token"
        + (f"; {d.fixed_blocks_per_seq} fixed block(s)/seq for window/recurrent state"
           if d.fixed_blocks_per_seq else ""),
        f"  weights         {fmt_bytes(d.weights_bytes)} ({d.weights_bytes} B, safetensors)",
        *([f"  {proposer:<15} weights {fmt_bytes(d.draft_weights_bytes)} "
           f"({d.draft_weights_bytes} B), KV {d.draft_block_bytes} B a block, its pool "
           f"{fmt_bytes(d.draft_pool_bytes)} (a block for every pool block)"]
          if d.draft_weights_bytes or d.draft_block_bytes else []),
        f"  budget          {fmt_bytes(d.budget_bytes)} ({d.budget_bytes} B, {mode} mode)",
        f"  reserve         {fmt_bytes(d.transient_reserve_bytes)} for transient allocations",
        f"  ceiling         {fmt_bytes(d.ceiling_bytes)} of {fmt_bytes(d.total_ram_bytes)} RAM",
        f"  u band          {d.band_low:.4f} < u < {d.band_high:.4f} "
        f"(footprint/ceiling < u < ceiling/RAM − trip offset)",
        f"  u               {d.gpu_memory_utilization:.4f} (--gpu-memory-utilization)",
        f"  allocation cap  {fmt_bytes(d.allocation_limit_bytes)} = u × ceiling",
        f"  trip            {fmt_bytes(d.trip_bytes)} = min(u + offset, 0.99) × RAM",
        f"  pool            {d.pool_blocks} blocks = {fmt_bytes(d.pool_bytes)} "
        f"(--max-cache-blocks, global, shared by all sequences)",
        f"  footprint       {fmt_bytes(d.footprint_bytes)} = weights + reserve + pool"
        + (f" (the {proposer}'s included)" if d.draft_weights_bytes else ""),
        f"  context         {d.context} tokens configured (asked {d.requested_context}, "
        f"model-native {d.native_max_context or 'unknown'}), "
        f"output reservation {d.output_reservation}",
        f"  concurrency     {d.concurrency} (asked {d.requested_concurrency}) × "
        f"{d.blocks_per_seq} blocks/seq",
    ]
    lines += [f"  - {r}" for r in d.reasons]
    lines.append(capability_line(refusal))
    return "\n".join(lines)
