"""The one MCP dispatcher behind every transport (HTTP, WebSocket) and both revisions.

The kernel (:mod:`gateway.mcp.kernel`) checks a message, builds the :class:`Call` (who,
which revision, how to emit notifications on the response stream) and asks
:meth:`Dispatcher.handle` for the answer. Methods live in one table of
``_handle_<method>`` coroutines; exceptions become wire errors only in
:func:`gateway.errors.wire_error`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import orjson
from prometheus_client import Counter, Histogram

from gateway.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    InvalidParams,
    McpError,
    NotFound,
    tool_error_text,
    wire_error,
)
from gateway.limits import exceeded
from gateway.mcp.sessions import SUBSCRIBED, Session
from gateway.mcp.types import (
    HANDSHAKE_VERSIONS,
    LEGACY_VERSION,
    LOG_LEVEL_META_KEY,
    LOG_LEVELS,
    MODERN_VERSION,
    MODERN_VERSIONS,
    SERVER_INFO_META_KEY,
    SUBSCRIPTION_ID_META_KEY,
    Emit,
    Envelope,
    Notification,
    Reply,
    Request,
    RequestId,
    Response,
)
from gateway.registry import Registry, Tool
from shared.metrics import MCP_LATENCY, MCP_REQUESTS

if TYPE_CHECKING:  # the gateway builds its dispatcher; the dispatcher only needs the type
    from gateway.state import Gateway

log = logging.getLogger(__name__)

_LEVEL_RANK = {lvl: i for i, lvl in enumerate(LOG_LEVELS)}
SERVER_INFO = {"name": "learnmesh", "version": "0.1.0"}

Handler = Callable[["Call", dict[str, Any]], Awaitable[dict[str, Any]]]


class InputRequired(Exception):
    """Raised by :meth:`Call.request_client` on 2026-07-28: the client must answer first."""

    def __init__(self, requests: dict[str, dict[str, Any]]) -> None:
        super().__init__("input required")
        self.requests = requests


class Call:
    """One request being served; the :class:`gateway.registry.ToolContext` handlers see."""

    __slots__ = ("principal", "request_id", "protocol_version", "state", "meta", "envelope", "session", "emit",
                 "expires_at", "modern", "responses", "cancelled", "_log_level")

    def __init__(self, *, principal: str, request_id: RequestId | None, protocol_version: str, state: Gateway,
                 meta: dict[str, Any] | None = None, envelope: Envelope | None = None,
                 session: Session | None = None, emit: Emit | None = None,
                 expires_at: float | None = None) -> None:
        self.principal = principal
        self.request_id = request_id
        self.protocol_version = protocol_version
        self.state = state
        self.meta = meta or {}
        self.envelope = envelope
        self.session = session
        self.emit = emit
        self.expires_at = expires_at  # the credential's end (epoch s), for what outlives the request: a listen
        self.modern = protocol_version in MODERN_VERSIONS
        self.responses: dict[str, Any] = {}
        self.cancelled = False
        level = self.meta.get(LOG_LEVEL_META_KEY) if self.modern else getattr(session, "log_level", None)
        self._log_level = level if level in _LEVEL_RANK else None

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        """Send a notification related to this request (dropped when there is no stream)."""
        note = Notification(method=method, params=params)
        if self.emit is not None:
            await self.emit(note)
        elif self.session is not None:
            await self.state.sessions.append_event(self.principal, self.session.id, note)

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        token = self.meta.get("progressToken")
        if token is None:
            return
        params: dict[str, Any] = {"progressToken": token, "progress": progress}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        await self.notify("notifications/progress", params)

    async def log(self, level: str, data: Any, logger: str | None = None) -> None:
        if level not in _LEVEL_RANK:
            raise ValueError(f"unknown log level {level!r}")
        if self._log_level is None:
            if self.modern:  # 2026-07-28: no logLevel in _meta means the client wants no log messages
                return
        elif _LEVEL_RANK[level] < _LEVEL_RANK[self._log_level]:
            return
        params: dict[str, Any] = {"level": level, "data": data}
        if logger:
            params["logger"] = logger
        await self.notify("notifications/message", params)

    async def request_client(self, method: str, params: dict[str, Any], key: str) -> dict[str, Any]:
        if self.modern:
            if key in self.responses:
                return self.responses[key]
            raise InputRequired({key: {"method": method, "params": params}})
        if self.session is None:
            raise McpError(INVALID_REQUEST, "server-to-client requests need a session")
        sessions = self.state.sessions
        rid = "srv-" + uuid.uuid4().hex
        async with self.state.limits.stream_slot(self.principal):  # the wait holds a Redis connection
            await sessions.add_pending(self.principal, self.session.id, rid)
            msg = Request(jsonrpc="2.0", id=rid, method=method, params=params)
            if self.emit is not None:
                await self.emit(msg)
            else:
                await sessions.append_event(self.principal, self.session.id, msg)
            answer = await sessions.await_response(self.principal, self.session.id, rid,
                                                   self.state.config.gateway.client_request_timeout_s)
        if answer is None:
            raise McpError(INTERNAL_ERROR, f"the client did not answer {method} in time")
        if answer.error is not None:
            err = answer.error
            raise McpError(err.code, err.message, None if err.data is msgspec.UNSET else err.data)
        return answer.result or {}


def _cursor(kind: str, offset: int) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{offset}".encode()).decode()


def _cursor_offset(cursor: Any, kind: str, page_size: int) -> int:
    """Where a list page starts. A cursor is only ever issued for a page boundary of its own list,
    spelt as :func:`_cursor` spells it; anything else is bad input (MCP pagination)."""
    if cursor is None:
        return 0
    if isinstance(cursor, str):
        try:
            name, _, digits = base64.urlsafe_b64decode(cursor.encode("ascii")).decode("ascii").partition(":")
            offset = int(digits) if name == kind and digits.isdigit() else 0
        except (ValueError, UnicodeError):
            offset = 0
        if offset > 0 and offset % page_size == 0 and _cursor(kind, offset) == cursor:
            return offset
    raise _not_issued()


def _not_issued() -> InvalidParams:
    return InvalidParams("params.cursor is not a cursor this server issued for this list")


async def _next_note(queue: asyncio.Queue[dict[str, Any]], ends_at: float | None) -> dict[str, Any] | None:
    """A listen stream's next notification; None once ``ends_at`` (epoch s) has passed."""
    if ends_at is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), ends_at - time.time())
    except TimeoutError:
        return None


def _str_param(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidParams(f"params.{name} must be a non-empty string")
    return value


class Dispatcher:
    """Routes JSON-RPC requests to ``_handle_*`` methods; shared by every transport."""

    LEGACY_ONLY = frozenset({"initialize", "ping", "logging/setLevel", "resources/subscribe",
                             "resources/unsubscribe"})
    MODERN_ONLY = frozenset({"server/discover", "subscriptions/listen", "tasks/get", "tasks/update",
                             "tasks/cancel"})

    def __init__(self, registry: Registry, state: Gateway) -> None:
        self.registry = registry
        self.state = state
        self.config = state.config
        gw = state.config.gateway
        self.list_ttl_ms = gw.list_ttl_ms
        self.read_ttl_ms = gw.read_ttl_ms
        self.table: dict[str, Handler] = {
            "initialize": self._handle_initialize,
            "ping": self._handle_ping,
            "server/discover": self._handle_server_discover,
            "tools/list": self._handle_tools_list,
            "tools/call": self._handle_tools_call,
            "resources/list": self._handle_resources_list,
            "resources/templates/list": self._handle_resources_templates_list,
            "resources/read": self._handle_resources_read,
            "resources/subscribe": self._handle_resources_subscribe,
            "resources/unsubscribe": self._handle_resources_unsubscribe,
            "prompts/list": self._handle_prompts_list,
            "prompts/get": self._handle_prompts_get,
            "completion/complete": self._handle_completion_complete,
            "logging/setLevel": self._handle_logging_set_level,
            "subscriptions/listen": self._handle_subscriptions_listen,
            "tasks/get": self._handle_tasks_get,
            "tasks/update": self._handle_tasks_update,
            "tasks/cancel": self._handle_tasks_cancel,
        }
        self._no_args_valid: set[str] = set()  # tools whose inputSchema accepts an empty arguments object
        self._lists: dict[str, list[dict[str, Any]]] | None = None
        self._metrics: dict[tuple[str, bool, str], tuple[Counter, Histogram]] = {}  # labelled children, looked up once

    # ------------------------------------------------------------------ entry points
    def knows(self, method: str, modern: bool) -> bool:
        if method not in self.table:
            return False
        return method not in (self.LEGACY_ONLY if modern else self.MODERN_ONLY)

    async def handle(self, call: Call, request: Request, transport: str = "http") -> Reply:
        """Serve one request; always answers (a result or an error)."""
        method, params = request.method, request.params
        counters = self._metrics.get((method, call.modern, transport))  # known methods only: bounded
        known = counters is not None or self.knows(method, call.modern)
        if counters is None:
            revision = MODERN_VERSION if call.modern else LEGACY_VERSION
            label = method if known else "unknown"
            counters = (MCP_REQUESTS.labels(label, revision, transport), MCP_LATENCY.labels(label, revision))
            if known:
                self._metrics[(method, call.modern, transport)] = counters
        counters[0].inc()
        t0 = time.perf_counter()
        try:
            if not known:
                raise McpError(METHOD_NOT_FOUND, f"Method not found: {method}")
            result = await self.table[method](call, params)
            if call.modern:
                result.setdefault("resultType", "complete")
            reply = Reply(Response(id=request.id, result=result))
        except InputRequired as ir:
            reply = Reply(Response(id=request.id, result=self._input_required(call, method, params, ir)))
        except asyncio.CancelledError:
            if not call.cancelled:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            # notifications/cancelled: the client has forgotten the request, and an answer would
            # reach it as a response to an unknown id (the spec's SHOULD NOT; both TS SDKs report it).
            reply = Reply(http_status=202)
        except Exception as exc:  # noqa: BLE001 - handed to the one error map
            wire = wire_error(exc, self.config, method=method, params=params, modern=call.modern)
            reply = Reply(wire.response(request.id))
            # A legacy session's answers are HTTP 200 whatever they carry, but for a limit:
            # 429 + Retry-After is what clients and proxies back off on.
            if call.modern or wire.http_status == 429:
                reply.http_status, reply.retry_after_s = wire.http_status, wire.retry_after_s
        counters[1].observe(time.perf_counter() - t0)
        return reply

    async def notification(self, call: Call, note: Notification) -> None:
        """Client notifications: initialized, cancelled, roots/list_changed ... (no response)."""
        if note.method == "notifications/cancelled":
            rid = note.params.get("requestId")
            if rid is not None:
                sid = call.session.id if call.session is not None else None
                await self.state.cancel_request(call.principal, sid, rid)

    # ------------------------------------------------------------------ lifecycle
    def capabilities(self) -> dict[str, Any]:
        return {"tools": {"listChanged": True}, "resources": {"subscribe": True, "listChanged": True},
                "prompts": {"listChanged": True}, "logging": {}, "completions": {}}

    async def _handle_initialize(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        requested = p.get("protocolVersion")
        version = requested if requested in HANDSHAKE_VERSIONS else LEGACY_VERSION
        return {"protocolVersion": version, "capabilities": self.capabilities(), "serverInfo": SERVER_INFO,
                "instructions": "learnmesh: a model served over MCP; per-client context lives in Redis."}

    async def _handle_ping(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def _handle_server_discover(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        caps = self.capabilities()
        caps["extensions"] = {"io.modelcontextprotocol/tasks": {}}  # gateway/tasks.py (SEP-2663)
        return {"supportedVersions": list(MODERN_VERSIONS), "capabilities": caps,
                "serverInfo": SERVER_INFO, "_meta": {SERVER_INFO_META_KEY: SERVER_INFO},
                "ttlMs": self.list_ttl_ms, "cacheScope": "public"}

    async def _handle_logging_set_level(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        level = p.get("level")
        if level not in _LEVEL_RANK:
            raise InvalidParams(f"level must be one of {', '.join(LOG_LEVELS)}")
        if call.session is not None:
            await self.state.sessions.set_log_level(call.session, level)
        return {}

    # ------------------------------------------------------------------ lists (precomputed)
    def lists(self) -> dict[str, list[dict[str, Any]]]:
        if self._lists is None:
            r = self.registry
            self._lists = {"tools": [t.describe() for t in r.tools.values()],
                           "resources": [x.describe() for x in r.resources.values()],
                           "resourceTemplates": [t.describe() for t in r.templates],
                           "prompts": [x.describe() for x in r.prompts.values()]}
        return self._lists

    def invalidate_lists(self) -> None:
        self._lists = None

    def _list(self, call: Call, key: str) -> dict[str, Any]:
        out: dict[str, Any] = {key: self.lists()[key]}
        if call.modern:
            out["ttlMs"] = self.list_ttl_ms
            out["cacheScope"] = "public"
        return out

    async def _merged(self, call: Call, key: str, params: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
        """``out`` with the upstreams' entries after the gateway's own, one page of
        ``proxy.page_size`` entries at a time (``nextCursor`` / ``cursor``); without upstreams,
        ``out`` whole, and any cursor is one this server never issued."""
        proxy = self.state.proxy
        if not proxy.active:
            if params.get("cursor") is not None:  # one page, so no cursor was ever issued
                raise _not_issued()
            return out
        size = self.config.proxy.page_size
        start = _cursor_offset(params.get("cursor"), key, size)
        upstream = await proxy.listing(call, key)
        # An upstream mounted unprefixed fronts the gateway as if it were that server: its entries first.
        entries = [*upstream, *out[key]] if proxy.transparent else [*out[key], *upstream]
        out[key] = entries[start:start + size]
        if start + size < len(entries):
            out["nextCursor"] = _cursor(key, start + size)
        if call.modern and proxy.per_principal_lists:
            out["cacheScope"] = "private"
        return out

    async def _handle_tools_list(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        return await self._merged(call, "tools", p, self._list(call, "tools"))

    async def _handle_resources_list(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        """Static resources, then each ``registry.resource_listers`` entry's resources for the
        caller's principal (e.g. its contexts); such a list is private to the principal."""
        out = self._list(call, "resources")
        listers = self.registry.resource_listers
        if listers:
            resources = list(out["resources"])
            for lister in listers:
                resources.extend(await lister(call))
            out["resources"] = resources
            if call.modern:
                out["cacheScope"] = "private"
        return await self._merged(call, "resources", p, out)

    async def _handle_resources_templates_list(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        return await self._merged(call, "resourceTemplates", p, self._list(call, "resourceTemplates"))

    async def _handle_prompts_list(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        return await self._merged(call, "prompts", p, self._list(call, "prompts"))

    # ------------------------------------------------------------------ tools
    async def _handle_tools_call(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        name = _str_param(p, "name")
        tool = self.registry.tools.get(name)
        if tool is None:
            if not self.state.proxy.active:
                raise InvalidParams(f"Tool not found: {name}")
            self._restore_inputs(call, p, "tools/call", name)
            return await self.state.proxy.call_tool(call, name, p)
        args = p.get("arguments")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise InvalidParams("params.arguments must be an object")
        if args or name not in self._no_args_valid:  # a tool's verdict on {} never changes
            self._check_arguments(name, tool, args)
        self._restore_inputs(call, p, "tools/call", name)
        if tool.task_support is not None:
            return await self.state.tasks.tools_call(call, tool, args, self._run_tool)
        return await self._run_tool(call, tool, args)

    def _check_arguments(self, name: str, tool: Tool, args: dict[str, Any]) -> None:
        problem = tool.input_problem(args)
        if problem is not None:
            raise InvalidParams(f"Invalid arguments for tool {name}: {problem}")
        if not args:
            self._no_args_valid.add(name)

    async def _run_tool(self, call: Call, tool: Tool, args: dict[str, Any]) -> dict[str, Any]:
        """Run a tool's handler and shape its output into a CallToolResult."""
        name = tool.name
        try:
            out = await tool.handler(call, args)
        except Exception as exc:
            text = tool_error_text(exc)
            if text is None:
                raise
            return {"content": [{"type": "text", "text": text}], "isError": True}
        if isinstance(out, dict) and "content" in out:
            return out
        if tool.output_schema is not None:
            if not tool.output_matches(out):
                log.error("tool %s returned output that does not match its outputSchema", name)
                raise McpError(INTERNAL_ERROR, "Tool output did not match its output schema")
            return {"content": [{"type": "text", "text": orjson.dumps(out).decode()}], "structuredContent": out}
        if isinstance(out, str):
            return {"content": [{"type": "text", "text": out}]}
        if isinstance(out, list):
            return {"content": out}
        return {"content": [{"type": "text", "text": orjson.dumps(out).decode()}]}

    # ------------------------------------------------------------------ tasks extension (gateway/tasks.py)
    async def _handle_tasks_get(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        if self.state.proxy.active:
            forwarded = await self.state.proxy.task_request(call, "tasks/get", p)
            if forwarded is not None:
                return forwarded
        return await self.state.tasks.get(call, p)

    async def _handle_tasks_update(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        if self.state.proxy.active:
            forwarded = await self.state.proxy.task_request(call, "tasks/update", p)
            if forwarded is not None:
                return forwarded
        return await self.state.tasks.update(call, p)

    async def _handle_tasks_cancel(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        if self.state.proxy.active:
            forwarded = await self.state.proxy.task_request(call, "tasks/cancel", p)
            if forwarded is not None:
                return forwarded
        return await self.state.tasks.cancel(call, p)

    # ------------------------------------------------------------------ input_required (2026-07-28)
    def _restore_inputs(self, call: Call, p: dict[str, Any], method: str, name: str) -> None:
        if not call.modern:
            return
        token = p.get("requestState")
        if token is not None:
            st = self.state.sealer.open(call.principal, token)
            if st.get("m") != method or st.get("n") != name:
                raise InvalidParams("requestState belongs to another request")
            call.responses.update(st.get("r") or {})
        if "inputResponses" in p:
            answers = p["inputResponses"]
            if not isinstance(answers, dict) or not all(isinstance(v, dict) for v in answers.values()):
                raise InvalidParams("params.inputResponses must map request keys to result objects")
            call.responses.update(answers)

    def _input_required(self, call: Call, method: str, p: dict[str, Any], ir: InputRequired) -> dict[str, Any]:
        name = p.get("name") if method != "resources/read" else p.get("uri")
        state = self.state.sealer.seal(call.principal, {"m": method, "n": name, "r": call.responses})
        return {"resultType": "input_required", "inputRequests": ir.requests, "requestState": state}

    # ------------------------------------------------------------------ resources
    async def _handle_resources_read(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        uri = _str_param(p, "uri")
        self._restore_inputs(call, p, "resources/read", uri)
        res = self.registry.resources.get(uri)
        if res is not None:
            out = await res.handler(call, {"uri": uri})
        else:
            found = self.registry.find_template(uri)
            if found is None and self._upstream_uri(uri):
                return self._read_result(call, await self.state.proxy.read_resource(call, uri))
            if found is None:
                raise NotFound(f"Resource not found: {uri}", {"uri": uri})
            tpl, variables = found
            out = await tpl.handler(call, {"uri": uri, **variables})
        return self._read_result(call, out if isinstance(out, dict) and "contents" in out else {"contents": out})

    def _read_result(self, call: Call, result: dict[str, Any]) -> dict[str, Any]:
        if call.modern:
            result.setdefault("ttlMs", self.read_ttl_ms)
            result.setdefault("cacheScope", "private")
        return result

    def _upstream_uri(self, uri: str) -> bool:
        """Whether a URI the gateway does not serve itself belongs to a proxied upstream."""
        return self.state.proxy.active and self.state.proxy.owns_uri(uri)

    async def _resource_exists(self, call: Call, uri: str) -> bool:
        """A static resource, or a template match that the template says exists for the caller."""
        if uri in self.registry.resources:
            return True
        found = self.registry.find_template(uri)
        if found is None:
            return self._upstream_uri(uri)
        tpl, variables = found
        return tpl.exists is None or await tpl.exists(call, {"uri": uri, **variables})

    async def _handle_resources_subscribe(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        uri = _str_param(p, "uri")
        if call.session is None:
            raise McpError(INVALID_REQUEST, "resources/subscribe needs a session")
        if not await self._resource_exists(call, uri):
            raise NotFound(f"Resource not found: {uri}", {"uri": uri})
        cap = self.state.limits.of(call.principal).subscriptions_per_session
        held = await self.state.sessions.subscribe(call.session, uri, cap)
        if not held:
            raise exceeded("subscriptions", f"a session holds at most {cap} resource subscriptions",
                           self.config.limits.cap_retry_after_s)
        # A session subscribes to a URI once: following it upstream again would count it twice, and
        # one unsubscribe would leave it followed. A subscription the upstream did not take (refused
        # to the principal, or failed) is not kept: the session would hold one that never updates.
        if held == SUBSCRIBED and self._proxied_resource(uri):
            try:
                await self.state.proxy.resources.subscribe(call, uri)
            except BaseException:
                await self.state.sessions.unsubscribe(call.session, uri)
                raise
        return {}

    async def _handle_resources_unsubscribe(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        uri = _str_param(p, "uri")
        if call.session is not None:
            await self.state.sessions.unsubscribe(call.session, uri)
            if self._proxied_resource(uri):
                await self.state.proxy.resources.unsubscribe(call, uri)
        return {}

    def _proxied_resource(self, uri: str) -> bool:
        return uri not in self.registry.resources and self.registry.find_template(uri) is None \
            and self._upstream_uri(uri)

    async def _handle_subscriptions_listen(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        """Hold a notification stream open until the client goes, the gateway stops or the token
        it was opened with expires (``call.expires_at``): its credential is checked once, so the
        stream ends then, answered as on shutdown, and the client listens again with a fresh one."""
        if call.emit is None:
            raise McpError(INVALID_REQUEST, "subscriptions/listen needs a streaming response")
        wanted = p.get("notifications")
        if not isinstance(wanted, dict):
            raise InvalidParams("params.notifications must be an object")
        ack: dict[str, Any] = {}
        uris = wanted.get("resourceSubscriptions")
        if uris is not None:
            if not isinstance(uris, list) or not all(isinstance(u, str) for u in uris):
                raise InvalidParams("notifications.resourceSubscriptions must be a list of URIs")
            cap = self.state.limits.of(call.principal).subscriptions_per_session
            if cap and len(uris) > cap:
                raise exceeded("subscriptions", f"a listen stream holds at most {cap} resource subscriptions",
                               self.config.limits.cap_retry_after_s)
            ack["resourceSubscriptions"] = uris
        for flag in ("toolsListChanged", "resourcesListChanged", "promptsListChanged"):
            if wanted.get(flag) is True:
                ack[flag] = True
        sub_meta = {SUBSCRIPTION_ID_META_KEY: call.request_id}
        async with self.state.limits.listen_slot(call.principal):
            await call.emit(Notification(method="notifications/subscriptions/acknowledged",
                                         params={"notifications": ack, "_meta": sub_meta}))
            queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)
            listener = self.state.add_listener(call.principal, set(uris or ()), ack, queue)
            proxied: list[str] = []  # upstream resources this stream subscribed to (undone when it ends)
            try:
                for uri in uris or ():
                    if self._proxied_resource(uri):
                        await self.state.proxy.resources.subscribe(call, uri)
                        proxied.append(uri)
                while True:
                    note = await _next_note(queue, call.expires_at)
                    if note is None or listener.ended is not None:  # expired, shutdown, or fell behind
                        break
                    params = dict(note.get("params") or {})
                    params["_meta"] = {**params.get("_meta", {}), **sub_meta}
                    await call.emit(Notification(method=note["method"], params=params))
            finally:
                self.state.remove_listener(listener)
                for uri in proxied:
                    await self.state.proxy.resources.unsubscribe(call, uri)
        return {"_meta": sub_meta}

    # ------------------------------------------------------------------ prompts and completion
    async def _handle_prompts_get(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        name = _str_param(p, "name")
        prompt = self.registry.prompts.get(name)
        if prompt is None:
            if not self.state.proxy.active:
                raise InvalidParams(f"Prompt not found: {name}")
            self._restore_inputs(call, p, "prompts/get", name)
            return await self.state.proxy.get_prompt(call, name, p)
        args = p.get("arguments") or {}
        if not isinstance(args, dict) or not all(isinstance(v, str) for v in args.values()):
            raise InvalidParams("params.arguments must map names to strings")
        missing = [a["name"] for a in prompt.arguments if a.get("required") and a["name"] not in args]
        if missing:
            raise InvalidParams(f"Missing required prompt argument(s): {', '.join(missing)}")
        self._restore_inputs(call, p, "prompts/get", name)
        out = await prompt.handler(call, args)
        if not isinstance(out, dict) or "messages" not in out:
            raise McpError(INTERNAL_ERROR, "Prompt handler returned no messages")
        if prompt.description and "description" not in out:
            out = {**out, "description": prompt.description}
        return out

    async def _handle_completion_complete(self, call: Call, p: dict[str, Any]) -> dict[str, Any]:
        ref = p.get("ref")
        arg = p.get("argument")
        if not isinstance(ref, dict) or not isinstance(arg, dict) or not isinstance(arg.get("name"), str):
            raise InvalidParams("params.ref and params.argument {name, value} are required")
        value = arg.get("value", "")
        if not isinstance(value, str):  # read as "" it would complete every value there is
            raise InvalidParams("params.argument.value must be a string")
        values: list[str] = []
        if ref.get("type") == "ref/prompt":
            prompt = self.registry.prompts.get(ref.get("name", ""))
            if prompt is None and self.state.proxy.active:
                return await self.state.proxy.complete(call, p)
            if prompt is None:
                raise InvalidParams(f"Prompt not found: {ref.get('name')}")
            completer = prompt.completions.get(arg["name"])
            if completer is not None:
                values = list(completer(str(value or "")))
        elif ref.get("type") == "ref/resource":
            uri = ref.get("uri")
            if not isinstance(uri, str):
                raise InvalidParams("ref.uri must be a string")
            tpl = self.registry.template(uri)
            if tpl is None and uri not in self.registry.resources:
                if self._upstream_uri(uri):
                    return await self.state.proxy.complete(call, p)
                raise InvalidParams(f"Resource template not found: {uri}")
            template_completer = tpl.completions.get(arg["name"]) if tpl is not None else None
            if template_completer is not None:
                context = p.get("context")
                resolved = context.get("arguments") if isinstance(context, dict) else None
                resolved = {k: v for k, v in resolved.items() if isinstance(v, str)} if isinstance(resolved, dict) else {}
                values = list(await template_completer(call, str(value or ""), resolved))
        else:
            raise InvalidParams("ref.type must be ref/prompt or ref/resource")
        return {"completion": {"values": values[:100], "total": len(values), "hasMore": len(values) > 100}}
