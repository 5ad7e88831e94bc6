"""The context store over MCP and admin REST.

Tools ``context_append``, ``context_get``, ``context_clear``, ``context_fork``; the resource
template ``context://{context_id}/{modality}`` (text entries as ``text`` contents, binary as
``blob``); the caller's contexts in resources/list; admin routes under ``/admin/contexts``.
Every handler scopes the store by the authenticated principal (``ctx.principal``) — a client
can only ever name its own contexts. Binary content arrives base64 and is decoded once here.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admin.auth import AdminPrincipal, require_role
from gateway.errors import InvalidParams, NotFound, Unavailable
from shared import audit as audit_log
from shared.context_store import ContextError, ContextNotFound, ContextStore
from shared.types import ContextWindow, Entry

log = logging.getLogger("learnmesh.context")

_ID = {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]*$"}
_ENTRY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"}, "modality": {"type": "string"}, "role": {"type": "string"},
        "text": {"type": "string"}, "data": {"type": "string", "description": "base64 (binary modalities)"},
        "mimeType": {"type": "string"}, "tokens": {"type": "integer"}, "bytes": {"type": "integer"},
        "tsMs": {"type": "integer"}, "links": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "modality", "role", "tokens", "bytes", "tsMs", "links"],
}

APPEND_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "context_id": _ID,
        "modality": {"type": "string", "description": "a configured modality: text, image, audio, ..."},
        "role": {"type": "string", "minLength": 1, "maxLength": 64, "default": "user"},
        "text": {"type": "string", "description": "UTF-8 content (text modality)"},
        "data": {"type": "string", "description": "base64 content (binary modalities)"},
        "mime_type": {"type": "string", "maxLength": 128},
        "tokens": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1,
                   "description": "token count; default 1 per byte"},
        "links": {"type": "array", "items": {"type": "string"}, "maxItems": 64,
                  "description": "ids of entries in other channels, e.g. 'image:3'"},
    },
    "required": ["context_id", "modality"],
    "additionalProperties": False,
}
APPEND_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"context_id": {"type": "string"}, "entry_id": {"type": "string"},
                   "version": {"type": "integer"}, "evicted": {"type": "array", "items": {"type": "string"}}},
    "required": ["context_id", "entry_id", "version", "evicted"],
}
GET_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "context_id": _ID,
        "modalities": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "last_n": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
        "resolve_links": {"type": "boolean", "default": False},
        "version": {"type": "integer", "minimum": 1, "description": "read the context as of this version"},
    },
    "required": ["context_id"],
    "additionalProperties": False,
}
GET_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"context_id": {"type": "string"}, "version": {"type": "integer"},
                   "entries": {"type": "array", "items": _ENTRY_SCHEMA}},
    "required": ["context_id", "version", "entries"],
}
CLEAR_INPUT: dict[str, Any] = {"type": "object", "properties": {"context_id": _ID}, "required": ["context_id"],
                               "additionalProperties": False}
CLEAR_OUTPUT: dict[str, Any] = {"type": "object", "properties": {"context_id": {"type": "string"},
                                                                 "version": {"type": "integer"}},
                                "required": ["context_id", "version"]}
FORK_INPUT: dict[str, Any] = {"type": "object", "properties": {"context_id": _ID, "new_context_id": _ID},
                              "required": ["context_id"], "additionalProperties": False}
FORK_OUTPUT: dict[str, Any] = {"type": "object", "properties": {"context_id": {"type": "string"},
                                                                "source": {"type": "string"},
                                                                "version": {"type": "integer"}},
                               "required": ["context_id", "source", "version"]}


def _store(state: Any) -> ContextStore:
    store = getattr(state, "store", None)
    if store is None:
        raise Unavailable("the context store is not started")
    return store


def _mapped(resource: bool = False) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Store errors -> protocol errors: bad input -32602, unknown context -32602 for tools and
    -32002 for resources, Redis unreachable -> Unavailable (HTTP 503 + Retry-After)."""
    def deco(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(ctx: Any, args: dict[str, Any]) -> Any:
            try:
                return await fn(ctx, args)
            except ContextNotFound as exc:
                raise (NotFound(str(exc), {"uri": args.get("uri")}) if resource else InvalidParams(str(exc))) from None
            except ContextError as exc:
                raise InvalidParams(str(exc)) from None
            except (RedisConnectionError, RedisTimeoutError):
                retry = getattr(getattr(ctx.state, "config", None), "redis", None)
                raise Unavailable("context store unavailable", getattr(retry, "retry_after_s", 2)) from None
        return wrapper
    return deco


def entry_json(e: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"id": e.id, "modality": e.modality, "role": e.role, "tokens": e.tokens,
                           "bytes": e.size_bytes, "tsMs": e.ts_ms, "links": list(e.links)}
    if e.modality == "text":
        out["text"] = e.text
    else:
        out["data"] = base64.b64encode(e.content).decode()
    if e.mime:
        out["mimeType"] = e.mime
    return out


def window_json(win: ContextWindow) -> dict[str, Any]:
    return {"context_id": win.context_id, "version": win.version, "entries": [entry_json(e) for e in win.entries()]}


def resource_uri(context_id: str, modality: str) -> str:
    return f"context://{context_id}/{modality}"


async def _notify(ctx: Any, context_id: str, modalities: list[str]) -> None:
    notify = getattr(ctx.state, "notify_resource_updated", None)
    if notify is None:
        return
    for mod in modalities:
        try:
            await notify(ctx.principal, resource_uri(context_id, mod))
        except Exception:  # noqa: BLE001 - a lost hint must not fail the write that succeeded
            log.warning("could not publish a resource update for %s", context_id)


# ---------------------------------------------------------------------- tool bodies
@_mapped()
async def context_append(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    store = _store(ctx.state)
    modality = args["modality"]
    text, data = args.get("text"), args.get("data")
    if (text is None) == (data is None):
        raise InvalidParams("give exactly one of 'text' (UTF-8) or 'data' (base64)")
    if text is not None:
        content = text.encode("utf-8")
    else:
        if modality == "text":
            raise InvalidParams("the text modality takes 'text', not 'data'")
        try:
            content = base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParams("'data' is not valid base64") from None
    res = await store.append(ctx.principal, args["context_id"], modality, args.get("role", "user"), content,
                             mime=args.get("mime_type"), tokens=args.get("tokens"), links=args.get("links", ()))
    await _notify(ctx, args["context_id"], [modality])
    return {"context_id": args["context_id"], "entry_id": res.entry_id, "version": res.version,
            "evicted": res.evicted}


@_mapped()
async def context_get(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    store = _store(ctx.state)
    if args.get("version") is not None:
        if any(args.get(k) for k in ("last_n", "max_tokens", "resolve_links")):
            raise InvalidParams("'version' reads the whole context at that version; drop last_n/max_tokens")
        win = await store.read_at_version(ctx.principal, args["context_id"], args["version"],
                                          modalities=args.get("modalities"))
    else:
        win = await store.get_window(ctx.principal, args["context_id"], modalities=args.get("modalities"),
                                     last_n=args.get("last_n"), max_tokens=args.get("max_tokens"),
                                     resolve_links=bool(args.get("resolve_links")))
    return window_json(win)


@_mapped()
async def context_clear(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    store = _store(ctx.state)
    version = await store.clear(ctx.principal, args["context_id"])
    await _notify(ctx, args["context_id"], list(store.cfg.modalities))
    return {"context_id": args["context_id"], "version": version}


@_mapped()
async def context_fork(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
    store = _store(ctx.state)
    dst = await store.fork(ctx.principal, args["context_id"], args.get("new_context_id"))
    version = await store.version(ctx.principal, dst)
    notify = getattr(ctx.state, "notify_list_changed", None)
    if notify is not None:
        try:
            await notify(ctx.principal, "resources")
        except Exception:  # noqa: BLE001
            log.warning("could not publish resources/list_changed")
    return {"context_id": dst, "source": args["context_id"], "version": version}


@_mapped(resource=True)
async def read_context_resource(ctx: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    store = _store(ctx.state)
    uri, modality = args["uri"], args["modality"]
    if modality not in store.cfg.modalities:
        raise NotFound(f"Resource not found: {uri}", {"uri": uri})
    win = await store.get_window(ctx.principal, args["context_id"], modalities=[modality])
    out = []
    for e in win.channels.get(modality, []):
        item: dict[str, Any] = {"uri": uri, "_meta": {"entryId": e.id, "role": e.role, "version": win.version}}
        if modality == "text":
            item.update(mimeType=e.mime or "text/plain", text=e.text)
        else:
            item.update(mimeType=e.mime or "application/octet-stream",
                        blob=base64.b64encode(e.content).decode())
        out.append(item)
    return out


async def list_context_resources(ctx: Any) -> list[dict[str, Any]]:
    store = getattr(ctx.state, "store", None)
    if store is None:
        return []
    try:
        infos = await store.list_contexts(ctx.principal)
    except (RedisConnectionError, RedisTimeoutError):
        raise Unavailable("context store unavailable") from None
    out = []
    for info in infos:
        for mod, n in info.entries.items():
            if n > 0:
                out.append({"uri": resource_uri(info.id, mod), "name": f"{info.id} ({mod})",
                            "mimeType": "text/plain" if mod == "text" else "application/octet-stream",
                            "description": f"{n} {mod} entries, version {info.version}"})
    return out


def register(registry: Any) -> None:
    registry.tool("context_append", description="Append one entry (text, or base64 data for image/audio) to "
                  "a context of yours; creates the context. Returns the entry id and the new version.",
                  input_schema=APPEND_INPUT, output_schema=APPEND_OUTPUT, title="Append to context")(context_append)
    registry.tool("context_get", description="Read a context: newest entries per modality (last_n and/or "
                  "max_tokens), optionally resolving linked entries; or the whole context at a retained version.",
                  input_schema=GET_INPUT, output_schema=GET_OUTPUT, title="Read context",
                  annotations={"readOnlyHint": True})(context_get)
    registry.tool("context_clear", description="Empty every channel of a context (bumps its version).",
                  input_schema=CLEAR_INPUT, output_schema=CLEAR_OUTPUT, title="Clear context",
                  annotations={"destructiveHint": True})(context_clear)
    registry.tool("context_fork", description="Copy a context's current entries into a new context.",
                  input_schema=FORK_INPUT, output_schema=FORK_OUTPUT, title="Fork context")(context_fork)
    registry.resource_template("context://{context_id}/{modality}", name="context channel",
                               description="The entries of one modality channel of one of your contexts "
                               "(text entries as text, binary as blob).")(read_context_resource)
    lister = getattr(registry, "resource_lister", None)
    if lister is not None:
        lister(list_context_resources)


async def startup(state: Any) -> None:
    cfg = state.config.context
    audit_log.configure(cfg.audit_maxlen)
    state.store = ContextStore(state.redis, cfg)
    try:
        conf = await state.redis.config_get("maxmemory-policy")
        policy = conf.get("maxmemory-policy") or conf.get(b"maxmemory-policy")
        policy = policy.decode() if isinstance(policy, bytes) else policy
        if policy != "noeviction":
            log.warning("redis maxmemory-policy is %r: Redis may evict part of a context's keys; learnmesh "
                        "enforces its own exact budgets and needs 'noeviction'", policy)
    except Exception as exc:  # noqa: BLE001 - CONFIG may be disabled (managed Redis); not fatal
        log.warning("could not read redis maxmemory-policy (%s); make sure it is 'noeviction'", type(exc).__name__)


async def shutdown(state: Any) -> None:
    state.store = None


# ---------------------------------------------------------------------- admin REST
router = APIRouter()


def _admin_store(request: Request) -> ContextStore:
    app_state = request.app.state
    for holder in (getattr(app_state, "gateway", None), getattr(app_state, "state", None),
                   getattr(app_state, "gateway_state", None), app_state):
        store = getattr(holder, "store", None) if holder is not None else None
        if isinstance(store, ContextStore):
            return store
    raise HTTPException(503, "the context store is not started")


def _http(exc: Exception) -> HTTPException:
    if isinstance(exc, ContextNotFound):
        return HTTPException(404, str(exc))
    if isinstance(exc, ContextError):
        return HTTPException(400, str(exc))
    return HTTPException(503, "context store unavailable", headers={"Retry-After": "2"})


_ERRS = (ContextError, RedisConnectionError, RedisTimeoutError)
_VIEWER = Depends(require_role("viewer"))
_OPERATOR = Depends(require_role("operator"))
_ADMIN = Depends(require_role("admin"))
_PRINCIPAL_Q = Query(None, max_length=256)


@router.get("/admin/contexts")
async def admin_list(request: Request, principal: str | None = _PRINCIPAL_Q,
                     who: AdminPrincipal = _VIEWER) -> dict[str, Any]:
    """Without ``principal``: principals with their bytes; with it: that principal's contexts."""
    store = _admin_store(request)
    try:
        if principal is None:
            names = await store.principals()
            return {"principals": [{"principal": p, "bytes": await store.principal_bytes(p)} for p in names],
                    "global_bytes": await store.global_bytes(),
                    "global_budget_bytes": store.cfg.global_budget_bytes}
        infos = await store.list_contexts(principal)
    except _ERRS as exc:
        raise _http(exc) from None
    return {"principal": principal, "bytes": sum(i.bytes for i in infos),
            "budget_bytes": store.cfg.principal_budget_bytes,
            "contexts": [{"id": i.id, "version": i.version, "bytes": i.bytes, "entries": i.entries,
                          "last_used_ms": i.last_used_ms, "created_ms": i.created_ms} for i in infos]}


@router.get("/admin/contexts/{principal}/{context_id}")
async def admin_inspect(request: Request, principal: str, context_id: str,
                        who: AdminPrincipal = _VIEWER) -> dict[str, Any]:
    """Entry metadata (no content) of the current version."""
    store = _admin_store(request)
    try:
        win = await store.get_window(principal, context_id)
    except _ERRS as exc:
        raise _http(exc) from None
    return {"principal": principal, "context_id": context_id, "version": win.version,
            "entries": [{k: v for k, v in entry_json(e).items() if k not in ("text", "data")}
                        for e in win.entries()]}


@router.get("/admin/contexts/{principal}/{context_id}/export")
async def admin_export(request: Request, principal: str, context_id: str,
                       who: AdminPrincipal = _ADMIN) -> dict[str, Any]:
    """The whole current context as JSON; binary entries base64 (``data``)."""
    store = _admin_store(request)
    try:
        win = await store.get_window(principal, context_id)
        await audit_log.audit(store.redis, principal=principal, action="admin_export", context=context_id,
                              version=win.version, admin=who.name)
    except _ERRS as exc:
        raise _http(exc) from None
    return {"principal": principal, **window_json(win)}


@router.delete("/admin/contexts/{principal}/{context_id}")
async def admin_evict(request: Request, principal: str, context_id: str,
                      who: AdminPrincipal = _OPERATOR) -> dict[str, Any]:
    store = _admin_store(request)
    try:
        done = await store.evict(principal, context_id, reason="admin")
        await audit_log.audit(store.redis, principal=principal, action="admin_evict", context=context_id,
                              admin=who.name, found=int(done))
    except _ERRS as exc:
        raise _http(exc) from None
    if not done:
        raise HTTPException(404, f"context {context_id} not found")
    return {"evicted": True, "principal": principal, "context_id": context_id}
