"""The watcher loop: observe, decide, act, log; again every tick.

Each tick reads everything fresh (the link through a debounce, the ceiling read back,
memory in use from the probe) and asks :func:`decide` for one action. Actions that move
things on (write the ceiling, ask the proxy) are followed at once by another decision;
a converged or held state waits for a link event, the poll interval, a pending settle or
a retry backoff, whichever comes first.

Every ceiling write is logged *before* it happens with the in-use figure checked right
before it (``ceiling-write … in_use_bytes=…``), and again once verified. The log is one
line per event — ``<UTC time> <LEVEL> <event> key=value … ts=<unix> msg="…"`` — so an
operator can read it and a test can parse it (``shlex.split`` of one line).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from plimsoll.core.units import mib_to_bytes
from plimsoll.watcher.decide import (
    Hold,
    Observation,
    ProxyAnswer,
    Retry,
    Settle,
    Targets,
    TellProxy,
    WriteCeiling,
    backoff_delay,
    check_write,
    decide,
    mode_for,
)
from plimsoll.watcher.link import LinkReader
from plimsoll.watcher.proxy_client import AdminClient
from plimsoll.watcher.sysctl import CeilingError, CeilingWriter

MAX_BUSY = 4  # immediate actions in a row before the loop waits a poll interval anyway


class EventLog:
    """One line per event on ``stream``, flushed at once (launchd redirects it to a file)."""

    def __init__(self, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._lock = threading.Lock()

    def emit(self, level: str, event: str, msg: str = "", **fields: Any) -> None:
        ts = self._clock()
        when = datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")
        parts = [when.replace("+00:00", "Z"), level, event]
        parts += [f"{k}={_value(v)}" for k, v in fields.items()]
        parts += [f"ts={ts:.6f}", f"msg={json.dumps(msg, ensure_ascii=False)}"]
        with self._lock:
            self._stream.write(" ".join(parts) + "\n")
            self._stream.flush()


def _value(v: Any) -> str:
    s = str(v)
    return json.dumps(s, ensure_ascii=False) if (not s or any(c in s for c in " \"'\\=\t")) \
        else s


@dataclass(frozen=True)
class Timing:
    poll_s: float = 0.5  # link re-read at least this often (events wake it sooner)
    settle_s: float = 1.0  # a link change must hold this long before the mode follows
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0
    proxy_check_s: float = 5.0  # while converged, re-read the proxy's mode this often


class Watcher:
    """Wires the link reader, the ceiling writer, the memory probe and the proxy client
    to :func:`decide`. Holds only what it can re-derive (see decide's docstring)."""

    def __init__(self, *, targets: Targets, link: LinkReader, ceiling: CeilingWriter,
                 in_use: Callable[[], int], proxy: AdminClient | None, log: EventLog,
                 timing: Timing = Timing(), clock: Callable[[], float] = time.monotonic):
        self.targets, self.link, self.ceiling = targets, link, ceiling
        self.in_use, self.proxy, self.log, self.t, self.clock = in_use, proxy, log, timing, clock

    def run(self, stop: threading.Event | None = None, once: bool = False) -> int:
        """Run until ``stop`` is set (0). With ``once``: until converged (0) or held (1)."""
        stop = stop or threading.Event()
        state = self.link.read()
        settle = Settle.start(state.up, self.clock())
        self.log.emit("INFO", "link", interface=self.link.interface, up=state.up,
                      mode=mode_for(state.up), detail=state.detail,
                      msg="initial link state (applied at once)")
        answer: ProxyAnswer | None = None
        proxy_mode = self.proxy.get_mode() if self.proxy else None
        last_check = self.clock()
        attempt, retry_at, busy, converged = 0, None, 0, None

        while not stop.is_set():
            now = self.clock()
            raw = self.link.read()
            new = settle.update(raw.up, now, self.t.settle_s)
            if raw.up != settle.raw:
                self.log.emit("INFO", "link-raw", up=raw.up, detail=raw.detail)
            if new.up != settle.up:
                self.log.emit("INFO", "link", interface=self.link.interface, up=new.up,
                              mode=mode_for(new.up), detail=raw.detail,
                              msg=f"link settled {'up' if new.up else 'down'}")
                answer, attempt, retry_at, converged = None, 0, None, None
            settle = new

            if retry_at is not None and now < retry_at:
                self._wait(settle, now, retry_at)
                continue
            if retry_at is not None:
                retry_at, answer = None, None  # ask again: POST /admin/mode is idempotent

            if self.proxy and converged and now - last_check >= self.t.proxy_check_s:
                seen, last_check = self.proxy.get_mode(), now
                if seen is not None and seen != proxy_mode:
                    self.log.emit("WARNING", "proxy-mode", proxy_mode=seen,
                                  msg=f"the proxy is in {seen} mode now (restarted?)")
                    answer = None  # what it confirmed no longer holds
                proxy_mode = seen or proxy_mode  # unreachable: keep the last known mode

            try:
                in_use = self.in_use()
            except (OSError, ValueError, NotImplementedError) as err:
                action: Any = Retry(mode_for(settle.up), f"memory probe failed: {err}")
            else:
                obs = Observation(settle.up, self.ceiling.read_mib(), in_use,
                                  self.proxy is not None, proxy_mode, answer)
                action = decide(obs, self.targets)

            if isinstance(action, Hold):
                busy, attempt = 0, 0
                key = (action.mode, self.targets.mib(action.mode))
                if converged != key:
                    converged = key
                    self.log.emit("INFO", "converged", mode=action.mode,
                                  ceiling_mib=self.targets.mib(action.mode), msg=action.reason)
                if once:
                    return 0
            elif isinstance(action, TellProxy):
                answer = self._tell(action)
                proxy_mode = answer.proxy_mode or proxy_mode
                last_check, converged = self.clock(), None
            elif isinstance(action, WriteCeiling):
                action = self._write(action)
                converged = None
            if isinstance(action, Retry):
                delay = backoff_delay(attempt, self.t.backoff_base_s, self.t.backoff_cap_s)
                retry_at, attempt, busy, converged = self.clock() + delay, attempt + 1, 0, None
                self.log.emit("ERROR", "held", mode=action.mode, attempt=attempt,
                              retry_in_s=f"{delay:g}", msg=action.reason)
                if once:
                    return 1
            if isinstance(action, TellProxy | WriteCeiling):
                busy += 1
                if busy <= MAX_BUSY:
                    continue
                busy = 0
            self._wait(settle, self.clock(), retry_at)
        self.log.emit("INFO", "stopped", msg="watcher stopped")
        return 0

    def _wait(self, settle: Settle, now: float, retry_at: float | None) -> None:
        timeout = self.t.poll_s
        pending = settle.remaining(now, self.t.settle_s)
        if pending is not None:
            timeout = min(timeout, pending)
        if retry_at is not None:
            timeout = min(timeout, max(0.0, retry_at - now))
        self.link.wait(timeout)

    def _tell(self, action: TellProxy) -> ProxyAnswer:
        assert self.proxy is not None  # decide asks only when a proxy is configured
        self.log.emit("INFO", "proxy-ask", mode=action.mode, url=self.proxy.url,
                      msg=action.reason)
        answer = self.proxy.set_mode(action.mode)
        self.log.emit("INFO" if answer.ok else "ERROR", "proxy-answer", mode=action.mode,
                      status=answer.status, http=answer.http_status,
                      proxy_mode=answer.proxy_mode, fits=answer.fits,
                      in_use_bytes=answer.in_use_bytes, envelope_bytes=answer.envelope_bytes,
                      msg=answer.describe())
        return answer

    def _write(self, action: WriteCeiling) -> WriteCeiling | Retry:
        """Check the probe right before writing; write; verify. A failure becomes a Retry."""
        try:
            in_use = self.in_use()
        except (OSError, ValueError, NotImplementedError) as err:
            return Retry(action.mode, f"memory probe failed right before writing: {err}")
        refusal = check_write(action.mib, in_use)
        if refusal:
            return Retry(action.mode, refusal)
        previous = self.ceiling.read_mib()
        self.log.emit("INFO", "ceiling-write", mode=action.mode, direction=action.direction,
                      ceiling_mib=action.mib, ceiling_bytes=mib_to_bytes(action.mib),
                      in_use_bytes=in_use, previous_mib=previous, backend=self.ceiling.name,
                      msg=action.reason)
        try:
            applied = self.ceiling.write_mib(action.mib)
        except CeilingError as err:
            self.log.emit("ERROR", "ceiling-error", mode=action.mode, ceiling_mib=action.mib,
                          backend=self.ceiling.name, msg=str(err))
            return Retry(action.mode, f"ceiling not applied: {err}")
        self.log.emit("INFO", "ceiling-verified", mode=action.mode, ceiling_mib=applied.mib,
                      read_back_mib=applied.read_back_mib, mlx_bytes=applied.mlx_bytes,
                      backend=self.ceiling.name, msg=applied.detail)
        return action
