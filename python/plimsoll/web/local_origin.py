"""Refusing requests a browser makes for another site (DNS rebinding, cross-site POSTs).

A page on any site can make a browser send requests to a server on 127.0.0.1: directly
(a cross-site ``POST`` with a ``text/plain`` body needs no CORS preflight), or through DNS
rebinding, its own name re-pointed at 127.0.0.1 so that the page's requests count as
same-origin and their answers (a model's output, ``/running``) become readable to it. Each
carries a tell: the rebound request's ``Host`` is the attacker's name, and a cross-site
request's ``Origin`` is the attacker's site.

:class:`LocalOrigin` (ASGI middleware) answers 403, in the route's protocol, to a request

- whose ``Host`` is not a name this server is known by: ``localhost``, a loopback address,
  the address it is bound to, or one of ``allowed_hosts`` (with a wildcard bind, any IP
  address too: rebinding needs a DNS name, and a client on the network uses the address);
- or whose ``Origin``, when sent, is not one of those (``null`` included: a sandboxed
  frame or a local file).

Clients that are not browsers (curl, the OpenAI and Anthropic SDKs, coding agents) send
no ``Origin`` and the ``Host`` of the URL they were given, so they pass. ``"*"`` among
``allowed_hosts`` turns the check off (behind a reverse proxy that checks ``Host`` itself).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from .errors import error_body

WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})
FLAG = "--allowed-host"


def host_name(value: str) -> str:
    """The name of a ``Host`` header's value, without its port (``[::1]:8080`` → ``::1``),
    lowercased, without a trailing dot."""
    value = value.strip()
    if value.startswith("["):
        name = value[1:].partition("]")[0]
    else:
        head, sep, port = value.rpartition(":")
        name = head if sep and port.isdigit() and ":" not in head else value
    return name.rstrip(".").lower()


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostRule:
    """Which names a server bound to ``bind_host`` answers to (the module docstring)."""

    def __init__(self, bind_host: str, allowed_hosts: Iterable[str] = ()) -> None:
        self.bind_host = bind_host
        allowed = {host_name(h) for h in allowed_hosts}
        self.any_host = "*" in allowed
        self.wildcard_bind = bind_host.strip("[]") in WILDCARD_BINDS
        self.names = frozenset(allowed - {"*"} | LOOPBACK_NAMES
                               | ({host_name(bind_host)} if not self.wildcard_bind else set()))

    def allows(self, name: str) -> bool:
        if self.any_host or name in self.names:
            return True
        ip = _ip(name)
        if ip is None:
            return False
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback) or (
            self.wildcard_bind)

    def refusal(self, host: str | None, origin: str | None) -> tuple[str, str] | None:
        """``(code, message)`` when a request with these headers is refused, else None."""
        if self.any_host:
            return None
        if host is not None and not self.allows(name := host_name(host)):
            return "host_not_allowed", (
                f"the Host header {host!r} is not a name this server answers to (localhost, "
                f"a loopback address, its bind address {self.bind_host!r}, or an "
                f"{FLAG}): a page on another site may be reaching it by DNS rebinding. If "
                f"you reach plimsoll by this name, start it with {FLAG} {name}")
        if origin is not None:
            parts = urlsplit(origin.strip())
            name = (parts.hostname or "").rstrip(".").lower()
            if not name or parts.scheme not in ("http", "https") or not self.allows(name):
                return "origin_not_allowed", (
                    f"the Origin {origin!r} is another site (not localhost, a loopback "
                    f"address, the bind address {self.bind_host!r} or an {FLAG}): a "
                    "browser page may not use this server. If that site is yours, start "
                    f"plimsoll with {FLAG} {name or 'NAME'}")
        return None


class LocalOrigin:
    """ASGI middleware: the 403 of the module docstring, before the app sees the request."""

    def __init__(self, app: Any, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        host, origin = headers.get(b"host"), headers.get(b"origin")
        refused = self.rule.refusal(host.decode("latin-1") if host is not None else None,
                                    origin.decode("latin-1") if origin is not None else None)
        if refused is None:
            await self.app(scope, receive, send)
            return
        code, message = refused
        path = scope.get("path", "")
        body = json.dumps(error_body(403, message, code,
                                     anthropic=path.startswith("/v1/messages"))).encode()
        await send({"type": "http.response.start", "status": 403, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
