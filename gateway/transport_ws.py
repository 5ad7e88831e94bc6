"""MCP over WebSocket at ``/mcp/ws`` following the SEP-1288 draft: subprotocol ``mcp``,
one JSON-RPC message per text frame, both directions.

The same guards (Origin/Host, credentials), the same dispatcher and the same Redis
sessions as HTTP: ``initialize`` opens a legacy session bound to the connection (its
event stream is pumped onto the socket); a message carrying
``_meta.io.modelcontextprotocol/protocolVersion`` is served statelessly. Requests run
concurrently so a tool waiting for the client's answer (sampling, elicitation) does not
block the frame that carries that answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
from fastapi import WebSocket, WebSocketDisconnect
from redis.exceptions import RedisError
from starlette.responses import Response

from gateway.auth import AuthError
from gateway.dispatcher import (
    HANDSHAKE_VERSIONS,
    MODERN_VERSIONS,
    PROTOCOL_VERSION_META_KEY,
    Call,
    error_response,
)
from gateway.errors import INVALID_REQUEST, PARSE_ERROR, SERVICE_UNAVAILABLE
from gateway.sessions import Session, SessionLimit, SessionNotFound

log = logging.getLogger(__name__)
SUBPROTOCOL = "mcp"
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
    def __init__(self, ws: WebSocket, state: Any, principal: str) -> None:
        self.ws = ws
        self.state = state
        self.principal = principal
        self.session: Session | None = None
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.pump: asyncio.Task | None = None

    async def send(self, msg: dict[str, Any]) -> None:
        async with self.lock:
            await self.ws.send_text(orjson.dumps(msg).decode())

    async def on_frame(self, text: str) -> None:
        try:
            msg = orjson.loads(text)
        except orjson.JSONDecodeError:
            await self.send(error_response(None, PARSE_ERROR, "Parse error"))
            return
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
            await self.send(error_response(None, INVALID_REQUEST, "Frame must hold one JSON-RPC 2.0 message"))
            return
        method, params, rid = msg.get("method"), msg.get("params"), msg.get("id")
        if method is None:
            if self.session is not None and rid is not None and ("result" in msg or "error" in msg):
                await self.state.sessions.post_response(self.principal, self.session.id, str(rid), msg)
            return
        if not isinstance(method, str) or (params is not None and not isinstance(params, dict)) or \
                ("id" in msg and (rid is None or isinstance(rid, bool) or not isinstance(rid, (str, int)))):
            await self.send(error_response(rid, INVALID_REQUEST, "Invalid JSON-RPC request"))
            return
        task = asyncio.create_task(self._serve(msg, method, params or {}))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, msg: dict[str, Any], method: str, params: dict[str, Any]) -> None:
        rid = msg.get("id")
        try:
            response = await self._dispatch(msg, method, params)
        except (RedisError, OSError):
            response = error_response(rid, SERVICE_UNAVAILABLE, "Service unavailable: store unreachable",
                                      {"retryAfterS": self.state.config.redis.retry_after_s})
        if response is not None and "id" in msg:
            with contextlib.suppress(Exception):
                await self.send(response)

    async def _dispatch(self, msg: dict[str, Any], method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        d = self.state.dispatcher
        rid = msg.get("id")
        raw_meta = params.get("_meta")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        version = meta.get(PROTOCOL_VERSION_META_KEY)
        if version is not None:
            if version not in MODERN_VERSIONS:
                return error_response(rid, -32022, "Unsupported protocol version",
                                      {"supported": list(MODERN_VERSIONS), "requested": version})
            call = Call(principal=self.principal, request_id=rid, protocol_version=version, state=self.state,
                        meta=meta, emit=self.send)
            if "id" not in msg:
                await d.notification(call, method, params)
                return None
            return await d.handle(call, method, params, transport="ws")
        if method == "initialize" and "id" in msg:
            call = Call(principal=self.principal, request_id=rid, protocol_version="2025-11-25", state=self.state)
            response = await d.handle(call, method, params, transport="ws")
            if "result" in response:
                caps = params.get("capabilities") if isinstance(params.get("capabilities"), dict) else {}
                try:
                    self.session = await self.state.sessions.create(
                        self.principal, response["result"]["protocolVersion"], caps)
                except SessionLimit:
                    return error_response(rid, SERVICE_UNAVAILABLE, "Too many sessions for this principal")
                self._start_pump()
            return response
        if self.session is None:
            return error_response(rid, INVALID_REQUEST, "Send initialize first (or a 2026-07-28 _meta envelope)")
        try:
            session = await self.state.sessions.get(self.principal, self.session.id)
        except SessionNotFound:
            return error_response(rid, INVALID_REQUEST, "Session not found")
        call = Call(principal=self.principal, request_id=rid, protocol_version=session.protocol_version,
                    state=self.state, meta=meta, session=session, emit=self.send)
        if "id" not in msg:
            await d.notification(call, method, params)
            return None
        key = self.state.track(self.principal, session.id, rid, call) if method == "tools/call" else None
        try:
            return await d.handle(call, method, params, transport="ws")
        finally:
            if key is not None:
                self.state.untrack(key)

    def _start_pump(self) -> None:
        if self.pump is None and self.session is not None:
            self.pump = asyncio.create_task(self._pump(self.session.id))

    async def _pump(self, sid: str) -> None:
        sessions = self.state.sessions
        cursor = await sessions.last_event_id(self.principal, sid)
        while True:
            try:
                events = await sessions.read_events(self.principal, sid, cursor, 5000)
            except (RedisError, OSError):
                await asyncio.sleep(1.0)
                continue
            for eid, data in events:
                async with self.lock:
                    await self.ws.send_text(data.decode())
                cursor = eid

    async def close(self) -> None:
        for t in [*self.tasks, *([self.pump] if self.pump else [])]:
            t.cancel()
        for t in [*self.tasks, *([self.pump] if self.pump else [])]:
            with contextlib.suppress(BaseException):
                await t
        if self.session is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.state.sessions.delete(self.principal, self.session.id)


async def _refuse(ws: WebSocket, exc: AuthError) -> None:
    """Refuse the handshake as HTTP refuses a request: 401 + ``WWW-Authenticate`` (an OAuth
    client finds the RFC 9728 document from it). A close before accept would answer 403 with
    no challenge; that is the fallback only where the server lacks the denial-response extension."""
    if "websocket.http.response" not in ws.scope.get("extensions", {}):
        await ws.close(code=1008, reason="unauthorized")
        return
    headers = {"www-authenticate": exc.www_authenticate} if exc.www_authenticate else None
    await ws.send_denial_response(Response(orjson.dumps({"error": "unauthorized", "error_description": exc.message}),
                                           status_code=exc.status, headers=headers, media_type="application/json"))


async def websocket_endpoint(ws: WebSocket) -> None:
    state = ws.app.state.gateway
    if SUBPROTOCOL not in ws.scope.get("subprotocols", []):
        await ws.close(code=1002, reason="subprotocol 'mcp' required")
        return
    if state.origin_guard.check(ws.headers.get("origin"), ws.headers.get("host")) is not None:
        await ws.close(code=1008, reason="origin not allowed")
        return
    try:
        principal = state.auth.principal(ws.headers.get("authorization"))
    except AuthError as exc:
        await _refuse(ws, exc)
        return
    await ws.accept(subprotocol=SUBPROTOCOL)
    conn = _Connection(ws, state, principal)
    limit = state.config.gateway.max_body_bytes
    try:
        while True:
            frame = await ws.receive()
            if frame["type"] == "websocket.disconnect":
                break
            text = frame.get("text")
            if text is None:
                await conn.send(error_response(None, INVALID_REQUEST, "Binary frames are not MCP messages"))
                continue
            if len(text) > limit:
                await ws.close(code=1009, reason="message too large")
                break
            await conn.on_frame(text)
    except WebSocketDisconnect:
        pass
    finally:
        await conn.close()


__all__ = ["websocket_endpoint", "HANDSHAKE_VERSIONS"]
