"""The control service answers only to its own names: a check of each request's `Host` header.

DNS rebinding: a web page at a name its attacker controls points that name at this service's address, and
the victim's browser, which thinks it talks to the page's own origin, reads the open routes (status,
workers, events) and hands them back. The browser still sends the attacker's name as `Host`, so a request
whose Host is not one of the service's names is refused (400, naming `control.allowed_hosts`) before any
route runs. An IP address as Host is always accepted: no rebinding goes through one (the page's origin
would be that address), and probes and scrapers address a pod or a container by it. A request without a
Host (HTTP/1.0) cannot come from a browser and is accepted too.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from sparkrl.services.common.http import AsciiJSON, ASGIApp, Receive, Scope, Send
from sparkrl.services.common.settings import ControlSettings

SETTING = "control.allowed_hosts"
_EVERY_INTERFACE = ("0.0.0.0", "::", "")


def own_names(cfg: ControlSettings) -> frozenset[str]:
    """The names the service answers to without being told (lower case)."""
    names = {"localhost", cfg.host, urlsplit(cfg.url).hostname or ""}
    if cfg.host in _EVERY_INTERFACE:
        names.add(socket.gethostname())
    return frozenset(name.lower() for name in names if name and name not in _EVERY_INTERFACE)


def host_of(header: str) -> str:
    """The name or address in a Host header, without its port or an IPv6 literal's brackets."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostCheck:
    """ASGI middleware: 400 for a request whose Host is not one of `names` nor matched by `allowed`."""

    def __init__(self, app: ASGIApp, names: Iterable[str], allowed: Iterable[str]) -> None:
        self.app = app
        self.names = frozenset(name.lower() for name in names)
        self.allowed = [entry.lower() for entry in allowed]

    def accepts(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        if "*" in self.allowed or _is_address(host) or host in self.names or host in self.allowed:
            return True
        domains = [entry for entry in self.allowed if entry.startswith(".")]
        return any(host.endswith(domain) or host == domain[1:] for domain in domains)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host")
        host = host_of(header.decode("latin-1")) if header is not None else None
        if host is None or self.accepts(host):
            await self.app(scope, receive, send)
            return
        shown = host if len(host) <= 100 else host[:100] + "…"
        # Its own names are not listed: a page that rebound a name to this service reads this answer too.
        detail = f"Host {shown!r} is not a name of this service: add it to {SETTING} to reach it by that name"
        await AsciiJSON({"detail": detail}, status_code=400)(scope, receive, send)
