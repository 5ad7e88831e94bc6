"""The audit log: query by principal (or ``admin:<key name>``), action (a trailing ``*``
matches a prefix) and time, newest first, merged from its shards (shared/audit.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import MAX_LIST, admin_router, viewer
from gateway.state import gateway_of
from shared import audit as audit_log
from shared.redis_client import Reach

router = admin_router()

_MAX_SCANNED = 100_000  # entries read per query at most, however few match


def _entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


@router.get("/audit", summary="Query the audit log by principal, action and time (newest first)")
async def query_audit(request: Request,
                      principal: Annotated[str | None, Query(max_length=200)] = None,
                      action: Annotated[str | None, Query(max_length=200)] = None,
                      since_ms: Annotated[int | None, Query(ge=0, le=2**53)] = None,
                      until_ms: Annotated[int | None, Query(ge=0, le=2**53)] = None,
                      limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                      who: AdminPrincipal = viewer) -> dict[str, Any]:
    """The audit shards live on every master: while a master is down the answer holds the
    records of the others, with ``partial: true`` and the masters missed."""
    redis = gateway_of(request).redis
    reach = Reach(redis)
    found = await audit_log.query(redis, principal=principal, action=action, since_ms=since_ms,
                                  until_ms=until_ms, limit=limit, scan_max=_MAX_SCANNED, reach=reach)
    reach.check()
    out: list[dict[str, Any]] = [{**e, "ts_ms": _entry_ms(e["id"])} for e in found]
    return {"entries": out, "count": len(out), **reach.as_json()}
