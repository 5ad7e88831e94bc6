"""Published model versions, and rolling the served model back (the trainer carries it out,
the workers follow)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import HTTPException, Query, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import (
    E404,
    E422,
    MAX_LIST,
    admin,
    admin_router,
    audit_action,
    current_version,
    redis_hash,
    viewer,
)
from gateway.admin.trainer import send_command
from gateway.state import Gateway, gateway_of
from shared import keys
from shared.text import as_str

router = admin_router()


async def _versions(gateway: Gateway, limit: int) -> list[dict[str, Any]]:
    entries = await gateway.redis.xrevrange(keys.MODEL_VERSION_LOG, count=limit) or []
    return [{**redis_hash(f), "id": as_str(i)} for i, f in entries]


@router.get("/models", summary="Published model versions, newest first")
async def list_models(request: Request, limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                      who: AdminPrincipal = viewer) -> dict[str, Any]:
    gateway = gateway_of(request)
    return {"current": await current_version(gateway), "versions": await _versions(gateway, limit)}


class Rollback(BaseModel):
    # Strict: a JSON true, 1.0 or "1" is a mistake, never version 1 (nor anchor: 1 an anchor)
    version: StrictInt | None = Field(default=None, ge=0, description="roll back to this published version")
    anchor: StrictBool = Field(default=False, description="roll back to the latest full anchor instead")


@router.post("/models/rollback", status_code=202, responses={404: E404, 422: E422},
             summary="Roll the served model back to a version or the latest anchor; workers follow")
async def rollback(request: Request, body: Rollback, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    if (body.version is None) == (not body.anchor):
        raise HTTPException(422, "give exactly one of: version, anchor=true")
    versions = await _versions(gateway, 10_000)
    target: dict[str, int]
    if body.version is not None:
        if not any(v.get("version") == body.version for v in versions):
            raise HTTPException(404, f"version {body.version} is not in the version log")
        target = {"to_version": body.version}
    else:
        anchors = [v for v in versions if v.get("anchor") in (1, True)]
        if not anchors:
            raise HTTPException(404, "no anchor in the version log")
        target = {"to_version": anchors[0]["version"], "anchor": 1}
    cid = await send_command(gateway, who, "rollback", **target)
    await audit_action(gateway, who, "model.rollback", command=cid, version=target["to_version"])
    return {"command_id": cid, **target, "status_url": f"/admin/trainer/commands/{cid}"}
