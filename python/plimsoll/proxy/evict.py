"""The eviction decision, pure: which running workers must stop so a target fits.

Co-resident workers share one envelope (docs/DESIGN.md, "Admission"): the sum of their
footprints must fit. Each running worker counts for the larger of its admitted footprint
and its observed process footprint (measured-peak accounting: what the process really
holds counts even where admission's formula did not see it, such as the interpreter).

This function takes values and returns a value; it must not log, read a probe or
touch a process (llama-swap's rule for its own eviction choice). The supervisor acts
on the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """One running worker as the decision sees it."""

    name: str
    admitted_bytes: int
    observed_bytes: int = 0
    last_used: float = 0.0
    busy: bool = False

    @property
    def bytes(self) -> int:
        return max(self.admitted_bytes, self.observed_bytes)


@dataclass(frozen=True)
class Eviction:
    """Who stops (in this order), and whether the target then fits the envelope."""

    stop: tuple[str, ...]
    fits: bool
    target_bytes: int
    kept_bytes: int
    envelope_bytes: int


def eviction_order(running: Sequence[Resident]) -> list[Resident]:
    """Idle workers before busy ones; within each, least recently used first."""
    return sorted(running, key=lambda r: (r.busy, r.last_used, r.name))


def choose_evictions(target_bytes: int, running: Sequence[Resident],
                     envelope_bytes: int) -> Eviction:
    """Stop workers in :func:`eviction_order` until ``target + kept ≤ envelope``.

    ``target_bytes`` is 0 when nothing is being loaded (a mode downshift: only the
    running set must fit the new envelope). If the target alone is larger than the
    envelope, nothing is stopped and ``fits`` is False: stopping workers would not help,
    and admission will refuse the target with its reasons.
    """
    kept = sum(r.bytes for r in running)
    if target_bytes > envelope_bytes:
        return Eviction((), False, target_bytes, kept, envelope_bytes)
    stop: list[str] = []
    for r in eviction_order(running):
        if target_bytes + kept <= envelope_bytes:
            break
        stop.append(r.name)
        kept -= r.bytes
    return Eviction(tuple(stop), target_bytes + kept <= envelope_bytes, target_bytes, kept,
                    envelope_bytes)
