"""What every HTTP request passes before routing and before any of its body is read.

- **One body limit** (``gateway.max_body_bytes``) for every route, ``/mcp`` and ``/admin``
  alike: a declared ``Content-Length`` over it is answered 413 at once; a chunked body is
  counted as the route reads it and cut off with :class:`~gateway.errors.BodyTooLarge` (413
  through the one error map) as soon as it passes the limit. A refused body never reaches the
  app: the answer closes the connection, after what the client still sends is dropped (a
  bounded linger, gateway/transports/http_protocol.py, so the client reads the answer).
- **Admin authentication before the body**: an ``/admin`` route needs a valid admin key
  (gateway/admin/auth.py says which do not), checked from the headers alone, so an
  unauthenticated upload costs the gateway nothing but its headers. The route still checks
  the key's role, with the key found here.
- **HEAD is GET without the body** on every route but ``/mcp`` (whose GET opens an event
  stream): the same admission, admin key and role, status and headers (``Content-Length``
  included), as RFC 9110 asks of a GET route; load balancers and monitors probe with it.
- **A loopback gateway answers loopback names only**: bound to loopback, a request whose
  ``Host`` names another host is 403 on every route, as on ``/mcp`` (which checks ``Origin``
  too, in its transport): a web page that rebinds its own name to 127.0.0.1 reads neither the
  metrics, the health answers, nor the dashboard's files (gateway/auth.py, ``OriginGuard``).
- **Admin answers are never stored nor sniffed**: every response under ``/admin`` (the
  dashboard's files, the API's answers and refusals alike) carries ``Cache-Control: no-store``
  and ``X-Content-Type-Options: nosniff``. They hold what only an admin key may read (a new
  key's plaintext, contexts' contents, the audit log), which a browser's or a proxy's cache must
  not keep for the next user of the machine; and an echoed identifier in a JSON refusal is
  never read as HTML.
- **CORS for allowed origins** on the routes a browser MCP client calls (``/mcp``, ``POST
  /mcp/ws-ticket``, the OAuth protected-resource document): a preflight from an origin
  ``OriginGuard`` allows is answered 204 here, and its requests' answers name it
  (gateway/transports/cors.py); other origins get nothing and their requests stay 403.
- **One credential**: a request with more than one ``Authorization`` header is 400
  (``invalid_request``, RFC 6750 3.1) on every route. The field is a singleton (RFC 9110); a
  proxy in front that reads one of two copies could otherwise vouch for a caller the gateway
  takes for another.

The read deadlines for headers and bodies live one layer down, where the socket is
(gateway/transports/http_protocol.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisClusterException, RedisError

from gateway.admin.auth import (
    ADMIN_KEY_REQUIRED,
    ADMIN_SCOPE_KEY,
    AdminPrincipal,
    admin_key_required,
    authenticate,
)
from gateway.auth import AuthError, bearer_token
from gateway.errors import BodyTooLarge, http_error, wire_error
from gateway.mcp.types import encode
from gateway.transports.cors import CORS_METHODS, preflight_headers, with_cors
from shared import metrics

if TYPE_CHECKING:
    from gateway.state import Gateway

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MCP_PATH = "/mcp"
_ADMIN_HEADERS = ((b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"))
TWO_CREDENTIALS = "more than one Authorization header"


class _ChunkedBody:
    """``receive``/``send`` of a request whose length its headers do not say: bytes are counted
    as the app reads them; once past the limit the read raises and the answer closes the connection."""

    __slots__ = ("_receive", "_send", "_left", "_limit", "_cut")

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive = receive
        self._send = send
        self._left = limit
        self._limit = limit
        self._cut = False

    async def receive(self) -> MutableMapping[str, Any]:
        message = await self._receive()
        if message["type"] == "http.request":
            self._left -= len(message.get("body", b""))
            if self._left < 0:
                self._cut = True
                raise BodyTooLarge(self._limit)
        return message

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self._cut and message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await self._send(message)


class HttpEdge:
    """Admits HTTP requests for one gateway replica (built by the app's lifespan)."""

    def __init__(self, gateway: Gateway) -> None:
        self.config = gateway.config
        self.max_body = gateway.config.gateway.max_body_bytes
        self.keyring = gateway.admin_keyring
        self.throttle = gateway.auth.throttle
        self.origin_guard = gateway.origin_guard

    async def admit(self, scope: Scope, receive: Receive, send: Send) -> tuple[Receive, Send] | None:
        """The ``receive``/``send`` the app serves the request with, or None when it was answered here."""
        length = authorization = host = origin = preflight = requested = None
        chunked = twice = False
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
            elif name == b"access-control-request-method":
                preflight = value
            elif name == b"access-control-request-headers":
                requested = value
            elif name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"authorization":
                twice = authorization is not None
                authorization = value
        if _is_admin(scope["path"]):
            send = _admin_headers(send)
        if scope["path"] != MCP_PATH and host is not None:
            why = self.origin_guard.check(None, host.decode("latin-1"))
            if why is not None:
                await _forbidden(scope, send, why)
                return None
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._too_large(scope, send)
            return None
        if origin is not None and scope["path"] in CORS_METHODS and self._cors_allowed(origin, host):
            if scope["method"] == "OPTIONS" and preflight is not None:
                await send({"type": "http.response.start", "status": 204,
                            "headers": preflight_headers(scope["path"], origin, requested)})
                await send({"type": "http.response.body", "body": b""})
                return None
            send = with_cors(send, origin)
        if twice:
            await _two_credentials(scope, send)
            return None
        if admin_key_required(scope["method"], scope["path"]):
            who = await self._admin_key(scope, send, None if authorization is None else authorization.decode("latin-1"))
            if who is None:
                return None
            scope[ADMIN_SCOPE_KEY] = who
        if chunked and length is None:
            body = _ChunkedBody(receive, send, self.max_body)
            return body.receive, body.send
        return receive, send

    def _cors_allowed(self, origin: bytes, host: bytes | None) -> bool:
        return self.origin_guard.check(
            origin.decode("latin-1"), None if host is None else host.decode("latin-1")) is None

    async def _admin_key(self, scope: Scope, send: Send, authorization: str | None) -> AdminPrincipal | None:
        """The admin key the request presents, or None once it is answered: 401 without a valid
        one, 429 while its address or key is refused for failed attempts (gateway/auth_throttle.py)
        unless it is a key no one can guess (``AdminKeyring.lookup_unguessable``)."""
        token = bearer_token(authorization)
        try:
            if token is not None:
                try:
                    self.throttle.check(scope, token)
                except AuthError:
                    served = await self.keyring.lookup_unguessable(token)  # one guesser behind a NAT locks out no one
                    if served is None:
                        raise
                    return served
            who = await authenticate(self.keyring, authorization)
            if who is None and token is not None:
                too_many = await self.throttle.failed(scope, token)
                if too_many is not None:
                    raise too_many
        except AuthError as exc:
            metrics.ADMIN_DENIED.labels(str(exc.status)).inc()
            await _answer(send, exc.status, orjson.dumps({"detail": exc.message}),
                          [(k.encode(), v.encode()) for k, v in exc.headers().items()])
            return None
        except (RedisError, RedisClusterException, OSError) as exc:  # runtime keys live in Redis: 503 + Retry-After while it is away
            http = http_error(exc, self.config)
            await _answer(send, http.status_code, orjson.dumps({"detail": http.detail}),
                          [(k.lower().encode(), v.encode()) for k, v in (http.headers or {}).items()])
            return None
        if who is None:
            await _answer(send, 401, orjson.dumps({"detail": ADMIN_KEY_REQUIRED}), [(b"www-authenticate", b"Bearer")])
        return who

    async def _too_large(self, scope: Scope, send: Send) -> None:
        exc = BodyTooLarge(self.max_body)
        if scope["path"] == MCP_PATH:  # MCP clients read a JSON-RPC error
            body = encode(wire_error(exc, self.config).response(None))
        else:
            body = orjson.dumps({"detail": exc.detail})
        await _answer(send, 413, body)


def _is_admin(path: str) -> bool:
    return path == "/admin" or path.startswith("/admin/")


def _admin_headers(send: Send) -> Send:
    """``send`` with :data:`_ADMIN_HEADERS` added to the response's headers (where the route set
    none of its own)."""

    async def guarded(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            present = {name.lower() for name, _ in headers}
            headers.extend(h for h in _ADMIN_HEADERS if h[0] not in present)
            message = {**message, "headers": headers}
        await send(message)

    return guarded


def head_as_get(scope: Scope, send: Send) -> tuple[Scope, Send] | None:
    """The scope and ``send`` that serve a HEAD request as its path's GET, or None when it is
    no HEAD to serve so. The scope is a copy: the server's own still says HEAD, so it writes no
    body either (uvicorn), and the body is dropped here for a server that would."""
    if scope["method"] != "HEAD" or scope["path"] == MCP_PATH:
        return None

    async def headers_only(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            message = {**message, "body": b""}
        await send(message)

    return {**scope, "method": "GET"}, headers_only


async def _forbidden(scope: Scope, send: Send, why: str) -> None:
    body = {"detail": why} if _is_admin(scope["path"]) else {"error": "forbidden", "error_description": why}
    await _answer(send, 403, orjson.dumps(body))


async def _two_credentials(scope: Scope, send: Send) -> None:
    if admin_key_required(scope["method"], scope["path"]):
        body = orjson.dumps({"detail": TWO_CREDENTIALS})
    else:
        body = orjson.dumps({"error": "invalid_request", "error_description": TWO_CREDENTIALS})
    await _answer(send, 400, body, [(b"www-authenticate", b'Bearer error="invalid_request"')])


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON answer that closes the connection: the request's body, if any, is never read."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or ())]})
    await send({"type": "http.response.body", "body": body})
