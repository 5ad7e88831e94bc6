"""The audit log: one capped Redis Stream (``keys.AUDIT_STREAM``) of every change.

Context scripts write their own records inside the same Lua call (so a change and its
audit record are atomic); everything else (admin actions, trainer) calls :func:`audit`.
Each record has ``ts_ms``, ``principal``, ``action`` and, when known, ``context`` and
``version``, plus free-form string fields.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis

from shared import keys
from shared.redis_batch import AutoPipeline, pack_command
from shared.text import as_str

log = logging.getLogger(__name__)

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


class BatchedAudit:
    """Records of a hot path (one per proxied call) written off that path: collected for at most
    ``window_s`` (or ``max_records``) and sent as one pipelined write. On loopback a write costs
    the writer a syscall and a Redis wake-up (tens of µs); one per window instead of one per call
    keeps the audit out of the per-call cost. A record reaches the stream within ``window_s`` plus
    a round trip; :meth:`close` sends what is still held."""

    def __init__(self, redis: aioredis.Redis, *, window_s: float = 0.005, max_records: int = 256) -> None:
        self.window_s = window_s
        self.max_records = max_records
        self._pipeline = AutoPipeline(redis, max_inflight=1, max_batch=max_records)
        self._pending: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._writing: set[asyncio.Future[Any]] = set()

    def add(self, entry: dict[Any, Any]) -> None:
        """Hold one record (from :func:`record`) for the next write; needs a running event loop."""
        self._pending.append(pack_command(xadd_command(entry)))
        if len(self._pending) >= self.max_records:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self.flush)

    def flush(self) -> None:
        """Send what is held now (one pipelined write); failures are logged once per write."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        written = asyncio.gather(*(self._pipeline.submit(packed) for packed in pending), return_exceptions=True)
        self._writing.add(written)
        written.add_done_callback(self._written)

    def _written(self, written: asyncio.Future[Any]) -> None:
        self._writing.discard(written)
        if written.cancelled():
            return
        failed = [r for r in written.result() if isinstance(r, BaseException)]
        if failed:
            log.warning("%d audit records were not written (%s)", len(failed), type(failed[0]).__name__)

    async def close(self) -> None:
        """Send what is held and wait for the writes in flight."""
        self.flush()
        if self._writing:
            await asyncio.gather(*self._writing, return_exceptions=True)


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
