"""Clustered admission, pure: per-rank shares of a model and the two-phase commit decision.

Nothing here does I/O or imports mlx. Callers pass every rank's probe figures (its own
ceiling, total RAM and clustered budget, measured where it runs), the model's config,
its :class:`~plimsoll.core.model_facts.ModelFacts` and the per-tensor byte counts read from the
safetensors headers (:mod:`plimsoll.cluster.weights`).

The shape of the protocol (docs/DESIGN.md, "The invariants"):

1. **Plan.** The layers are split into contiguous ranges, one per rank, in proportion to
   each rank's capacity ``min(budget, ceiling)`` (largest remainder, at least one layer each).
   Rank 0 runs the first layers and holds the embeddings; the last rank runs the last layers
   and holds the final norm and the output head (and, with tied embeddings, a second copy
   of the embedding matrix that it uses as the head). Each rank's weights share is the sum
   of *its* tensors' bytes from the headers — never ``weights ÷ ranks``. Each rank's KV per
   token counts only the full-attention layers it runs; its per-sequence fixed bytes only
   its sliding/linear layers. Ranks that talk to a peer also hold communication buffers:
   the activation messages (one in and one out per link, at the prefill chunk) and the
   backend's own buffers (:func:`plimsoll.cluster.backend.transport_bytes`: ring, jaccl
   from MLX's sources, nccl a conservative reserve from NCCL's defaults), all counted as
   resident for the life of the load.
2. **Preflight and reserve.** Each rank runs the single-host :func:`~plimsoll.core.admission.admit`
   on its own figures and its own share (:func:`preflight`) and, if admitted, reserves
   (the rank process sets its allocation limit); it answers admit/refuse with its figures.
3. **Commit all or roll back all** (:func:`decide`): every rank admitted and reserved →
   commit with the common concurrency and context (the minimum over ranks, which every
   rank's pool holds because admission is monotone in both); otherwise roll back every
   rank, with every rank's reasons. A missing answer is a refusal.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from plimsoll.cluster.backend import Backend, transport_bytes
from plimsoll.core.admission import AdmissionDecision, AdmissionRequest, admit
from plimsoll.core.cache_layout import CAPPED_KINDS, GROWING_KINDS, lookup
from plimsoll.core.model_facts import DTYPE_BYTES, ModelFacts
from plimsoll.core.sizing import mlx_cache_mb

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED_KEYS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
_HEAD_KEYS = ("lm_head", "output.weight")
_NORM_RE = re.compile(r"^(?:model\.|language_model\.model\.)?(norm|final_layernorm|ln_f)\.")

Part = Literal["layer", "embed", "head", "norm", "other"]


class ClusterPlanError(ValueError):
    """The cluster cannot be planned at all (e.g. more ranks than layers); the message says why."""


class RankProbe(BaseModel):
    """One rank's own memory figures, measured on its own host (or given on its command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    host: str = ""
    ceiling_bytes: int = Field(gt=0)
    total_ram_bytes: int = Field(gt=0)
    budget_bytes: int = Field(gt=0, description="This host's clustered maxLocalLlmGb in bytes.")
    measured_extra_bytes: int = Field(
        default=0, ge=0,
        description="Calibrated peak above the formula footprint (counted as resident).")
    source: str = ""

    @property
    def capacity_bytes(self) -> int:
        return min(self.budget_bytes, self.ceiling_bytes)


class ClusterRequest(BaseModel):
    """What is asked of the whole cluster (the same on every rank)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int = Field(default=1, gt=0)
    context: int = Field(default=4096, gt=0)
    max_tokens: int = Field(default=512, gt=0)
    block_tokens: int = Field(default=16, gt=0)
    transient_reserve: float = Field(default=0.05, ge=0, le=1)
    min_context: int = Field(default=1024, gt=0)
    prefill_chunk: int = Field(default=512, gt=0, description="Tokens per pipeline message.")
    stage: Literal["loop", "engine"] = Field(
        default="engine", description="How a rank runs its layers: the worker's engine "
        "(:mod:`plimsoll.cluster.engine_stage`: paged pools, batching, prefix sharing), or "
        "its own per-layer loop, one slot per sequence (:mod:`plimsoll.cluster.stage`).")
    micro_batches: int = Field(
        default=2, ge=1, le=2, description="Steps in flight across the ranks on the engine "
        "stage: 2 decodes alternate halves of the sequences so two ranks compute at once; 1 "
        "runs each step through every rank before the next (the all-sum messages of nccl "
        "always do).")
    backend: Backend = Field(default="ring", description="The MLX distributed backend every "
                             "rank runs on (chosen before the ranks start: "
                             ":func:`plimsoll.cluster.backend.choose`).")
    parallel: Literal["auto", "pipeline", "tensor"] = Field(
        default="auto", description="How the model is split: by layers (each rank runs a "
        "contiguous range, activations passed rank to rank), or every layer across every "
        "rank (mlx-lm's ``shard``: each rank holds 1/n of each projection and of the KV "
        "heads, two all-sums a layer; dense models of :data:`TENSOR_PARALLEL_TYPES` only, "
        "on the engine stage); ``auto``: the plan chooses (:func:`resolve_parallel`).")


class RankPlan(BaseModel):
    """One rank's share of the model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    layer_start: int
    layer_end: int
    holds_embeddings: bool
    holds_head: bool
    weights_bytes: int
    comm_bytes: int
    transport_bytes: int = Field(default=0, description="The backend's own buffers on this "
                                 "rank (:func:`plimsoll.cluster.backend.transport_bytes`).")
    kv_bytes_per_token: int
    per_sequence_fixed_bytes: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


class Preflight(BaseModel):
    """One rank's phase-one answer: admit or refuse, with its figures and reasons."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    admitted: bool
    reserved: bool = False
    reasons: list[str] = Field(default_factory=list)
    plan: RankPlan | None = None
    decision: AdmissionDecision | None = None
    error: str | None = None


class ClusterDecision(BaseModel):
    """Phase two: commit every rank or roll back every rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Literal["commit", "rollback"]
    concurrency: int = 0
    context: int = 0
    pool_blocks: int = Field(default=0, description="Blocks every rank's pool holds: the "
                             "smallest admitted (a sequence holds its blocks on every rank).")
    reasons: dict[int, list[str]]
    refusing_ranks: list[int]

    def explain(self) -> str:
        lines = [f"cluster {self.action}"
                 + (f": refused by rank(s) {self.refusing_ranks}" if self.refusing_ranks else "")]
        for rank in sorted(self.reasons):
            for reason in self.reasons[rank] or ["admitted"]:
                lines.append(f"  rank {rank}: {reason}")
        return "\n".join(lines)


# ---------------------------------------------------------------- the split


def split_layers(num_layers: int, capacities: list[int]) -> list[int]:
    """Layers per rank, proportional to ``capacities``, each ≥ 1, summing to ``num_layers``.

    Largest remainder after giving every rank its one layer; ties go to the lower rank.
    """
    n = len(capacities)
    if n == 0:
        raise ClusterPlanError("a cluster needs at least one rank")
    if num_layers < n:
        raise ClusterPlanError(f"{n} ranks but only {num_layers} layers: use fewer ranks")
    if any(c < 0 for c in capacities):
        raise ClusterPlanError("capacities must be non-negative")
    total = sum(capacities)
    spare = num_layers - n
    weights = [c / total for c in capacities] if total else [1 / n] * n
    exact = [w * spare for w in weights]
    counts = [1 + math.floor(x) for x in exact]
    left = num_layers - sum(counts)
    order = sorted(range(n), key=lambda r: (-(exact[r] - math.floor(exact[r])), r))
    for r in order[:left]:
        counts[r] += 1
    return counts


def ranges(split: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in split:
        out.append((start, start + count))
        start += count
    return out


def classify(name: str) -> tuple[Part, int | None]:
    """Which part of the model a tensor belongs to: a numbered layer, embeddings, head, norm."""
    m = _LAYER_RE.search(name)
    if m:
        return "layer", int(m.group(1))
    if any(k in name for k in _EMBED_KEYS):
        return "embed", None
    if any(name.startswith(k) or f".{k}" in name for k in _HEAD_KEYS):
        return "head", None
    if _NORM_RE.match(name):
        return "norm", None
    return "other", None


def weight_shares(tensor_bytes: dict[str, int], split: list[int], tied: bool) -> list[int]:
    """Each rank's weight bytes: its layers, embeddings on rank 0, norm and head on the last.

    With tied embeddings the last rank holds the embedding matrix as its head too. Tensors
    of no known part are charged to every rank (over-reserving beats paging).
    """
    spans = ranges(split)
    last = len(split) - 1
    shares = [0] * len(split)
    for name, nbytes in tensor_bytes.items():
        part, idx = classify(name)
        if part == "layer":
            owner = next((r for r, (a, b) in enumerate(spans) if a <= idx < b), None)
            if owner is None:
                raise ClusterPlanError(f"tensor {name!r} names layer {idx}, past the model's "
                                       f"{sum(split)} layers")
            shares[owner] += nbytes
        elif part == "embed":
            shares[0] += nbytes
            if tied and last != 0:
                shares[last] += nbytes
        elif part in ("head", "norm"):
            shares[last] += nbytes
        else:
            shares = [s + nbytes for s in shares]
    return shares


def plan_cluster(config: dict, facts: ModelFacts, tensor_bytes: dict[str, int],
                 probes: list[RankProbe], request: ClusterRequest) -> list[RankPlan]:
    """Every rank's share. ``probes`` must be ranks 0..n-1 in order."""
    if [p.rank for p in probes] != list(range(len(probes))):
        raise ClusterPlanError(f"probes must be ranks 0..{len(probes) - 1} in order")
    if resolve_parallel(request, config, facts, len(probes)).parallel == "tensor":
        return tensor_plans(config, facts, tensor_bytes, probes, request)
    n_layers = facts.num_layers
    split = split_layers(n_layers, [p.capacity_bytes for p in probes])
    tied = bool(lookup(config, "tie_word_embeddings", False))
    shares = weight_shares(tensor_bytes, split, tied)
    def costs(a: int, b: int) -> tuple[int, int]:  # (bytes per token, fixed bytes) of [a, b)
        per_token = fixed = 0
        for c in facts.caches:
            mine = sum(a <= i < b for i in c.layers)
            if c.kind in GROWING_KINDS:
                per_token += mine * c.bytes_per_token
            elif c.kind in CAPPED_KINDS:
                fixed += mine * c.bytes_per_token * (c.max_tokens or 0)
            fixed += mine * c.state_bytes
        return per_token, fixed

    hidden = int(lookup(config, "hidden_size", 0) or 0)
    act = DTYPE_BYTES.get(facts.kv_dtype, 4)
    # One activation message in and one out per peer link, at the prefill chunk size.
    message = hidden * request.prefill_chunk * act
    last = len(probes) - 1
    transport = transport_bytes(request.backend, len(probes)).bytes
    plans = []
    for r, (a, b) in enumerate(ranges(split)):
        per_token, fixed = costs(a, b)
        links = (r > 0) + (r < last)
        plans.append(RankPlan(
            rank=r, layer_start=a, layer_end=b, holds_embeddings=r == 0, holds_head=r == last,
            weights_bytes=shares[r], comm_bytes=links * message if last else 0,
            transport_bytes=transport,
            kv_bytes_per_token=per_token, per_sequence_fixed_bytes=fixed))
    return plans


# ---------------------------------------------------------------- tensor parallel

#: model types whose mlx-lm ``shard`` splits exactly the projections of
#: :data:`_SHARDED_RE` (q/k/v/gate/up by output, o/down by input) and nothing else: what
#: :func:`tensor_plans` charges 1/n of (read in mlx-lm's ``models/{llama,qwen2,qwen3}.py``)
TENSOR_PARALLEL_TYPES = ("llama", "qwen2", "qwen3")
_SHARDED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.")
_BY_OUTPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


#: backends whose links carry tensor parallelism's two all-sums a layer fast enough for it
#: to be the plan's choice (NCCL between GPUs, RDMA over Thunderbolt 5: mlx-lm's own
#: distributed default is its ``shard`` too). Over ring's TCP a step took 0.10-0.15 × one
#: rank's on one H200 (bench/results/cluster-h200-2026-12-03-tensor.md): layers there.
TENSOR_BACKENDS = ("nccl", "jaccl")


def resolve_parallel(request: ClusterRequest, config: dict, facts: ModelFacts,
                     ranks: int) -> ClusterRequest:
    """``request`` with ``parallel`` decided: ``auto`` is ``tensor`` where the ranks are
    linked by a :data:`TENSOR_BACKENDS` backend, run the engine stage and the model splits
    (:func:`tensor_refusal`), else ``pipeline``; a named split stays as asked. Every rank
    and the proxy decide alike from the same figures."""
    if request.parallel != "auto":
        return request
    tensor = (ranks > 1 and request.backend in TENSOR_BACKENDS and request.stage == "engine"
              and tensor_refusal(config, facts, ranks) is None)
    return request.model_copy(update={"parallel": "tensor" if tensor else "pipeline"})


def tensor_refusal(config: dict, facts: ModelFacts, ranks: int) -> str | None:
    """Why ``ranks`` ranks cannot split this model's every layer (None: they can)."""
    if ranks < 2:
        return None
    if facts.model_type not in TENSOR_PARALLEL_TYPES:
        return (f"{facts.model_type}: tensor parallelism serves {', '.join(TENSOR_PARALLEL_TYPES)}"
                " (the dense models whose mlx-lm split plimsoll counts); use --parallel pipeline")
    if facts.kv_bits is not None:
        return "tensor parallelism serves float KV only; drop the quantized KV dtype"
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(lookup(config, name, 0) or 0)
        if value % ranks:
            return (f"{facts.model_type}: {name} = {value} does not divide by {ranks} ranks; "
                    f"use a rank count that divides it, or --parallel pipeline")
    return None


def tensor_share(tensor_bytes: dict[str, int], ranks: int) -> int:
    """One rank's weight bytes under mlx-lm's split: 1/n of each projection (its bias too
    where the split is by output), everything else whole (embeddings, head, norms)."""
    total = 0
    for name, nbytes in tensor_bytes.items():
        m = _SHARDED_RE.search(name)
        split = m is not None and (name.endswith(".weight") or m.group(1) in _BY_OUTPUT)
        total += -(-nbytes // ranks) if split else nbytes
    return total


def tensor_plans(config: dict, facts: ModelFacts, tensor_bytes: dict[str, int],
                 probes: list[RankProbe], request: ClusterRequest) -> list[RankPlan]:
    """Every rank runs every layer on 1/n of each projection and of the KV heads: the same
    share on every rank; the all-sums' activations (in and out, at the prefill chunk)
    counted as the messages."""
    n = len(probes)
    if why := tensor_refusal(config, facts, n):
        raise ClusterPlanError(why)
    if request.stage != "engine":
        raise ClusterPlanError("tensor parallelism runs on the engine stage; drop --stage loop")
    hidden = int(lookup(config, "hidden_size", 0) or 0)
    message = hidden * request.prefill_chunk * DTYPE_BYTES.get(facts.kv_dtype, 4)
    share = tensor_share(tensor_bytes, n)
    transport = transport_bytes(request.backend, n).bytes
    return [RankPlan(rank=r, layer_start=0, layer_end=facts.num_layers, holds_embeddings=True,
                     holds_head=True, weights_bytes=share, comm_bytes=2 * message if n > 1 else 0,
                     transport_bytes=transport, kv_bytes_per_token=facts.kv_bytes_per_token // n,
                     per_sequence_fixed_bytes=facts.per_sequence_fixed_bytes)
            for r in range(n)]


# ---------------------------------------------------------------- the two phases


def preflight(plan: RankPlan, probe: RankProbe, facts: ModelFacts,
              request: ClusterRequest) -> Preflight:
    """Phase one on one rank: single-host admission of this rank's own share and figures.

    Communication buffers count as weights (resident for the life of the load); a calibrated
    peak above the formula counts as co-resident memory. A rank with no full-attention layer
    still needs a positive KV figure for the arithmetic: one byte per token stands in.
    """
    if plan.rank != probe.rank:
        raise ClusterPlanError(f"plan for rank {plan.rank} given probe of rank {probe.rank}")
    req = AdmissionRequest(
        ceiling_bytes=probe.ceiling_bytes, total_ram_bytes=probe.total_ram_bytes,
        budget_bytes=probe.budget_bytes, resident_bytes=probe.measured_extra_bytes,
        weights_bytes=plan.weights_bytes + plan.comm_bytes + plan.transport_bytes,
        kv_bytes_per_token=max(plan.kv_bytes_per_token, 1),
        per_sequence_fixed_bytes=plan.per_sequence_fixed_bytes,
        native_max_context=facts.native_max_context,
        transient_reserve=request.transient_reserve, block_tokens=request.block_tokens,
        concurrency=request.concurrency, context=request.context,
        max_tokens=request.max_tokens, min_context=request.min_context)
    decision = admit(req)
    head = (f"layers {plan.layer_start}..{plan.layer_end - 1}, weights share "
            f"{plan.weights_bytes} B + comm {plan.comm_bytes} B + {request.backend} "
            f"buffers {plan.transport_bytes} B, ceiling "
            f"{probe.ceiling_bytes} B" + (f" ({probe.source})" if probe.source else ""))
    return Preflight(rank=plan.rank, admitted=decision.admitted, reasons=[head, *decision.reasons],
                     plan=plan, decision=decision)


def decide(answers: list[Preflight], world_size: int) -> ClusterDecision:
    """Phase two: commit all only if every rank answered, admitted and reserved."""
    by_rank = {a.rank: a for a in answers}
    reasons: dict[int, list[str]] = {}
    refusing: list[int] = []
    for r in range(world_size):
        a = by_rank.get(r)
        if a is None:
            reasons[r] = ["no preflight answer (rank unreachable or dead)"]
            refusing.append(r)
            continue
        reasons[r] = list(a.reasons) + ([f"error: {a.error}"] if a.error else [])
        if not a.admitted or not a.reserved or a.error or a.decision is None:
            if a.admitted and not a.reserved and not a.error:
                reasons[r].append("admitted but could not reserve")
            refusing.append(r)
    extra = sorted(set(by_rank) - set(range(world_size)))
    if extra:
        raise ClusterPlanError(f"answers from ranks {extra} outside a world of {world_size}")
    if refusing:
        return ClusterDecision(action="rollback", reasons=reasons, refusing_ranks=refusing)
    decisions = [by_rank[r].decision for r in range(world_size)]
    return ClusterDecision(action="commit", reasons=reasons, refusing_ranks=[],
                           concurrency=min(d.concurrency for d in decisions),
                           context=min(d.context for d in decisions),
                           pool_blocks=min(d.pool_blocks for d in decisions))


def cache_limit_mib(transient_reserve_bytes: int) -> int:
    """A rank's MLX buffer-cache cap in MiB: a worker's own figure (invariant 4: every
    cache is capped and counted inside the reserve)."""
    return mlx_cache_mb(transient_reserve_bytes)
