"""Inference workers as the mesh sees them: this replica's pool merged with the workers'
own reports in Redis (version, lag behind the trainer, load, drained); drain and undrain."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import HTTPException, Request
from fastapi import Path as PathParam

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import (
    E404,
    admin_router,
    audit_action,
    current_version,
    operator,
    redis_hash,
    viewer,
)
from gateway.state import Gateway, gateway_of
from shared import keys
from shared.redis_client import Reach
from shared.text import as_str

router = admin_router()


async def _members(gateway: Gateway, reach: Reach, key: str) -> set[str]:
    """A set's members; none while its master is down (``reach`` names it)."""
    empty: set[Any] = set()
    return {as_str(m) for m in await reach.read(key, lambda: gateway.redis.smembers(key), empty)}


async def _statuses(gateway: Gateway, prefix: str, reach: Reach) -> dict[str, dict[str, Any]]:
    """Live self-reports (shared.control.report_status) whose component name starts with
    ``prefix``. On a cluster a report on a master that is down is left out (``reach`` names the
    master); so are all of them while the master of their index is."""
    r = gateway.redis
    names = sorted(n for n in await _members(gateway, reach, keys.STATUS_INDEX) if n.startswith(prefix))
    if not names:
        return {}
    if isinstance(r, aioredis.RedisCluster):
        # One read per report: a pipeline over the masters fails whole when one is down.
        raws = await asyncio.gather(*[reach.read(keys.component_status(n), partial(r.hgetall, keys.component_status(n)),
                                                 None) for n in names])
    else:
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.component_status(n))
        raws = await pipe.execute()
    out, gone = {}, []
    for n, raw in zip(names, raws, strict=True):
        if raw:
            out[n] = redis_hash(raw)
        elif raw is not None:  # None: not read (its master is down)
            gone.append(n)
    if gone:  # expired reports: the process stopped reporting
        await r.srem(keys.STATUS_INDEX, *gone)
    return out


async def _version(gateway: Gateway, reach: Reach) -> int | None:
    """The model version the trainer published last; None too while its master is down."""
    return await reach.read(keys.MODEL_VERSION, lambda: current_version(gateway), None)


async def mesh_workers(gateway: Gateway) -> list[dict[str, Any]]:
    """Every worker this replica connects to or that reports itself, by id; with a master of a
    cluster down, what it holds is missing (the first failure is raised when no master answered)."""
    reach = Reach(gateway.redis)
    out = await _workers(gateway, reach, await _version(gateway, reach))
    reach.check()
    return out


async def _workers(gateway: Gateway, reach: Reach, current: int | None) -> list[dict[str, Any]]:
    """:func:`mesh_workers` within ``reach`` (which names the masters missed), ``current`` the
    trainer's model version."""
    drained = await _members(gateway, reach, keys.WORKERS_DRAINED)
    by_id: dict[str, dict[str, Any]] = {w["id"]: w for w in gateway.workers.status()}
    for comp, st in (await _statuses(gateway, "worker:", reach)).items():
        wid = comp.split(":", 1)[1]
        # A report outlives its worker by its TTL: one this replica does not reach is not serving here.
        by_id[wid] = {"alive": False, **st, **by_id.get(wid, {}), "id": wid, "reported_ms": st.get("ts_ms")}
    out = []
    for wid, w in sorted(by_id.items()):
        version = w.get("version")
        lag = max(0, current - int(version)) if current is not None and isinstance(version, (int, float)) else None
        reported = w.get("lag")
        if isinstance(reported, (int, float)):  # a worker counts only versions it could open (wrong key ring)
            lag = int(reported) if lag is None else max(lag, int(reported))
        out.append({**w, "version": version, "lag": lag, "load": w.get("load"),
                    "drained": wid in drained or bool(w.get("drained"))})
    return out


@router.get("/workers", summary="Inference workers: version, lag behind the trainer, load, drained")
async def list_workers(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    gateway = gateway_of(request)
    reach = Reach(gateway.redis)
    version = await _version(gateway, reach)
    workers = await _workers(gateway, reach, version)
    reach.check()
    return {"model_version": version, "workers": workers, **reach.as_json()}


async def _set_drain(request: Request, worker_id: str, who: AdminPrincipal, drain: bool) -> dict[str, Any]:
    gateway = gateway_of(request)
    known = {w["id"] for w in await mesh_workers(gateway)}
    if worker_id not in known:
        raise HTTPException(404, f"no worker {worker_id!r}")
    if drain:
        await gateway.redis.sadd(keys.WORKERS_DRAINED, worker_id)
        gateway.workers.drain(worker_id)
    else:
        await gateway.redis.srem(keys.WORKERS_DRAINED, worker_id)
        gateway.workers.undrain(worker_id)
    await audit_action(gateway, who, "worker.drain" if drain else "worker.undrain", worker=worker_id)
    return {"worker": worker_id, "drained": drain}


@router.post("/workers/{worker_id}/drain", summary="Stop routing new requests to a worker",
             responses={404: E404})
async def drain_worker(request: Request, worker_id: Annotated[str, PathParam(max_length=256)],
                       who: AdminPrincipal = operator) -> dict[str, Any]:
    return await _set_drain(request, worker_id, who, True)


@router.delete("/workers/{worker_id}/drain", summary="Route to a drained worker again", responses={404: E404})
async def undrain_worker(request: Request, worker_id: Annotated[str, PathParam(max_length=256)],
                         who: AdminPrincipal = operator) -> dict[str, Any]:
    return await _set_drain(request, worker_id, who, False)
