"""CORS for the routes a browser MCP client calls across origins, for allowed origins only.

A browser app on another origin (one listed in ``gateway.allowed_origins``, or a loopback one:
what :class:`~gateway.auth.OriginGuard` lets through) sends its ``POST /mcp`` with
``Content-Type: application/json`` and an ``Authorization`` header, so the browser asks first
with a preflight (``OPTIONS`` with ``Access-Control-Request-Method``); and it may read an answer
only when the answer names its origin in ``Access-Control-Allow-Origin``. It must also be told
which answer headers it may read: ``Mcp-Session-Id`` (the session of a 2025-11-25 client),
``WWW-Authenticate`` (where an OAuth client finds the authorization server) and ``Retry-After``.

An origin the guard refuses gets no CORS header at all: its requests are 403 as before (the MCP
transports answer that), so a page on it can neither send nor read. Requests without ``Origin``
(every client that is not a browser) pass untouched, at no cost. Credentials are headers, never
cookies, so ``Access-Control-Allow-Credentials`` is never sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.auth import PROTECTED_RESOURCE_PATH

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# path -> the methods a cross-origin page may use there
CORS_METHODS: dict[str, bytes] = {
    "/mcp": b"GET, POST, DELETE",
    "/mcp/ws-ticket": b"POST",
    PROTECTED_RESOURCE_PATH: b"GET",
    PROTECTED_RESOURCE_PATH + "/mcp": b"GET",
}
# The request headers the gateway reads, besides the CORS-safelisted ones. A tool may declare
# its own (``Mcp-Param-<name>``, gateway/mcp/kernel.py): those are allowed as the preflight names them.
ALLOWED_HEADERS = (b"authorization", b"content-type", b"accept", b"mcp-session-id", b"mcp-protocol-version",
                   b"mcp-method", b"mcp-name", b"last-event-id")
_PARAM_HEADER = b"mcp-param-"
EXPOSED_HEADERS = b"mcp-session-id, www-authenticate, retry-after"
PREFLIGHT_MAX_AGE_S = 600


def preflight_headers(path: str, origin: bytes, requested: bytes | None) -> list[tuple[bytes, bytes]]:
    """The headers of a 204 answering a preflight from an allowed ``origin`` for ``path``."""
    allowed = list(ALLOWED_HEADERS)
    for name in (requested or b"").split(b","):
        name = name.strip().lower()
        if name.startswith(_PARAM_HEADER) and name not in allowed and len(allowed) < 64:
            allowed.append(name)
    return [(b"access-control-allow-origin", origin), (b"vary", b"Origin"),
            (b"access-control-allow-methods", CORS_METHODS[path]),
            (b"access-control-allow-headers", b", ".join(allowed)),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
            (b"content-length", b"0")]


def with_cors(send: Send, origin: bytes) -> Send:
    """``send`` with the CORS headers an allowed ``origin`` needs added to the response's."""
    extra = ((b"access-control-allow-origin", origin), (b"access-control-expose-headers", EXPOSED_HEADERS),
             (b"vary", b"Origin"))

    async def cors(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return cors
