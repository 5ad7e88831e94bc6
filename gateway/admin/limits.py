"""What each MCP principal may use (gateway/limits.py): the config's limits (``limits``) and
the fields an operator sets over them at runtime, applied by every replica at once (the
control channel), with no restart; ``DELETE`` goes back to the config."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import HTTPException, Request
from fastapi import Path as PathParam
from pydantic import BaseModel

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E422, McpPrincipal, admin_router, audit_action, operator, viewer
from gateway.limits import OVERRIDE_RECHECK_S, clear_override, overrides, read_override, set_override
from gateway.state import Gateway, gateway_of
from shared.config import ConfigError, PrincipalLimits, partial_model
from shared.control import check_storable

router = admin_router()

PrincipalName = Annotated[McpPrincipal, PathParam(description="an MCP principal (an API key's name, or a token's subject)")]
if TYPE_CHECKING:
    LimitsPatch = BaseModel
else:  # the fields of limits.default, with their types and bounds, to set over the config's
    LimitsPatch = partial_model(PrincipalLimits, examples=[
        {"requests_per_s": 10.0, "requests_burst": 20, "inference_in_flight": 2}])


async def _view(gateway: Gateway, principal: str) -> dict[str, Any]:
    limits = gateway.limits
    runtime = await read_override(gateway.redis, principal)
    fields = runtime["limits"] if runtime else {}
    return {"principal": principal, "role": limits.cfg.principal_roles.get(principal),
            "limits": dataclasses.asdict(limits.with_override(principal, fields)),
            "source": limits.sources(principal, fields), "runtime": runtime}


async def _apply(gateway: Gateway, principal: str) -> None:
    """Every replica reads the principal's override again (the control channel); this one
    before it answers, so the answer holds here already."""
    await gateway.publish_control({"t": "lim", "p": principal})
    await gateway.limits.refresh(principal)


def _validated(gateway: Gateway, principal: str, patch: BaseModel) -> dict[str, Any]:
    """The fields ``patch`` sets, checked as runtime config is (``PATCH /admin/config``): each
    field's type and bounds by the model, then what every replica can read back, then the whole
    as ``limits.principals.<name>`` is at start. Every error names its field."""
    fields = patch.model_dump(exclude_unset=True, exclude_none=True)
    if not fields:
        raise HTTPException(422, "name at least one limit to set; DELETE goes back to the config's limits")
    try:
        for name, value in fields.items():
            check_storable(name, value)
        PrincipalLimits(**{**dataclasses.asdict(gateway.limits.by_config(principal)), **fields})
    except ConfigError as exc:
        raise HTTPException(422, str(exc)) from None
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
async def set_limits(request: Request, principal: PrincipalName, patch: LimitsPatch,
                     who: AdminPrincipal = operator) -> dict[str, Any]:
    """Replaces what was set before for this principal; the fields not named keep the config's values."""
    gateway = gateway_of(request)
    checked = _validated(gateway, principal, patch)
    await set_override(gateway.redis, principal, checked, who.audit_name)
    await _apply(gateway, principal)
    await audit_action(gateway, who, "limit.set", client=principal, change=json.dumps(checked, sort_keys=True))
    return await _view(gateway, principal)


@router.delete("/limits/{principal}", summary="Back to the config's limits for a principal (every replica)")
async def reset_limits(request: Request, principal: PrincipalName, who: AdminPrincipal = operator) -> dict[str, Any]:
    gateway = gateway_of(request)
    await clear_override(gateway.redis, principal)
    await _apply(gateway, principal)
    await audit_action(gateway, who, "limit.reset", client=principal)
    return await _view(gateway, principal)
