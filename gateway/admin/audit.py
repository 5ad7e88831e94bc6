"""The audit log: query by principal (or ``admin:<key name>``), action (a trailing ``*``
matches a prefix) and time, newest first."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import MAX_LIST, admin_router, viewer
from gateway.state import gateway_of
from shared import keys
from shared.text import as_str

router = admin_router()

_BATCH = 500
_MAX_SCANNED = 100_000  # entries read per query at most, however few match
_MAX_SEQ = "18446744073709551615"


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
    r = gateway_of(request).redis
    hi = f"{until_ms}-{_MAX_SEQ}" if until_ms is not None else "+"
    lo = f"{since_ms}-0" if since_ms is not None else "-"
    out: list[dict[str, Any]] = []
    scanned = 0
    while len(out) < limit and scanned < _MAX_SCANNED:
        batch = await r.xrevrange(keys.AUDIT_STREAM, max=hi, min=lo, count=_BATCH)
        if not batch:
            break
        for eid, fields in batch:
            scanned += 1
            e = {as_str(k): as_str(v) for k, v in (fields or {}).items()}
            if principal is not None and e.get("principal") != principal and not (
                    principal.startswith("admin:") and e.get("admin") == principal[6:]):
                continue
            if action is not None and e.get("action") != action and not (
                    action.endswith("*") and e.get("action", "").startswith(action[:-1])):
                continue
            out.append({"id": as_str(eid), **e, "ts_ms": _entry_ms(as_str(eid))})
            if len(out) >= limit:
                break
        last = as_str(batch[-1][0])
        ms, seq = (int(x) for x in last.split("-"))
        if seq > 0:
            hi = f"{ms}-{seq - 1}"
        elif ms > 0:
            hi = f"{ms - 1}-{_MAX_SEQ}"
        else:
            break
        if len(batch) < _BATCH:
            break
    return {"entries": out, "count": len(out)}
