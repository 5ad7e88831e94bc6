"""ASGI guards in front of an MCP server's Streamable HTTP app: a revision pin and a bearer check.

They make an upstream that speaks one protocol revision only, for the conformance runs through
the proxy (``conformance/pinned_upstream.py``: a learnmesh gateway with the fixtures) and the
proxy tests (``tests/proxy/upstreams``: the official SDK's server). The SDK 2.3.0 has no switch to serve one protocol revision only: one
``StreamableHTTPSessionManager`` serves both eras and routes each POST by its
``MCP-Protocol-Version`` header (absent or a handshake-era version → the 2025-11-25
session transport; anything else → the 2026-07-28 single-exchange entry), and stdio decides
the era from the client's first message. :class:`RevisionPin` answers the other revision's
requests the way a server that never learnt it does, before the SDK sees them:

- pinned to ``2025-11-25``: a request whose header names a per-request (2026-07-28) version
  gets HTTP 400 with JSON-RPC -32600 "Unsupported protocol version", what a 2025-11-25
  server answers for a version it does not know. A client in ``auto`` mode then falls back
  to ``initialize``.
- pinned to ``2026-07-28``: a request with no header or a handshake-era one (``initialize``,
  anything on a session) gets HTTP 400 with -32022 and ``data.supported = ["2026-07-28"]``;
  GET and DELETE (session streams and teardown) get 405.

:class:`BearerCheck` answers 401 unless ``Authorization: Bearer <token>`` matches, so a test
can prove a proxy forwards the credential it was configured with.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Receive, Scope, Send

LEGACY = "2025-11-25"
MODERN = "2026-07-28"
REVISIONS = (LEGACY, MODERN)
INVALID_REQUEST = -32600
UNSUPPORTED_PROTOCOL_VERSION = -32022


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _error(code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": None, "error": error}


class RevisionPin:
    """Serve only ``revision`` (``2025-11-25`` or ``2026-07-28``) of the wrapped app's MCP
    endpoint ``path``; its other routes (``/healthz``) pass untouched."""

    def __init__(self, app: ASGIApp, revision: str, path: str = "/mcp") -> None:
        if revision not in REVISIONS:
            raise ValueError(f"revision must be one of {REVISIONS}, got {revision!r}")
        self.app = app
        self.revision = revision
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == self.path:
            refusal = self._refusal(scope)
            if refusal is not None:
                await _send_json(send, *refusal)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, dict[str, Any]] | None:
        version = _header(scope, b"mcp-protocol-version")
        handshake_era = version is None or version in HANDSHAKE_PROTOCOL_VERSIONS
        if self.revision == LEGACY and not handshake_era:
            return 400, _error(INVALID_REQUEST, f"Bad Request: Unsupported protocol version: {version}")
        if self.revision == MODERN and scope["method"] in ("GET", "DELETE"):
            return 405, _error(INVALID_REQUEST, "Method Not Allowed")
        if self.revision == MODERN and handshake_era:
            return 400, _error(UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                               {"supported": [MODERN], "requested": version or LEGACY})
        return None


class BearerCheck:
    """401 for every HTTP request without ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                await _send_json(send, 401, _error(INVALID_REQUEST, "missing or wrong bearer token"))
                return
        await self.app(scope, receive, send)
