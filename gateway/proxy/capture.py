"""Opt-in capture: a proxied call's arguments and results become entries of the caller's
context (``_meta`` ``io.learnmesh/context`` names it, else ``proxy.<upstream>``), by channel:
text, image and audio content. An image or audio item whose header no worker could read is left
out (logged): stored, it would fail every later ``generate`` and ``score`` on the context, as
``context_append`` refuses it (shared/media_check.py). A capture that fails is logged; the
call's answer is unaffected."""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

import orjson

from gateway.errors import McpError
from gateway.mcp.dispatcher import Call
from shared.context import ContextError, ContextStore
from shared.media_check import MediaError, check_media_header

log = logging.getLogger(__name__)

CAPTURE_CONTEXT_META_KEY = "io.learnmesh/context"  # _meta key naming the context captured calls go to
_MEDIA = {"image": "image", "audio": "audio"}


async def capture(store: ContextStore, call: Call, upstream: str, name: str, args: dict[str, Any],
                  result: dict[str, Any], *, max_image_pixels: int) -> None:
    """The call (``{"tool", "arguments"}`` as JSON, role ``user``) then each result content item
    (role ``assistant``), or the structured result when there is no content."""
    context = call.meta.get(CAPTURE_CONTEXT_META_KEY)
    context_id = context if isinstance(context, str) and context else f"proxy.{upstream}"
    try:
        call_text = orjson.dumps({"tool": name, "arguments": args})
        await store.append(call.principal, context_id, "text", "user", call_text)
        for item in result.get("content") or ():
            entry = _capture_entry(item)
            if entry is not None and entry[0] != "text":
                try:
                    check_media_header(entry[0], entry[1], max_image_pixels=max_image_pixels)
                except MediaError as exc:
                    log.warning("proxy capture of %s into %s left out an %s item no worker could read: %s",
                                name, context_id, entry[0], exc)
                    continue
            if entry is not None:
                await store.append(call.principal, context_id, entry[0], "assistant", entry[1], mime=entry[2])
        if isinstance(result.get("structuredContent"), dict) and not result.get("content"):
            await store.append(call.principal, context_id, "text", "assistant",
                               orjson.dumps(result["structuredContent"]))
    except (ContextError, McpError, OSError) as exc:
        log.warning("proxy capture of %s into %s failed: %s", name, context_id, type(exc).__name__)


def _capture_entry(item: Any) -> tuple[str, bytes, str | None] | None:
    """(channel, bytes, mime type) of one content item; None for what has no channel."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind == "text" and isinstance(item.get("text"), str):
        return "text", item["text"].encode(), None
    if kind in _MEDIA and isinstance(item.get("data"), str):
        try:
            return _MEDIA[kind], base64.b64decode(item["data"], validate=True), item.get("mimeType")
        except (binascii.Error, ValueError):
            return None
    return None
