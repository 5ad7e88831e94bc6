"""The delta key ring: its report, and rotation requests (the AES key, the trainer's signing
key, or both) the trainer carries out without downtime."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import admin, admin_router, audit_action, redis_hash, viewer
from gateway.state import gateway_of
from shared import control, keys
from shared.text import as_str

router = admin_router()


@router.get("/delta-key", summary="The delta key ring's report (key id, epoch, last rotation)")
async def delta_key_status(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    r = gateway_of(request).redis
    pending = await r.xlen(keys.DELTA_KEY_ROTATE)
    ring = redis_hash(await r.hgetall(keys.DELTA_KEY_STATUS))
    # the keys the trainer's last publish used: what is in force before any rotation too
    in_use = redis_hash(await r.hgetall(keys.component_status("delta")))
    for name in ("key_id", "signing_key_id"):
        if name not in ring and in_use.get(name):
            ring[name] = in_use[name]
    return {"key_ring": ring, "rotation_requests": pending}


@router.post("/delta-key/rotate", status_code=202, summary="Rotate a delta key: encryption, signing or both "
             "(no downtime; the previous key is refused after security.delta_key_grace_s)")
async def delta_key_rotate(request: Request, who: AdminPrincipal = admin,
                           kind: Literal["encryption", "signing", "both"] = "encryption") -> dict[str, Any]:
    gateway = gateway_of(request)
    rid = await gateway.redis.xadd(keys.DELTA_KEY_ROTATE, {"by": who.audit_name, "kind": kind,
                                                           "ts_ms": str(control.now_ms())},
                                   maxlen=1000, approximate=True)
    await audit_action(gateway, who, "delta_key.rotate", request=as_str(rid), kind=kind)
    return {"request_id": as_str(rid), "status_url": "/admin/delta-key"}
