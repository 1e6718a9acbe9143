"""The proxy's own figures (the command line's): queues, waits, holds, drains, timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from plimsoll.core.policy import ModelEntry


@dataclass(frozen=True)
class Settings:
    max_waiting: int = 16  # requests per model waiting for it to load; beyond: 429
    wait_timeout_s: float = 600.0  # a waiting request gives up after this: 503
    retry_after_s: int = 5
    swap_hold_s: float = 2.0  # a model in use keeps its slot this long after its load
    idle_grace_s: float = 0.5  # ...unless it has had no request for this long
    drain_s: float = 30.0  # in-flight requests may finish for this long before the stop
    release_timeout_s: float = 10.0  # memory must come back within this, else 503
    spawn_timeout_s: float = 300.0
    admin_deadline_s: float = 60.0  # a downshift makes room within this, else 409
    default_idle_ttl_s: float = 300.0  # models with no TTL of their own
    idle_ttl_s: tuple[tuple[str, float], ...] = ()  # (model, seconds) from the command line
    # --cluster-rank: (ceiling, total RAM, budget) bytes per rank of a sharded model, rank 0
    # first; in clustered mode a model with ``sharded: true`` runs as `plimsoll cluster serve`
    cluster_ranks: tuple[tuple[int, int, int], ...] = ()
    # the MLX backend those ranks run on, resolved at start (--cluster-backend, else the
    # policy's cluster.backend; "auto" becomes what MLX reports available)
    cluster_backend: str = "ring"
    quiet: bool = False  # --quiet: workers write no access-log lines either
    ollama_api: bool = True  # False (--no-ollama-api): no /api/* routes, whatever the policy says

    def idle_ttl(self, name: str, entry: ModelEntry) -> float:
        """Model ``name``'s idle TTL: the command line's per-model TTL, else the policy
        entry's ``idleTtlS`` when the entry sets it, else the command line's default. 0 means
        never."""
        for model, ttl in self.idle_ttl_s:
            if model == name:
                return ttl
        if "idle_ttl_s" in entry.model_fields_set:
            return entry.idle_ttl_s
        return self.default_idle_ttl_s
