"""Every replica's view of the upstreams' circuit breakers, for the admin API and the dashboard.

Breakers stay per replica (gateway/proxy/breaker.py says why), so behind a load balancer one
replica's answer shows one random replica's view. Each replica therefore publishes its view, one
field of the hash ``keys.PROXY_BREAKERS`` (replica id -> JSON report), with the stats publisher's
period (``metrics.status_interval_s``) and at once when one of its breakers changes state: a
write per state change, never one per call. A report older than ``proxy.health_ttl_s`` belongs
to a replica that stopped publishing: readers leave it out and delete it; the hash itself
expires once no replica has refreshed it for that long, and a replica that stops cleanly
withdraws its field. Ages compare the replicas' wall clocks, as the dashboard's rates do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, ValidationError
from redis.exceptions import RedisError

from gateway.proxy.breaker import CLOSED, OPEN
from shared import keys
from shared.aio import spawn
from shared.control import now_ms
from shared.text import as_str

if TYPE_CHECKING:
    from gateway.proxy.proxy import Upstream
    from shared.redis_client import AsyncRedis

log = logging.getLogger(__name__)

BreakerState = Literal["closed", "half_open", "open"]


class BreakerReport(BaseModel):
    """One replica's breaker of one upstream, as that replica last published it."""

    replica: str = Field(description="the gateway replica's id")
    state: BreakerState
    consecutive_failures: int = Field(ge=0)
    opened_ms: int | None = Field(description="when it last opened (ms since the epoch); null while closed")
    retry_at_ms: int | None = Field(description="while open: when one probe call may pass")
    calls: int = Field(ge=0, description="calls through that replica since it opened the upstream")
    errors: int = Field(ge=0)
    age_s: float = Field(ge=0, description="how old the report is (0: the replica answering)")


class MeshBreakers(BaseModel):
    """An upstream's breakers over the live replicas that have it open."""

    replicas: int = Field(ge=0, description="live replicas reporting this upstream")
    closed: int = Field(ge=0)
    half_open: int = Field(ge=0)
    open: int = Field(ge=0, description="replicas whose breaker is open: open on `open` of `replicas`")
    calls: int = Field(ge=0, description="the replicas' calls summed")
    errors: int = Field(ge=0)


def mesh_summary(reports: list[BreakerReport]) -> MeshBreakers:
    states = [r.state for r in reports]
    return MeshBreakers(replicas=len(reports), closed=states.count("closed"), half_open=states.count("half_open"),
                        open=states.count("open"), calls=sum(r.calls for r in reports),
                        errors=sum(r.errors for r in reports))


class BreakerBoard:
    """Publishes this replica's breakers and reads every replica's."""

    def __init__(self, redis: AsyncRedis, replica_id: str, ttl_s: float,
                 upstreams: Callable[[], Mapping[str, Upstream]]) -> None:
        self.redis = redis
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self._upstreams = upstreams
        self._lock = asyncio.Lock()  # one snapshot written at a time: an older one never lands last
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: asyncio.Task[Any] | None = None
        self._again = False
        self._published = False
        self._closed = False  # withdrawn: calls failing while the replica stops must not write it back

    # ------------------------------------------------------------------ this replica
    def local(self) -> dict[str, dict[str, Any]]:
        """This replica's breakers now, by upstream (the published form, without replica and age)."""
        now_mono, now_wall = time.monotonic(), now_ms()
        out: dict[str, dict[str, Any]] = {}
        for name, up in self._upstreams().items():
            breaker = up.client.breaker
            state = breaker.state
            opened = None if state == CLOSED else now_wall - round((now_mono - breaker.opened_at) * 1000)
            retry_at = opened + round(breaker.reset_s * 1000) if opened is not None and state == OPEN else None
            out[name] = {"state": state, "consecutive_failures": breaker.failures, "opened_ms": opened,
                         "retry_at_ms": retry_at, "calls": up.calls, "errors": up.errors}
        return out

    def changed(self) -> None:
        """A breaker moved (or the set of upstreams did): publish soon, coalescing a burst of
        changes into one write while a write is under way."""
        if self._closed:
            return
        if self._pending is None or self._pending.done():
            self._pending = spawn(self._publish_changes(), self._tasks, "publishing the upstreams' breakers")
        else:
            self._again = True

    async def _publish_changes(self) -> None:
        while True:
            self._again = False
            await self.publish()
            if not self._again:
                return

    async def publish(self) -> None:
        """Write this replica's report and renew the hash's TTL (the stats publisher's round)."""
        async with self._lock:
            upstreams = self.local()
            if self._closed or (not upstreams and not self._published):
                return
            ttl_ms = max(1, round(self.ttl_s * 1000))
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(keys.PROXY_BREAKERS, self.replica_id, json.dumps({"ts_ms": now_ms(), "upstreams": upstreams}))
            pipe.pexpire(keys.PROXY_BREAKERS, ttl_ms)
            await pipe.execute()
            self._published = bool(upstreams)

    async def close(self) -> None:
        """Stop publishing and take this replica's report out (with Redis away it ages out)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        try:
            async with self._lock:  # after a write under way, never before it
                await self.redis.hdel(keys.PROXY_BREAKERS, self.replica_id)
        except (RedisError, OSError) as exc:
            log.debug("could not withdraw the breakers' report: %s", type(exc).__name__)

    # ------------------------------------------------------------------ the mesh
    async def read(self) -> dict[str, list[BreakerReport]]:
        """Every live replica's breakers, by upstream: this replica's as they are now, the others'
        as last published. Reports older than ``ttl_s`` are deleted on the way."""
        raw = await self.redis.hgetall(keys.PROXY_BREAKERS)
        now = now_ms()
        out: dict[str, list[BreakerReport]] = {}
        stale: list[str] = []
        for field, body in (raw or {}).items():
            replica = as_str(field)
            if replica == self.replica_id:
                continue
            report = _parsed(body)
            age_ms = now - report["ts_ms"] if report is not None else None
            if report is None or age_ms is None or age_ms > self.ttl_s * 1000:
                stale.append(replica)
                continue
            for name, fields in report["upstreams"].items():
                entry = _report(replica, fields, max(0.0, age_ms / 1000))
                if entry is not None:
                    out.setdefault(str(name), []).append(entry)
        if stale:
            await self.redis.hdel(keys.PROXY_BREAKERS, *stale)
        for reports in out.values():
            reports.sort(key=lambda r: r.replica)
        for name, fields in self.local().items():  # the answering replica's own first
            own = _report(self.replica_id, fields, 0.0)
            if own is not None:
                out.setdefault(name, []).insert(0, own)
        return out


def _parsed(body: Any) -> dict[str, Any] | None:
    """A replica's report, or None when it is not one (written by something else)."""
    try:
        report = json.loads(body)
    except (TypeError, ValueError):
        return None
    ok = isinstance(report, dict) and isinstance(report.get("ts_ms"), int) and isinstance(report.get("upstreams"), dict)
    return report if ok else None


def _report(replica: str, fields: Any, age_s: float) -> BreakerReport | None:
    if not isinstance(fields, dict):
        return None
    try:
        return BreakerReport(replica=replica, age_s=round(age_s, 3), **fields)
    except (TypeError, ValidationError):
        return None
