"""The audit log: one capped Redis Stream (``keys.AUDIT_STREAM``) of every change.

Context scripts write their own records inside the same Lua call (so a change and its
audit record are atomic); everything else (admin actions, trainer) calls :func:`audit`.
Each record has ``ts_ms``, ``principal``, ``action`` and, when known, ``context`` and
``version``, plus free-form string fields.
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis

from shared import keys
from shared.text import as_str

DEFAULT_MAXLEN = 100_000
_maxlen = DEFAULT_MAXLEN


def configure(maxlen: int) -> None:
    """Set the stream cap (``context.audit_maxlen``); called once at start."""
    global _maxlen
    if maxlen < 1:
        raise ValueError("audit maxlen must be >= 1")
    _maxlen = maxlen


def record(*, principal: str, action: str, context: str | None = None, version: int | None = None,
           **fields: Any) -> dict[Any, Any]:
    """One audit record as the stream stores it (every value a string; None fields left out)."""
    out: dict[Any, Any] = {"ts_ms": str(int(time.time() * 1000)), "principal": principal, "action": action}
    if context is not None:
        out["context"] = context
    if version is not None:
        out["version"] = str(version)
    for name, value in fields.items():
        if value is not None:
            out[name] = str(value)
    return out


async def audit(redis: aioredis.Redis, *, principal: str, action: str, context: str | None = None,
                version: int | None = None, **fields: Any) -> str:
    """Append one record (XADD ... MAXLEN ~ cap); returns the stream id."""
    entry = record(principal=principal, action=action, context=context, version=version, **fields)
    entry_id = await redis.xadd(keys.AUDIT_STREAM, entry, maxlen=_maxlen, approximate=True)
    return as_str(entry_id)


def xadd_command(entry: dict[Any, Any]) -> tuple[Any, ...]:
    """The XADD that appends ``entry`` (from :func:`record`), for callers that pipeline their
    writes (shared/redis_batch.py) instead of one round trip each."""
    fields = [part for pair in entry.items() for part in pair]
    return ("XADD", keys.AUDIT_STREAM, "MAXLEN", "~", _maxlen, "*", *fields)


async def query(redis: aioredis.Redis, *, principal: str | None = None, action: str | None = None,
                context: str | None = None, since_ms: int | None = None, limit: int = 100,
                scan_max: int = 10_000) -> list[dict[str, str]]:
    """Newest-first records matching every given filter (scans at most ``scan_max`` records)."""
    if limit < 1 or scan_max < 1:
        raise ValueError("limit and scan_max must be >= 1")
    out: list[dict[str, str]] = []
    upper = "+"
    lower = f"{since_ms}-0" if since_ms is not None else "-"
    scanned = 0
    while len(out) < limit and scanned < scan_max:
        batch = await redis.xrevrange(keys.AUDIT_STREAM, max=upper, min=lower, count=min(500, scan_max - scanned))
        if not batch:
            break
        for entry_id, raw in batch:
            rec = {as_str(k): as_str(v) for k, v in (raw or {}).items()}
            rec["id"] = as_str(entry_id)
            if ((principal is None or rec.get("principal") == principal)
                    and (action is None or rec.get("action") == action)
                    and (context is None or rec.get("context") == context)):
                out.append(rec)
                if len(out) >= limit:
                    break
        scanned += len(batch)
        upper = "(" + as_str(batch[-1][0])  # exclusive: continue below the last id seen
    return out
