"""MCP over WebSocket at ``/mcp/ws`` following the SEP-1288 draft: subprotocol ``mcp``,
one JSON-RPC message per text frame, both directions.

Credentials travel in the ``Authorization`` header, or — for clients that cannot set headers
(browsers, the TypeScript SDK's ``WebSocketClientTransport``) — as a subprotocol
``bearer.<token>`` offered next to ``mcp`` (the answer names ``mcp`` only), or as a single-use
ticket from ``POST /mcp/ws-ticket`` in the query string (``/mcp/ws?ticket=...``). A handshake
without valid credentials is refused with HTTP 401, as HTTP refuses a request. A handshake and a
ticket count against the principal's request rate like any request, and a connection holds one of
the principal's ``event_streams`` for its life (gateway/limits.py): beyond either, 429 + Retry-After.

This module moves frames: the handshake guards (subprotocol, Origin/Host, credentials),
the frame size limit, and the socket writes. Every message goes through the same kernel
as HTTP (:mod:`gateway.mcp.kernel`), so a frame gets exactly the checks an HTTP body gets
(frames carry no headers, so the routing-header checks are the one part that does not
apply). A 2025-11-25 ``initialize`` opens a session bound to the connection; its event
stream is pumped onto the socket and the session ends with the connection. A connection has
one session: a second ``initialize`` is refused (-32600). Requests run
concurrently so a tool waiting for the client's answer (sampling, elicitation) does not
block the frame that carries that answer; beyond ``ws_concurrent_requests`` of them (a
per-principal limit) a request is answered at once with the limit error. Notifications and
client replies get no frame back, as JSON-RPC asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request as HttpRequest
from fastapi import WebSocket, WebSocketDisconnect
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response

from gateway.auth import AuthError
from gateway.errors import INVALID_REQUEST, LimitExceeded, McpError, Unavailable, wire_error
from gateway.limits import exceeded
from gateway.mcp.kernel import Kernel, Link, Message
from gateway.mcp.types import ErrorResponse, Reply, Request, ServerMessage, encode
from gateway.mcp.types import Response as RpcResponse
from gateway.state import gateway_of
from gateway.transports.edge import TWO_CREDENTIALS
from shared.aio import pause, stop_if_cancelled

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger(__name__)
SUBPROTOCOL = "mcp"
BEARER_SUBPROTOCOL = "bearer."
TICKET_PARAM = "ticket"
EVENT_POLL_MS = 5000
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "sec-websocket-protocol"})


class _RedactHandshakeCredentials(logging.Filter):
    """uvicorn logs each handshake with its path and query at INFO, and at DEBUG websockets (handed
    the ``uvicorn.error`` logger) logs the request line and every header (``< name: value``).
    HTTP never logs a credential, so neither may the handshake: not a header, not a bearer
    subprotocol, not a ticket in the query."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or not isinstance(record.msg, str):
            return True
        if record.msg == "< %s: %s" and len(args) == 2 and str(args[0]).lower() in _SECRET_HEADERS:
            record.args = (args[0], "[redacted]")
        elif (record.msg == "< %s %s %s" or '"WebSocket %s"' in record.msg) and len(args) >= 2 \
                and "?" in str(args[1]):  # the path is the second argument of both
            record.args = (args[0], str(args[1]).split("?", 1)[0] + "?[redacted]", *args[2:])
        return True


logging.getLogger("uvicorn.error").addFilter(_RedactHandshakeCredentials())


class _Connection:
    def __init__(self, ws: WebSocket, gateway: Gateway, kernel: Kernel, principal: str) -> None:
        self.ws = ws
        self.gateway = gateway
        self.kernel = kernel
        self.principal = principal
        self.session_id: str | None = None
        self.opening = False  # an initialize is being served or has opened the connection's session
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.pump: asyncio.Task[None] | None = None
        self.retry_after_s = gateway.config.limits.cap_retry_after_s

    async def send(self, msg: ServerMessage | RpcResponse | ErrorResponse) -> None:
        await self.send_bytes(encode(msg))

    async def send_bytes(self, data: bytes) -> None:
        async with self.lock:
            await self.ws.send_text(data.decode())

    async def on_frame(self, text: str) -> None:
        message = self.kernel.decode(text)
        if isinstance(message, Reply):
            if message.message is not None:
                await self.send(message.message)
            return
        if not isinstance(message, Request):
            await self._serve(message)  # notifications and client replies are quick: in frame order
            return
        opening = message.method == "initialize" and not self.kernel.is_stateless(message, self._link())
        if opening and self.opening:
            # One session per socket: the socket pumps that session's stream alone, so notes of another would reach no one.
            again = self.kernel.fail(McpError(INVALID_REQUEST, "This connection has opened its session already "
                                              "(one initialize per connection)"), message.id)
            if again.message is not None:
                await self.send(again.message)
            return
        max_inflight = self.gateway.limits.of(self.principal).ws_concurrent_requests  # a change holds on open sockets
        if max_inflight and len(self.tasks) >= max_inflight:
            busy = self.kernel.fail(exceeded("ws_concurrent_requests", f"at most {max_inflight} requests may "
                                             "run at once on one connection", self.retry_after_s), message.id)
            if busy.message is not None:
                await self.send(busy.message)
            return
        self.opening = self.opening or opening
        task = asyncio.create_task(self._serve(message, opening))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _link(self) -> Link:
        return Link("ws", session_id=self.session_id, emit=self.send)

    async def _serve(self, message: Message, opening: bool = False) -> None:
        reply = await self.kernel.receive(self.principal, message, self._link())
        if reply.session_id is not None:
            self.session_id = reply.session_id
            self._start_pump()
        elif opening:
            self.opening = False  # refused (a limit, an outage): the client may initialize again
        if isinstance(message, Request) and reply.message is not None:
            with contextlib.suppress(Exception):
                await self.send(reply.message)

    def _start_pump(self) -> None:
        if self.pump is None and self.session_id is not None:
            self.pump = asyncio.create_task(self._pump(self.session_id))

    async def _pump(self, sid: str) -> None:
        sessions = self.gateway.sessions
        cursor = await sessions.last_event_id(self.principal, sid)
        async with self.gateway.session_stream(self.principal, sid):
            while True:
                # a close that cancels the pump while it opens the stream can reach it as a
                # TimeoutError caught on the way (shared/aio.py): it would pump for ever, and the
                # connection would keep its session and its slot
                stop_if_cancelled()
                try:
                    events = await sessions.read_events(self.principal, sid, cursor, EVENT_POLL_MS)
                except (RedisError, OSError):
                    await pause(1.0)
                    continue
                for eid, data in events:
                    await self.send_bytes(data)
                    cursor = eid

    async def close(self) -> None:
        for t in [*self.tasks, *([self.pump] if self.pump else [])]:
            t.cancel()
        for t in [*self.tasks, *([self.pump] if self.pump else [])]:
            with contextlib.suppress(BaseException):
                await t
        if self.session_id is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.gateway.sessions.delete(self.principal, self.session_id)


async def _refuse(ws: WebSocket, status: int, body: dict[str, str], headers: dict[str, str] | None = None) -> None:
    """Refuse the handshake as HTTP refuses a request: 401 + ``WWW-Authenticate`` (an OAuth
    client finds the RFC 9728 document from it), 503 + ``Retry-After``. A close before accept
    would answer 403 with no header; that is the fallback only where the server lacks the
    denial-response extension."""
    if "websocket.http.response" not in ws.scope.get("extensions", {}):
        await ws.close(code=1013 if status in (429, 503) else 1008, reason=body["error"])
        return
    await ws.send_denial_response(Response(encode(body), status_code=status, headers=headers,
                                           media_type="application/json"))


def _retry_later(exc: Exception, gateway: Gateway) -> tuple[int, dict[str, str], dict[str, str] | None]:
    """Status, body and headers refusing a handshake or a ticket for now: 429 over a limit of the
    principal's, 503 when Redis cannot be reached or the replica's streams are full; with the
    Retry-After to wait."""
    wire = wire_error(exc, gateway.config, crashed_status=500)
    retry = {"retry-after": str(wire.retry_after_s)} if wire.retry_after_s is not None else None
    error = "limit_exceeded" if isinstance(exc, LimitExceeded) else "unavailable"
    return wire.http_status, {"error": error, "error_description": wire.message}, retry


async def _principal(gateway: Gateway, ws: WebSocket) -> tuple[str, float | None]:
    """Who opens the connection, and until when (the expiry of its token; None: for good): the
    ``Authorization`` header, else a ``bearer.<token>`` subprotocol, else a ticket; raises
    :class:`AuthError` (401) when none is valid."""
    if len(ws.headers.getlist("authorization")) > 1:  # as the HTTP edge (gateway/transports/edge.py)
        raise AuthError(400, TWO_CREDENTIALS, 'Bearer error="invalid_request"')
    authorization = ws.headers.get("authorization")
    if authorization is None and not gateway.auth.open:
        bearer = [p for p in ws.scope.get("subprotocols", ()) if p.startswith(BEARER_SUBPROTOCOL)]
        ticket = ws.query_params.get(TICKET_PARAM)
        if bearer:
            authorization = "Bearer " + bearer[0][len(BEARER_SUBPROTOCOL):]
        elif ticket is not None:
            return await _redeem(gateway, ws, ticket)
    principal = await gateway.auth.authenticate(authorization, ws.scope)
    return principal, gateway.auth.expires_at(authorization)


async def _redeem(gateway: Gateway, ws: WebSocket, ticket: str) -> tuple[str, float | None]:
    """The principal of a ticket, which counts as a credential for the throttle. A ticket is
    served from a refused address too: it holds 256 random bits no guessing finds, and is
    issued only to a caller that authenticated (gateway/auth.py, ``Authenticator._unguessable``);
    a ticket that does not redeem there is 429, as a wrong guess, and is not counted."""
    try:
        gateway.auth.throttle.check(ws.scope, ticket)
    except AuthError:
        redeemed = await gateway.ws_tickets.redeem(ticket)
        if redeemed is None:
            raise
        return redeemed
    redeemed = await gateway.ws_tickets.redeem(ticket)
    if redeemed is not None:
        return redeemed
    refused = AuthError(401, "invalid or expired ticket", gateway.auth.challenge + ', error="invalid_token"')
    raise await gateway.auth.throttle.failed(ws.scope, ticket) or refused


async def websocket_endpoint(ws: WebSocket) -> None:
    gateway = gateway_of(ws)
    if SUBPROTOCOL not in ws.scope.get("subprotocols", []):
        await ws.close(code=1002, reason="subprotocol 'mcp' required")
        return
    if gateway.origin_guard.check(ws.headers.get("origin"), ws.headers.get("host")) is not None:
        await ws.close(code=1008, reason="origin not allowed")
        return
    async with contextlib.AsyncExitStack() as held:
        try:
            principal, expires_at = await _principal(gateway, ws)
            await gateway.limits.admit_request(principal)  # a handshake is a request, as on HTTP
            await held.enter_async_context(gateway.limits.stream_slot(principal))  # for the connection's life
        except AuthError as exc:
            await _refuse(ws, exc.status, {"error": exc.error, "error_description": exc.message}, exc.headers() or None)
            return
        except (LimitExceeded, Unavailable, RedisError, OSError) as exc:  # Unavailable: the replica's streams are full
            await _refuse(ws, *_retry_later(exc, gateway))
            return
        await ws.accept(subprotocol=SUBPROTOCOL)
        await _serve(ws, _Connection(ws, gateway, gateway.kernel, principal), expires_at)


async def _serve(ws: WebSocket, conn: _Connection, expires_at: float | None) -> None:
    """Hand every text frame to the kernel until the client goes, or until ``expires_at`` (epoch
    s), when the token the connection was opened with expires: HTTP checks the token of every
    request, a connection only its handshake's. Then end what the connection started."""
    limit = conn.gateway.config.gateway.max_body_bytes
    try:
        while True:
            frame = await (ws.receive() if expires_at is None else _receive_before(ws, conn, expires_at))
            if frame is None or frame["type"] == "websocket.disconnect":
                break
            text = frame.get("text")
            if text is None:
                binary = conn.kernel.fail(McpError(INVALID_REQUEST, "Binary frames are not MCP messages"))
                if binary.message is not None:
                    await conn.send(binary.message)
                continue
            if len(text) > limit:
                await ws.close(code=1009, reason="message too large")
                break
            await conn.on_frame(text)
    except WebSocketDisconnect:
        pass
    finally:
        await conn.close()


async def _receive_before(ws: WebSocket, conn: _Connection, expires_at: float) -> Any:
    """The next frame, or None once ``expires_at`` has passed (the connection is closed, 1008)."""
    try:
        return await asyncio.wait_for(ws.receive(), expires_at - time.time())
    except TimeoutError:
        async with conn.lock:  # not in the middle of a frame another task sends
            with contextlib.suppress(Exception):
                await ws.close(code=1008, reason="token expired")
        return None


async def ws_ticket_endpoint(request: HttpRequest) -> Response:
    """``POST /mcp/ws-ticket``: a single-use ticket for one WebSocket handshake of the caller's
    principal, for clients that can authenticate an HTTP request but not a WebSocket one."""
    gateway = gateway_of(request)
    why = gateway.origin_guard.check(request.headers.get("origin"), request.headers.get("host"))
    if why is not None:
        return JSONResponse({"error": "forbidden", "error_description": why}, status_code=403)
    try:
        principal = await gateway.auth.authenticate(request.headers.get("authorization"), request.scope)
    except AuthError as exc:
        return JSONResponse({"error": exc.error, "error_description": exc.message}, status_code=exc.status,
                            headers=exc.headers() or None)
    try:
        await gateway.limits.admit_request(principal)  # a ticket is a request, as on /mcp
    except LimitExceeded as exc:
        status, body, retry = _retry_later(exc, gateway)
        return JSONResponse(body, status_code=status, headers=retry)
    ticket = await gateway.ws_tickets.issue(principal, gateway.auth.expires_at(request.headers.get("authorization")))
    return JSONResponse({"ticket": ticket, "expires_in_s": gateway.ws_tickets.ttl_s},
                        headers={"cache-control": "no-store"})
