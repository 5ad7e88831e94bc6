"""Admin keys: list them (names and roles, never the keys), create one (shown once), revoke
one created through the API (config-file keys are removed in the config file)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import HTTPException, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, Field

from gateway.admin.auth import ROLES, AdminPrincipal, KeyNameTaken
from gateway.admin.common import E404, E409, admin, admin_router, audit_action
from gateway.state import gateway_of

router = admin_router()


class KeyCreate(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.@\-]{1,64}$")
    role: Literal["viewer", "operator", "admin"] = "viewer"


@router.get("/keys", summary="List admin keys (names and roles, never the keys)")
async def list_keys(request: Request, who: AdminPrincipal = admin) -> dict[str, Any]:
    return {"keys": await gateway_of(request).admin_keyring.list(), "roles": list(ROLES)}


@router.post("/keys", status_code=201, summary="Create an admin key (the key is shown once)",
             responses={409: E409})
async def create_key(request: Request, body: KeyCreate, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    try:
        plaintext, meta = await gateway.admin_keyring.create(body.name, body.role, who.audit_name)
    except KeyNameTaken:
        raise HTTPException(409, f"an admin key named {body.name!r} exists") from None
    await audit_action(gateway, who, "admin_key.create", key_name=body.name, key_role=body.role)
    return {**meta, "key": plaintext}


@router.delete("/keys/{name}", summary="Revoke an admin key created through the API",
               responses={404: E404, 409: E409})
async def revoke_key(request: Request, name: Annotated[str, PathParam(max_length=64)],
                     who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    ring = gateway.admin_keyring
    if name in ring.config_names():
        raise HTTPException(409, f"{name!r} comes from the config file; remove it there")
    if not await ring.revoke(name):
        raise HTTPException(404, f"no admin key named {name!r}")
    await audit_action(gateway, who, "admin_key.revoke", key_name=name)
    return {"revoked": name}
