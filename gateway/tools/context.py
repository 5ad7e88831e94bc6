"""The context store over MCP.

Tools ``context_append``, ``context_get``, ``context_clear``, ``context_fork``; the resource
template ``context://{context_id}/{modality}`` (text entries as ``text`` contents, binary as
``blob``), whose variables ``completion/complete`` fills from the caller's own contexts; the
caller's contexts in resources/list. The admin routes over the same store are
in gateway/admin/contexts.py. Every handler scopes the store by the authenticated principal (``ctx.principal``) — a client
can only ever name its own contexts. Binary content arrives base64 and is decoded once here.
Store and Redis exceptions propagate: gateway/errors.py decides what the client sees (an
unknown context is -32602 for a tool; for the resource, -32002 on 2025-11-25 and -32602 with
``data.uri`` on 2026-07-28).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from gateway.errors import InvalidParams, NotFound
from gateway.registry import Registry, ToolContext
from shared.aio import spawn
from shared.context import ContextError
from shared.context.validation import REQUEST_ID_PATTERN, is_context_id
from shared.media_check import MediaError, check_media_header
from shared.types import ContextWindow, Entry

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger("learnmesh.context")

_ID = {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]*$"}
# A modality's name as the configuration allows it (context.modalities): a name of megabytes
# is refused here rather than echoed back in the error that it is not configured.
MODALITY: dict[str, Any] = {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,31}$"}
# Channels to read, each named once (a list of thousands of names would reach Redis whole).
MODALITIES: dict[str, Any] = {"type": "array", "items": MODALITY, "minItems": 1, "maxItems": 64,
                              "uniqueItems": True}
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
        "modality": {**MODALITY, "description": "a configured modality: text, image, audio, ..."},
        "role": {"type": "string", "minLength": 1, "maxLength": 64, "default": "user"},
        "text": {"type": "string", "description": "UTF-8 content (text modality)"},
        "data": {"type": "string", "description": "base64 content (binary modalities)"},
        # no control characters: a client may put the stored type into a header of its own
        "mime_type": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[^\\u0000-\\u001f\\u007f]*$"},
        "tokens": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1,
                   "description": "token count; default 1 per byte"},
        "links": {"type": "array", "items": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,31}:[0-9]{1,15}$"},
                  "maxItems": 64,
                  "description": "ids of entries in other channels, e.g. 'image:3'"},
        "request_id": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN}$",
                       "description": "makes a retry safe: an append naming the request_id of one of this "
                                      "context's last 8 appends that named one appends nothing and answers "
                                      "that append's entry_id and version (with repeated: true)"},
    },
    "required": ["context_id", "modality"],
    "additionalProperties": False,
}
APPEND_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"context_id": {"type": "string"}, "entry_id": {"type": "string"},
                   "version": {"type": "integer"}, "evicted": {"type": "array", "items": {"type": "string"}},
                   "repeated": {"type": "boolean", "description": "true: the request_id named an earlier append, "
                                                                  "whose answer this is; nothing was appended"}},
    "required": ["context_id", "entry_id", "version", "evicted"],
}
GET_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "context_id": _ID,
        "modalities": MODALITIES,
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


def integer(value: Any) -> Any:
    """``value``, a float with no fraction as the int it is: JSON Schema's integer (which the
    inputSchema promises) includes 5.0, and a client whose numbers are floats sends that. Only
    within 2**53, where a float is exact: 1e300 stays a float (and is refused) rather than
    becoming a 300-digit int that no 64-bit field holds."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53 else value


def _integers(args: dict[str, Any], *names: str) -> dict[str, Any]:
    """``args`` with the integer arguments ``names`` as ints (see :func:`integer`)."""
    return {**args, **{n: integer(args[n]) for n in names if n in args}}


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


async def notify_changed(ctx: ToolContext, context_id: str, modalities: list[str], *, listed: bool = False) -> None:
    """Tell the caller's subscribers of each channel; ``listed``: the caller's resources/list
    changed too (a channel gained its first entry or lost its entries)."""
    for mod in modalities:
        try:
            await ctx.state.notify_resource_updated(ctx.principal, resource_uri(context_id, mod))
        except Exception:  # noqa: BLE001 - a lost hint must not fail the write that succeeded
            log.warning("could not publish a resource update for %s", context_id)
    if listed:
        await _list_changed(ctx)


# ---------------------------------------------------------------------- resources/list_changed
# The principals whose resources/list changed during the call being served (a context of theirs
# was evicted: idle, over a budget, by an admin; or a tool opened, cleared or forked one). Each
# is told once, when the call ends, however many of its operations changed the list.
_CHANGED: ContextVar[set[str] | None] = ContextVar("learnmesh_resources_changed", default=None)


@contextlib.asynccontextmanager
async def list_changes(state: Gateway) -> AsyncIterator[None]:
    """Collect the list changes of the block and announce each principal's once at its end
    (in the background if the block failed: a cancelled call must not wait on Redis)."""
    if _CHANGED.get() is not None:  # an outer block announces
        yield
        return
    changed: set[str] = set()
    token = _CHANGED.set(changed)
    try:
        yield
    except BaseException:
        _announce_later(state, changed, token)
        raise
    _CHANGED.reset(token)
    if changed:
        await state.contexts_evicted(sorted(changed))


def _announce_later(state: Gateway, changed: set[str], token: Token[set[str] | None]) -> None:
    _CHANGED.reset(token)
    if changed:
        spawn(state.contexts_evicted(sorted(changed)), _ANNOUNCING, "announcing resources/list_changed")


_ANNOUNCING: set[asyncio.Task[Any]] = set()  # announcements made in the background


def eviction_notices(state: Gateway) -> Callable[[str, list[str]], None]:
    """The store's ``on_evicted`` for a gateway: the principal's list changed. Inside a call
    (:func:`list_changes`, :func:`announcing`) it is announced when the call ends; elsewhere in
    the background."""
    def evicted(principal: str, _contexts: list[str]) -> None:
        changed = _CHANGED.get()
        if changed is not None:
            changed.add(principal)
        else:
            spawn(state.contexts_evicted([principal]), _ANNOUNCING, "announcing resources/list_changed")
    return evicted


_P = ParamSpec("_P")
_R = TypeVar("_R")


def announcing(fn: Callable[Concatenate[ToolContext, _P], Awaitable[_R]]
               ) -> Callable[Concatenate[ToolContext, _P], Awaitable[_R]]:
    """A handler whose calls announce their list changes once, as :func:`list_changes` does
    (written out: a context manager would cost every call several microseconds)."""
    @functools.wraps(fn)
    async def run(ctx: ToolContext, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if _CHANGED.get() is not None:
            return await fn(ctx, *args, **kwargs)
        changed: set[str] = set()
        token = _CHANGED.set(changed)
        try:
            out = await fn(ctx, *args, **kwargs)
        except BaseException:
            _announce_later(ctx.state, changed, token)
            raise
        _CHANGED.reset(token)
        if changed:
            await ctx.state.contexts_evicted(sorted(changed))
        return out
    return run


async def _list_changed(ctx: ToolContext) -> None:
    changed = _CHANGED.get()
    if changed is not None:
        changed.add(ctx.principal)
        return
    try:
        await ctx.state.notify_list_changed(ctx.principal, "resources")
    except Exception:  # noqa: BLE001 - a lost hint must not fail the write that succeeded
        log.warning("could not publish resources/list_changed")


# ---------------------------------------------------------------------- tool bodies
async def context_append(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    store = ctx.state.store
    args = _integers(args, "tokens")
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
    try:  # what no worker could read would fail every later generate and score on this context
        check_media_header(modality, content, max_image_pixels=ctx.state.config.model.max_image_pixels)
    except MediaError as exc:
        raise InvalidParams(f"{modality} entry refused: {exc}", {"modality": modality}) from None
    res = await store.append(ctx.principal, args["context_id"], modality, args.get("role", "user"), content,
                             mime=args.get("mime_type"), tokens=args.get("tokens"), links=args.get("links", ()),
                             request_id=args.get("request_id"))
    out = {"context_id": args["context_id"], "entry_id": res.entry_id, "version": res.version, "evicted": res.evicted}
    if res.repeated:
        out["repeated"] = True
    else:
        await notify_changed(ctx, args["context_id"], [modality], listed=res.opened)
    return out


async def context_get(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    store = ctx.state.store
    args = _integers(args, "last_n", "max_tokens", "version")
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


async def context_clear(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    store = ctx.state.store
    version = await store.clear(ctx.principal, args["context_id"])
    await notify_changed(ctx, args["context_id"], list(store.cfg.modalities), listed=True)
    return {"context_id": args["context_id"], "version": version}


async def context_fork(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    store = ctx.state.store
    dst = await store.fork(ctx.principal, args["context_id"], args.get("new_context_id"))
    version = await store.version(ctx.principal, dst)
    await _list_changed(ctx)
    return {"context_id": dst, "source": args["context_id"], "version": version}


async def read_context_resource(ctx: ToolContext, args: dict[str, Any]) -> list[dict[str, Any]]:
    store = ctx.state.store
    uri, modality = args["uri"], args["modality"]
    if modality not in store.cfg.modalities or not is_context_id(args["context_id"]):
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


async def context_resource_exists(ctx: ToolContext, args: dict[str, Any]) -> bool:
    """The caller holds the context and the modality is configured (what it may subscribe to)."""
    store = ctx.state.store
    if args["modality"] not in store.cfg.modalities:
        return False
    try:
        await store.version(ctx.principal, args["context_id"])
    except ContextError:  # unknown context, or not an id at all
        return False
    return True


async def list_context_resources(ctx: ToolContext) -> list[dict[str, Any]]:
    infos = await ctx.state.store.list_contexts(ctx.principal)
    out = []
    for info in infos:
        for mod, n in info.entries.items():
            if n > 0:
                out.append({"uri": resource_uri(info.id, mod), "name": f"{info.id} ({mod})",
                            "mimeType": "text/plain" if mod == "text" else "application/octet-stream",
                            "description": f"{n} {mod} entries, version {info.version}"})
    return out


async def complete_context_id(ctx: ToolContext, typed: str, resolved: dict[str, str]) -> list[str]:
    """The caller's context ids that start with what was typed, most recently used first."""
    return [info.id for info in await ctx.state.store.list_contexts(ctx.principal) if info.id.startswith(typed)]


async def complete_modality(ctx: ToolContext, typed: str, resolved: dict[str, str]) -> list[str]:
    """The modalities the chosen context holds entries in; every configured one before a context is chosen."""
    store = ctx.state.store
    context_id = resolved.get("context_id")
    if context_id:
        info = next((i for i in await store.list_contexts(ctx.principal) if i.id == context_id), None)
        held = [] if info is None else [m for m in store.cfg.modalities if info.entries.get(m, 0) > 0]
    else:
        held = list(store.cfg.modalities)
    return [m for m in held if m.startswith(typed)]


def register(registry: Registry) -> None:
    registry.tool("context_append", description="Append one entry (text, or base64 data for image/audio) to "
                  "a context of yours; creates the context. Returns the entry id and the new version.",
                  input_schema=APPEND_INPUT, output_schema=APPEND_OUTPUT,
                  title="Append to context")(announcing(context_append))
    registry.tool("context_get", description="Read a context: newest entries per modality (last_n and/or "
                  "max_tokens), optionally resolving linked entries; or the whole context at a retained version.",
                  input_schema=GET_INPUT, output_schema=GET_OUTPUT, title="Read context",
                  annotations={"readOnlyHint": True})(announcing(context_get))
    registry.tool("context_clear", description="Empty every channel of a context (bumps its version).",
                  input_schema=CLEAR_INPUT, output_schema=CLEAR_OUTPUT, title="Clear context",
                  annotations={"destructiveHint": True})(announcing(context_clear))
    registry.tool("context_fork", description="Copy a context's current entries into a new context.",
                  input_schema=FORK_INPUT, output_schema=FORK_OUTPUT, title="Fork context")(announcing(context_fork))
    registry.resource_template("context://{context_id}/{modality}", name="context channel",
                               description="The entries of one modality channel of one of your contexts "
                               "(text entries as text, binary as blob).",
                               completions={"context_id": announcing(complete_context_id),
                                            "modality": announcing(complete_modality)},
                               exists=announcing(context_resource_exists))(announcing(read_context_resource))
    registry.resource_lister(announcing(list_context_resources))
