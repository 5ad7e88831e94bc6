"""Everything the dashboard shows, in one call: every replica's rates and latency, workers,
trainer, delta sync, the sample log, recent sessions and contexts."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fastapi import Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import admin_router, current_version, redis_hash, viewer
from gateway.admin.sessions import session_infos, session_refs
from gateway.admin.stats import publish_stats
from gateway.admin.trainer import trainer_report
from gateway.admin.upstreams import mesh_health
from gateway.admin.workers import mesh_workers
from gateway.state import Gateway, gateway_of
from shared import control, keys
from shared.context.store import ContextInfo
from shared.redis_client import Reach
from shared.text import as_str

router = admin_router()

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
    gateway = gateway_of(request)
    await publish_stats(gateway)
    reach = Reach(gateway.redis)
    sessions = await session_infos(gateway.redis, await session_refs(gateway.redis, None, 20, max_scan_calls=3,
                                                                     reach=reach), reach)
    delta = redis_hash(await gateway.redis.hgetall(keys.component_status("delta")))
    trainer = await trainer_report(gateway)
    return {
        "ts_ms": control.now_ms(),
        "gateway": await _gateways(gateway),
        "model_version": await current_version(gateway),
        "workers": await mesh_workers(gateway),
        "trainer": trainer,
        "delta": delta,
        "sync": {"compression_ratio": delta.get("compression_ratio", trainer.get("compression_ratio")),
                 "sync_latency_ms": delta.get("sync_latency_ms", trainer.get("sync_latency_ms"))},
        "samples": await _samples(gateway),
        "sessions": {"shown": sessions, **reach.as_json()},
        "contexts": await _contexts(gateway),
        "upstreams": [u.model_dump() for u in await mesh_health(gateway)],
        "who": {"name": who.name, "role": who.role},
    }
