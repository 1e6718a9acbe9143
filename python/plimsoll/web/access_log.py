"""One access-log line per API request, on the worker and the proxy.

A line is ``key=value`` pairs on the ``plimsoll.access`` logger, e.g.::

    access route="POST /v1/messages" model=demo-tiny status=200 prompt=32221 cached=31870
    completion=57 reservation=8192 submit_s=0.031 admit_s=0.034 ttft_s=0.412 total_s=3.118

``code`` is the refusal or error code of a non-2xx answer (or of an error event that ended
a stream), ``reservation`` the output reservation the request was admitted with (after a
clamp: see ``x-plimsoll-max-tokens``), ``drafted`` / ``accepted`` the tokens speculation
proposed for the request and those the model accepted (only when it drafted). Times are
from the request's arrival: ``parse_s`` when its body was read and parsed, ``submit_s`` when
it was handed to the scheduler (its prompt rendered and tokenized too; ``render_s`` is how
long the rendering took, a wait for a thread included), ``admit_s`` when the scheduler
admitted it (its prompt blocks reserved; its first chunk planned), ``ttft_s`` its first
token. Figures a server does not know are left out (the proxy relays streams without
parsing their prompt). ``--quiet`` turns the lines off (:func:`set_quiet`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("plimsoll.access")


@dataclass
class Access:
    """What one request's line says; handlers fill in what they learn as they go."""

    route: str
    model: str | None = None
    prompt: int | None = None
    cached: int | None = None
    completion: int | None = None
    reservation: int | None = None
    status: int | None = None
    code: str | None = None
    drafted: int | None = None
    accepted: int | None = None
    started: float = field(default_factory=time.monotonic)
    parsed_at: float | None = None
    rendered_at: float | None = None
    submitted_at: float | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None

    def first_token(self) -> None:
        """Mark the first generated token (only the first call counts)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def line(self, now: float) -> str:
        parts = [f'route="{self.route}"']
        for key in ("model", "status", "code", "prompt", "cached", "completion",
                    "reservation", "drafted", "accepted"):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{key}={value}")
        for key, at in (("parse_s", self.parsed_at), ("submit_s", self.submitted_at),
                        ("admit_s", self.admitted_at), ("ttft_s", self.first_token_at)):
            if at is not None:
                parts.append(f"{key}={at - self.started:.3f}")
        if self.parsed_at is not None and self.rendered_at is not None:
            parts.append(f"render_s={self.rendered_at - self.parsed_at:.3f}")
        parts.append(f"total_s={now - self.started:.3f}")
        return "access " + " ".join(parts)


def emit(rec: Access, now: float) -> None:
    log.info("%s", rec.line(now))


def set_quiet(quiet: bool) -> None:
    """``--quiet``: no access lines (warnings and errors still print)."""
    log.setLevel(logging.WARNING if quiet else logging.INFO)
