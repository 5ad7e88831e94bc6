"""Legacy (2025-11-25) MCP sessions: list them, inspect one, terminate one on every replica."""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import HTTPException, Query, Request
from fastapi import Path as PathParam

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E404, MAX_LIST, admin_router, audit_action, operator, viewer
from gateway.mcp.sessions import is_session_id
from gateway.state import gateway_of
from shared import keys
from shared.redis_client import Reach
from shared.text import as_str

router = admin_router()

_SESS_RE = re.compile(r"^" + re.escape(keys.PREFIX) + r"\{([^{}]+)\}:sess:([^:]+)$")


async def session_refs(redis: aioredis.Redis, principal: str | None, limit: int, session_id: str | None = None,
                       max_scan_calls: int | None = None, reach: Reach | None = None) -> list[tuple[str, str]]:
    """(principal, session id) pairs: from the principal's index, or by scanning session hashes
    on every master (``max_scan_calls`` bounds the cost where completeness does not matter:
    the dashboard). ``reach``: the masters that do not answer are left out and named there."""
    reach = reach or Reach(redis)
    if principal and session_id is None:
        newest = await redis.zrevrange(keys.principal_sessions(principal), 0, limit - 1)
        return [(principal, as_str(x)) for x in newest]
    pattern = keys.session(principal or "*", session_id or "*")
    out: list[tuple[str, str]] = []
    budget = [max_scan_calls]  # shared by every master: the dashboard's bound holds for the whole cluster

    async def scan_node(node: aioredis.Redis) -> None:
        cursor = 0
        while len(out) < limit and budget[0] != 0:
            cursor, batch = await node.scan(cursor=cursor, match=pattern, count=1000)
            if budget[0] is not None:
                budget[0] -= 1
            out.extend(ref for ref in map(_session_ref, batch) if ref is not None)
            if cursor == 0:
                return

    await reach.each_primary(scan_node)
    reach.check()
    return out[:limit]


def _session_ref(key: bytes | str) -> tuple[str, str] | None:
    m = _SESS_RE.fullmatch(as_str(key))
    return (m.group(1), m.group(2)) if m else None


async def session_info(redis: aioredis.Redis, principal: str, sid: str) -> dict[str, Any] | None:
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(keys.session(principal, sid))
    pipe.pttl(keys.session(principal, sid))
    pipe.xlen(keys.session_events(principal, sid))
    pipe.hlen(keys.session_pending(principal, sid))
    pipe.zscore(keys.principal_sessions(principal), sid)
    fields, ttl_ms, n_events, n_pending, last_used = await pipe.execute()
    if not fields:
        return None
    f = {as_str(k): as_str(v) for k, v in fields.items()}
    try:
        caps = json.loads(f.get("caps") or "{}")
    except ValueError:
        caps = {}
    return {"id": sid, "principal": principal, "protocol_version": f.get("v"), "log_level": f.get("lvl") or None,
            "capabilities": caps, "last_used_s": last_used, "ttl_s": None if ttl_ms < 0 else round(ttl_ms / 1000, 1),
            "events": n_events, "pending_requests": n_pending}


async def _find_session(redis: aioredis.Redis, session_id: str) -> dict[str, Any]:
    if not is_session_id(session_id):
        raise HTTPException(404, "no such session")
    reach = Reach(redis)
    for principal, sid in await session_refs(redis, None, 2, session_id=session_id, reach=reach):
        info = await session_info(redis, principal, sid)
        if info is not None:
            return info
    reach.require_all()  # the session may be on the master that did not answer: not a 404
    raise HTTPException(404, "no such session")


@router.get("/sessions", summary="List legacy MCP sessions (optionally of one principal)")
async def list_sessions(request: Request,
                        principal: Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9_.@:\-]+$")] = None,
                        limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                        who: AdminPrincipal = viewer) -> dict[str, Any]:
    """Without ``principal`` the session hashes of every master are scanned: while a master is
    down the answer holds the others' sessions, with ``partial: true`` and the masters missed."""
    redis = gateway_of(request).redis
    reach = Reach(redis)
    infos = await session_infos(redis, await session_refs(redis, principal, limit, reach=reach), reach)
    return {"sessions": infos, "count": len(infos), **reach.as_json()}


async def session_infos(redis: aioredis.Redis, refs: list[tuple[str, str]], reach: Reach) -> list[dict[str, Any]]:
    """:func:`session_info` of each ref; one whose master went down since it was found is left out."""
    infos = []
    for p, sid in refs:
        info = await reach.read(keys.session(p, sid), partial(session_info, redis, p, sid), None)
        if info is not None:
            infos.append(info)
    return infos


@router.get("/sessions/{session_id}", summary="Inspect one session", responses={404: E404})
async def get_session(request: Request, session_id: Annotated[str, PathParam(max_length=256)],
                      who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _find_session(gateway_of(request).redis, session_id)


@router.delete("/sessions/{session_id}", summary="Terminate a session on every replica", responses={404: E404})
async def terminate_session(request: Request, session_id: Annotated[str, PathParam(max_length=256)],
                            who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    info = await _find_session(gateway.redis, session_id)
    await gateway.sessions.delete(info["principal"], session_id)
    await audit_action(gateway, who, "session.terminate", session=session_id, client=info["principal"])
    return {"terminated": session_id, "principal": info["principal"]}
