"""The memory-pressure tripwire's decisions, pure: a level from readings, actions from a level.

Why a tripwire at all: admission sizes every worker so the host never reaches pressure,
but other processes, a wrong measured peak or the OS itself can still push it there. When
the OS starts fighting for memory (PSI stalls, macOS's pressure level, pages leaving RAM
for disk), the proxy stops adding load before it pages, and gives memory back if it must.
It is a backstop, never a substitute for admission (docs/DESIGN.md, "The invariants").

Three steps, each a function of values (no probe, no clock, no process, no log):

1. :func:`classify` — one reading (and the one before, for the page-out rate) against the
   policy's thresholds → the *raw* level and the reasons.
2. :func:`step` — hysteresis: the level rises at once; once any reading was above a line,
   it stays at least ``warn`` until readings have stayed under every line for
   ``clear_after_s`` (so one calm reading cannot reopen admission into a storm).
3. :func:`decide` — the actions for that level: ``warn`` closes admission (new requests
   and loads: 503 ``memory_pressure``) and cancels requests waiting for a load;
   ``critical`` also unloads one worker per tick — idle ones first, then busy ones, least
   recently used first within each (:func:`.evict.eviction_order`) — while the *raw*
   reading stays critical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from plimsoll.core.policy import Pressure

from ..probes.pressure import PressureReading
from .evict import Resident, eviction_order

Level = Literal["normal", "warn", "critical"]
RANK: dict[Level, int] = {"normal": 0, "warn": 1, "critical": 2}
DARWIN_WARN, DARWIN_CRITICAL = 2, 4  # kern.memorystatus_vm_pressure_level values


def page_out_rate(prev: PressureReading | None, cur: PressureReading) -> float | None:
    """Pages/s that left RAM between two readings; None without two counts to compare.

    A counter that went down (a reboot cannot happen under one proxy, but a test file can
    be rewritten) reads as 0, never as negative pressure.
    """
    if prev is None or prev.page_outs is None or cur.page_outs is None:
        return None
    dt = cur.mono - prev.mono
    if dt <= 0:
        return None
    return max(cur.page_outs - prev.page_outs, 0) / dt


def classify(cur: PressureReading, prev: PressureReading | None,
             th: Pressure) -> tuple[Level, tuple[str, ...]]:
    """The raw level of ``cur`` and why (each reason names the figure and its line)."""
    critical: list[str] = []
    warn: list[str] = []
    if cur.some_avg10 is not None:
        some = cur.some_avg10
        if some >= th.some_avg10_critical:
            critical.append(f"PSI memory some avg10={some:.2f} ≥ {th.some_avg10_critical:g} "
                            "(pressure.someAvg10Critical)")
        elif some >= th.some_avg10_warn:
            warn.append(f"PSI memory some avg10={some:.2f} ≥ {th.some_avg10_warn:g} "
                        "(pressure.someAvg10Warn)")
    if cur.full_avg10 is not None and cur.full_avg10 >= th.full_avg10_critical:
        critical.append(f"PSI memory full avg10={cur.full_avg10:.2f} ≥ "
                        f"{th.full_avg10_critical:g} (pressure.fullAvg10Critical)")
    if cur.darwin_level is not None:
        lvl = cur.darwin_level
        if lvl >= DARWIN_CRITICAL:
            critical.append(f"kern.memorystatus_vm_pressure_level={lvl} (critical)")
        elif lvl >= DARWIN_WARN and th.darwin_level == "warn":
            warn.append(f"kern.memorystatus_vm_pressure_level={lvl} (warn; "
                        "pressure.darwinLevel = warn)")
    rate = page_out_rate(prev, cur)
    if rate is not None and rate >= th.page_outs_per_s:
        critical.append(f"{rate:.0f} page-outs/s ≥ {th.page_outs_per_s:g} "
                        "(pressure.pageOutsPerS): memory is leaving RAM for disk")
    if critical:
        return "critical", tuple(critical + warn)
    if warn:
        return "warn", tuple(warn)
    return "normal", ()


@dataclass(frozen=True)
class TripState:
    """What the tripwire remembers between readings.

    ``raw`` is the last reading's own level; ``level`` the one acted on (never below
    ``raw``); ``last_alarm`` the time of the last reading above a line; ``since`` when
    ``level`` last changed; ``reasons`` those of the last reading above a line.
    """

    level: Level = "normal"
    raw: Level = "normal"
    last_alarm: float | None = None
    since: float | None = None
    reasons: tuple[str, ...] = ()

    def calm_for(self, now: float) -> float | None:
        """Seconds since the last reading above a line (None: there never was one)."""
        return None if self.last_alarm is None else max(now - self.last_alarm, 0.0)


def step(state: TripState, raw: Level, reasons: Sequence[str], now: float,
         clear_after_s: float) -> TripState:
    """The next state after a reading of level ``raw`` at ``now`` (hysteresis on the way down).

    Invariants: ``level ≥ raw``; ``level`` is ``normal`` only if no reading was above a
    line within the last ``clear_after_s`` seconds.
    """
    if raw != "normal":
        level = raw
        new = replace(state, raw=raw, last_alarm=now, reasons=tuple(reasons))
    else:
        held = state.last_alarm is not None and now - state.last_alarm < clear_after_s
        level = "warn" if held and state.level != "normal" else "normal"
        new = replace(state, raw=raw)
    if level != state.level:
        new = replace(new, since=now)
    return replace(new, level=level)


@dataclass(frozen=True)
class Actions:
    """What the proxy does after one reading."""

    level: Level
    admit: bool  # new requests and loads may proceed
    cancel_waiting: bool  # requests waiting for a load get a reasoned 503 now
    unload: str | None  # the one worker to unload this tick


def choose_unload(residents: Sequence[Resident]) -> str | None:
    """Idle before busy, least recently used first: the order evictions use."""
    order = eviction_order(residents)
    return order[0].name if order else None


def decide(state: TripState, residents: Sequence[Resident]) -> Actions:
    """The actions for ``state``: unload only while the raw reading itself is critical."""
    closed = state.level != "normal"
    victim = choose_unload(residents) if state.raw == "critical" else None
    return Actions(state.level, admit=not closed, cancel_waiting=closed, unload=victim)
