"""The MCP kernel: everything between a transport's bytes and the dispatcher, for every transport.

A transport reads one message (an HTTP body, a WebSocket text frame), hands it to
:meth:`Kernel.decode`, then to :meth:`Kernel.receive` with a :class:`Link` saying what
else it knows (HTTP headers, the session a WebSocket opened, the stream to emit on),
and writes the :class:`~gateway.mcp.types.Reply` it gets back. In between, and the same
for every transport:

- **decoding** (msgspec) and the JSON-RPC 2.0 shape checks;
- **the principal's request rate** (gateway/limits.py), before any other work;
- **revision negotiation**: an ``Mcp-Session-Id`` means the 2025-11-25 session protocol;
  otherwise a 2026-07-28 ``MCP-Protocol-Version`` header or a protocol version in
  ``params._meta`` means the stateless revision; anything else is a legacy message;
- **the 2026-07-28 envelope checks**, first failure wins: ``_meta`` with the protocol
  version and client capabilities, the routing headers when the transport has headers
  (``Mcp-Method``, ``Mcp-Name``, ``Mcp-Param-*``, SEP-2243), a supported version, client
  capabilities and client info within ``gateway.max_client_capabilities_bytes``;
- **session resolution** for 2025-11-25: ``initialize`` creates the session (its
  capabilities and client info within the same bound), every other message needs a live one;
- cancellation tracking of ``tools/call`` requests.

Every exception on the way becomes an answer through :func:`gateway.errors.wire_error`.
"""

from __future__ import annotations

import base64
import binascii
import decimal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from gateway.errors import (
    HEADER_MISMATCH,
    INVALID_REQUEST,
    PARSE_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
    InvalidParams,
    McpError,
    wire_error,
)
from gateway.mcp import param_headers
from gateway.mcp.dispatcher import Call
from gateway.mcp.sessions import SessionNotFound
from gateway.mcp.types import (
    CLIENT_CAPABILITIES_META_KEY,
    CLIENT_INFO_META_KEY,
    HANDSHAKE_VERSIONS,
    LEGACY_VERSION,
    LOG_LEVEL_META_KEY,
    LOG_LEVELS,
    MODERN_VERSIONS,
    PROTOCOL_VERSION_META_KEY,
    ClientReply,
    Emit,
    Envelope,
    ErrorObject,
    Incoming,
    Notification,
    Reply,
    Request,
    RequestId,
    Response,
)

if TYPE_CHECKING:
    from gateway.state import Gateway

Message = Request | Notification | ClientReply

# Which body parameter the Mcp-Name header repeats, per method.
NAME_BEARING = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
                "tasks/get": "taskId", "tasks/update": "taskId", "tasks/cancel": "taskId"}
_ID_MIN, _ID_MAX = -(2**63), 2**64  # integer ids JSON-RPC peers can be expected to round-trip

_requests = msgspec.json.Decoder(Request)
_incoming = msgspec.json.Decoder(Incoming)
_any_json = msgspec.json.Decoder()
_OUT_OF_RANGE = "Number out of range"
_any_number = msgspec.json.Decoder(float_hook=decimal.Decimal)  # reads 1e400 too: tells valid JSON apart


@dataclass(slots=True)
class Link:
    """What a transport knows about one message besides its body.

    ``headers``: the HTTP request headers (lower-case names), whose routing headers the
    envelope checks compare with the body; None where messages carry no headers
    (WebSocket frames). ``session_id``: the ``Mcp-Session-Id`` header, or the session a
    WebSocket connection opened. ``emit``: the response stream (SSE, the socket); None
    when the answer can only be one JSON body. ``duplicated_header``: a routing header the
    request carried twice. ``expires_at``: when the credential of a request that lives on as a
    stream (a listen) expires (epoch s, :meth:`gateway.auth.Authenticator.expires_at`); None when
    it lasts, or when the transport ends the whole connection then (WebSocket)."""

    transport: str
    headers: Mapping[str, str] | None = None
    session_id: str | None = None
    emit: Emit | None = None
    duplicated_header: str | None = None
    expires_at: float | None = None


def _meta(message: Request | Notification) -> dict[str, Any] | None:
    meta = message.params.get("_meta")
    return meta if isinstance(meta, dict) else None


class Kernel:
    """Decodes, negotiates, checks and resolves; the dispatcher serves what passes."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.dispatcher = gateway.dispatcher
        self.sessions = gateway.sessions
        self.config = gateway.config

    # ------------------------------------------------------------------ decoding
    def decode(self, data: bytes | str) -> Message | Reply:
        """The message, or the error answer when ``data`` is not one JSON-RPC 2.0 message
        (or nests deeper than ``MAX_JSON_DEPTH``)."""
        try:
            message = self._decode(data)
        except RecursionError:  # the decoder recurses per level: far deeper than any message
            return self.fail(_too_deep())
        if not isinstance(message, Reply):
            problem = _kept_values_problem(data, message)
            if problem is not None:
                return self.fail(McpError(INVALID_REQUEST, problem), None if isinstance(message, Notification)
                                 else message.id)
        return message

    def _decode(self, data: bytes | str) -> Message | Reply:
        try:  # most messages are plain requests: typed in one step
            request = _requests.decode(data)
            if isinstance(request.id, str) or _ID_MIN <= request.id < _ID_MAX:
                return request
        except msgspec.DecodeError:
            pass
        try:
            return _classify(_incoming.decode(data))
        except msgspec.ValidationError as exc:
            if str(exc).startswith(_OUT_OF_RANGE):  # valid JSON maybe, which the gateway will not take
                return self.fail(*_out_of_range(data))
            return self.fail(_not_an_object(data))  # not an object: refused at its first token, before the rest was read
        except msgspec.DecodeError:
            return self.fail(McpError(PARSE_ERROR, "Parse error"))
        except _Invalid as exc:
            return self.fail(exc.error, exc.request_id)

    def fail(self, exc: BaseException, request_id: RequestId | None = None) -> Reply:
        """The answer to a message that could not be served (``exc`` through the error map)."""
        wire = wire_error(exc, self.config, crashed_status=500)
        return Reply(wire.response(request_id), wire.http_status, wire.retry_after_s)

    # ------------------------------------------------------------------ negotiation
    def is_stateless(self, message: Message, link: Link) -> bool:
        """True for the 2026-07-28 revision (see the module docstring for the rule)."""
        headers = link.headers
        if headers is not None:
            if "mcp-session-id" in headers:
                return False
            if headers.get("mcp-protocol-version") in MODERN_VERSIONS:
                return True
        if isinstance(message, ClientReply):
            return False
        meta = _meta(message)
        return meta is not None and PROTOCOL_VERSION_META_KEY in meta

    async def receive(self, principal: str, message: Message, link: Link) -> Reply:
        """Serve one decoded message from ``principal``; always answers (202: nothing to send)."""
        request_id = message.id if isinstance(message, Request) else None
        try:
            await self.gateway.limits.admit_request(principal)
            if self.is_stateless(message, link):
                if isinstance(message, ClientReply):  # the stateless revision sends no requests to answer
                    return self.fail(McpError(INVALID_REQUEST, "Invalid JSON-RPC message"), message.id)
                return await self._stateless(principal, message, link)
            return await self._session(principal, message, link)
        except Exception as exc:  # noqa: BLE001 - handed to the one error map
            return self.fail(exc, request_id)

    # ------------------------------------------------------------------ 2026-07-28
    async def _stateless(self, principal: str, message: Request | Notification, link: Link) -> Reply:
        if isinstance(message, Notification):
            meta = _meta(message) or {}
            requested = (link.headers.get("mcp-protocol-version", "") if link.headers is not None
                         else meta.get(PROTOCOL_VERSION_META_KEY, ""))
            if requested not in MODERN_VERSIONS:
                raise McpError(UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                               {"supported": list(MODERN_VERSIONS), "requested": requested})
            call = Call(principal=principal, request_id=None, protocol_version=requested, state=self.gateway)
            await self.dispatcher.notification(call, message)
            return Reply(http_status=202)
        if link.duplicated_header is not None:
            raise McpError(HEADER_MISMATCH, f"{link.duplicated_header} header appears more than once")
        envelope = self.envelope(message, link.headers)
        call = Call(principal=principal, request_id=message.id, protocol_version=envelope.protocol_version,
                    state=self.gateway, meta=message.params["_meta"], envelope=envelope, emit=link.emit,
                    expires_at=link.expires_at)
        if message.method != "tools/call":
            return await self.dispatcher.handle(call, message, link.transport)
        return await self._cancellable(principal, None, message, call, link.transport)

    def envelope(self, request: Request, headers: Mapping[str, str] | None) -> Envelope:
        """The checked ``_meta`` envelope of a 2026-07-28 request; the first failed check raises."""
        meta = request.params.get("_meta")
        if type(meta) is not dict:
            raise InvalidParams("params._meta must be an object carrying the required "
                                f"'{PROTOCOL_VERSION_META_KEY}' and '{CLIENT_CAPABILITIES_META_KEY}' envelope keys")
        if PROTOCOL_VERSION_META_KEY not in meta or CLIENT_CAPABILITIES_META_KEY not in meta:
            missing = [k for k in (PROTOCOL_VERSION_META_KEY, CLIENT_CAPABILITIES_META_KEY) if k not in meta]
            raise InvalidParams(f"params._meta is missing the required envelope key(s): {', '.join(missing)}")
        version = meta[PROTOCOL_VERSION_META_KEY]
        if headers is not None:
            self._check_routing_headers(request, version, headers)
        if not isinstance(version, str):
            raise InvalidParams("the protocol-version envelope value must be a string")
        if version not in MODERN_VERSIONS:
            raise McpError(UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                           {"supported": list(MODERN_VERSIONS), "requested": version})
        if headers is not None and request.method == "tools/call":
            self._check_param_headers(request.params, headers)
        capabilities = meta[CLIENT_CAPABILITIES_META_KEY]
        if not isinstance(capabilities, dict):
            raise InvalidParams("the client-capabilities envelope value must be an object")
        info, level = meta.get(CLIENT_INFO_META_KEY), meta.get(LOG_LEVEL_META_KEY)
        self._check_declared_size(capabilities, "the client-capabilities envelope value")
        self._check_declared_size(info, "the client-info envelope value")
        return Envelope(protocol_version=version, client_capabilities=capabilities,
                        client_info=info if isinstance(info, dict) else None,
                        log_level=level if level in LOG_LEVELS else None)

    def _check_routing_headers(self, request: Request, version: object, headers: Mapping[str, str]) -> None:
        if headers.get("mcp-protocol-version") != version:
            raise McpError(HEADER_MISMATCH, "MCP-Protocol-Version header does not match the request's protocol version")
        if headers.get("mcp-method") != request.method:
            raise McpError(HEADER_MISMATCH, "Mcp-Method header does not match the request body's method")
        name_key = NAME_BEARING.get(request.method)
        if name_key is not None:
            body_value = request.params.get(name_key)
            if body_value is not None and _decode_header(headers.get("mcp-name")) != body_value:
                raise McpError(HEADER_MISMATCH,
                               f"Mcp-Name header does not match the request body's {name_key!r} parameter")

    def _check_param_headers(self, params: dict[str, Any], headers: Mapping[str, str]) -> None:
        """SEP-2243 custom headers: every tool argument declared with ``x-mcp-header: X`` (at any
        depth of ``properties``, gateway/mcp/param_headers.py) travels as ``Mcp-Param-X`` too, and
        the two must agree. The declarations were read when the tool was registered or listed: a
        dict lookup for tools without any."""
        name = params.get("name")
        if not isinstance(name, str):
            return
        tool = self.gateway.registry.tools.get(name)
        spec = tool.param_spec if tool is not None else self.gateway.proxy.param_spec(name)
        if spec:
            args = params.get("arguments")
            _check_param_header_values(spec, args if isinstance(args, dict) else {}, headers)

    # ------------------------------------------------------------------ 2025-11-25
    async def _session(self, principal: str, message: Message, link: Link) -> Reply:
        if isinstance(message, Request) and message.method == "initialize":
            return await self._initialize(principal, message, link.transport)
        version = link.headers.get("mcp-protocol-version") if link.headers is not None else None
        if version is not None and version not in HANDSHAKE_VERSIONS and not isinstance(message, ClientReply):
            raise McpError(INVALID_REQUEST, f"Unsupported MCP-Protocol-Version: {version}",
                           {"supported": list(HANDSHAKE_VERSIONS), "requested": version})
        if link.session_id is None:
            raise McpError(INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required" if link.headers is not None
                           else "Send initialize first (or a 2026-07-28 _meta envelope)")
        session = await self.sessions.get(principal, link.session_id)
        if isinstance(message, ClientReply):
            await self.sessions.post_response(principal, session.id, str(message.id), message)
            return Reply(http_status=202)
        call = Call(principal=principal, request_id=message.id if isinstance(message, Request) else None,
                    protocol_version=session.protocol_version, state=self.gateway, meta=_meta(message),
                    session=session, emit=link.emit)
        if isinstance(message, Notification):
            await self.dispatcher.notification(call, message)
            return Reply(http_status=202)
        if message.method != "tools/call":
            return await self.dispatcher.handle(call, message, link.transport)
        return await self._cancellable(principal, session.id, message, call, link.transport)

    async def _cancellable(self, principal: str, sid: str | None, request: Request, call: Call,
                           transport: str) -> Reply:
        """Serve a ``tools/call`` that the client's ``notifications/cancelled`` (on any replica;
        on 2026-07-28 naming the request's id, there being no session) may cancel while it runs."""
        key = self.gateway.track(principal, sid, request.id, call)
        try:
            return await self.dispatcher.handle(call, request, transport)
        finally:
            self.gateway.untrack(key)

    async def _initialize(self, principal: str, request: Request, transport: str) -> Reply:
        self._check_declared_size(request.params.get("capabilities"), "params.capabilities")
        self._check_declared_size(request.params.get("clientInfo"), "params.clientInfo")
        call = Call(principal=principal, request_id=request.id, protocol_version=LEGACY_VERSION, state=self.gateway)
        reply = await self.dispatcher.handle(call, request, transport)
        if not isinstance(reply.message, Response):
            return reply
        caps = request.params.get("capabilities")
        lists = await self.gateway.list_revisions.current(principal)  # what a new session needs no news of
        session = await self.sessions.create(principal, reply.message.result["protocolVersion"],
                                             caps if isinstance(caps, dict) else {}, lists)
        reply.session_id = session.id
        return reply

    def _check_declared_size(self, value: object, what: str) -> None:
        """What a client declares about itself outlives the request: a session keeps it in Redis and
        in every replica's cache, a listen stream or a task holds it while it lives. The body limit
        alone would let each of them hold megabytes, far beyond anything a client has to declare."""
        if value is None:
            return
        limit = self.config.gateway.max_client_capabilities_bytes
        size = len(orjson.dumps(value))
        if size > limit:
            raise InvalidParams(f"{what} is {size} bytes as JSON; at most {limit} are accepted "
                                "(gateway.max_client_capabilities_bytes)")

    async def resolve(self, principal: str, session_id: str) -> None:
        """Raise :class:`SessionNotFound` unless ``session_id`` is a live session of ``principal``."""
        await self.sessions.get(principal, session_id)

    async def end_session(self, principal: str, session_id: str) -> None:
        if not await self.sessions.delete(principal, session_id):
            raise SessionNotFound(session_id)


# ---------------------------------------------------------------------- decoding helpers
MAX_JSON_DEPTH = 128
"""Levels of nesting a message may have (the message object is the first)."""
_ENCODER_DEPTH = 254  # the deepest nesting orjson encodes
_PROBLEMS = {"Recursion limit reached": f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
             "Integer exceeds 64-bit range": "a number is an integer outside the 64-bit range"}


def _too_deep() -> McpError:
    return McpError(INVALID_REQUEST, _PROBLEMS["Recursion limit reached"])


def _not_an_object(data: bytes | str) -> McpError:
    """The error for a body whose top-level value is not an object: a parse error unless the whole body
    is JSON (a batch, a scalar). Only this error path reads such a body a second time."""
    try:
        _any_json.decode(data)  # RecursionError (too deep to tell) is decode()'s to answer
    except msgspec.DecodeError:
        return McpError(PARSE_ERROR, "Parse error")
    return McpError(INVALID_REQUEST, "Body must be a single JSON-RPC 2.0 request, notification or response")


def _out_of_range(data: bytes | str) -> tuple[McpError, RequestId | None]:
    """The error for a body with a number beyond a 64-bit float (``1e400``): the message is
    refused as invalid (-32600, with its id where it has a usable one), unless the body is not
    JSON at all (-32700), which msgspec cannot say before it reaches the number."""
    try:
        value = _any_number.decode(data)
    except msgspec.DecodeError:
        return McpError(PARSE_ERROR, "Parse error"), None
    rid = value.get("id") if isinstance(value, dict) else None
    if not (isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool) and _ID_MIN <= rid < _ID_MAX)):
        rid = None
    return McpError(INVALID_REQUEST, "a number is outside the range of a 64-bit float"), rid


def _kept_values_problem(data: bytes | str, message: Message) -> str | None:
    """Why values of ``message`` could not be encoded again, or None. What the gateway keeps of a
    message is encoded again (a session's capabilities, a sealed requestState, a task's answers)
    by orjson, which refuses integers outside 64 bits and nesting deeper than 254 levels; decoding
    recursed into a crash far deeper. So such input is refused here, once, as bad input: the values
    are encoded once at C speed, inside enough lists that they fail past ``MAX_JSON_DEPTH`` (a
    message with fewer brackets than that, counted first, cannot be that deep)."""
    if isinstance(message, ClientReply):
        values: Any = [message.result, None if message.error is None or message.error.data is msgspec.UNSET
                       else message.error.data]
    else:
        values = [message.params]
    # ``values`` is one level, like the message object: padded, the encoder's limit is ours
    opened = data.count("{") + data.count("[") if isinstance(data, str) else data.count(b"{") + data.count(b"[")
    if opened > MAX_JSON_DEPTH:
        for _ in range(_ENCODER_DEPTH - MAX_JSON_DEPTH):
            values = [values]
    try:
        orjson.dumps(values)
    except orjson.JSONEncodeError as exc:
        return _PROBLEMS.get(str(exc), "a value cannot be encoded as JSON")
    return None


class _Invalid(Exception):
    def __init__(self, error: McpError, request_id: RequestId | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id


def _classify(msg: Incoming) -> Message:
    """The JSON-RPC 2.0 shape checks, first failure wins."""
    if msg.jsonrpc != "2.0":
        raise _Invalid(McpError(INVALID_REQUEST, "Body must be a single JSON-RPC 2.0 request, notification or "
                                "response"))
    has_id = msg.id is not msgspec.UNSET
    if has_id and not (isinstance(msg.id, str) or (type(msg.id) is int and _ID_MIN <= msg.id < _ID_MAX)):
        raise _Invalid(McpError(INVALID_REQUEST, "id must be a string or an integer"))
    rid: RequestId | None = msg.id if has_id else None
    if msg.method is msgspec.UNSET:
        if rid is not None and (msg.result is not msgspec.UNSET or msg.error is not msgspec.UNSET):
            return _client_reply(rid, msg)
        raise _Invalid(McpError(INVALID_REQUEST, "Invalid JSON-RPC message"), rid)
    params = msg.params
    if not isinstance(msg.method, str) or (params not in (msgspec.UNSET, None) and not isinstance(params, dict)):
        raise _Invalid(McpError(INVALID_REQUEST, "method must be a string and params an object"), rid)
    params = params if isinstance(params, dict) else {}
    if rid is None:
        return Notification(method=msg.method, params=params)
    return Request(jsonrpc="2.0", id=rid, method=msg.method, params=params)


def _client_reply(rid: RequestId, msg: Incoming) -> ClientReply:
    if msg.error is msgspec.UNSET:
        return ClientReply(id=rid, result=msg.result if isinstance(msg.result, dict) else {})
    try:
        error = msgspec.convert(msg.error, ErrorObject)
    except msgspec.ValidationError:
        error = ErrorObject(code=-32603, message="client error")
    return ClientReply(id=rid, error=error)


# ---------------------------------------------------------------------- routing headers
def _decode_header(value: str | None) -> str | None:
    """Header values that are not plain printable ASCII travel as ``=?base64?...?=``.
    Optional whitespace around a field value is not part of it (RFC 9110 §5.5)."""
    if value is None:
        return None
    value = value.strip(" \t")
    if not (value.startswith("=?base64?") and value.endswith("?=")):
        return value
    payload = value[9:-2]
    try:
        raw = base64.b64decode(payload, validate=True)
        if base64.b64encode(raw).decode("ascii") != payload:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def _check_param_header_values(spec: param_headers.Spec, args: dict[str, Any], headers: Mapping[str, str]) -> None:
    for path, header, body in param_headers.each_value(spec, args):
        arg = ".".join(path)
        raw = headers.get(header)
        if raw is None and body is None:
            continue
        if raw is None:
            raise McpError(HEADER_MISMATCH, f"{header} header is required when argument {arg!r} is present")
        decoded = _decode_header(raw)
        if decoded is None:
            raise McpError(HEADER_MISMATCH, f"{header} header is not valid base64-encoded UTF-8")
        if decoded != body:
            raise McpError(HEADER_MISMATCH, f"{header} header does not match argument {arg!r}")
