"""ASGI middleware deciding who may use the API: a Host allowlist and an optional API key.

- **Host.** A request whose `Host` header names a host outside `allowed_hosts` is refused
  with a 400 before anything else runs. A server on 127.0.0.1 is reachable from any web page
  the user opens: a page on `evil.example` whose name is re-pointed at 127.0.0.1 (DNS
  rebinding) sends requests that the browser labels `Host: evil.example`, so the name is what
  tells them apart. `loopback_hosts` gives the names of a loopback address.
- **API key.** With a key, every request but `GET /health` (liveness probes) needs
  `Authorization: Bearer <key>`, as OpenAI's API does; otherwise a 401 in OpenAI's error shape
  (`invalid_api_key`) with `WWW-Authenticate: Bearer`. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

PUBLIC_PATHS = frozenset({"/health"})
"""Paths served without the API key."""
ANY_HOST = "*"
"""In `allowed_hosts`: accept every Host header."""


def loopback_hosts(host: str) -> list[str]:
    """The host names a server bound to `host` answers to by default: a loopback address and
    `localhost` stand for each other; a wildcard address (`0.0.0.0`, `::`) accepts any name;
    any other address or name only itself."""
    loopback = ["127.0.0.1", "localhost", "::1"]
    if host in ("0.0.0.0", "::", ""):
        return [ANY_HOST]
    if host in loopback or host.startswith("127."):
        return sorted({host, *loopback})
    return [host]


def host_name(header: str) -> str:
    """The host of a `Host` header value, lower-cased, without its port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class AccessControl:
    """Refuses requests from hosts not allowed (400) and, with `api_key`, requests without it
    (401), as `reject(status, message, param, code, headers)` Starlette responses.

    Args:
        app: the wrapped application.
        reject: builds the error response.
        api_key: the key every non-public request must carry, or None for none.
        allowed_hosts: accepted `Host` names (see `host_name`), `ANY_HOST` for all, or None
            for no check.
    """

    def __init__(
        self,
        app: ASGIApp,
        reject: Callable,
        api_key: str | None = None,
        allowed_hosts: list[str] | None = None,
    ):
        self.app, self.reject = app, reject
        self.api_key = None if api_key is None else api_key.encode()
        hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.allowed = None if hosts is None or ANY_HOST in hosts else hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.allowed is not None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                response = self.reject(
                    400, f"Host {host!r} is not served here", "host", "host_not_allowed"
                )
                await response(scope, receive, send)
                return
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                response = self.reject(
                    401,
                    "missing or incorrect API key: send Authorization: Bearer <key>",
                    None,
                    "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
