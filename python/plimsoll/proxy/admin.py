"""The admin edge: the mode change the link watcher calls, the admin token, the event log.

Contract (the link watcher depends on it exactly):

- ``POST /admin/mode`` with ``{"mode": "standalone" | "clustered"}`` and
  ``Authorization: Bearer <admin token>``. The change takes the transition lock ahead of
  queued loads (so no worker is admitted meanwhile), evicts least-recently-used workers
  until the running set fits the new mode's envelope, re-runs admission for every
  survivor under the new budget (evicting any whose caps it would no longer grant),
  verifies each evicted worker's memory came back, and only then answers
  ``200 {"mode", "fits": true, "in_use_bytes", "envelope_bytes"}``. If it cannot make
  room within ``admin_deadline_s``: ``409 {"error", "mode": <unchanged>, "fits": false,
  "in_use_bytes", "envelope_bytes"}``. Wrong or missing token: 401. Bad body: 400.
- ``in_use_bytes`` is the observed memory of the LLM workers (the sum of their process
  footprints: phys_footprint on macOS, VmRSS on Linux); ``fits`` means the running set,
  each worker counted at the larger of its admitted and its observed footprint, is
  within ``envelope_bytes``. ``host_in_use_bytes`` (the probe's host-wide in-use figure)
  and ``accounted_bytes`` are given beside them.
- ``GET /admin/mode`` → ``{"mode"}``; ``GET /admin/events`` → the event log.

The token is read from ``--admin-token-file`` at start, or generated into a user-only
(0600) file, in a user-only directory (:func:`plimsoll.core.paths.private_dir`), whose path
is logged.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plimsoll.core.paths import private_dir
from plimsoll.web.body import read_body

from ..protocol import decode_json_body, error_body
from .errors import ProxyError
from .evict import choose_evictions
from .state import State
from .supervisor import Supervisor

log = logging.getLogger("plimsoll.proxy")
MODES = ("standalone", "clustered")


def load_or_create_token(path: Path | None, default_path: Path) -> tuple[str, Path]:
    """The admin token from ``path``, or a new one written to ``default_path`` (0600)."""
    if path is not None:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"{path}: the admin token file is empty")
        return token, path
    token = secrets.token_urlsafe(32)
    private_dir(default_path.parent, "the admin token")
    fd = os.open(default_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    log.warning("admin token written to %s (user-only)", default_path)
    return token, default_path


def bearer_ok(request: Request, secret: str | None) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    return (secret is not None and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), secret.encode()))


def unauthorized(what: str) -> JSONResponse:
    return JSONResponse(error_body(401, f"missing or wrong {what}: send "
                                   "'Authorization: Bearer <token>'", code="unauthorized",
                                   type="authentication_error"), 401,
                        headers={"WWW-Authenticate": "Bearer"})


async def change_mode(sup: Supervisor, new: str) -> tuple[int, dict[str, Any]]:
    """Switch the mode; on a downshift make room first. (status, body)."""
    s = sup.settings
    deadline = time.monotonic() + s.admin_deadline_s
    figures = sup.figures(new)  # type: ignore[arg-type]
    env = sup.envelope(figures)

    def answer(status: int, fits: bool, message: str | None = None) -> tuple[int, dict]:
        running = [w for w in sup.workers.values() if w.current is not None]
        observed = sum(sup.observed_bytes(w.current.pid) for w in running if w.current)
        accounted = sum(r.bytes for r in sup.residents(running))
        body: dict[str, Any] = {"mode": sup.mode, "fits": fits, "in_use_bytes": observed,
                                "envelope_bytes": env, "accounted_bytes": accounted,
                                "host_in_use_bytes": sup.in_use(),
                                "workers": [w.name for w in running]}
        if message:
            body.update(error_body(status, message, code="mode_change_refused"))
        return status, body

    try:
        lock = sup.transition(admin=True, timeout_s=s.admin_deadline_s)
        await lock.__aenter__()
    except TimeoutError:
        return answer(409, False, f"could not stop admission within {s.admin_deadline_s:g} s "
                      "(a load did not finish)")
    try:
        figures = sup.figures(new)  # type: ignore[arg-type]  (live again, under the lock)
        env = sup.envelope(figures)
        old = sup.mode
        running = [w for w in sup.workers.values() if w.state is State.READY]
        victims = list(choose_evictions(0, sup.residents(running), env).stop)
        survivors = [w for w in running if w.name not in victims]
        # re-admission under the new budget, each survivor beside the others
        for w in sorted(survivors, key=lambda w: w.current.last_used if w.current else 0):
            inc = w.current
            if inc is None or w.name in victims:
                continue
            others = [r for r in sup.residents(survivors)
                      if r.name != w.name and r.name not in victims]
            _facts, dec = sup.admit(w, figures, sum(r.bytes for r in others))
            old_dec = inc.decision
            if (not dec.admitted or dec.pool_blocks < old_dec.pool_blocks
                    or dec.concurrency < old_dec.concurrency or dec.context < old_dec.context):
                victims.append(w.name)
        for name in victims:
            left = deadline - time.monotonic()
            sup.events.record("evict", name, for_mode=new, envelope_bytes=env)
            try:
                await sup.stop_verified(sup.workers[name], f"evicted: {new} mode's envelope is "
                                        f"{env} bytes", drain_s=min(s.drain_s, max(left / 2, 0)),
                                        deadline_s=max(left, 1.0))
            except ProxyError as err:
                sup.events.record("mode-refused", None, mode=new, reason=err.message)
                return answer(409, False, err.message)
        running = [w for w in sup.workers.values() if w.state is State.READY]
        accounted = sum(r.bytes for r in sup.residents(running))
        if accounted > env:
            msg = (f"the running workers hold {accounted} bytes, over the {new} envelope of "
                   f"{env} bytes, after evicting {victims}")
            sup.events.record("mode-refused", None, mode=new, reason=msg)
            return answer(409, False, msg)
        sup.mode = new  # type: ignore[assignment]
        sup.events.record("mode-change", None, old=old, new=new, evicted=victims,
                          envelope_bytes=env)
        return answer(200, True)
    finally:
        await lock.__aexit__(None, None, None)


async def post_mode(request: Request) -> Response:
    state = request.app.state
    if not bearer_ok(request, state.admin_token):
        return unauthorized("admin token")
    raw = await read_body(request)  # bounded; any undecodable body is the 400 below
    data = decode_json_body(raw) if isinstance(raw, bytes) else None
    mode = data.get("mode") if isinstance(data, dict) else None
    if mode not in MODES or set(data) != {"mode"}:
        return JSONResponse(error_body(400, 'the body must be {"mode": "standalone"} or '
                                       '{"mode": "clustered"}', param="mode",
                                       code="invalid_mode"), 400)
    status, body = await change_mode(state.supervisor, mode)
    return JSONResponse(body, status)


async def get_mode(request: Request) -> Response:
    if not bearer_ok(request, request.app.state.admin_token):
        return unauthorized("admin token")
    return JSONResponse({"mode": request.app.state.supervisor.mode})


async def get_events(request: Request) -> Response:
    if not bearer_ok(request, request.app.state.admin_token):
        return unauthorized("admin token")
    return JSONResponse({"events": request.app.state.supervisor.events.as_json()})
