"""Protocol errors. Everything a handler raises becomes a wire error in exactly one place
(``gateway.dispatcher``): a :class:`McpError` keeps its code, a validation error becomes
INVALID_PARAMS, anything else is logged and becomes INTERNAL_ERROR without internals.
A :class:`ToolError` raised from a tool body becomes a result with ``isError: true``."""

from __future__ import annotations

from typing import Any

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
RESOURCE_NOT_FOUND = -32002
HEADER_MISMATCH = -32020
UNSUPPORTED_PROTOCOL_VERSION = -32022
SERVICE_UNAVAILABLE = -32050  # learnmesh: a backend (Redis, workers) is unreachable; retry


class McpError(Exception):
    """A JSON-RPC error with an HTTP status for the Streamable HTTP transport."""

    def __init__(self, code: int, message: str, data: Any = None, http_status: int = 200,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.http_status = http_status
        self.retry_after_s = retry_after_s


class InvalidParams(McpError):
    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(INVALID_PARAMS, message, data)


class NotFound(McpError):
    """Unknown resource / context id (MCP resource-not-found code)."""

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(RESOURCE_NOT_FOUND, message, data)


class Unavailable(McpError):
    """A backend is down; clients should retry after ``retry_after_s`` (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(SERVICE_UNAVAILABLE, message, {"retryAfterS": retry_after_s},
                         http_status=503, retry_after_s=retry_after_s)


class ToolError(Exception):
    """Raised inside a tool body: the call returns ``isError: true`` with this message."""
