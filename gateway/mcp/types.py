"""The MCP vocabulary: revisions, ``_meta`` keys and the JSON-RPC messages as msgspec structs.

Messages arrive as :class:`Incoming` (any JSON-RPC 2.0 object, fields not yet checked:
the wire is the one place where a value may be anything) and the kernel turns them into
:class:`Request`, :class:`Notification` or :class:`ClientReply`. What the gateway sends is
a :class:`Response`, an :class:`ErrorResponse`, or, on a stream, a :class:`Notification` or
a server->client :class:`Request`. A :class:`Reply` is what a transport writes for one
message: the message and the HTTP status that goes with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

LEGACY_VERSION = "2025-11-25"
MODERN_VERSION = "2026-07-28"
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MODERN_VERSIONS = (MODERN_VERSION,)
SUPPORTED_VERSIONS = (*HANDSHAKE_VERSIONS, *MODERN_VERSIONS)

PROTOCOL_VERSION_META_KEY = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_META_KEY = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO_META_KEY = "io.modelcontextprotocol/clientInfo"
LOG_LEVEL_META_KEY = "io.modelcontextprotocol/logLevel"
SERVER_INFO_META_KEY = "io.modelcontextprotocol/serverInfo"
SUBSCRIPTION_ID_META_KEY = "io.modelcontextprotocol/subscriptionId"

LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")

RequestId = int | str


class Incoming(msgspec.Struct):
    """One JSON-RPC 2.0 object as received; :mod:`gateway.mcp.kernel` checks every field."""

    jsonrpc: Any = msgspec.UNSET
    id: Any = msgspec.UNSET
    method: Any = msgspec.UNSET
    params: Any = msgspec.UNSET
    result: Any = msgspec.UNSET
    error: Any = msgspec.UNSET


class Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request either way. ``jsonrpc`` has no default so that a body decoded straight into
    this struct (the kernel's fast path) is a well-formed JSON-RPC 2.0 request."""

    jsonrpc: Literal["2.0"]
    id: RequestId
    method: str
    params: dict[str, Any] = {}


class Notification(msgspec.Struct, kw_only=True):
    jsonrpc: str = "2.0"
    method: str
    params: dict[str, Any] = {}


class ErrorObject(msgspec.Struct, kw_only=True):
    code: int
    message: str
    data: Any = msgspec.UNSET  # left out of the JSON when unset


class Response(msgspec.Struct, kw_only=True):
    jsonrpc: str = "2.0"
    id: RequestId
    result: dict[str, Any]


class ErrorResponse(msgspec.Struct, kw_only=True):
    jsonrpc: str = "2.0"
    id: RequestId | None
    error: ErrorObject


class ClientReply(msgspec.Struct, kw_only=True):
    """The client's answer to a server->client request (sampling, elicitation, roots)."""

    jsonrpc: str = "2.0"
    id: RequestId
    result: dict[str, Any] | None = None
    error: ErrorObject | None = None


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """The checked ``_meta`` envelope of a 2026-07-28 request (the raw ``_meta`` stays
    available to handlers: clients may put any other key there)."""

    protocol_version: str
    client_capabilities: dict[str, Any]
    client_info: dict[str, Any] | None = None
    log_level: str | None = None


ServerMessage = Notification | Request  # what the gateway sends on a stream besides the answer
Emit = Callable[[ServerMessage], Awaitable[None]]


@dataclass(slots=True)
class Reply:
    """What a transport writes for one incoming message. ``message`` None: accepted, no body
    (HTTP 202). ``retry_after_s`` becomes a Retry-After header; ``session_id`` an
    Mcp-Session-Id header (a session was just created)."""

    message: Response | ErrorResponse | None = None
    http_status: int = 200
    retry_after_s: int | None = None
    session_id: str | None = None


_encoder = msgspec.json.Encoder()
encode = _encoder.encode
