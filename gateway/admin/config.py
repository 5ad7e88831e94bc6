"""The effective configuration (secrets redacted) and the runtime overrides of the sections
that may change while the mesh runs (compression, consistency, scheduling)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException, Request
from pydantic import BaseModel

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E422, admin, admin_router, audit_action, viewer
from gateway.proxy.names import shown_url
from gateway.state import Gateway, gateway_of
from shared import control, keys
from shared.config import ConfigError, patch_model
from shared.redis_client import redact_url

router = admin_router()

_SECRET_HINTS = ("key", "secret", "password", "token")


def redact(obj: Any, path: str = "") -> Any:
    """Config as a dict with every secret replaced by "***" (key files' paths are not secret)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if p in ("gateway.api_keys", "gateway.admin_keys"):
                out[k] = {name: ({"role": val.get("role"), "key": "***"} if isinstance(val, dict) else "***")
                          for name, val in (v or {}).items()}
            elif p == "proxy.upstreams":
                out[k] = [_upstream(u) for u in v or []]
            elif isinstance(v, (dict, list)):
                out[k] = redact(v, p)
            elif any(h in str(k).lower() for h in _SECRET_HINTS) and not str(k).endswith("_file") \
                    and isinstance(v, str) and v:
                out[k] = "***"
            else:
                out[k] = redact(v, p)
        return out
    if isinstance(obj, list):
        if any(h in path.lower() for h in _SECRET_HINTS):
            return ["***" for _ in obj]
        return [redact(v, path) for v in obj]
    if isinstance(obj, str) and path == "redis.url":
        return redact_url(obj)
    return obj


def _upstream(entry: dict[str, Any]) -> dict[str, Any]:
    """A ``proxy.upstreams`` entry as the upstream routes show it (gateway/admin/upstreams.py): the
    URL as ``shown_url`` shows it, the program without its arguments, and which headers and query
    parameters carry credentials without the variables' names or the files' paths."""
    command = entry.get("command")
    return {**entry, "url": entry.get("url") and shown_url(entry["url"]),
            "command": command and [command[0], *("***" for _ in command[1:])],
            "headers_from_env": dict.fromkeys(entry.get("headers_from_env") or {}, "***"),
            "headers_from_file": dict.fromkeys(entry.get("headers_from_file") or {}, "***"),
            "query_from_env": dict.fromkeys(entry.get("query_from_env") or {}, "***"),
            "query_from_file": dict.fromkeys(entry.get("query_from_file") or {}, "***")}


class _SyncView:
    """Adapts an already-fetched hash to the sync ``hgetall`` that shared.control expects."""

    def __init__(self, raw: dict[Any, Any]) -> None:
        self.raw = raw

    def hgetall(self, _key: str) -> dict[Any, Any]:
        return self.raw


async def _config_view(gateway: Gateway) -> dict[str, Any]:
    overrides = control.read_overrides(_SyncView(await gateway.redis.hgetall(keys.RUNTIME_CONFIG)))
    rev = int(await gateway.redis.get(keys.RUNTIME_CONFIG_REV) or 0)
    effective = control.effective_config(gateway.file_config, overrides)
    return {"config": redact(effective.to_dict()), "runtime_overrides": overrides, "revision": rev,
            "runtime_sections": list(control.RUNTIME_SECTIONS)}


if TYPE_CHECKING:
    ConfigPatch = BaseModel
else:  # fields to change per runtime section, with the types and bounds of shared/config.py
    ConfigPatch = patch_model("ConfigPatch", control.RUNTIME_SECTIONS, examples=[
        {"compression": {"density": 0.02}, "consistency": {"sync_interval": 2}}])


@router.get("/config", summary="Effective configuration (secrets redacted) and runtime overrides")
async def get_config(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _config_view(gateway_of(request))


@router.patch("/config", responses={422: E422},
              summary="Change compression / consistency / scheduling settings at runtime")
async def patch_config(request: Request, patch: ConfigPatch, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    r = gateway.redis
    body = patch.model_dump(exclude_unset=True, exclude_none=True)
    current = control.read_overrides(_SyncView(await r.hgetall(keys.RUNTIME_CONFIG)))
    try:
        merged = control.validate_runtime_patch(gateway.file_config, current, body)
    except ConfigError as exc:
        raise HTTPException(422, str(exc)) from None
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.RUNTIME_CONFIG, mapping={k: json.dumps(v) for k, v in merged.items()})
    pipe.incr(keys.RUNTIME_CONFIG_REV)
    _, rev = await pipe.execute()
    await r.publish(keys.RUNTIME_CONFIG_CHANNEL, str(rev))
    await gateway.publish_control({"t": "cfg"})  # every gateway replica, this one first
    await audit_action(gateway, who, "config.change", change=json.dumps(body, sort_keys=True), revision=rev)
    return await _config_view(gateway)


@router.delete("/config/runtime", summary="Drop every runtime override (back to the config file)")
async def reset_config(request: Request, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    pipe = gateway.redis.pipeline(transaction=True)
    pipe.delete(keys.RUNTIME_CONFIG)
    pipe.incr(keys.RUNTIME_CONFIG_REV)
    _, rev = await pipe.execute()
    await gateway.redis.publish(keys.RUNTIME_CONFIG_CHANNEL, str(rev))
    await gateway.publish_control({"t": "cfg"})
    await audit_action(gateway, who, "config.reset", revision=rev)
    return await _config_view(gateway)
