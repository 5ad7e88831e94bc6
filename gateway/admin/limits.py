"""What each MCP principal may use (gateway/limits.py): the config's limits (``limits``) and
the fields an operator sets over them at runtime, applied by every replica at once (the
control channel), with no restart; ``DELETE`` goes back to the config."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any

from fastapi import Body, HTTPException, Request
from fastapi import Path as PathParam
from pydantic import JsonValue

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E422, McpPrincipal, admin_router, audit_action, operator, viewer
from gateway.limits import OVERRIDE_RECHECK_S, clear_override, overrides, read_override, set_override
from gateway.state import Gateway, gateway_of
from shared.config import ConfigError, PrincipalLimits

router = admin_router()

PrincipalName = Annotated[McpPrincipal, PathParam(description="an MCP principal (an API key's name, or a token's subject)")]
LimitFields = Annotated[dict[str, JsonValue], Body(
    description="fields of limits.default to set for this principal over the config's (replacing any set before)",
    examples=[{"requests_per_s": 10.0, "requests_burst": 20, "inference_in_flight": 2}])]


async def _view(gateway: Gateway, principal: str) -> dict[str, Any]:
    limits = gateway.limits
    runtime = await read_override(gateway.redis, principal)
    fields = runtime["limits"] if runtime else {}
    return {"principal": principal, "role": limits.cfg.principal_roles.get(principal),
            "limits": dataclasses.asdict(limits.with_override(principal, fields)),
            "source": limits.sources(principal, fields), "runtime": runtime}


def _validated(gateway: Gateway, principal: str, fields: dict[str, JsonValue]) -> dict[str, Any]:
    """``fields`` checked as ``limits.principals.<name>`` is at start: every error names its field."""
    if not fields:
        raise HTTPException(422, "name at least one limit to set; DELETE goes back to the config's limits")
    try:
        PrincipalLimits(**{**dataclasses.asdict(gateway.limits.by_config(principal)), **fields})
    except (ConfigError, TypeError) as exc:
        raise HTTPException(422, f"limits: {exc}") from None
    return fields


@router.get("/limits", summary="Every principal's limits set at runtime, and the config's defaults")
async def list_limits(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    gateway = gateway_of(request)
    return {"default": dataclasses.asdict(gateway.limits.cfg.default), "runtime": await overrides(gateway.redis),
            "applied_within_s": OVERRIDE_RECHECK_S}


@router.get("/limits/{principal}", summary="A principal's limits in force, and where each comes from")
async def get_limits(request: Request, principal: PrincipalName, who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _view(gateway_of(request), principal)


@router.put("/limits/{principal}", responses={422: E422},
            summary="Set some of a principal's limits over the config's (every replica, no restart)")
async def set_limits(request: Request, principal: PrincipalName, fields: LimitFields,
                     who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    checked = _validated(gateway, principal, fields)
    await set_override(gateway.redis, principal, checked, who.audit_name)
    await gateway.publish_control({"t": "lim", "p": principal})  # every replica, this one first
    await audit_action(gateway, who, "limits.set", client=principal, change=json.dumps(checked, sort_keys=True))
    return await _view(gateway, principal)


@router.delete("/limits/{principal}", summary="Back to the config's limits for a principal (every replica)")
async def reset_limits(request: Request, principal: PrincipalName, who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    await clear_override(gateway.redis, principal)
    await gateway.publish_control({"t": "lim", "p": principal})
    await audit_action(gateway, who, "limits.reset", client=principal)
    return await _view(gateway, principal)
