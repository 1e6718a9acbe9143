"""The embedded default: what runs when the user brings no model and no policy.

A newcomer's first command must work on a fresh machine with nothing downloaded, so
the default model is a locally built random-weight demo model cached under the
user's cache directory, and the default policy is sized from this machine's live
probes (total RAM minus an OS floor). Nothing here is used once a policy exists.
"""

from __future__ import annotations

import math
from pathlib import Path

from plimsoll.core.paths import cache_dir
from plimsoll.core.policy import SCHEMA_VERSION, Policy, parse_policy
from plimsoll.core.units import GIB
from plimsoll.probes.snapshot import MemorySnapshot

DEFAULT_PRESET = "tiny"
DEFAULT_MODEL_NAME = "demo-tiny"


def demo_model_dir(preset: str = DEFAULT_PRESET) -> Path:
    return cache_dir() / "models" / f"demo-{preset}"


def ensure_demo_model(preset: str = DEFAULT_PRESET, report=None) -> Path:
    """Build the demo model once; later calls return the cached directory."""
    from plimsoll.demo.model import build_demo_model  # engine edge: imports mlx lazily

    return build_demo_model(demo_model_dir(preset), preset=preset, progress=report)


def os_floor_gib(total_ram_gib: float) -> float:
    """A conservative OS floor for an undeclared host: a quarter of RAM, at least 2 GiB."""
    return max(2.0, math.ceil(total_ram_gib / 4))


#: The embedded default's disk tier for KV blocks (``plimsoll serve`` with no policy), GiB.
EMBEDDED_DISK_CACHE_GB = 4.0


def default_policy(snapshot: MemorySnapshot, model_dir: Path | None = None,
                   disk_cache_dir: Path | None = None) -> Policy:
    """A policy for this machine from its live figures: every budget leaves the OS floor.

    Inside a memory cgroup (Linux) the figure is the cgroup's limit, and the host's OS
    lives outside it: the floor protects the host, so none is subtracted from the cgroup
    (a 4 GiB cgroup gets a 4 GiB budget, not 2); admission's trip offset and margin still
    keep the worker below the cgroup's line."""
    total_gib = round(snapshot.total_ram_bytes / GIB, 2)
    floor = 0.0 if snapshot.cgroup_bound else os_floor_gib(total_gib)
    budget = round(total_gib - floor, 2)
    models = {}
    if model_dir is not None:
        models[DEFAULT_MODEL_NAME] = {
            "path": str(model_dir), "context": 8192, "concurrency": 4,
            "defaultMaxTokens": 512, "maxTokens": 1024,
        }
    return parse_policy(
        {
            "schemaVersion": SCHEMA_VERSION,
            "host": "localhost",
            "totalRamGb": total_gib,
            "modes": {"standalone": {"maxLocalLlmGb": budget},
                      "clustered": {"maxLocalLlmGb": budget}},
            "osFloorGb": floor,
            "models": models,
            **({"diskCache": {"path": str(disk_cache_dir), "maxGb": EMBEDDED_DISK_CACHE_GB}}
               if disk_cache_dir is not None else {}),
        },
        "default policy",
    )
