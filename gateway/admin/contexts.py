"""The context store for operators: principals and their bytes, a principal's contexts, one
context's entry metadata, a full export, and eviction. Store and Redis errors reach the
client through the one error map (gateway/errors.py: 400 bad input, 404 unknown context,
503 with Retry-After when Redis is away)."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import MAX_LIST, McpPrincipal, admin, operator, viewer
from gateway.state import gateway_of
from gateway.tools.context import entry_json, list_changes, window_json
from shared import audit as audit_log
from shared import keys
from shared.redis_client import Reach

router = APIRouter()

Principal = Annotated[McpPrincipal, Query(description="an MCP principal (an API key's name, or a token's subject)")]


@router.get("/admin/contexts")
async def admin_list(request: Request, principal: Principal | None = None,
                     limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                     who: AdminPrincipal = viewer) -> dict[str, Any]:
    """Without ``principal``: the ``limit`` most recently active principals with their bytes
    (``total``: how many hold contexts), read from every master: while a master is down the
    answer holds what the others hold (a principal whose own master is down with ``bytes:
    null``), with ``partial: true`` and the masters missed. With it: that principal's ``limit``
    most recently used contexts, and the bytes of all of them."""
    store = gateway_of(request).store
    if principal is None:
        reach = Reach(store.redis)
        names = await store.principals(reach)
        rows = [{"principal": p, "bytes": await reach.read(keys.ctx_meta(p), partial(store.principal_bytes, p), None)}
                for p in names[:limit]]
        total = await store.global_bytes(reach)
        reach.check()
        return {"principals": rows, "count": len(rows), "total": len(names), "global_bytes": total,
                "global_budget_bytes": store.cfg.global_budget_bytes, **reach.as_json()}
    infos = await store.list_contexts(principal)
    shown = infos[:limit]
    return {"principal": principal, "bytes": sum(i.bytes for i in infos),
            "budget_bytes": store.cfg.principal_budget_bytes, "count": len(shown), "total": len(infos),
            "contexts": [{"id": i.id, "version": i.version, "bytes": i.bytes, "entries": i.entries,
                          "last_used_ms": i.last_used_ms, "created_ms": i.created_ms} for i in shown]}


@router.get("/admin/contexts/{principal}/{context_id}")
async def admin_inspect(request: Request, principal: McpPrincipal, context_id: str,
                        who: AdminPrincipal = viewer) -> dict[str, Any]:
    """Entry metadata (no content) of the current version."""
    win = await gateway_of(request).store.get_window(principal, context_id)
    return {"principal": principal, "context_id": context_id, "version": win.version,
            "entries": [{k: v for k, v in entry_json(e).items() if k not in ("text", "data")}
                        for e in win.entries()]}


@router.get("/admin/contexts/{principal}/{context_id}/export")
async def admin_export(request: Request, principal: McpPrincipal, context_id: str,
                       who: AdminPrincipal = admin) -> dict[str, Any]:
    """The whole current context as JSON; binary entries base64 (``data``)."""
    gateway = gateway_of(request)
    win = await gateway.store.get_window(principal, context_id)
    await audit_log.audit(gateway.redis, principal=principal, action="admin_export", context=context_id,
                          version=win.version, admin=who.name)
    return {"principal": principal, **window_json(win)}


@router.delete("/admin/contexts/{principal}/{context_id}")
async def admin_evict(request: Request, principal: McpPrincipal, context_id: str,
                      who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    async with list_changes(gateway):  # the principal's clients see its channels leave their resources/list
        done = await gateway.store.evict(principal, context_id, reason="admin")
    await audit_log.audit(gateway.redis, principal=principal, action="admin_evict", context=context_id,
                          admin=who.name, found=int(done))
    if not done:
        raise HTTPException(404, f"context {context_id} not found")
    return {"evicted": True, "principal": principal, "context_id": context_id}
