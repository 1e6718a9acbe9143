"""Gather admission's inputs from the live machine (or overrides) and run it.

This is the edge around the pure admission
(:func:`plimsoll.core.admission.admit_counting_transient`): it reads the memory probe
(only when an override does not already give the figure), inspects the model directory
(headers only) and picks per-model settings from the policy.
The launch wrapper and ``plimsoll admit`` share it, so both derive the same caps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plimsoll.core.admission import (
    AdmissionDecision,
    AdmissionRequest,
    admit_counting_transient,
)
from plimsoll.core.model_facts import ModelFacts, inspect_model
from plimsoll.core.policy import Mode, ModelEntry, Policy
from plimsoll.core.sizing import LAUNCH_OUTPUT_CAP, output_limit
from plimsoll.core.units import gib_to_bytes, mib_to_bytes
from plimsoll.launch.calibration import lookup, reserve_fraction
from plimsoll.launch.model_source import resolve_model_dir
from plimsoll.probes.snapshot import MemorySnapshot

DEFAULT_CONTEXT = 8192


@dataclass(frozen=True)
class MemoryOverrides:
    """Figures given on the command line; ``None`` means read the live probe."""

    budget_gib: float | None = None
    ceiling_mib: int | None = None
    total_ram_gib: float | None = None

    @property
    def complete(self) -> bool:
        return None not in (self.budget_gib, self.ceiling_mib, self.total_ram_gib)


@dataclass(frozen=True)
class MemoryFigures:
    ceiling_bytes: int
    total_ram_bytes: int
    budget_bytes: int
    source: str


def memory_figures(
    policy: Policy | None,
    mode: Mode,
    overrides: MemoryOverrides,
    read_snapshot: Callable[[], MemorySnapshot],
) -> MemoryFigures:
    """Ceiling, total RAM and budget in bytes; the probe is read only if something is missing."""
    snap = None if overrides.complete else read_snapshot()
    sources = []
    if overrides.ceiling_mib is not None:
        ceiling = mib_to_bytes(overrides.ceiling_mib)
        sources.append("ceiling: --ceiling-mib")
    else:
        ceiling = snap.ceiling_bytes
        sources.append(f"ceiling: {snap.ceiling_source}")
    if overrides.total_ram_gib is not None:
        total = gib_to_bytes(overrides.total_ram_gib)
        sources.append("total RAM: --total-ram-gib")
    else:
        total = snap.total_ram_bytes
        sources.append(f"total RAM: {snap.platform} probe")
    if overrides.budget_gib is not None:
        budget = gib_to_bytes(overrides.budget_gib)
        sources.append("budget: --budget-gib")
    elif policy is not None:
        budget = policy.budget_bytes(mode)
        sources.append(f"budget: policy {policy.host} {mode}")
    else:
        from .defaults import default_policy

        budget = default_policy(snap).budget_bytes(mode)
        sources.append("budget: default (the cgroup's limit: the host's OS floor lies "
                       "outside it)" if snap.cgroup_bound
                       else "budget: default (total RAM less the OS floor)")
    return MemoryFigures(ceiling, total, budget, "; ".join(sources))


@dataclass(frozen=True)
class Wanted:
    """What the caller asks for; ``None`` takes the policy entry's value, then a default."""

    concurrency: int | None = None
    context: int | None = None
    max_tokens: int | None = None
    block_tokens: int | None = None
    kv_dtype: str | None = None
    draft_model: str | None = None  # DIR|ORG/NAME; None: the entry's draftModel, else none
    mtp: bool | None = None  # count the checkpoint's MTP head where it has one; None: the
    #                          entry's mtp, else on (the worker's default)


def resolve_model(model: str, policy: Policy | None) -> tuple[Path, ModelEntry | None]:
    """MODEL is a directory, or the name of a model in the policy's registry."""
    if policy is not None and model in policy.models:
        entry = policy.models[model]
        return Path(entry.path), entry
    path = Path(model)
    if policy is not None:
        for entry in policy.models.values():
            if Path(entry.path) == path:
                return path, entry
    return path, None


def draft_spec(wanted: Wanted, entry: ModelEntry | None) -> str | None:
    """The draft model asked for: the flag, else the policy entry's ``draftModel``."""
    return wanted.draft_model or (entry.draft_model if entry else None)


def mtp_spec(mtp: bool | None, entry: ModelEntry | None) -> bool:
    """Whether the checkpoint's MTP head is wanted: the flag ``mtp``, else the entry's, else
    on (a checkpoint without one counts nothing either way)."""
    if mtp is not None:
        return mtp
    return entry.mtp if entry else True


def plan(
    model_dir: Path,
    entry: ModelEntry | None,
    policy: Policy | None,
    figures: MemoryFigures,
    wanted: Wanted,
    resident_bytes: int = 0,
    *,
    calibrated: bool = True,
    calibration_root: Path | None = None,
) -> tuple[ModelFacts, AdmissionRequest, AdmissionDecision]:
    """Inspect the model, assemble the request from wanted → entry → policy → defaults, admit.

    With ``calibrated`` (the default), a ``plimsoll calibrate`` record for this model, engine
    and KV dtype raises the transient reserve to the measured unknown (never lowers it),
    so the admitted footprint is at least the measured peak. A draft model (the flag, else
    the entry's ``draftModel``) counts its weights, its KV for every pool block and its
    transient (:class:`~plimsoll.core.admission.AdmissionRequest`).
    """
    kv_dtype = wanted.kv_dtype or (entry.kv_dtype if entry else None)
    facts = inspect_model(model_dir, kv_dtype=None if kv_dtype in (None, "auto") else kv_dtype)
    spec = draft_spec(wanted, entry)
    draft = inspect_model(resolve_model_dir(spec, "--draft-model")) if spec else None
    context = wanted.context or (entry.context if entry else None)
    if context is None:
        context = min(facts.native_max_context or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    max_tokens = wanted.max_tokens or (entry.max_tokens if entry else None)
    if max_tokens is None:
        max_tokens = output_limit(context, LAUNCH_OUTPUT_CAP)

    def knob(name: str):
        return getattr(policy, name) if policy else Policy.model_fields[name].default

    concurrency = wanted.concurrency or (entry.concurrency if entry else 1)
    reserve = knob("transient_reserve")
    if calibrated:
        measured = lookup(model_dir, facts.kv_format, concurrency, context, calibration_root)
        reserve = reserve_fraction(reserve, measured, figures.budget_bytes)

    mtp_on = mtp_spec(wanted.mtp, entry) and draft is None  # a draft model wins over the head
    mtp_weights = facts.mtp_weights_bytes if mtp_on else 0
    mtp_kv = facts.mtp_kv_bytes_per_token if mtp_on else 0
    req = AdmissionRequest(
        ceiling_bytes=figures.ceiling_bytes,
        total_ram_bytes=figures.total_ram_bytes,
        budget_bytes=figures.budget_bytes,
        resident_bytes=resident_bytes,
        weights_bytes=facts.weights_bytes,
        # A model with no growing cache (pure state-space) pages nothing: one byte stands in.
        kv_bytes_per_token=max(facts.kv_bytes_per_token, 1),
        # the proposer's memory: a draft model, else the MTP head (its own layer's KV)
        draft_weights_bytes=draft.weights_bytes if draft else mtp_weights,
        draft_kv_bytes_per_token=draft.kv_bytes_per_token if draft else mtp_kv,
        per_sequence_fixed_bytes=facts.fixed_bytes(context),  # windows at min(window, context)
        native_max_context=facts.native_max_context,
        transient_reserve=reserve,
        trip_offset=knob("trip_offset"),
        u_margin=knob("u_margin"),
        block_tokens=wanted.block_tokens or knob("block_tokens"),
        concurrency=concurrency,
        context=context,
        max_tokens=max_tokens,
        min_context=knob("min_context"),
    )
    return facts, req, admit_counting_transient(facts, req, draft)
