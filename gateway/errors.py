"""The one error map: where an exception becomes a JSON-RPC error object or an HTTP status.

Handlers and components raise what they know: a protocol error (:class:`McpError` and its
subclasses) or a domain exception of the context store, the sample ingest, the worker
pool, the session registry, or Redis itself. :func:`wire_error` decides what the client
sees, in the manner of the MCP SDK's kernel:

- a protocol error keeps its code (and its HTTP status, when it names one);
- a body over ``gateway.max_body_bytes`` is INVALID_REQUEST with HTTP 413;
- bad input (a store or sample validation error, a worker's ``bad_input``) is INVALID_PARAMS;
- an unknown context is INVALID_PARAMS for a tool, with ``data`` naming the ``kind``
  (``context_not_found`` or ``version_unavailable``), the ``context_id`` and the ``version``,
  and RESOURCE_NOT_FOUND for ``resources/read``;
  on 2026-07-28 every unknown resource is INVALID_PARAMS with ``data.uri`` and HTTP 400 (SEP-2164);
- a principal over one of its limits (:class:`LimitExceeded`) is LIMIT_EXCEEDED with HTTP 429
  and a Retry-After that ``data.retryAfterS`` repeats; a principal without a permission
  (:class:`Forbidden`) is FORBIDDEN with HTTP 403;
- a backend that is down or overloaded (Redis unreachable, no worker, a worker timeout,
  the session cap) is SERVICE_UNAVAILABLE with HTTP 503 and a Retry-After of
  ``redis.retry_after_s`` seconds, unless the exception knows a better wait;
- anything else is logged and becomes INTERNAL_ERROR without internals.

A failing tool body is not a protocol error: :func:`tool_error_text` says which
exceptions become a result with ``isError: true``. Admin REST routes get the same map as
HTTP errors: :func:`install_http_errors` registers it once as the FastAPI exception
handler, so a route lets store/Redis/pool exceptions propagate; :func:`http_error` is the
same decision for code that needs an :class:`HTTPException` in hand. A request body that is
not JSON is 400 on every REST route; JSON the route's model refuses stays FastAPI's 422.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MaxConnectionsError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.mcp.sessions import SessionLimit, SessionNotFound
from gateway.mcp.types import ErrorObject, ErrorResponse, RequestId
from gateway.workers import NoWorker, WorkerRequestError, WorkerTimeout
from shared.config import Config
from shared.context import ContextError, ContextNotFound
from shared.log_throttle import ThrottledWarning
from shared.metrics import MCP_ERRORS
from shared.samples import SampleError

log = logging.getLogger(__name__)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
REQUEST_CANCELLED = -32800
RESOURCE_NOT_FOUND = -32002
HEADER_MISMATCH = -32020
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022
SERVICE_UNAVAILABLE = -32050  # learnmesh: a backend (Redis, workers) is unreachable; retry
FORBIDDEN = -32003  # learnmesh: the principal lacks the permission this needs (teach)
LIMIT_EXCEEDED = -32029  # learnmesh: a quota or rate limit of the principal; retry after data.retryAfterS
UPSTREAM_FAILED = -32052  # learnmesh: a proxied upstream failed, timed out or its breaker is open (data.upstream)
# The codes the gateway raises itself: an upstream's error in one of them is not passed on as it
# came (gateway/proxy/client.py), or a client would take it for the gateway's word.
GATEWAY_CODES = frozenset({SERVICE_UNAVAILABLE, FORBIDDEN, LIMIT_EXCEEDED, UPSTREAM_FAILED})

# HTTP status of a 2026-07-28 answer carrying one of these codes (the others ride on 200).
HTTP_STATUS = {PARSE_ERROR: 400, INVALID_REQUEST: 400, INVALID_PARAMS: 400, HEADER_MISMATCH: 400,
               MISSING_REQUIRED_CLIENT_CAPABILITY: 400, UNSUPPORTED_PROTOCOL_VERSION: 400,
               METHOD_NOT_FOUND: 404}

# Redis (or the network under it) is down, failing over or overloaded: worth a retry. On a Redis
# Cluster the client follows MOVED/ASK itself; what escapes it (a slot with no master yet, the
# redirect budget spent while a failover settles, a stale map pointing at a node gone since) is
# the same outage, never a redirect for the client to see.
OUTAGE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, MasterDownError, TryAgainError,
          ClusterDownError, ClusterError, SlotNotCoveredError, MovedError, AskError, OSError)


def is_outage(exc: BaseException) -> bool:
    """An OUTAGE, or a cluster client that could reach no node at all (redis-py raises its
    RedisClusterException for that, caused by the last connection error)."""
    return isinstance(exc, OUTAGE) or (isinstance(exc, RedisClusterException) and isinstance(exc.__cause__, OUTAGE))


class McpError(Exception):
    """A JSON-RPC error; ``http_status`` is the status of an HTTP answer carrying it
    (200 leaves it to the code: see ``HTTP_STATUS``)."""

    def __init__(self, code: int, message: str, data: Any = None, http_status: int = 200) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.http_status = http_status


class InvalidParams(McpError):
    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(INVALID_PARAMS, message, data)


class NotFound(McpError):
    """Unknown resource / context id (MCP resource-not-found code)."""

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(RESOURCE_NOT_FOUND, message, data)


class Unavailable(McpError):
    """Something this request needs is not there now; the client should retry (HTTP 503).
    ``retry_after_s`` None: the configured ``redis.retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(SERVICE_UNAVAILABLE, message, http_status=503)
        self.retry_after_s = retry_after_s


class BodyTooLarge(HTTPException):
    """A request body passed ``gateway.max_body_bytes`` (HTTP 413; the edge closes the connection,
    the rest of the body is never read). An HTTPException so that a FastAPI route reading its
    body lets it through unchanged."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(413, f"Request body too large (at most {limit_bytes} bytes)")


class Forbidden(McpError):
    """The principal may not do this (HTTP 403); ``data.permission`` names what it lacks."""

    def __init__(self, message: str, permission: str) -> None:
        super().__init__(FORBIDDEN, message, {"permission": permission}, http_status=403)


class LimitExceeded(McpError):
    """The principal reached one of its limits (gateway/limits.py): HTTP 429 with a Retry-After
    of ``retry_after_s``, which ``data.retryAfterS`` repeats for transports without headers."""

    def __init__(self, limit: str, message: str, retry_after_s: int) -> None:
        super().__init__(LIMIT_EXCEEDED, message, {"limit": limit, "retryAfterS": retry_after_s}, http_status=429)
        self.limit = limit
        self.retry_after_s = retry_after_s


class ToolError(Exception):
    """Raised inside a tool body: the call returns ``isError: true`` with this message."""


@dataclass(frozen=True, slots=True)
class WireError:
    """An exception as the client sees it: the JSON-RPC error, and the HTTP status (with a
    Retry-After of ``retry_after_s`` when set) of an answer that carries it over HTTP."""

    code: int
    message: str
    data: Any = None
    http_status: int = 200
    retry_after_s: int | None = None

    def object(self) -> ErrorObject:
        return ErrorObject(code=self.code, message=self.message,
                           data=msgspec.UNSET if self.data is None else self.data)

    def response(self, request_id: RequestId | None) -> ErrorResponse:
        MCP_ERRORS.labels(str(self.code)).inc()
        return ErrorResponse(id=request_id, error=self.object())


# Requests answered 503 because Redis is away: thousands a second while a cluster fails over.
_OUTAGE_LOG = ThrottledWarning(log)
_POOL_LOG = ThrottledWarning(log)


def _unavailable(message: str, retry_after_s: int) -> WireError:
    return WireError(SERVICE_UNAVAILABLE, message, {"retryAfterS": retry_after_s}, 503, retry_after_s)


def wire_error(exc: BaseException, config: Config, *, method: str = "",
               params: Mapping[str, Any] | None = None, crashed_status: int = 200, modern: bool = False) -> WireError:
    """THE map. ``method``/``params``: the request being served, when there is one; ``modern``:
    it is a 2026-07-28 request. ``crashed_status``: the HTTP status of an unexpected exception (200
    inside a handler, where JSON-RPC carries the error; 500 when the transport itself failed)."""
    wire = _wire_error(exc, config, method, params, crashed_status)
    if modern and wire.code == RESOURCE_NOT_FOUND:  # SEP-2164: -32002 is the 2025-11-25 code alone
        return WireError(INVALID_PARAMS, wire.message, wire.data, HTTP_STATUS[INVALID_PARAMS])
    return wire


def _wire_error(exc: BaseException, config: Config, method: str, params: Mapping[str, Any] | None,
                crashed_status: int) -> WireError:
    retry_after_s = config.redis.retry_after_s
    if isinstance(exc, BodyTooLarge):
        return WireError(INVALID_REQUEST, exc.detail, None, 413)
    if isinstance(exc, Unavailable):
        return _unavailable(exc.message, exc.retry_after_s or retry_after_s)
    if isinstance(exc, LimitExceeded):
        return WireError(exc.code, exc.message, exc.data, 429, exc.retry_after_s)
    if isinstance(exc, McpError):
        status = exc.http_status if exc.http_status != 200 else HTTP_STATUS.get(exc.code, 200)
        return WireError(exc.code, exc.message, exc.data, status)
    if isinstance(exc, ContextNotFound):
        plain = type(exc) is ContextNotFound  # not a VersionUnavailable, whose text says what is missing
        if method == "resources/read":
            uri = (params or {}).get("uri")
            return WireError(RESOURCE_NOT_FOUND, f"Resource not found: {uri}" if plain else str(exc), {"uri": uri})
        return WireError(INVALID_PARAMS, f"{exc} not found" if plain else str(exc), exc.data(), 400)
    if isinstance(exc, ContextError):
        return WireError(INVALID_PARAMS, str(exc), None, 400)
    if isinstance(exc, SampleError):
        # The sample's place only where the error is one sample's (not the call's shape)
        return WireError(INVALID_PARAMS, str(exc), None if exc.index is None else {"index": exc.index}, 400)
    if isinstance(exc, WorkerRequestError) and exc.code == "bad_input":
        return WireError(INVALID_PARAMS, str(exc), None, 400)
    if isinstance(exc, SessionNotFound):
        return WireError(INVALID_REQUEST, "Session not found", None, 404)
    if isinstance(exc, SessionLimit):
        return _unavailable("Too many sessions for this principal", retry_after_s)
    if isinstance(exc, NoWorker):
        return _unavailable(str(exc), exc.retry_after_s or retry_after_s)
    if isinstance(exc, WorkerTimeout):
        return _unavailable(str(exc), retry_after_s)
    if isinstance(exc, MaxConnectionsError):  # Redis answers; this replica has every connection in use
        _POOL_LOG.warning("redis connection pool full while serving %s: raise redis.max_connections or add "
                          "gateway replicas", method or "a request")
        return _unavailable("Service unavailable: this replica's Redis connections are all in use "
                            "(redis.max_connections)", retry_after_s)
    if is_outage(exc):
        _OUTAGE_LOG.warning("redis unavailable while serving %s: %s", method or "a request", type(exc).__name__)
        return _unavailable("Service unavailable: store unreachable", retry_after_s)
    log.error("internal error while serving %s", method or "a request", exc_info=exc)
    return WireError(INTERNAL_ERROR, "Internal error", None, crashed_status)


def tool_error_text(exc: BaseException) -> str | None:
    """The text of an ``isError: true`` result when a tool body raised ``exc``; None when the
    exception is a protocol matter for :func:`wire_error` instead."""
    if isinstance(exc, ToolError):
        return str(exc)
    if isinstance(exc, WorkerRequestError) and exc.code != "bad_input":
        return f"inference failed: {exc}"
    return None


def http_error(exc: BaseException, config: Config) -> HTTPException:
    """The same map for REST routes: 400 bad input, 403 a permission missing, 404 unknown
    context, 429 + Retry-After for a limit, 503 + Retry-After for an outage, 500 for anything
    unexpected."""
    wire = wire_error(exc, config, crashed_status=500)
    if isinstance(exc, ContextNotFound) or wire.code == RESOURCE_NOT_FOUND:
        status = 404
    else:
        status = wire.http_status if wire.http_status >= 400 else 400
    headers = {"Retry-After": str(wire.retry_after_s)} if wire.retry_after_s is not None else None
    return HTTPException(status, wire.message, headers=headers)


# What a REST route may let propagate; everything else stays FastAPI's (500).
HTTP_MAPPED = (McpError, ContextError, SampleError, SessionNotFound, SessionLimit, NoWorker, WorkerTimeout,
               WorkerRequestError, RedisClusterException, *OUTAGE)


def install_http_errors(app: FastAPI, config: Config) -> None:
    """Answer the exceptions of ``HTTP_MAPPED`` escaping any REST route through :func:`http_error`,
    and a request body that is not JSON with 400."""

    async def handler(request: Request, exc: Exception) -> JSONResponse:
        err = http_error(exc, config)
        return JSONResponse({"detail": err.detail}, status_code=err.status_code, headers=err.headers)

    for cls in HTTP_MAPPED:
        app.add_exception_handler(cls, handler)
    app.add_exception_handler(RequestValidationError, _body_not_json)


def _not_json(exc: RequestValidationError) -> str | None:
    """Why the request's body is not JSON at all (malformed, or sent with another content type,
    so FastAPI validated its raw bytes), or None when it is JSON the route's model refused."""
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"the body is not valid JSON: {err.get('ctx', {}).get('error')} (char {err['loc'][-1]})"
    if isinstance(exc.body, (bytes, bytearray)):
        return "the body must be JSON, sent with Content-Type: application/json"
    return None


async def _body_not_json(request: Request, exc: Exception) -> JSONResponse:
    """Input the route cannot accept, as every other (400); 422 is for JSON that fails validation."""
    invalid = cast(RequestValidationError, exc)  # the one class it is registered for
    reason = _not_json(invalid)
    if reason is None:
        return JSONResponse({"detail": _json_safe(jsonable_encoder(invalid.errors()))}, status_code=422)
    return JSONResponse({"detail": reason}, status_code=400)


def _json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity as its name: a refused input echoed back may be one
    (Python's JSON reader takes ``NaN``, ``Infinity`` and ``1e400``), which JSON cannot carry."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
