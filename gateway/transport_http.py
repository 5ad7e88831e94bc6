"""MCP Streamable HTTP at ``/mcp`` as a raw ASGI app (no framework machinery on the hot path).

The revision is chosen per request: a body whose ``params._meta`` names a protocol
version, or an ``MCP-Protocol-Version`` header naming 2026-07-28, is served statelessly;
everything else is the 2025-11-25 session protocol (``initialize`` + ``Mcp-Session-Id``).
Guards run before any parsing: Origin/Host (403), credentials (401), body size (413).
A request's response is JSON unless the handler emits a notification or a
server->client request first; then the response switches to an SSE stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway.auth import AuthError
from gateway.dispatcher import (
    CLIENT_CAPABILITIES_META_KEY,
    HANDSHAKE_VERSIONS,
    MODERN_VERSIONS,
    PROTOCOL_VERSION_META_KEY,
    Call,
    Dispatcher,
    error_response,
)
from gateway.errors import (
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    SERVICE_UNAVAILABLE,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from gateway.sessions import SessionLimit, SessionNotFound

log = logging.getLogger(__name__)

MODERN_STATUS = {PARSE_ERROR: 400, INVALID_REQUEST: 400, INVALID_PARAMS: 400, HEADER_MISMATCH: 400,
                 -32021: 400, UNSUPPORTED_PROTOCOL_VERSION: 400, METHOD_NOT_FOUND: 404}
NAME_BEARING = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
                "tasks/get": "taskId", "tasks/update": "taskId", "tasks/cancel": "taskId"}
_ROUTING = frozenset({"mcp-protocol-version", "mcp-method", "mcp-name"})
_EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache, no-transform"),
                (b"x-accel-buffering", b"no")]
STREAM_POLL_MS = 5000
KEEPALIVE_EVERY = 3  # polls


class _Sent:
    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


async def _reply(send: Any, sent: _Sent, status: int, body: bytes = b"",
                 headers: list[tuple[bytes, bytes]] | None = None, json: bool = True) -> None:
    h = [_JSON] if json and body else []
    h.append((b"content-length", str(len(body)).encode()))
    if headers:
        h.extend(headers)
    sent.started = True
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body})


async def _rpc_error(send: Any, sent: _Sent, status: int, rid: Any, code: int, message: str, data: Any = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _reply(send, sent, status, orjson.dumps(error_response(rid, code, message, data)), headers)


def _sse(msg: dict[str, Any], event_id: str | None = None) -> bytes:
    head = b"id: " + event_id.encode() + b"\n" if event_id else b""
    return head + b"event: message\ndata: " + orjson.dumps(msg) + b"\n\n"


class _LazySse:
    """Response stream that commits to ``text/event-stream`` on the first emitted message."""

    __slots__ = ("send", "sent", "headers", "lock")

    def __init__(self, send: Any, sent: _Sent, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.sent = sent
        self.headers = headers
        self.lock: asyncio.Lock | None = None

    async def emit(self, msg: dict[str, Any]) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:  # concurrent emitters (several pending client requests) keep frames whole
            if not self.sent.started:
                self.sent.started = True
                await self.send({"type": "http.response.start", "status": 200,
                                 "headers": _SSE_HEADERS + self.headers})
            await self.send({"type": "http.response.body", "body": _sse(msg), "more_body": True})

    async def finish(self, msg: dict[str, Any]) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            await self.send({"type": "http.response.body", "body": _sse(msg), "more_body": False})


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


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


class McpHttpTransport:
    """ASGI app for ``/mcp``; one instance per gateway replica."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.dispatcher: Dispatcher = state.dispatcher
        self.max_body = state.config.gateway.max_body_bytes
        self.retry_after_s = state.config.redis.retry_after_s
        self._param_specs: dict[str, tuple[Any, tuple[tuple[str, str], ...]]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sent = _Sent()
        try:
            await self._serve(scope, receive, send, sent)
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable while serving /mcp: %s", type(exc).__name__)
            if not sent.started:
                await _rpc_error(send, sent, 503, None, SERVICE_UNAVAILABLE, "Service unavailable: store unreachable",
                                 {"retryAfterS": self.retry_after_s},
                                 [(b"retry-after", str(self.retry_after_s).encode())])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unexpected error on /mcp")
            if not sent.started:
                await _rpc_error(send, sent, 500, None, INTERNAL_ERROR, "Internal error")

    async def _serve(self, scope: Any, receive: Any, send: Any, sent: _Sent) -> None:
        raw = scope["headers"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        duplicated = _duplicated_routing_header(raw) if len(headers) != len(raw) else None
        why = self.state.origin_guard.check(headers.get("origin"), headers.get("host"))
        if why is not None:
            await _reply(send, sent, 403, orjson.dumps({"error": "forbidden", "error_description": why}))
            return
        try:
            principal = self.state.auth.principal(headers.get("authorization"))
        except AuthError as exc:
            extra = [(b"www-authenticate", exc.www_authenticate.encode())] if exc.www_authenticate else []
            await _reply(send, sent, exc.status, orjson.dumps({"error": "unauthorized",
                                                               "error_description": exc.message}), extra)
            return
        method = scope["method"]
        if method == "POST":
            await self._post(scope, receive, send, sent, headers, principal, duplicated)
        elif method in ("GET", "DELETE"):
            sid = headers.get("mcp-session-id")
            if sid is None:
                if headers.get("mcp-protocol-version") in HANDSHAKE_VERSIONS:
                    await _rpc_error(send, sent, 400, None, INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required")
                else:
                    await _reply(send, sent, 405, b"", [(b"allow", b"POST")])
            elif method == "GET":
                await self._get_stream(receive, send, sent, headers, principal, sid)
            else:
                existed = await self.state.sessions.delete(principal, sid)
                if existed:
                    await _reply(send, sent, 200)
                else:
                    await _rpc_error(send, sent, 404, None, INVALID_REQUEST, "Session not found")
        else:
            await _reply(send, sent, 405, b"", [(b"allow", b"GET, POST, DELETE")])

    async def _read_body(self, receive: Any, headers: dict[str, str]) -> bytes | None:
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            return None
        body = b""
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError
            body += msg.get("body", b"")
            if len(body) > self.max_body:
                return None
            more = msg.get("more_body", False)
        return body

    # ------------------------------------------------------------------ POST
    async def _post(self, scope: Any, receive: Any, send: Any, sent: _Sent, headers: dict[str, str],
                    principal: str, duplicated: str | None) -> None:
        body = await self._read_body(receive, headers)
        if body is None:
            await _rpc_error(send, sent, 413, None, INVALID_REQUEST, "Request body too large")
            return
        try:
            msg = orjson.loads(body)
        except orjson.JSONDecodeError:
            await _rpc_error(send, sent, 400, None, PARSE_ERROR, "Parse error")
            return
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
            await _rpc_error(send, sent, 400, None, INVALID_REQUEST,
                             "Body must be a single JSON-RPC 2.0 request, notification or response")
            return
        params = msg.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        version_header = headers.get("mcp-protocol-version")
        modern = "mcp-session-id" not in headers and (
            version_header in MODERN_VERSIONS or (isinstance(meta, dict) and PROTOCOL_VERSION_META_KEY in meta))
        has_json, has_sse = _accepts(headers.get("accept", ""))
        if not has_json:
            await _reply(send, sent, 406, orjson.dumps({"error": "Accept must include application/json"}))
            return
        method = msg.get("method")
        rid = msg.get("id")
        if "id" in msg and (rid is None or isinstance(rid, bool) or not isinstance(rid, (str, int))):
            await _rpc_error(send, sent, 400, None, INVALID_REQUEST, "id must be a string or an integer")
            return
        if method is None:
            if "id" in msg and ("result" in msg or "error" in msg) and not modern:
                await self._client_response(send, sent, headers, principal, msg)
            else:
                await _rpc_error(send, sent, 400, rid, INVALID_REQUEST, "Invalid JSON-RPC message")
            return
        if not isinstance(method, str) or (params is not None and not isinstance(params, dict)):
            await _rpc_error(send, sent, 400, rid, INVALID_REQUEST, "method must be a string and params an object")
            return
        if modern:
            await self._modern(scope, receive, send, sent, headers, principal, duplicated, msg, has_sse)
        else:
            await self._legacy(send, sent, headers, principal, msg, has_sse)

    # ------------------------------------------------------------------ 2026-07-28
    async def _modern(self, scope: Any, receive: Any, send: Any, sent: _Sent, headers: dict[str, str],
                      principal: str, duplicated: str | None, msg: dict[str, Any], has_sse: bool) -> None:
        method: str = msg["method"]
        params = msg.get("params") or {}
        if "id" not in msg:
            requested = headers.get("mcp-protocol-version", "")
            if requested not in MODERN_VERSIONS:
                await _rpc_error(send, sent, 400, None, UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                                 {"supported": list(MODERN_VERSIONS), "requested": requested})
                return
            await self.dispatcher.notification(Call(principal=principal, request_id=None, protocol_version=requested,
                                                    state=self.state), method, params)
            await _reply(send, sent, 202)
            return
        rid = msg["id"]
        if method == "subscriptions/listen" and not has_sse:
            await _reply(send, sent, 406, orjson.dumps({"error": "subscriptions/listen needs Accept: text/event-stream"}))
            return
        if duplicated is not None:
            await _rpc_error(send, sent, 400, rid, HEADER_MISMATCH, f"{duplicated} header appears more than once")
            return
        rejection = _ladder(msg, headers)
        if rejection is None and method == "tools/call":
            rejection = self._check_param_headers(params, headers)
        if rejection is not None:
            code, message, data = rejection
            await _rpc_error(send, sent, MODERN_STATUS.get(code, 400), rid, code, message, data)
            return
        meta = params["_meta"]
        call = Call(principal=principal, request_id=rid, protocol_version=meta[PROTOCOL_VERSION_META_KEY],
                    state=self.state, meta=meta)
        stream = _LazySse(send, sent, []) if has_sse else None
        call.emit = stream.emit if stream is not None else None
        if method == "subscriptions/listen":
            handler = asyncio.ensure_future(self.dispatcher.handle(call, method, params))
            gone = asyncio.ensure_future(_wait_disconnect(receive))
            done, _ = await asyncio.wait({handler, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if handler not in done:
                handler.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await handler
                return
            response = handler.result()
        else:
            response = await self.dispatcher.handle(call, method, params)
        if sent.started and stream is not None:
            await stream.finish(response)
        else:
            err = response.get("error")
            status = MODERN_STATUS.get(err["code"], call.http_status or 200) if err is not None else 200
            await _reply(send, sent, status, orjson.dumps(response))

    def _check_param_headers(self, params: dict[str, Any], headers: dict[str, str]) -> tuple[int, str, Any] | None:
        """SEP-2243 custom headers: every tool argument declared with ``x-mcp-header: X`` travels
        as ``Mcp-Param-X`` too, and the two must agree (a cached lookup for tools without any)."""
        name = params.get("name")
        if not isinstance(name, str):
            return None
        tool = self.state.registry.tools.get(name)
        if tool is None:
            return None
        cached = self._param_specs.get(name)
        if cached is None or cached[0] is not tool:
            cached = self._param_specs[name] = (tool, _param_header_spec(tool.input_schema))
        if not cached[1]:
            return None
        args = params.get("arguments")
        return _param_header_mismatch(cached[1], args if isinstance(args, dict) else {}, headers)

    # ------------------------------------------------------------------ 2025-11-25
    async def _legacy(self, send: Any, sent: _Sent, headers: dict[str, str], principal: str,
                      msg: dict[str, Any], has_sse: bool) -> None:
        method: str = msg["method"]
        params = msg.get("params") or {}
        is_request = "id" in msg
        rid = msg.get("id")
        if method == "initialize" and is_request:
            await self._initialize(send, sent, principal, rid, params)
            return
        version = headers.get("mcp-protocol-version")
        if version is not None and version not in HANDSHAKE_VERSIONS:
            await _rpc_error(send, sent, 400, rid, INVALID_REQUEST, f"Unsupported MCP-Protocol-Version: {version}",
                             {"supported": list(HANDSHAKE_VERSIONS), "requested": version})
            return
        sid = headers.get("mcp-session-id")
        if sid is None:
            await _rpc_error(send, sent, 400, rid, INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required")
            return
        try:
            session = await self.state.sessions.get(principal, sid)
        except SessionNotFound:
            await _rpc_error(send, sent, 404, rid, INVALID_REQUEST, "Session not found")
            return
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else None
        call = Call(principal=principal, request_id=rid, protocol_version=session.protocol_version,
                    state=self.state, meta=meta, session=session)
        if not is_request:
            await self.dispatcher.notification(call, method, params)
            await _reply(send, sent, 202)
            return
        stream = _LazySse(send, sent, []) if has_sse else None
        call.emit = stream.emit if stream is not None else None
        track = self.state.track(principal, sid, rid, call) if method == "tools/call" else None
        try:
            response = await self.dispatcher.handle(call, method, params)
        finally:
            if track is not None:
                self.state.untrack(track)
        if sent.started and stream is not None:
            await stream.finish(response)
        else:
            await _reply(send, sent, 200, orjson.dumps(response))

    async def _initialize(self, send: Any, sent: _Sent, principal: str, rid: Any, params: dict[str, Any]) -> None:
        call = Call(principal=principal, request_id=rid, protocol_version="2025-11-25", state=self.state)
        response = await self.dispatcher.handle(call, "initialize", params)
        if "error" in response:
            await _reply(send, sent, 200, orjson.dumps(response))
            return
        caps = params.get("capabilities") if isinstance(params.get("capabilities"), dict) else {}
        try:
            session = await self.state.sessions.create(principal, response["result"]["protocolVersion"], caps)
        except SessionLimit:
            ra = str(self.retry_after_s).encode()
            await _rpc_error(send, sent, 503, rid, SERVICE_UNAVAILABLE, "Too many sessions for this principal",
                             None, [(b"retry-after", ra)])
            return
        await _reply(send, sent, 200, orjson.dumps(response), [(b"mcp-session-id", session.id.encode())])

    async def _client_response(self, send: Any, sent: _Sent, headers: dict[str, str], principal: str,
                               msg: dict[str, Any]) -> None:
        sid = headers.get("mcp-session-id")
        if sid is None:
            await _rpc_error(send, sent, 400, None, INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required")
            return
        try:
            await self.state.sessions.get(principal, sid)
        except SessionNotFound:
            await _rpc_error(send, sent, 404, None, INVALID_REQUEST, "Session not found")
            return
        await self.state.sessions.post_response(principal, sid, str(msg["id"]), msg)
        await _reply(send, sent, 202)

    # ------------------------------------------------------------------ GET stream (legacy)
    async def _get_stream(self, receive: Any, send: Any, sent: _Sent, headers: dict[str, str],
                          principal: str, sid: str) -> None:
        if not _accepts(headers.get("accept", ""))[1]:
            await _reply(send, sent, 406, orjson.dumps({"error": "Accept must include text/event-stream"}))
            return
        try:
            await self.state.sessions.get(principal, sid)
        except SessionNotFound:
            await _rpc_error(send, sent, 404, None, INVALID_REQUEST, "Session not found")
            return
        last = headers.get("last-event-id")
        cursor = last if last and _EVENT_ID.fullmatch(last) else await self.state.sessions.last_event_id(principal, sid)
        sent.started = True
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": f"id: {cursor}\ndata: \n\n".encode(), "more_body": True})
        pump = asyncio.ensure_future(self._pump(send, principal, sid, cursor))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        for t in (pump, gone):
            t.cancel()
        for t in (pump, gone):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Any, principal: str, sid: str, cursor: str) -> None:
        sessions = self.state.sessions
        idle = 0
        while not self.state.shutting_down.is_set():
            try:
                events = await sessions.read_events(principal, sid, cursor, STREAM_POLL_MS)
                if not events:
                    await sessions.get(principal, sid)  # ends the stream once the session is gone
            except (SessionNotFound, RedisError, OSError):
                return
            for eid, data in events:
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"id: " + eid.encode() + b"\nevent: message\ndata: " + data + b"\n\n"})
                cursor = eid
            idle = 0 if events else idle + 1
            if idle >= KEEPALIVE_EVERY:
                idle = 0
                await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})


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


def _ladder(msg: dict[str, Any], headers: dict[str, str]) -> tuple[int, str, Any] | None:
    """2026-07-28 request checks, first failure wins: envelope _meta, routing headers, version."""
    params = msg.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict):
        return (INVALID_PARAMS, "params._meta must be an object carrying the required "
                f"'{PROTOCOL_VERSION_META_KEY}' and '{CLIENT_CAPABILITIES_META_KEY}' envelope keys", None)
    if PROTOCOL_VERSION_META_KEY not in meta or CLIENT_CAPABILITIES_META_KEY not in meta:
        missing = [k for k in (PROTOCOL_VERSION_META_KEY, CLIENT_CAPABILITIES_META_KEY) if k not in meta]
        return INVALID_PARAMS, f"params._meta is missing the required envelope key(s): {', '.join(missing)}", None
    version = meta[PROTOCOL_VERSION_META_KEY]
    header_version = headers.get("mcp-protocol-version")
    if header_version is None or header_version != version:
        return HEADER_MISMATCH, "MCP-Protocol-Version header does not match the request's protocol version", None
    method = msg["method"]
    if headers.get("mcp-method") != method:
        return HEADER_MISMATCH, "Mcp-Method header does not match the request body's method", None
    name_key = NAME_BEARING.get(method)
    if name_key is not None:
        body_value = params.get(name_key) if isinstance(params, dict) else None
        if body_value is not None and _decode_header(headers.get("mcp-name")) != body_value:
            return HEADER_MISMATCH, f"Mcp-Name header does not match the request body's {name_key!r} parameter", None
    if not isinstance(version, str):
        return INVALID_PARAMS, "the protocol-version envelope value must be a string", None
    if version not in MODERN_VERSIONS:
        return (UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                {"supported": list(MODERN_VERSIONS), "requested": version})
    return None


def _decode_header(value: str | None) -> str | None:
    """Header values that are not plain printable ASCII travel as ``=?base64?...?=``.
    Optional whitespace around a field value is not part of it (RFC 9110 §5.5)."""
    if value is None:
        return None
    value = value.strip(" \t")
    if not (value.startswith("=?base64?") and value.endswith("?=")):
        return value
    import base64
    import binascii

    payload = value[9:-2]
    try:
        raw = base64.b64decode(payload, validate=True)
        if base64.b64encode(raw).decode("ascii") != payload:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def _param_header_spec(schema: Any) -> tuple[tuple[str, str], ...]:
    """(argument name, lower-case ``mcp-param-*`` header name) for each ``x-mcp-header`` property."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return ()
    return tuple((arg, "mcp-param-" + prop["x-mcp-header"].lower()) for arg, prop in props.items()
                 if isinstance(prop, dict) and isinstance(prop.get("x-mcp-header"), str))


def _header_form(value: Any) -> str | None:
    """How a primitive argument reads in a header (JSON spelling for numbers and booleans)."""
    if value is None or isinstance(value, (dict, list)):
        return None
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _param_header_mismatch(spec: tuple[tuple[str, str], ...], args: dict[str, Any],
                           headers: dict[str, str]) -> tuple[int, str, Any] | None:
    for arg, header in spec:
        raw = headers.get(header)
        body = _header_form(args.get(arg))
        if raw is None and body is None:
            continue
        if raw is None:
            return HEADER_MISMATCH, f"{header} header is required when argument {arg!r} is present", None
        decoded = _decode_header(raw)
        if decoded is None:
            return HEADER_MISMATCH, f"{header} header is not valid base64-encoded UTF-8", None
        if decoded != body:
            return HEADER_MISMATCH, f"{header} header does not match argument {arg!r}", None
    return None
