"""MCP over WebSocket at ``/mcp/ws`` following the SEP-1288 draft: subprotocol ``mcp``,
one JSON-RPC message per text frame, both directions.

This module moves frames: the handshake guards (subprotocol, Origin/Host, credentials),
the frame size limit, and the socket writes. Every message goes through the same kernel
as HTTP (:mod:`gateway.mcp.kernel`), so a frame gets exactly the checks an HTTP body gets
(frames carry no headers, so the routing-header checks are the one part that does not
apply). A 2025-11-25 ``initialize`` opens a session bound to the connection; its event
stream is pumped onto the socket and the session ends with the connection. Requests run
concurrently so a tool waiting for the client's answer (sampling, elicitation) does not
block the frame that carries that answer; beyond ``ws_concurrent_requests`` of them (a
per-principal limit) a request is answered at once with the limit error. Notifications and
client replies get no frame back, as JSON-RPC asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from fastapi import WebSocket, WebSocketDisconnect
from redis.exceptions import RedisError
from starlette.responses import Response

from gateway.auth import AuthError
from gateway.errors import INVALID_REQUEST, McpError
from gateway.limits import exceeded
from gateway.mcp.kernel import Kernel, Link, Message
from gateway.mcp.types import ErrorResponse, Reply, Request, ServerMessage, encode
from gateway.mcp.types import Response as RpcResponse
from gateway.state import gateway_of

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger(__name__)
SUBPROTOCOL = "mcp"
EVENT_POLL_MS = 5000
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


class _RedactHandshakeCredentials(logging.Filter):
    """At DEBUG, websockets (handed the ``uvicorn.error`` logger by uvicorn) logs every handshake
    header as ``< name: value``; HTTP never logs a credential, so neither may the handshake."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg == "< %s: %s" and isinstance(args, tuple) and len(args) == 2 \
                and str(args[0]).lower() in _SECRET_HEADERS:
            record.args = (args[0], "[redacted]")
        return True


logging.getLogger("uvicorn.error").addFilter(_RedactHandshakeCredentials())


class _Connection:
    def __init__(self, ws: WebSocket, gateway: Gateway, kernel: Kernel, principal: str) -> None:
        self.ws = ws
        self.gateway = gateway
        self.kernel = kernel
        self.principal = principal
        self.session_id: str | None = None
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.pump: asyncio.Task[None] | None = None
        self.max_inflight = gateway.limits.of(principal).ws_concurrent_requests
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
        if self.max_inflight and len(self.tasks) >= self.max_inflight:
            busy = self.kernel.fail(exceeded("ws_concurrent_requests", f"at most {self.max_inflight} requests may "
                                             "run at once on one connection", self.retry_after_s), message.id)
            if busy.message is not None:
                await self.send(busy.message)
            return
        task = asyncio.create_task(self._serve(message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _link(self) -> Link:
        return Link("ws", session_id=self.session_id, emit=self.send)

    async def _serve(self, message: Message) -> None:
        reply = await self.kernel.receive(self.principal, message, self._link())
        if reply.session_id is not None:
            self.session_id = reply.session_id
            self._start_pump()
        if isinstance(message, Request) and reply.message is not None:
            with contextlib.suppress(Exception):
                await self.send(reply.message)

    def _start_pump(self) -> None:
        if self.pump is None and self.session_id is not None:
            self.pump = asyncio.create_task(self._pump(self.session_id))

    async def _pump(self, sid: str) -> None:
        sessions = self.gateway.sessions
        cursor = await sessions.last_event_id(self.principal, sid)
        while True:
            try:
                events = await sessions.read_events(self.principal, sid, cursor, EVENT_POLL_MS)
            except (RedisError, OSError):
                await asyncio.sleep(1.0)
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


async def _refuse(ws: WebSocket, exc: AuthError) -> None:
    """Refuse the handshake as HTTP refuses a request: 401 + ``WWW-Authenticate`` (an OAuth
    client finds the RFC 9728 document from it). A close before accept would answer 403 with
    no challenge; that is the fallback only where the server lacks the denial-response extension."""
    if "websocket.http.response" not in ws.scope.get("extensions", {}):
        await ws.close(code=1008, reason="unauthorized")
        return
    headers = {"www-authenticate": exc.www_authenticate} if exc.www_authenticate else None
    await ws.send_denial_response(Response(encode({"error": "unauthorized", "error_description": exc.message}),
                                           status_code=exc.status, headers=headers, media_type="application/json"))


async def websocket_endpoint(ws: WebSocket) -> None:
    gateway = gateway_of(ws)
    if SUBPROTOCOL not in ws.scope.get("subprotocols", []):
        await ws.close(code=1002, reason="subprotocol 'mcp' required")
        return
    if gateway.origin_guard.check(ws.headers.get("origin"), ws.headers.get("host")) is not None:
        await ws.close(code=1008, reason="origin not allowed")
        return
    try:
        principal = gateway.auth.principal(ws.headers.get("authorization"))
    except AuthError as exc:
        await _refuse(ws, exc)
        return
    await ws.accept(subprotocol=SUBPROTOCOL)
    conn = _Connection(ws, gateway, gateway.kernel, principal)
    limit = gateway.config.gateway.max_body_bytes
    try:
        while True:
            frame = await ws.receive()
            if frame["type"] == "websocket.disconnect":
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
