"""The proxy's upstream MCP servers at runtime: list, add, change, enable/disable, remove and
health, for every replica at once (the set lives in Redis: gateway/proxy/store.py). Health shows
the answering replica's view of the upstream and every live replica's breaker
(gateway/proxy/health.py), so an operator behind a load balancer sees the whole mesh.

Reads show where a credential comes from (``env`` or ``file``) for each header, never its
value, the variable's name or the file's path; likewise for each query parameter that carries
one (``query_credentials``), shown in the URL as ``?api_key=***``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from fastapi import Body, HTTPException, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, Field

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E404, E409, E422, admin, admin_router, audit_action, viewer
from gateway.proxy import store
from gateway.proxy.client import credential_headers, credential_query, describe_sources, with_query
from gateway.proxy.health import BreakerReport, BreakerState, MeshBreakers, mesh_summary
from gateway.proxy.names import shown_url
from gateway.state import Gateway, gateway_of
from shared.config import ConfigError, UpstreamConfig

router = admin_router()

Name = Annotated[str, PathParam(pattern=r"^[a-z0-9_-]{1,32}$", description="an upstream's name")]
# A change is made from the entry as read and written only if it is still that entry; a change that
# loses to concurrent ones this often is answered 409 rather than tried on without end.
CHANGE_TRIES = 8
PATCHABLE = frozenset({"enabled", "timeout_s", "concurrency", "principal_concurrency", "capture", "revision", "stdio_max_processes",
                       "stdio_idle_s"})
STDIO_ONLY = frozenset({"stdio_max_processes", "stdio_idle_s"})  # nothing an HTTP upstream has


def public_view(cfg: UpstreamConfig) -> dict[str, Any]:
    """What an admin read shows of an upstream (no credential, no credential source's name)."""
    out: dict[str, Any] = {"name": cfg.name, "namespace": cfg.prefix, "revision": cfg.revision,
                           "timeout_s": cfg.timeout_s, "concurrency": cfg.concurrency,
                           "principal_concurrency": cfg.principal_share, "enabled": cfg.enabled,
                           "capture": cfg.capture if isinstance(cfg.capture, bool) else dataclasses.asdict(cfg.capture),
                           "credentials": dict(describe_sources(cfg))}
    if cfg.url is not None:
        query = {**dict.fromkeys(cfg.query_from_env, "env"), **dict.fromkeys(cfg.query_from_file, "file")}
        out["transport"], out["url"] = "http", shown_url(with_query(cfg.url, query))
        out["query_credentials"] = query
    else:
        out["transport"], out["program"] = "stdio", (cfg.command or [""])[0]
        out["stdio_max_processes"], out["stdio_idle_s"] = cfg.stdio_max_processes, cfg.stdio_idle_s
    return out


class UpstreamHealth(BaseModel):
    """An upstream as the answering replica sees it, and its breaker on every live replica."""

    name: str
    enabled: bool
    revision: str = Field(description="the revision spoken with it (unknown: not negotiated yet)")
    transport: Literal["http", "stdio"]
    lists_age_s: float | None = Field(description="age of the replica's copy of its lists; null: none")
    tools: int = Field(ge=0)
    replica: str = Field(description="the replica answering; breaker to errors are its own")
    breaker: BreakerState
    consecutive_failures: int = Field(ge=0)
    calls: int = Field(ge=0)
    errors: int = Field(ge=0)
    processes: int | None = Field(default=None, ge=0,
                                  description="a stdio upstream's processes running on the replica; null: not stdio")
    mesh: MeshBreakers
    per_replica: list[BreakerReport] = Field(description="the answering replica first, then the others by id")


def health(gateway: Gateway, name: str, breakers: dict[str, list[BreakerReport]]) -> UpstreamHealth:
    """``name``'s health (open on this replica); ``breakers``: ``gateway.proxy.breakers.read()``."""
    reports = breakers.get(name, [])
    return UpstreamHealth(**gateway.proxy.health(name), replica=gateway.replica_id, mesh=mesh_summary(reports),
                          per_replica=reports)


async def mesh_health(gateway: Gateway) -> list[UpstreamHealth]:
    """Every upstream open on this replica, by name (the dashboard's panel)."""
    breakers = await gateway.proxy.breakers.read()
    return [health(gateway, name, breakers) for name in sorted(gateway.proxy.upstreams)]


def _view(gateway: Gateway, cfg: UpstreamConfig, breakers: dict[str, list[BreakerReport]]) -> dict[str, Any]:
    out = public_view(cfg)
    if cfg.name in gateway.proxy.upstreams:
        out["health"] = health(gateway, cfg.name, breakers).model_dump()
    return out


async def _viewed(gateway: Gateway, cfg: UpstreamConfig) -> dict[str, Any]:
    return _view(gateway, cfg, await gateway.proxy.breakers.read())


def _check_transport(body: dict[str, Any], http: bool) -> None:
    """Settings of the other transport would be stored and never used: refused (422), so that an
    operator tuning them learns they do nothing here."""
    misplaced = sorted(STDIO_ONLY & set(body)) if http else []
    if misplaced:
        raise HTTPException(422, f"{', '.join(misplaced)} apply to stdio upstreams only; this one speaks HTTP (url)")


def _validated(body: dict[str, Any]) -> UpstreamConfig:
    try:
        cfg = UpstreamConfig(**body)
        credential_headers(cfg)  # a source that cannot be read is refused now, not at the first call
        credential_query(cfg)
    except (ConfigError, TypeError) as exc:
        raise HTTPException(422, str(exc)) from None
    return cfg


async def _changed(gateway: Gateway) -> None:
    """Every replica reloads the set; this one before answering."""
    await gateway.publish_control({"t": "proxy"})
    await gateway.reload_proxy()


def _readable(name: str, raw: bytes | None) -> UpstreamConfig:
    """The upstream stored as ``raw``: 404 when there is none, 409 when its entry cannot be read."""
    entry = store.read(name, raw) if raw is not None else None
    if entry is None:
        raise HTTPException(404, f"no upstream named {name!r}")
    if isinstance(entry, store.Unreadable):
        raise HTTPException(409, f"the stored entry of upstream {name!r} cannot be read ({entry.reason}); "
                                 "remove it and add it again")
    return entry


def _unreadable_view(entry: store.Unreadable) -> dict[str, Any]:
    """What a read shows of an entry no replica serves: its name and why (never its content,
    which may name credential sources)."""
    return {"name": entry.name, "unreadable": entry.reason}


def _conflict(cfg: UpstreamConfig, exc: store.Conflict) -> HTTPException:
    if exc.what == "name":
        return HTTPException(409, f"an upstream named {cfg.name!r} exists")
    if exc.what == "namespace":
        return HTTPException(409, f"another upstream ({exc.other!r}) mounts under namespace {cfg.prefix!r}")
    if exc.what == "gone":
        return HTTPException(404, f"no upstream named {cfg.name!r}")
    return HTTPException(409, f"upstream {cfg.name!r} changed meanwhile; send the change again")


@router.get("/upstreams", summary="Upstream MCP servers the proxy serves, with their health on every replica")
async def list_upstreams(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    gateway = gateway_of(request)
    found = await store.entries(gateway.redis)
    breakers = await gateway.proxy.breakers.read()
    return {"upstreams": [_unreadable_view(e) if isinstance(e, store.Unreadable) else _view(gateway, e, breakers)
                          for e in found]}


@router.post("/upstreams", status_code=201, summary="Add an upstream (every replica)",
             responses={409: E409, 422: E422})
async def add_upstream(request: Request, body: Annotated[dict[str, Any], Body()],
                       who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    cfg = _validated(body)
    _check_transport(body, cfg.url is not None)
    try:
        await store.put(gateway.redis, cfg)
    except store.Conflict as exc:
        raise _conflict(cfg, exc) from None
    await audit_action(gateway, who, "upstream.add", upstream=cfg.name)
    await _changed(gateway)
    return await _viewed(gateway, cfg)


@router.get("/upstreams/{name}", summary="One upstream", responses={404: E404})
async def get_upstream(request: Request, name: Name, who: AdminPrincipal = viewer) -> dict[str, Any]:
    gateway = gateway_of(request)
    entry = await store.get(gateway.redis, name)
    if entry is None:
        raise HTTPException(404, f"no upstream named {name!r}")
    if isinstance(entry, store.Unreadable):
        return _unreadable_view(entry)
    return await _viewed(gateway, entry)


@router.patch("/upstreams/{name}", summary="Enable, disable or tune an upstream (every replica)",
              responses={404: E404, 409: E409, 422: E422})
async def patch_upstream(request: Request, name: Name, body: Annotated[dict[str, Any], Body()],
                         who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    unknown = set(body) - PATCHABLE
    if unknown:
        raise HTTPException(422, f"cannot change {', '.join(sorted(unknown))} (changeable: {', '.join(sorted(PATCHABLE))})")
    for _ in range(CHANGE_TRIES):
        read = await store.get_raw(gateway.redis, name)
        current = _readable(name, read)
        _check_transport(body, current.url is not None)
        cfg = _validated({**dataclasses.asdict(current), **body})
        try:
            await store.put(gateway.redis, cfg, read)
            break
        except store.Conflict as exc:
            if exc.what != "changed":
                raise _conflict(cfg, exc) from None
    else:
        raise HTTPException(409, f"upstream {name!r} kept changing under this change; send it again")
    await audit_action(gateway, who, "upstream.change", upstream=name, fields=",".join(sorted(body)))
    await _changed(gateway)
    return await _viewed(gateway, cfg)


@router.delete("/upstreams/{name}", summary="Remove an upstream (every replica; stays removed after a restart)",
               responses={404: E404})
async def delete_upstream(request: Request, name: Name, who: AdminPrincipal = admin) -> dict[str, Any]:
    gateway = gateway_of(request)
    if not await store.remove(gateway.redis, name):
        raise HTTPException(404, f"no upstream named {name!r}")
    await audit_action(gateway, who, "upstream.remove", upstream=name)
    await _changed(gateway)
    return {"removed": name}


@router.get("/upstreams/{name}/health", responses={404: E404},
            summary="An upstream's revision, lists and breaker on this replica, and its breaker on every live replica")
async def upstream_health(request: Request, name: Name, who: AdminPrincipal = viewer) -> UpstreamHealth:
    gateway = gateway_of(request)
    if not isinstance(await store.get(gateway.redis, name), UpstreamConfig):
        raise HTTPException(404, f"no upstream named {name!r} that can be read")
    if name not in gateway.proxy.upstreams:
        raise HTTPException(404, f"upstream {name!r} is not open on this replica (its credentials cannot be read)")
    return health(gateway, name, await gateway.proxy.breakers.read())
