"""Who may teach: the teach permission of MCP principals (``learn``, and the sample import
for them). ``learning.teachers`` in the config says who may by default; grants and revokes
made here override it on every replica at the principal's next call, with no restart."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path as PathParam
from fastapi import Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import McpPrincipal, admin, admin_router, audit_action, viewer
from gateway.limits import set_teacher, teacher_grants
from gateway.state import Gateway, gateway_of

router = admin_router()

PrincipalName = Annotated[McpPrincipal, PathParam(description="an MCP principal (an API key's name, or a token's subject)")]


async def _status(gateway: Gateway, principal: str) -> dict[str, Any]:
    grant = (await teacher_grants(gateway.redis)).get(principal)
    return {"principal": principal, "may_teach": await gateway.limits.may_teach(principal),
            "by_config": gateway.limits.teaches_by_config(principal), "runtime": grant}


@router.get("/teachers", summary="Who may teach: learning.teachers and the grants and revokes made at runtime")
async def list_teachers(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    gateway = gateway_of(request)
    return {"config": sorted(gateway.limits.teachers), "runtime": await teacher_grants(gateway.redis)}


@router.get("/teachers/{principal}", summary="Whether a principal may teach, and why")
async def get_teacher(request: Request, principal: PrincipalName, who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _status(gateway_of(request), principal)


@router.put("/teachers/{principal}", summary="Grant a principal the teach permission (every replica)")
async def grant_teacher(request: Request, principal: PrincipalName, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    await set_teacher(gateway.redis, principal, True, who.audit_name)
    await audit_action(gateway, who, "teacher.grant", teacher=principal)
    return await _status(gateway, principal)


@router.delete("/teachers/{principal}", summary="Revoke a principal's teach permission (every replica, over "
               "learning.teachers)")
async def revoke_teacher(request: Request, principal: PrincipalName, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    await set_teacher(gateway.redis, principal, False, who.audit_name)
    await audit_action(gateway, who, "teacher.revoke", teacher=principal)
    return await _status(gateway, principal)
