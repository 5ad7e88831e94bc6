"""Everything the dashboard shows, in one call: every replica's rates and latency, workers,
trainer, delta sync, the sample log, recent sessions and contexts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from fastapi import Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import admin_router, current_version, redis_hash, viewer
from gateway.admin.sessions import session_infos, session_refs
from gateway.admin.stats import publish_stats
from gateway.admin.trainer import trainer_report
from gateway.admin.upstreams import mesh_health
from gateway.admin.workers import mesh_workers
from gateway.errors import is_outage
from gateway.state import Gateway, gateway_of
from shared import control, keys
from shared.context.store import ContextInfo
from shared.redis_client import Reach
from shared.text import as_str

router = admin_router()
T = TypeVar("T")

STATS_TTL_S = 10.0  # a replica snapshot older than this belongs to a replica that stopped


async def _samples(gateway: Gateway) -> dict[str, Any]:
    totals = await gateway.samples.log_totals()
    last = totals.last_seq if totals.written else None
    backlog = totals.backlog if totals.written and "seq" in totals.offset else None
    return {"log_length": totals.entries, "last_seq": last, "trainer_offset": redis_hash(totals.offset),
            "backlog": backlog}


async def _gateways(gateway: Gateway) -> dict[str, Any]:
    raw = await gateway.redis.hgetall(keys.GATEWAY_STATS)
    now = control.now_ms()
    live: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for rid, body in raw.items():
        snap = json.loads(body)
        fresh = now - snap.get("ts_ms", 0) < STATS_TTL_S * 1000
        (live if fresh else stale).append({"replica": as_str(rid), **snap})
    if stale:
        await gateway.redis.hdel(keys.GATEWAY_STATS, *[s["replica"] for s in stale])
    p99s = [g["p99_ms"] for g in live if g.get("p99_ms") is not None]
    p50s = [g["p50_ms"] for g in live if g.get("p50_ms") is not None]
    return {"replicas": len(live), "rps": round(sum(g.get("rps", 0) for g in live), 3),
            "errors_per_s": round(sum(g.get("errors_per_s", 0) for g in live), 3),
            "requests_total": sum(g.get("requests_total", 0) for g in live),
            "p50_ms": max(p50s) if p50s else None, "p99_ms": max(p99s) if p99s else None,
            "per_replica": live}


async def _contexts(gateway: Gateway, principals_shown: int = 5, contexts_shown: int = 20) -> dict[str, Any]:
    """Global bytes and budget, principals by recency, the most recently used contexts."""
    store = gateway.store
    reach = Reach(store.redis)
    principals = await store.principals(reach)
    rows: list[dict[str, Any]] = []
    for p in principals[:principals_shown]:
        infos: list[ContextInfo] = await reach.read(keys.ctx_meta(p), partial(store.list_contexts, p), [])
        for info in infos:
            rows.append({"principal": p, "id": info.id, "version": info.version, "bytes": info.bytes,
                         "entries": sum(info.entries.values()), "last_used_ms": info.last_used_ms})
    rows.sort(key=lambda c: c["last_used_ms"], reverse=True)
    total = await store.global_bytes(reach)
    reach.check()
    return {"principals": len(principals), "global_bytes": total,
            "global_budget_bytes": store.cfg.global_budget_bytes, "recent": rows[:contexts_shown], **reach.as_json()}


@router.get("/summary", summary="Everything the dashboard shows, in one call")
async def summary(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    """On a Redis Cluster with a master down, each part read from it is ``null`` and named in
    ``unavailable`` (the rest still shows; the listings say what they miss with ``partial``);
    503 only when no part could be read. On one server an outage answers 503."""
    gateway = gateway_of(request)
    cluster = isinstance(gateway.redis, aioredis.RedisCluster)
    parts = _Parts(2 * gateway.config.redis.socket_timeout_s if cluster else None)

    async def sessions() -> dict[str, Any]:
        reach = Reach(gateway.redis)
        shown = await session_infos(gateway.redis, await session_refs(gateway.redis, None, 20, max_scan_calls=3,
                                                                      reach=reach), reach)
        return {"shown": shown, **reach.as_json()}

    async def gateways() -> dict[str, Any]:
        await publish_stats(gateway)
        return await _gateways(gateway)

    readers: dict[str, Callable[[], Awaitable[Any]]] = {
        "model_version": lambda: current_version(gateway), "workers": lambda: mesh_workers(gateway),
        "trainer": lambda: trainer_report(gateway), "delta": lambda: _delta(gateway), "samples": lambda: _samples(gateway),
        "sessions": sessions, "contexts": lambda: _contexts(gateway), "upstreams": lambda: _upstreams(gateway)}
    # The one part that writes goes first, alone: a write refused by a cluster that is down makes
    # redis-py close every connection, reads of the other masters in flight included. The reads
    # then go at once: each that waits on a master that is down waits at the same time as the others.
    got = {"gateway": await parts.read("gateway", gateways)}
    got.update(zip(readers, await asyncio.gather(*[parts.read(name, fn) for name, fn in readers.items()]),
                   strict=True))
    parts.check()
    sync_from = [d for d in (got["delta"], got["trainer"]) if d is not None]
    return {"ts_ms": control.now_ms(), **got,
            "sync": {name: next((d[name] for d in sync_from if d.get(name) is not None), None)
                     for name in ("compression_ratio", "sync_latency_ms")},
            "who": {"name": who.name, "role": who.role}, "unavailable": sorted(parts.missing)}


async def _delta(gateway: Gateway) -> dict[str, Any]:
    return redis_hash(await gateway.redis.hgetall(keys.component_status("delta")))


async def _upstreams(gateway: Gateway) -> list[dict[str, Any]]:
    return [u.model_dump() for u in await mesh_health(gateway)]


class _Parts:
    """The summary's parts, each read on its own: on a cluster (``limit_s`` set) a part whose keys
    sit on a master that is down, or that takes longer than ``limit_s`` (a master that is silent
    rather than refusing), is left out (``missing``) instead of failing the whole answer."""

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.missing: list[str] = []
        self.read_any = False
        self._first: BaseException | None = None

    async def read(self, name: str, make: Callable[[], Awaitable[T]]) -> T | None:
        try:
            async with asyncio.timeout(self.limit_s):
                got = await make()
        except Exception as exc:
            if self.limit_s is None or not (is_outage(exc) or isinstance(exc, TimeoutError)):
                raise
            self.missing.append(name)
            self._first = self._first or exc
            return None
        self.read_any = True
        return got

    def check(self) -> None:
        """Raise the first failure when no part could be read (no master answers: 503)."""
        if self._first is not None and not self.read_any:
            raise self._first
