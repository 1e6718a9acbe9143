"""The watcher's one network call: the local proxy's ``/admin/mode``, with the admin token.

Contract (the proxy's): ``POST /admin/mode {"mode": "standalone"|"clustered"}`` with
``Authorization: Bearer <token>`` answers 200 ``{"mode", "fits": true, "in_use_bytes",
"envelope_bytes"}`` once observed memory fits the mode's envelope (on a downshift, after
evicting), 409 ``{"error", "mode": <unchanged>, "fits": false, ...}`` when it cannot make
room in time, 401 for a bad token, 400 for a bad body. ``GET /admin/mode`` → ``{"mode"}``.

Only loopback URLs are accepted, and the environment's HTTP proxies are ignored: the
watcher runs as root and must not send its token, or anything else, off the host.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

import httpx

from plimsoll.core.policy import Mode
from plimsoll.watcher.decide import ProxyAnswer

MODES = ("standalone", "clustered")


def check_local_url(url: str) -> str:
    """``url`` if it is http(s) on a loopback address; ValueError naming the problem."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"proxy URL {url!r}: expected http://127.0.0.1:PORT")
    host = parts.hostname
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host == "localhost"
    if not local:
        raise ValueError(
            f"proxy URL {url!r}: the watcher only talks to the local proxy (loopback)"
        )
    return url.rstrip("/")


def read_token(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as err:
        raise ValueError(f"admin token file {path}: {err.strerror}") from None
    if not token:
        raise ValueError(f"admin token file {path} is empty")
    return token


def _mode(value: Any) -> Mode | None:
    return value if value in MODES else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def answer_from_response(mode: Mode, status_code: int, body: Any) -> ProxyAnswer:
    """An HTTP answer to ``POST /admin/mode`` → what the decision needs (pure)."""
    b = body if isinstance(body, dict) else {}
    err = b.get("error")
    detail = ""
    if isinstance(err, dict):
        detail = str(err.get("message") or err.get("type") or err)
    elif err:
        detail = str(err)
    fits = b.get("fits") if isinstance(b.get("fits"), bool) else None
    common = dict(http_status=status_code, proxy_mode=_mode(b.get("mode")), fits=fits,
                  in_use_bytes=_int(b.get("in_use_bytes")),
                  envelope_bytes=_int(b.get("envelope_bytes")), detail=detail)
    if status_code == 200:
        if fits is False:  # a 200 that does not fit is not a confirmation
            return ProxyAnswer(mode, "refused", **common)
        return ProxyAnswer(mode, "ok", **common)
    if status_code == 409:
        return ProxyAnswer(mode, "refused", **common)
    if status_code in (401, 403):
        return ProxyAnswer(mode, "unauthorized", **common)
    return ProxyAnswer(mode, "rejected", **common)


class AdminClient:
    """``POST``/``GET /admin/mode`` on the local proxy. Never raises: failures are answers.

    The read timeout is longer than the proxy's own deadline for making room (60 s), so a
    slow downshift comes back as the proxy's 409 rather than as our timeout.
    """

    def __init__(self, url: str, token: str, timeout_s: float = 90.0,
                 connect_timeout_s: float = 2.0) -> None:
        self.url = check_local_url(url)
        self._client = httpx.Client(
            trust_env=False,  # no HTTP(S)_PROXY, no .netrc: loopback only
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={"Authorization": f"Bearer {token}"},
        )

    def set_mode(self, mode: Mode) -> ProxyAnswer:
        """Ask the proxy to enter ``mode``; on a downshift it evicts until memory fits."""
        try:
            r = self._client.post(f"{self.url}/admin/mode", json={"mode": mode})
        except httpx.TimeoutException as err:
            return ProxyAnswer(mode, "timeout", detail=f"{type(err).__name__}")
        except httpx.HTTPError as err:
            return ProxyAnswer(mode, "unreachable", detail=f"{type(err).__name__}: {err}")
        try:
            body = r.json()
        except ValueError:
            body = None
        return answer_from_response(mode, r.status_code, body)

    def get_mode(self) -> Mode | None:
        """The proxy's current mode; None when it cannot be asked."""
        try:
            r = self._client.get(f"{self.url}/admin/mode")
            return _mode(r.json().get("mode")) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def close(self) -> None:
        self._client.close()
