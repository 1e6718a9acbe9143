"""The watcher's pure core: one observation of the world in, the next action out.

Why a pure function of a fresh observation: the watcher must survive restarts (launchd
``RunAtLoad``/``KeepAlive``) and hold no state it cannot re-derive. Every input is read
again on each tick (the settled link, the ceiling read back from the OS, the memory in
use, the proxy's mode); the only remembered fact is the proxy's answer to the last
``POST /admin/mode`` of the current transition, and asking again is idempotent.

The two orders (docs/DESIGN.md, "The process model": the mode's ceiling):

- raising is always safe, so an upshift raises and verifies the ceiling *before* the
  proxy is told it may use the clustered envelope;
- lowering a cap does not reclaim wired memory, so a downshift tells the proxy *first*
  and lowers only after it answered that observed memory fits the new envelope.

And one rule above both: no ceiling is ever written below the memory in use
(:func:`check_write`); a refusal keeps the higher ceiling and is retried with backoff.
Nothing here logs or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from plimsoll.core.policy import Mode, Policy
from plimsoll.core.units import bytes_to_mib_floor, fmt_bytes, mib_to_bytes

Direction = Literal["raise", "lower"]
ProxyStatus = Literal["ok", "refused", "timeout", "unreachable", "unauthorized", "rejected"]


def mode_for(link_up: bool) -> Mode:
    return "clustered" if link_up else "standalone"


@dataclass(frozen=True)
class Targets:
    """Each mode's ceiling in whole MiB: ``maxLocalLlmGb × 1024``, exact for whole GiB.

    A fractional budget that is not a whole number of MiB is rounded down, so the ceiling
    never exceeds the budget (units.bytes_to_mib_floor).
    """

    standalone_mib: int
    clustered_mib: int

    @classmethod
    def from_policy(cls, policy: Policy) -> Targets:
        return cls(
            standalone_mib=bytes_to_mib_floor(policy.budget_bytes("standalone")),
            clustered_mib=bytes_to_mib_floor(policy.budget_bytes("clustered")),
        )

    def mib(self, mode: Mode) -> int:
        return self.clustered_mib if mode == "clustered" else self.standalone_mib


@dataclass(frozen=True)
class ProxyAnswer:
    """What the proxy said to ``POST /admin/mode {"mode": mode}`` (or why it said nothing)."""

    mode: Mode  # the mode we asked for
    status: ProxyStatus
    http_status: int | None = None
    proxy_mode: Mode | None = None  # the mode the proxy reports being in afterwards
    fits: bool | None = None
    in_use_bytes: int | None = None
    envelope_bytes: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        """The proxy is in ``mode`` and its observed memory fits that envelope."""
        return self.status == "ok" and self.fits is not False and self.proxy_mode in (
            None, self.mode,
        )

    def describe(self) -> str:
        code = f"HTTP {self.http_status}" if self.http_status is not None else "no answer"
        parts = [f"{self.status} ({code})"]
        if self.in_use_bytes is not None and self.envelope_bytes is not None:
            parts.append(
                f"in use {fmt_bytes(self.in_use_bytes)} vs envelope "
                f"{fmt_bytes(self.envelope_bytes)}"
            )
        if self.detail:
            parts.append(self.detail)
        return "; ".join(parts)


@dataclass(frozen=True)
class Observation:
    """One tick's view of the world; every field but ``answer`` is read fresh."""

    link_up: bool  # the settled (debounced) link state
    ceiling_mib: int | None  # read back from the OS; None unreadable, 0 the OS default
    in_use_bytes: int  # the probe's in_use_bytes (wired memory on macOS)
    proxy: bool = False  # a proxy is configured (else the ceiling alone is managed)
    proxy_mode: Mode | None = None  # the proxy's current mode as last observed
    answer: ProxyAnswer | None = None  # the proxy's answer in the current transition


@dataclass(frozen=True)
class Hold:
    """Converged: the ceiling is the mode's budget and the proxy is in that mode."""

    mode: Mode
    reason: str


@dataclass(frozen=True)
class WriteCeiling:
    mode: Mode
    mib: int
    direction: Direction
    reason: str


@dataclass(frozen=True)
class TellProxy:
    mode: Mode
    reason: str


@dataclass(frozen=True)
class Retry:
    """Keep the current (higher) ceiling, say so loudly, and try again after a backoff."""

    mode: Mode
    reason: str


Action = Hold | WriteCeiling | TellProxy | Retry


def check_write(mib: int, in_use_bytes: int) -> str | None:
    """None if ``mib`` may be written; else why not (it is below the memory in use).

    A lowered cap does not reclaim memory that is already wired, so a ceiling below what
    is in use describes a state the host is already past. The caller reads the probe
    right before writing and asks again.
    """
    ceiling = mib_to_bytes(mib)
    if ceiling < in_use_bytes:
        return (
            f"refusing to write {mib} MiB ({fmt_bytes(ceiling)}): below the memory in use "
            f"({fmt_bytes(in_use_bytes)}, {in_use_bytes} B)"
        )
    return None


def _direction(current: int | None, target: int, want: Mode) -> Direction:
    """Raise or lower. An unknown current value (unreadable, or 0 = the OS default) is
    treated by the mode: towards clustered it is a raise, towards standalone a lowering,
    so the safe order for that mode applies."""
    if current is None:
        return "raise" if want == "clustered" else "lower"
    return "raise" if target > current else "lower"


def decide(obs: Observation, targets: Targets) -> Action:
    """The next step towards: ceiling = the link's mode budget, proxy in that mode."""
    want = mode_for(obs.link_up)
    target = targets.mib(want)
    current = obs.ceiling_mib or None
    answer = obs.answer if obs.answer is not None and obs.answer.mode == want else None
    confirmed = answer is not None and answer.ok  # the proxy fits `want`, this transition
    # The proxy's observed mode wins over a remembered answer (it may have restarted).
    in_mode = not obs.proxy or (
        obs.proxy_mode == want if obs.proxy_mode is not None else confirmed)

    if current == target:
        if in_mode:
            return Hold(want, f"ceiling {target} MiB is the {want} budget")
        return _ask_proxy(want, answer, f"ceiling {target} MiB verified; proxy next")

    if _direction(current, target, want) == "raise":
        refusal = check_write(target, obs.in_use_bytes)
        if refusal:
            return Retry(want, refusal)
        return WriteCeiling(want, target, "raise", f"{want}: raise before the proxy is told")

    # Lowering: the proxy must first have made room (a 200 in this transition).
    if obs.proxy and not confirmed:
        return _ask_proxy(want, answer, f"{want}: the proxy must fit before the ceiling drops")
    refusal = check_write(target, obs.in_use_bytes)
    if refusal:
        return Retry(want, refusal)
    return WriteCeiling(want, target, "lower", f"{want}: memory fits, lower the ceiling")


def _ask_proxy(want: Mode, answer: ProxyAnswer | None, why: str) -> Action:
    if answer is not None and not answer.ok:
        return Retry(want, f"proxy did not confirm {want}: {answer.describe()}; "
                           "keeping the current ceiling")
    return TellProxy(want, why)


def backoff_delay(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Seconds before retry number ``attempt`` (0-based): base, 2×base, 4×base, … ≤ cap."""
    return min(cap, base * 2 ** min(max(attempt, 0), 30))


@dataclass(frozen=True)
class Settle:
    """A debounced link: ``up`` changes only after the raw reading held ``settle_s``.

    ``up`` is the settled state the decision uses; ``raw``/``since`` track the latest
    reading and when it began. A flapping cable keeps resetting ``since``, so nothing
    happens until it rests.
    """

    up: bool
    raw: bool
    since: float

    @classmethod
    def start(cls, up: bool, now: float) -> Settle:
        """At start-up the first reading is taken as settled: apply at once (RunAtLoad)."""
        return cls(up=up, raw=up, since=now)

    def update(self, raw: bool, now: float, settle_s: float) -> Settle:
        s = self if raw == self.raw else replace(self, raw=raw, since=now)
        if s.raw != s.up and now - s.since >= settle_s:
            s = replace(s, up=s.raw)
        return s

    def remaining(self, now: float, settle_s: float) -> float | None:
        """Seconds until a pending change settles; None when nothing is pending."""
        if self.raw == self.up:
            return None
        return max(0.0, settle_s - (now - self.since))
