"""One forwarded call's side traffic, carried between the upstream and the client: progress
and log messages to the client's stream, list changes to the proxy, and server->client requests
(sampling, elicitation, roots) asked of the client the way its revision expects, refused with
-32021 when the client did not declare the capability.

A 2026-07-28 client answers on its next request (``input_required``): the question is refused
upstream and the call repeated later with the answers at hand; a 2025-11-25 upstream's questions
have no key of their own, so they are named by what they ask.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import INTERNAL_ERROR, MISSING_REQUIRED_CLIENT_CAPABILITY, McpError
from gateway.mcp.dispatcher import Call, InputRequired
from gateway.mcp.types import CLIENT_CAPABILITIES_META_KEY, LOG_LEVEL_META_KEY, LOG_LEVELS
from gateway.proxy.capture import CAPTURE_CONTEXT_META_KEY
from gateway.proxy.client import ALL_FORWARDED
from gateway.proxy.errors import UpstreamFailed
from gateway.proxy.wire import MAX_OPEN_QUESTIONS, Hooks, Message

if TYPE_CHECKING:
    from gateway.proxy.proxy import Proxy, Upstream

INPUT_GATHER_S = 0.05  # how long a 2025-11-25 upstream's further questions are awaited before refusing
CLIENT_CAPABILITY_OF = {"sampling/createMessage": "sampling", "elicitation/create": "elicitation",
                        "roots/list": "roots"}
LIST_KINDS = frozenset({"tools", "resources", "prompts"})  # the lists whose changes an upstream announces


def upstream_meta(call: Call) -> dict[str, Any]:
    """The ``_meta`` the upstream gets: the client's own (progress token, log level, extensions;
    for a 2025-11-25 client its session's capabilities and log level), without learnmesh's keys."""
    meta = {k: v for k, v in call.meta.items() if k != CAPTURE_CONTEXT_META_KEY}
    if not call.modern:
        session = call.session
        meta[LOG_LEVEL_META_KEY] = (session.log_level if session is not None else None) or "debug"
        if session is not None:
            meta[CLIENT_CAPABILITIES_META_KEY] = session.capabilities
    return meta


def _declared(call: Call) -> dict[str, Any]:
    if call.envelope is not None:
        return call.envelope.client_capabilities
    return call.session.capabilities if call.session is not None else {}


def forwardable_capabilities(call: Call) -> tuple[str, ...]:
    declared = _declared(call)
    return tuple(c for c in ALL_FORWARDED if c in declared)


def client_lacks(call: Call, method: str) -> str | None:
    """The capability a server->client request needs that the client did not declare, if any."""
    need = CLIENT_CAPABILITY_OF.get(method)
    if need is None:
        return None
    return None if need in _declared(call) else need


class CallHooks:
    """What arrives from the upstream during one forwarded call, carried to the client."""

    def __init__(self, proxy: Proxy, call: Call, up: Upstream) -> None:
        self.proxy = proxy
        self.call = call
        self.up = up
        self.asked: dict[str, int] = {}  # questions of a 2025-11-25 upstream so far, by key
        self._open = 0  # questions being asked of a 2025-11-25 client now
        self.stopped: InputRequired | McpError | None = None  # why the call cannot finish on this round
        self.hooks = Hooks(notify=self.notify, ask=self.ask, progress_token=call.meta.get("progressToken"))

    async def notify(self, msg: Message) -> None:
        """Progress for this call's own token (an upstream's progress for any other would reach
        the client as that request's) and log messages (a level MCP does not have read as
        ``info``) to the client; list changes to the proxy."""
        method = msg.get("method", "")
        params = _params(msg)
        if method == "notifications/progress":
            token = params.get("progressToken")
            if token is not None and token == self.hooks.progress_token:
                await self.call.notify(method, params)
        elif method == "notifications/message":
            level = params.get("level")
            await self.call.log(level if level in LOG_LEVELS else "info", params.get("data"),
                                params.get("logger") if isinstance(params.get("logger"), str) else None)
        elif (kind := changed_list(msg)) is not None:
            self.proxy.list_changed(self.up, kind)

    async def ask(self, msg: Message) -> Message:
        """A server->client request: the client's answer (or why there is none yet). At most
        MAX_OPEN_QUESTIONS are open at once (asked of the client, or gathered for its next
        request); what an upstream asks beyond them is refused, never relayed."""
        method, params = str(msg.get("method")), _params(msg)
        if self._open + len(self._gathered()) >= MAX_OPEN_QUESTIONS:
            return _error_reply(msg, INTERNAL_ERROR, f"more than {MAX_OPEN_QUESTIONS} requests to the client "
                                                     "at once")
        self._open += 1
        try:
            result = await self._ask_client(method, params, self._key(method, params))
        except InputRequired as ir:
            self._defer(ir)
        except McpError as exc:
            return _error_reply(msg, exc.code, exc.message)
        else:
            return {"jsonrpc": "2.0", "id": msg.get("id"), "result": result}
        finally:
            self._open -= 1
        # The upstream may be asking more at once: let those arrive before this refusal makes it
        # give up, so the client gets every question in one input_required.
        await asyncio.sleep(INPUT_GATHER_S)
        return _error_reply(msg, INTERNAL_ERROR, "the client answers on its next request")

    def _gathered(self) -> dict[str, Any]:
        return self.stopped.requests if isinstance(self.stopped, InputRequired) else {}

    def _key(self, method: str, params: dict[str, Any]) -> str:
        """A 2025-11-25 upstream's question has no key of its own: it is named by what it asks, so
        that the same question asked again when the call is repeated with the answers (in
        whatever order concurrent questions arrive) finds its answer."""
        digest = hashlib.sha256(orjson.dumps([method, params], option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
        key = f"{self.up.name}:{digest}"
        self.asked[key] = n = self.asked.get(key, 0) + 1
        return key if n == 1 else f"{key}#{n}"

    async def _ask_client(self, method: str, params: dict[str, Any], key: str) -> dict[str, Any]:
        lacking = client_lacks(self.call, method)
        if lacking is not None:
            self.stopped = McpError(MISSING_REQUIRED_CLIENT_CAPABILITY,
                                    f"Missing required client capability: {lacking}", {"capability": lacking})
            raise self.stopped
        return await self.call.request_client(method, params, key)

    async def answers(self, requests: Any) -> dict[str, Any]:
        """Answers to a 2026-07-28 upstream's ``inputRequests``, each asked of the client; a
        2026-07-28 client is asked for every missing one at once."""
        if not isinstance(requests, dict):
            raise McpError(INTERNAL_ERROR, f"upstream {self.up.name!r} sent input_required without inputRequests")
        if len(requests) > MAX_OPEN_QUESTIONS:
            raise UpstreamFailed(self.up.name, "protocol", f"upstream {self.up.name!r} asked {len(requests)} "
                                 f"questions at once (at most {MAX_OPEN_QUESTIONS})")
        out: dict[str, Any] = {}
        for key, req in requests.items():
            req = req if isinstance(req, dict) else {}
            try:  # the upstream's keys pass through: one call goes to one upstream
                out[key] = await self._ask_client(str(req.get("method")), _params(req), key)
            except InputRequired as ir:
                self._defer(ir)
        if self.stopped is not None:
            raise self.stopped
        return out

    def _defer(self, ir: InputRequired) -> None:
        if isinstance(self.stopped, InputRequired):
            self.stopped.requests.update(ir.requests)
        elif self.stopped is None:
            self.stopped = ir


def _params(msg: dict[str, Any]) -> dict[str, Any]:
    params = msg.get("params")
    return params if isinstance(params, dict) else {}


def _error_reply(msg: Message, code: int, message: str) -> Message:
    return {"jsonrpc": "2.0", "id": msg.get("id"), "error": {"code": code, "message": message}}


def changed_list(msg: Message) -> str | None:
    """The list (tools | resources | prompts) a ``notifications/<list>/list_changed`` is about;
    None for any other message."""
    method = msg.get("method", "")
    kind = method[len("notifications/"):-len("/list_changed")] if method.endswith("/list_changed") else ""
    return kind if kind in LIST_KINDS else None
