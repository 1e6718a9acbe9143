"""The one value every probe returns: a frozen reading of the host's memory world.

Why one type: admission, the watcher and the tripwire must reason about the same
figures whether they came from ``sysctl``/``vm_stat`` on macOS or ``/proc`` and a
cgroup on Linux. Probes fill it; the pure core only reads it.

Invariant: ``0 < ceiling_bytes <= total_ram_bytes`` (a ceiling above RAM is clamped
by the probe and the clamp is named in ``ceiling_source``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PressureLevel = Literal["normal", "warn", "critical", "unknown"]


class MemorySnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    platform: Literal["darwin", "linux", "override"]
    #: Physical RAM (Linux: min(cgroup limit, MemTotal), the process's whole world).
    total_ram_bytes: int = Field(gt=0)
    #: The hard ceiling a worker's memory must stay under.
    ceiling_bytes: int = Field(gt=0)
    #: Where the ceiling came from, e.g. 'cgroup v1 limit'.
    ceiling_source: str
    #: Memory in use: wired on macOS; cgroup usage or MemTotal − MemAvailable on Linux.
    in_use_bytes: int = Field(ge=0)
    #: This (or the probed) process's footprint.
    process_footprint_bytes: int = Field(ge=0)
    pressure: PressureLevel = "unknown"
    #: The raw figure behind the level, e.g. 'some avg10=0.00'.
    pressure_detail: str = ""
    #: Cumulative page-outs/swap-outs since boot.
    page_outs: int = Field(default=0, ge=0)

    @property
    def cgroup_bound(self) -> bool:
        """The ceiling is a memory cgroup's limit (Linux): the host lives outside it."""
        return self.platform == "linux" and self.ceiling_source.startswith("cgroup ")

    @model_validator(mode="after")
    def _ceiling_within_ram(self) -> MemorySnapshot:
        if self.ceiling_bytes > self.total_ram_bytes:
            raise ValueError(
                f"ceiling {self.ceiling_bytes} B exceeds total RAM {self.total_ram_bytes} B; "
                "probes must clamp it"
            )
        return self
