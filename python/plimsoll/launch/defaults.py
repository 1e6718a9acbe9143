"""The embedded default: what runs when the user brings no model and no policy.

A newcomer's first command must work on a fresh machine with nothing downloaded, so
the default model is a locally built random-weight demo model cached under the
user's cache directory, and the default policy is sized from this machine's live
probes (total RAM minus an OS floor). Nothing here is used once a policy exists.

The model entry (the demo's, or ``plimsoll serve --model``'s) is sized so coding clients'
first prompts fit: the largest context up to the model's native maximum that the budget
admits at :data:`DEFAULT_CONCURRENCY` sequences (Claude Code's first request is ~32k
tokens with the demo tokenizer, OpenCode's ~11k), an output limit of a quarter of it (a
larger ``max_tokens`` is clamped, not refused), and aliases so the model names those
clients send of their own (``claude-…``, ``gpt-…``) are served by it.
"""

from __future__ import annotations

import math
from pathlib import Path

from plimsoll.core.paths import cache_dir, private_dir
from plimsoll.core.policy import SCHEMA_VERSION, Policy, parse_policy
from plimsoll.core.sizing import CLIENT_OUTPUT_CAP, output_limit
from plimsoll.core.units import GIB
from plimsoll.probes.snapshot import MemorySnapshot

DEFAULT_PRESET = "tiny"
DEFAULT_MODEL_NAME = "demo-tiny"
DEFAULT_CONCURRENCY = 2
FALLBACK_CONTEXT = 8192  # a model that states no native maximum


#: The embedded demo's end-of-turn lead (:mod:`plimsoll.demo.model`): sampled answers end
#: after a few dozen tokens, so coding clients get complete answers, not ones cut at their
#: limit (which Claude Code and Codex report as failures).
DEMO_EOS_BIAS = 3.5


def demo_model_dir(preset: str = DEFAULT_PRESET) -> Path:
    return cache_dir() / "models" / f"demo-{preset}-eos"


def ensure_demo_model(preset: str = DEFAULT_PRESET, report=None) -> Path:
    """Build the demo model once; later calls return the cached directory."""
    from plimsoll.demo.model import build_demo_model  # engine edge: imports mlx lazily

    out = demo_model_dir(preset)
    private_dir(out.parent, "demo models")  # the server loads what it finds there
    return build_demo_model(out, preset=preset, progress=report,
                            eos_bias=DEMO_EOS_BIAS)


def os_floor_gib(total_ram_gib: float) -> float:
    """A conservative OS floor for an undeclared host: a quarter of RAM, at least 2 GiB."""
    return max(2.0, math.ceil(total_ram_gib / 4))


#: The embedded default's disk tier for KV blocks (``plimsoll serve`` with no policy), GiB.
EMBEDDED_DISK_CACHE_GB = 4.0


def _budgets(snapshot: MemorySnapshot) -> dict:
    """Inside a memory cgroup (Linux) the figure is the cgroup's limit, and the host's OS
    lives outside it: the floor protects the host, so none is subtracted from the cgroup
    (a 4 GiB cgroup gets a 4 GiB budget, not 2); admission's trip offset and margin still
    keep the worker below the cgroup's line."""
    total_gib = round(snapshot.total_ram_bytes / GIB, 2)
    floor = 0.0 if snapshot.cgroup_bound else os_floor_gib(total_gib)
    budget = round(total_gib - floor, 2)
    return {"schemaVersion": SCHEMA_VERSION, "host": "localhost", "totalRamGb": total_gib,
            "modes": {"standalone": {"maxLocalLlmGb": budget},
                      "clustered": {"maxLocalLlmGb": budget}},
            "osFloorGb": floor}


def native_entry(model_dir: Path) -> dict:
    """A model entry at the model's native context, :data:`DEFAULT_CONCURRENCY` sequences and
    a quarter of the context for output — admission clamps it on a smaller machine;
    :func:`plimsoll.launch.serve_sizing.model_entry` sizes it against the budget instead."""
    from plimsoll.core.model_facts import inspect_model

    context = inspect_model(model_dir).native_max_context or FALLBACK_CONTEXT
    limit = output_limit(context, CLIENT_OUTPUT_CAP)
    return {"path": str(model_dir), "context": context, "concurrency": DEFAULT_CONCURRENCY,
            "maxTokens": limit, "defaultMaxTokens": limit}


def budgets(snapshot: MemorySnapshot) -> dict:
    """The policy's budget fields for this machine (every budget leaves the OS floor)."""
    return _budgets(snapshot)


def default_policy(snapshot: MemorySnapshot, model_dir: Path | None = None, *,
                   name: str = DEFAULT_MODEL_NAME, entry: dict | None = None,
                   disk_cache_dir: Path | None = None) -> Policy:
    """A policy for this machine from its live figures: every budget leaves the OS floor.

    ``model_dir`` is served as ``name`` (``entry`` its sized entry, default
    :func:`native_entry`), the default model of coding clients' names; ``disk_cache_dir``
    the embedded default's bounded disk tier for KV blocks.
    """
    data = _budgets(snapshot)
    if disk_cache_dir is not None:
        data["diskCache"] = {"path": str(disk_cache_dir), "maxGb": EMBEDDED_DISK_CACHE_GB}
    data["models"] = {}
    if model_dir is not None:
        data["models"][name] = entry or native_entry(model_dir)
        data["defaultModel"] = name
    return parse_policy(data, "default policy")
