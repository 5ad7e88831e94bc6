"""The trainer: its status, pause and resume (durable until changed), and commands it picks
up from its control stream (checkpoint, rollback) with their acknowledgements."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi import HTTPException, Request
from fastapi import Path as PathParam

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E404, admin_router, audit_action, operator, redis_hash, viewer
from gateway.state import Gateway, gateway_of
from shared import control, keys
from shared.text import as_str

router = admin_router()

ALIVE_S = 30  # a trainer that has not reported for longer is shown as not alive


async def trainer_report(gateway: Gateway) -> dict[str, Any]:
    """The trainer's progress hash merged with its self-report, plus paused and alive."""
    r = gateway.redis
    status = redis_hash(await r.hgetall(keys.TRAINER_STATUS))
    status.update({k: v for k, v in redis_hash(await r.hgetall(keys.component_status("trainer"))).items()
                   if k not in status})
    updated = status.get("updated_ms", status.get("ts_ms"))
    age_s = (control.now_ms() - updated) / 1000 if isinstance(updated, (int, float)) else None
    return {**status, "paused": bool(await r.exists(keys.TRAINER_PAUSED)),
            "alive": age_s is not None and age_s < ALIVE_S, "report_age_s": age_s}


async def send_command(gateway: Gateway, who: AdminPrincipal, cmd: str, **args: Any) -> str:
    """Append a command to the trainer's control stream; returns its id (for the status route)."""
    cid = uuid.uuid4().hex
    fields = {"id": cid, "cmd": cmd, "by": who.audit_name, "ts_ms": control.now_ms(), **args}
    await gateway.redis.xadd(keys.TRAINER_CONTROL, {k: str(v) for k, v in fields.items()},
                             maxlen=10_000, approximate=True)
    return cid


@router.get("/trainer", summary="Trainer status: step, loss, samples/s, paused")
async def trainer_status(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await trainer_report(gateway_of(request))


@router.post("/trainer/pause", summary="Pause training (durable until resumed)")
async def trainer_pause(request: Request, who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    await gateway.redis.set(keys.TRAINER_PAUSED, json.dumps({"by": who.audit_name, "ts_ms": control.now_ms()}))
    await audit_action(gateway, who, "trainer.pause")
    return {"paused": True}


@router.post("/trainer/resume", summary="Resume training")
async def trainer_resume(request: Request, who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    await gateway.redis.delete(keys.TRAINER_PAUSED)
    await audit_action(gateway, who, "trainer.resume")
    return {"paused": False}


@router.post("/trainer/checkpoint", status_code=202, summary="Ask the trainer to checkpoint now")
async def trainer_checkpoint(request: Request, who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    cid = await send_command(gateway, who, "checkpoint")
    await audit_action(gateway, who, "trainer.checkpoint", command=cid)
    return {"command_id": cid, "status_url": f"/admin/trainer/commands/{cid}"}


@router.get("/trainer/commands/{command_id}", summary="Whether the trainer handled a command",
            responses={404: E404})
async def trainer_command(request: Request, command_id: Annotated[str, PathParam(pattern=r"^[0-9a-f]{32}$")],
                          who: AdminPrincipal = viewer) -> dict[str, Any]:
    r = gateway_of(request).redis
    ack = await r.hget(keys.TRAINER_CONTROL_ACK, command_id)
    if ack is not None:
        return {"command_id": command_id, "state": "done", "result": json.loads(ack)}
    for _id, fields in await r.xrevrange(keys.TRAINER_CONTROL, count=10_000) or []:
        f = {as_str(k): as_str(v) for k, v in (fields or {}).items()}
        if f.get("id") == command_id:
            return {"command_id": command_id, "state": "pending", "cmd": f.get("cmd")}
    raise HTTPException(404, "no such command")
