"""MCP Streamable HTTP at ``/mcp`` as a raw ASGI app (no framework machinery on the hot path).

This module moves bytes: guards that belong to HTTP run before any parsing (the edge's body
limit 413 first, then Origin/Host 403, credentials 401, ``Accept`` 406); the body goes to the kernel
(:mod:`gateway.mcp.kernel`: revisions, envelope, sessions) and its
:class:`~gateway.mcp.types.Reply` goes back as JSON — or as an SSE stream once the handler
emits a notification or a server->client request before its answer. GET opens a legacy
session's standalone SSE stream (``Last-Event-ID`` replay), DELETE ends the session; both count
against the principal's request rate as a POST does (the kernel admits those), and a GET stream
holds one of the principal's ``event_streams`` while it is open (gateway/limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from gateway.auth import AuthError
from gateway.errors import INVALID_REQUEST, McpError
from gateway.mcp.kernel import Link
from gateway.mcp.sessions import SessionNotFound
from gateway.mcp.types import (
    HANDSHAKE_VERSIONS,
    ErrorResponse,
    Reply,
    Request,
    Response,
    ServerMessage,
    encode,
)
from gateway.transports.http_protocol import DISCONNECT, Disconnect

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_ROUTING = frozenset({"mcp-protocol-version", "mcp-method", "mcp-name"})
_EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache, no-transform"),
                (b"x-accel-buffering", b"no")]
STREAM_POLL_MS = 5000
KEEPALIVE_EVERY = 3  # polls


def _is_event_id(value: str) -> bool:
    """Whether ``value`` can be an event id of ours (a Redis Stream entry id: two 64-bit numbers);
    anything else in ``Last-Event-ID`` is ignored as if absent, never handed to Redis."""
    return _EVENT_ID.fullmatch(value) is not None and all(int(part) < 2**64 for part in value.split("-"))


class _Sent:
    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


async def _reply(send: Send, sent: _Sent, status: int, body: bytes = b"",
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    h = [_JSON] if body else []
    h.append((b"content-length", str(len(body)).encode()))
    if headers:
        h.extend(headers)
    sent.started = True
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body})


async def _write(send: Send, sent: _Sent, reply: Reply) -> None:
    headers: list[tuple[bytes, bytes]] = []
    if reply.retry_after_s is not None:
        headers.append((b"retry-after", str(reply.retry_after_s).encode()))
    if reply.session_id is not None:
        headers.append((b"mcp-session-id", reply.session_id.encode()))
    body = encode(reply.message) if reply.message is not None else b""
    await _reply(send, sent, reply.http_status, body, headers)


def _sse(msg: ServerMessage | Response | ErrorResponse) -> bytes:
    return b"event: message\ndata: " + encode(msg) + b"\n\n"


class _LazySse:
    """Response stream that commits to ``text/event-stream`` on the first emitted message."""

    __slots__ = ("send", "sent", "lock")

    def __init__(self, send: Send, sent: _Sent) -> None:
        self.send = send
        self.sent = sent
        self.lock: asyncio.Lock | None = None

    async def emit(self, msg: ServerMessage) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:  # concurrent emitters (several pending client requests) keep frames whole
            if not self.sent.started:
                self.sent.started = True
                await self.send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await self.send({"type": "http.response.body", "body": _sse(msg), "more_body": True})

    async def finish(self, msg: Response | ErrorResponse | None) -> None:
        """End the stream with the answer (None: a cancelled request, which gets none)."""
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            await self.send({"type": "http.response.body", "body": b"" if msg is None else _sse(msg),
                             "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(serving: Coroutine[Any, Any, Reply], receive: Receive, scope: Scope) -> Reply | None:
    """``serving``'s reply, or None once the client has gone (``serving`` is then cancelled).
    Under the gateway's own HTTP protocol the connection says when it goes (``Disconnect``) and
    ``serving`` runs in this task; elsewhere (another ASGI server) a second task reads
    ``receive()`` for ``http.disconnect``."""
    watch = scope.get(DISCONNECT)
    task = asyncio.current_task()
    if not isinstance(watch, Disconnect) or task is None:
        return await _until_disconnect_read(serving, receive)
    if watch.gone:
        serving.close()
        return None
    stopped = False

    def lost() -> None:
        nonlocal stopped
        stopped = True
        task.cancel()

    watch.add(lost)
    try:
        reply = await serving
    except asyncio.CancelledError:
        if not stopped:  # the server's own cancellation (shutdown): not ours to end
            raise
        task.uncancel()
        return None
    finally:
        watch.discard(lost)
    if stopped:  # gone as it answered: nobody reads the reply
        task.uncancel()
        return None
    return reply


async def _until_disconnect_read(serving: Coroutine[Any, Any, Reply], receive: Receive) -> Reply | None:
    handler = asyncio.ensure_future(serving)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    done, _ = await asyncio.wait({handler, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if handler in done:
        return handler.result()
    handler.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await handler
    return None


_ACCEPTS: dict[str, tuple[bool, bool]] = {}


def _accepts(accept: str) -> tuple[bool, bool]:
    """(json, sse) acceptable per the Accept header; a missing header accepts both."""
    found = _ACCEPTS.get(accept)
    if found is not None:  # clients send the same few values over and over
        return found
    if not accept:
        return True, True
    a = accept.lower()
    wild = "*/*" in a
    found = (wild or "application/json" in a or "application/*" in a), (wild or "text/event-stream" in a)
    if len(_ACCEPTS) >= 256:
        _ACCEPTS.clear()
    _ACCEPTS[accept] = found
    return found


def _duplicated_routing_header(raw: list[tuple[bytes, bytes]]) -> str | None:
    """The last routing header (``MCP-Protocol-Version``, ``Mcp-Method``, ``Mcp-Name``) sent twice."""
    seen: set[str] = set()
    duplicated = None
    for k, _ in raw:
        name = k.decode("latin-1")
        if name in seen and name in _ROUTING:
            duplicated = name
        seen.add(name)
    return duplicated


class _ClientGone(Exception):
    """The client disconnected (or its body deadline cut it off) before its body arrived."""


class McpHttpTransport:
    """ASGI app for ``/mcp``; one instance per gateway replica. The body limit is the edge's
    (gateway/transports/edge.py), which runs first."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.kernel = gateway.kernel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = _Sent()
        try:
            await self._serve(scope, receive, send, sent)
        except asyncio.CancelledError:
            raise
        except _ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - handed to the one error map
            if not sent.started:
                await _write(send, sent, self.kernel.fail(exc))

    async def _serve(self, scope: Scope, receive: Receive, send: Send, sent: _Sent) -> None:
        raw = scope["headers"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        why = self.gateway.origin_guard.check(headers.get("origin"), headers.get("host"))
        if why is not None:
            await _reply(send, sent, 403, orjson.dumps({"error": "forbidden", "error_description": why}))
            return
        try:
            principal = await self.gateway.auth.authenticate(headers.get("authorization"), scope)
        except AuthError as exc:
            extra = [(k.encode(), v.encode()) for k, v in exc.headers().items()]
            await _reply(send, sent, exc.status, orjson.dumps({"error": exc.error,
                                                               "error_description": exc.message}), extra)
            return
        method = scope["method"]
        if method == "POST":
            duplicated = _duplicated_routing_header(raw) if len(headers) != len(raw) else None
            await self._post(scope, receive, send, sent, headers, principal, duplicated)
        elif method in ("GET", "DELETE"):
            await self._get_or_delete(method, receive, send, sent, headers, principal)
        else:
            await _reply(send, sent, 405, b"", [(b"allow", b"GET, POST, DELETE")])

    @staticmethod
    async def _read_body(receive: Receive) -> bytes:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        if not msg.get("more_body", False):
            return msg.get("body", b"")  # the usual case: the whole body in one message
        chunks = [msg.get("body", b"")]
        while msg.get("more_body", False):
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone
            chunks.append(msg.get("body", b""))
        return b"".join(chunks)

    # ------------------------------------------------------------------ POST
    async def _post(self, scope: Scope, receive: Receive, send: Send, sent: _Sent, headers: dict[str, str],
                    principal: str, duplicated: str | None) -> None:
        body = await self._read_body(receive)
        has_json, has_sse = _accepts(headers.get("accept", ""))
        if not has_json:
            await _reply(send, sent, 406, orjson.dumps({"error": "Accept must include application/json"}))
            return
        message = self.kernel.decode(body)
        if isinstance(message, Reply):
            await _write(send, sent, message)
            return
        stream = _LazySse(send, sent) if has_sse else None
        link = Link("http", headers, headers.get("mcp-session-id"), stream.emit if stream is not None else None,
                    duplicated)
        listen = isinstance(message, Request) and message.method == "subscriptions/listen" \
            and self.kernel.is_stateless(message, link)
        if listen and not has_sse:
            await _reply(send, sent, 406, orjson.dumps({"error": "subscriptions/listen needs Accept: text/event-stream"}))
            return
        if listen:
            link.expires_at = self.gateway.auth.expires_at(headers.get("authorization"))
        if listen or self._ends_with_its_client(message, link):
            reply = await _until_disconnect(self.kernel.receive(principal, message, link), receive, scope)
            if reply is None:
                return
        else:
            reply = await self.kernel.receive(principal, message, link)
        if sent.started and stream is not None:
            await stream.finish(reply.message)
        else:
            await _write(send, sent, reply)

    def _ends_with_its_client(self, message: object, link: Link) -> bool:
        """Whether the client closing the connection cancels the request: on 2026-07-28 that is
        how a client cancels (the spec's MUST), and a ``tools/call`` may hold a worker for
        hundreds of tokens nobody reads. 2025-11-25 says a disconnect is no cancellation."""
        return isinstance(message, Request) and message.method == "tools/call" \
            and self.kernel.is_stateless(message, link)

    # ------------------------------------------------------------------ GET stream and DELETE (legacy)
    async def _get_or_delete(self, method: str, receive: Receive, send: Send, sent: _Sent, headers: dict[str, str],
                             principal: str) -> None:
        await self.gateway.limits.admit_request(principal)  # counted like a POST; over the rate: 429
        sid = headers.get("mcp-session-id")
        if sid is None:
            if headers.get("mcp-protocol-version") in HANDSHAKE_VERSIONS:
                await _write(send, sent, self.kernel.fail(
                    McpError(INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required")))
            else:  # the stateless revision has no GET stream and no session to end
                await _reply(send, sent, 405, b"", [(b"allow", b"POST")])
            return
        if method == "DELETE":
            try:
                await self.kernel.end_session(principal, sid)
            except SessionNotFound as exc:
                await _write(send, sent, self.kernel.fail(exc))
                return
            await _reply(send, sent, 200)
            return
        if not _accepts(headers.get("accept", ""))[1]:
            await _reply(send, sent, 406, orjson.dumps({"error": "Accept must include text/event-stream"}))
            return
        try:
            await self.kernel.resolve(principal, sid)
        except SessionNotFound as exc:
            await _write(send, sent, self.kernel.fail(exc))
            return
        async with self.gateway.limits.stream_slot(principal):  # over the principal's cap: 429
            await self._stream(receive, send, sent, principal, sid, headers.get("last-event-id"),
                               self.gateway.auth.expires_at(headers.get("authorization")))

    async def _stream(self, receive: Receive, send: Send, sent: _Sent, principal: str, sid: str,
                      last: str | None, expires_at: float | None) -> None:
        """The session's event stream, until the client goes, the session ends or ``expires_at``
        (epoch s): the token the stream was opened with expires, and with it the stream (every
        request checks its token; a stream only when it opens). The client reconnects with
        ``Last-Event-ID`` and misses nothing."""
        sessions = self.gateway.sessions
        cursor = last if last and _is_event_id(last) else await sessions.last_event_id(principal, sid)
        sent.started = True
        async with self.gateway.session_stream(principal, sid):
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await send({"type": "http.response.body", "body": f"id: {cursor}\ndata: \n\n".encode(), "more_body": True})
            pump = asyncio.ensure_future(self._pump(send, principal, sid, cursor))
            gone = asyncio.ensure_future(_wait_disconnect(receive))
            ends = [pump, gone] if expires_at is None else [pump, gone, asyncio.ensure_future(
                asyncio.sleep(max(0.0, expires_at - time.time())))]
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        for t in ends:
            t.cancel()
        for t in ends:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send, principal: str, sid: str, cursor: str) -> None:
        """Copy the session's event log onto the stream until the session ends or Redis is lost
        (the client reconnects with ``Last-Event-ID`` and misses nothing)."""
        sessions = self.gateway.sessions
        idle = 0
        while not self.gateway.shutting_down.is_set():
            try:
                events = await sessions.read_events(principal, sid, cursor, STREAM_POLL_MS)
                if not events:
                    await sessions.get(principal, sid)  # ends the stream once the session is gone
            except (SessionNotFound, RedisError, OSError):  # the client reconnects; the log keeps the events
                return
            for eid, data in events:
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"id: " + eid.encode() + b"\nevent: message\ndata: " + data + b"\n\n"})
                cursor = eid
            idle = 0 if events else idle + 1
            if idle >= KEEPALIVE_EVERY:
                idle = 0
                await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
