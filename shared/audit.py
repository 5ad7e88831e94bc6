"""The audit log: capped Redis Streams of every change, sharded so that no one key takes every
write (and so that a Redis Cluster spreads them), merged newest first on read.

- The context store's records (append, clear, fork, evict, ...) go to the principal's own
  stream (``keys.ctx_audit``), written by the context script in the same call as the change,
  so a change and its record are atomic.
- Everything else (admin actions, the trainer, learn) goes through :func:`audit` to one of
  ``keys.AUDIT_SHARDS`` streams chosen by the record's principal (``keys.audit_stream``).

:func:`query` reads the streams a filter can match and merges them by entry id (the time
Redis wrote the record). Principals' streams are found through the store's stamps
(``keys.ctx_global_lru`` and ``keys.ctx_global_seen``) and read lazily: a principal last stamped before the newest
records already found cannot hold newer ones. Each record has ``ts_ms``, ``principal``,
``action`` and, when known, ``context`` and ``version``, plus free-form string fields.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shared import keys
from shared.redis_batch import pack_command
from shared.redis_client import AsyncRedis, Reach, read_within
from shared.redis_cluster_batch import auto_pipeline
from shared.text import as_str

log = logging.getLogger(__name__)

DEFAULT_MAXLEN = 100_000
_maxlen = DEFAULT_MAXLEN
_PAGE = 200
_MAX_SEQ = "18446744073709551615"
STAMP_SLACK_MS = 5_000  # a stamp may be this much older than its principal's newest record


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


async def audit(redis: AsyncRedis, *, principal: str, action: str, context: str | None = None,
                version: int | None = None, **fields: Any) -> str:
    """Append one record (XADD ... MAXLEN ~ cap) to the principal's shard; returns its id."""
    entry = record(principal=principal, action=action, context=context, version=version, **fields)
    entry_id = await redis.xadd(keys.audit_stream(principal), entry, maxlen=_maxlen, approximate=True)
    return as_str(entry_id)


def xadd_command(entry: dict[Any, Any]) -> tuple[Any, ...]:
    """The XADD that appends ``entry`` (from :func:`record`) to its principal's shard, for callers
    that pipeline their writes (shared/redis_batch.py) instead of one round trip each."""
    fields = [part for pair in entry.items() for part in pair]
    return ("XADD", keys.audit_stream(entry["principal"]), "MAXLEN", "~", _maxlen, "*", *fields)


AUDIT_INFLIGHT = 1  # a batched audit's round trips at once: the connection it keeps


class BatchedAudit:
    """Records of a hot path (one per proxied call) written off that path: collected for at most
    ``window_s`` (or ``max_records``) and sent as one pipelined write. On loopback a write costs
    the writer a syscall and a Redis wake-up (tens of µs); one per window instead of one per call
    keeps the audit out of the per-call cost. A record reaches the stream within ``window_s`` plus
    a round trip; :meth:`close` sends what is still held."""

    def __init__(self, redis: AsyncRedis, *, window_s: float = 0.005, max_records: int = 256) -> None:
        self.window_s = window_s
        self.max_records = max_records
        self._pipeline = auto_pipeline(redis, max_inflight=AUDIT_INFLIGHT, max_batch=max_records)
        self._pending: list[tuple[bytes, str]] = []  # (packed XADD, its stream)
        self._timer: asyncio.TimerHandle | None = None
        self._writing: set[asyncio.Future[Any]] = set()

    def add(self, entry: dict[Any, Any]) -> None:
        """Hold one record (from :func:`record`) for the next write; needs a running event loop."""
        command = xadd_command(entry)
        self._pending.append((pack_command(command), command[1]))
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
        written = asyncio.gather(*(self._pipeline.submit(packed, key) for packed, key in pending),
                                 return_exceptions=True)
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
        """Send what is held, wait for the writes in flight, and let go of the connections."""
        self.flush()
        if self._writing:
            await asyncio.gather(*self._writing, return_exceptions=True)
        await self._pipeline.aclose()


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Reader:
    """One stream read newest first, a page at a time, within [lo, hi]."""

    redis: Any
    key: str
    hi: str
    lo: str
    reach: Reach | None = None
    page: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    done: bool = False

    async def fill(self) -> None:
        if self.page or self.done:
            return
        batch = await read_within(self.reach, self.key, partial(self.redis.xrevrange, self.key, max=self.hi,
                                                                min=self.lo, count=_PAGE), None)
        if batch is None:  # its master is down (the reach names it)
            self.done = True
            return
        self.page = [(as_str(i), {as_str(k): as_str(v) for k, v in (raw or {}).items()}) for i, raw in batch]
        self.page.reverse()  # pop() from the end: newest first
        if len(batch) < _PAGE:
            self.done = True
        if batch:
            self.hi = "(" + as_str(batch[-1][0])

    def head(self) -> tuple[int, int] | None:
        return _id_key(self.page[-1][0]) if self.page else None


def matcher(principal: str | None, action: str | None, context: str | None) -> Callable[[dict[str, str]], bool]:
    """The filter of :func:`query`: ``action`` ending in ``*`` matches a prefix; ``principal``
    ``admin:<name>`` also matches records an admin key of that name made for others."""
    def match(rec: dict[str, str]) -> bool:
        if principal is not None and rec.get("principal") != principal and not (
                principal.startswith("admin:") and rec.get("admin") == principal[6:]):
            return False
        if action is not None and rec.get("action") != action and not (
                action.endswith("*") and rec.get("action", "").startswith(action[:-1])):
            return False
        return context is None or rec.get("context") == context
    return match


async def _principal_streams(redis: Any, principal: str | None, reach: Reach | None) -> list[tuple[int, str]]:
    """(bound ms, stream) of the context-store streams a query for ``principal`` visits, the
    newest bound first: no record of the stream is newer than its bound."""
    if principal is not None and not principal.startswith("admin:"):
        return [(2**62, keys.ctx_audit(principal))]
    if principal is not None:
        return []  # admin keys' records are never in a principal's context stream
    shards: list[Any] = await asyncio.gather(*[read_within(reach, key(k), partial(redis.zrange, key(k), 0, -1, withscores=True), [])
                                    for key in (keys.ctx_global_lru, keys.ctx_global_seen)
                                    for k in range(keys.CTX_GLOBAL_SHARDS)])
    last: dict[str, int] = {}
    for shard in shards:
        for p, score in shard:
            last[as_str(p)] = max(int(score), last.get(as_str(p), 0))
    return sorted(((t + STAMP_SLACK_MS, keys.ctx_audit(p)) for p, t in last.items()), reverse=True)


async def query(redis: AsyncRedis, *, principal: str | None = None, action: str | None = None,
                context: str | None = None, since_ms: int | None = None, until_ms: int | None = None,
                limit: int = 100, scan_max: int = 10_000, reach: Reach | None = None) -> list[dict[str, str]]:
    """Newest-first records matching every given filter (see :func:`matcher`), from every
    stream that can hold them; reads at most ``scan_max`` records. ``reach``: streams whose
    master is down are left out and named there (without it their failure is raised)."""
    if limit < 1 or scan_max < 1:
        raise ValueError("limit and scan_max must be >= 1")
    hi = f"{until_ms}-{_MAX_SEQ}" if until_ms is not None else "+"
    lo = f"{since_ms}-0" if since_ms is not None else "-"
    shard_keys = ([keys.audit_stream(principal)] if principal is not None and not principal.startswith("admin:")
                  else keys.audit_streams())
    waiting = await _principal_streams(redis, principal, reach)
    waiting.reverse()  # pop() from the end: the newest bound first
    heap: list[tuple[tuple[int, int], int, _Reader]] = []
    readers = [_Reader(redis, k, hi, lo, reach) for k in shard_keys]

    async def add(new: list[_Reader]) -> None:
        await asyncio.gather(*[r.fill() for r in new])
        for r in new:
            head = r.head()
            if head is not None:
                heapq.heappush(heap, ((-head[0], -head[1]), id(r), r))

    await add(readers)
    match = matcher(principal, action, context)
    out: list[dict[str, str]] = []
    scanned = 0
    while len(out) < limit and scanned < scan_max:
        newest = -heap[0][0][0] if heap else -1
        if waiting and waiting[-1][0] >= newest:  # that stream may hold newer records: read it too
            batch: list[_Reader] = []
            while waiting and waiting[-1][0] >= newest and len(batch) < 64:
                batch.append(_Reader(redis, waiting.pop()[1], hi, lo, reach))
            await add(batch)
            continue
        if not heap:
            break
        _, _, reader = heapq.heappop(heap)
        entry_id, rec = reader.page.pop()
        scanned += 1
        if match(rec):
            out.append({**rec, "id": entry_id})
        await add([reader])
    return out
