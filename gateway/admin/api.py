"""Admin REST API under /admin: operate the running mesh.

Plug-in module (see gateway/app.py COMPONENTS): ``router`` holds every route here,
``startup(state)`` builds the admin keyring and starts the stats publisher,
``shutdown(state)`` stops it. Other components add their own admin routers
(/admin/contexts from gateway.tools.context, /admin/samples from gateway.tools.learning);
/admin/openapi.json documents all of them.

Roles (gateway/admin/auth.py): GET routes need ``viewer``; acting on the running mesh
(terminate, drain, pause, checkpoint) needs ``operator``; changing it (keys, config,
rollback, delta key rotation) needs ``admin``. Every action is written to the audit
stream. Commands for other processes travel through Redis (shared/control.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import logging
import os
import re
import secrets
import socket
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.auth import ROLES, AdminKeyring, AdminPrincipal, KeyNameTaken, keyring_of, require_role
from gateway.admin.stats import LocalStats
from shared import control, keys, metrics
from shared.audit import audit
from shared.config import ConfigError

log = logging.getLogger(__name__)

UI_DIR = Path(__file__).with_name("ui")
UI_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
STATS_TTL_S = 10.0
MAX_LIST = 1000

viewer = Depends(require_role("viewer"))
operator = Depends(require_role("operator"))
admin = Depends(require_role("admin"))

_E400 = {"description": "input the route cannot accept (malformed body, bad identifier)"}
_E401 = {"description": "no valid admin key"}
_E403 = {"description": "the key's role may not do this"}
_E404 = {"description": "not found"}
_E409 = {"description": "conflict"}
_E422 = {"description": "invalid input"}

API_DESCRIPTION = (
    "Operate a learnmesh mesh. Bearer admin keys; roles viewer < operator < admin. Every operation "
    "may answer 400 for input it cannot accept, 401 without a valid admin key and 403 when the key's "
    "role may not act; operations on a named resource answer 404 when it does not exist.")

router = APIRouter(prefix="/admin", tags=["admin"], responses={401: _E401, 403: _E403})


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(v: Any) -> Any:
    """Redis strings back to numbers where they are numbers."""
    s = _s(v)
    try:
        i = int(s)
        return i
    except ValueError:
        pass
    try:
        f = float(s)
        return f if f == f else None
    except ValueError:
        return s


def _hash(raw: dict) -> dict[str, Any]:
    return {_s(k): _num(v) for k, v in (raw or {}).items()}


def _state(request: Request) -> Any:
    """The GatewayState this app was built with."""
    st = request.app.state
    for name in ("gateway", "state", "gateway_state"):
        gs = getattr(st, name, None)
        if gs is not None and hasattr(gs, "redis"):
            return gs
    if hasattr(st, "redis"):
        return st
    raise HTTPException(503, "gateway state not ready")


async def _maybe_await(v: Any) -> Any:
    return await v if inspect.isawaitable(v) else v


async def audit_action(state: Any, who: AdminPrincipal, action: str, **fields: Any) -> None:
    """Every admin action goes to the audit stream, as ``admin:<key name>`` with its role."""
    metrics.ADMIN_ACTIONS.labels(action).inc()
    await audit(state.redis, principal=who.audit_name, action=action, role=who.role, **fields)


# ====================================================================== meta
def admin_doc(request: Request) -> dict[str, Any]:
    """OpenAPI of every route under /admin, including other components' admin routers (cached)."""
    cached = getattr(request.app.state, "admin_openapi", None)
    if cached is not None:
        return cached
    full = copy.deepcopy(request.app.openapi())
    doc: dict[str, Any] = {
        "openapi": full.get("openapi", "3.1.0"),
        "info": {"title": "learnmesh admin API", "version": "1", "description": API_DESCRIPTION},
        "paths": {p: ops for p, ops in full.get("paths", {}).items() if p.startswith("/admin/")},
        "components": full.get("components", {}),
    }
    doc["components"].setdefault("securitySchemes", {})["adminKey"] = {"type": "http", "scheme": "bearer"}
    doc["security"] = [{"adminKey": []}]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            if isinstance(op, dict) and "responses" in op:
                op["responses"].setdefault("400", {"description": _E400["description"]})
                op["responses"].setdefault("401", {"description": _E401["description"]})
                op["responses"].setdefault("403", {"description": _E403["description"]})
                if "{" in path:
                    op["responses"].setdefault("404", {"description": _E404["description"]})
    request.app.state.admin_openapi = doc
    return doc


@router.get("/openapi.json", include_in_schema=False)
async def admin_openapi(request: Request) -> JSONResponse:
    return JSONResponse(admin_doc(request))


@router.get("/ui", include_in_schema=False)
async def ui_index() -> HTMLResponse:
    return HTMLResponse((UI_DIR / "index.html").read_text(), headers={"Cache-Control": "no-store"})


@router.get("/ui/{name}", include_in_schema=False)
async def ui_file(name: str) -> FileResponse:
    if name not in UI_FILES:
        raise HTTPException(404, "no such file")
    return FileResponse(UI_DIR / name, media_type=UI_FILES[name], headers={"Cache-Control": "no-store"})


@router.get("/whoami", summary="The calling admin key's name and role")
async def whoami(who: AdminPrincipal = viewer) -> dict[str, Any]:
    return {"name": who.name, "role": who.role, "source": who.source}


# ====================================================================== admin keys
class KeyCreate(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.@\-]{1,64}$")
    role: Literal["viewer", "operator", "admin"] = "viewer"


@router.get("/keys", summary="List admin keys (names and roles, never the keys)")
async def list_keys(request: Request, who: AdminPrincipal = admin) -> dict[str, Any]:
    return {"keys": await _ring(request).list(), "roles": list(ROLES)}


@router.post("/keys", status_code=201, summary="Create an admin key (the key is shown once)",
             responses={409: _E409})
async def create_key(request: Request, body: KeyCreate, who: AdminPrincipal = admin) -> dict[str, Any]:
    state = _state(request)
    try:
        plaintext, meta = await _ring(request).create(body.name, body.role, who.audit_name)
    except KeyNameTaken:
        raise HTTPException(409, f"an admin key named {body.name!r} exists") from None
    await audit_action(state, who, "admin_key.create", key_name=body.name, key_role=body.role)
    return {**meta, "key": plaintext}


@router.delete("/keys/{name}", summary="Revoke an admin key created through the API",
               responses={404: _E404, 409: _E409})
async def revoke_key(request: Request, name: Annotated[str, PathParam(max_length=64)],
                     who: AdminPrincipal = admin) -> dict[str, Any]:
    ring = _ring(request)
    if name in ring.config_names():
        raise HTTPException(409, f"{name!r} comes from the config file; remove it there")
    if not await ring.revoke(name):
        raise HTTPException(404, f"no admin key named {name!r}")
    await audit_action(_state(request), who, "admin_key.revoke", key_name=name)
    return {"revoked": name}


def _ring(request: Request) -> AdminKeyring:
    ring = keyring_of(request)
    if ring is None:
        raise HTTPException(503, "admin keyring not ready")
    return ring


# ====================================================================== sessions
_SESS_RE = re.compile(r"^" + re.escape(keys.PREFIX) + r"\{([^{}]+)\}:sess:([^:]+)$")


async def _session_refs(state: Any, principal: str | None, limit: int, session_id: str | None = None,
                        max_scan_calls: int | None = None) -> list[tuple[str, str]]:
    """(principal, session id) pairs: from the principal's index, or by scanning session hashes
    (``max_scan_calls`` bounds the cost where completeness does not matter: the dashboard)."""
    r = state.redis
    if principal and session_id is None:
        return [(principal, _s(x)) for x in await r.zrevrange(keys.principal_sessions(principal), 0, limit - 1)]
    pattern = keys.session(principal or "*", session_id or "*")
    out: list[tuple[str, str]] = []
    cursor, calls = 0, 0
    while True:
        cursor, batch = await r.scan(cursor=cursor, match=pattern, count=1000)
        calls += 1
        for k in batch:
            m = _SESS_RE.fullmatch(_s(k))
            if m:
                out.append((m.group(1), m.group(2)))
                if len(out) >= limit:
                    return out
        if cursor == 0 or (max_scan_calls is not None and calls >= max_scan_calls):
            return out


async def _session_info(state: Any, principal: str, sid: str) -> dict[str, Any] | None:
    r = state.redis
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.session(principal, sid))
    pipe.pttl(keys.session(principal, sid))
    pipe.xlen(keys.session_events(principal, sid))
    pipe.hlen(keys.session_pending(principal, sid))
    pipe.zscore(keys.principal_sessions(principal), sid)
    fields, ttl_ms, n_events, n_pending, last_used = await pipe.execute()
    if not fields:
        return None
    f = {_s(k): _s(v) for k, v in fields.items()}
    try:
        caps = json.loads(f.get("caps") or "{}")
    except ValueError:
        caps = {}
    return {"id": sid, "principal": principal, "protocol_version": f.get("v"), "log_level": f.get("lvl") or None,
            "capabilities": caps, "last_used_s": last_used, "ttl_s": None if ttl_ms < 0 else round(ttl_ms / 1000, 1),
            "events": n_events, "pending_requests": n_pending}


async def _find_session(state: Any, session_id: str) -> dict[str, Any]:
    if "*" in session_id or "?" in session_id or "[" in session_id or ":" in session_id:
        raise HTTPException(404, "no such session")
    for principal, sid in await _session_refs(state, None, 2, session_id=session_id):
        info = await _session_info(state, principal, sid)
        if info is not None:
            return info
    raise HTTPException(404, "no such session")


@router.get("/sessions", summary="List legacy MCP sessions (optionally of one principal)")
async def list_sessions(request: Request,
                        principal: Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9_.@:\-]+$")] = None,
                        limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                        who: AdminPrincipal = viewer) -> dict[str, Any]:
    state = _state(request)
    infos = []
    for p, sid in await _session_refs(state, principal, limit):
        info = await _session_info(state, p, sid)
        if info is not None:
            infos.append(info)
    return {"sessions": infos, "count": len(infos)}


@router.get("/sessions/{session_id}", summary="Inspect one session", responses={404: _E404})
async def get_session(request: Request, session_id: Annotated[str, PathParam(max_length=256)],
                      who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _find_session(_state(request), session_id)


@router.delete("/sessions/{session_id}", summary="Terminate a session on every replica", responses={404: _E404})
async def terminate_session(request: Request, session_id: Annotated[str, PathParam(max_length=256)],
                            who: AdminPrincipal = operator) -> dict[str, Any]:
    state = _state(request)
    info = await _find_session(state, session_id)
    await state.sessions.delete(info["principal"], session_id)
    await audit_action(state, who, "session.terminate", session=session_id, client=info["principal"])
    return {"terminated": session_id, "principal": info["principal"]}


# ====================================================================== workers
async def _statuses(state: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """Live self-reports (shared.control.report_status) whose component name starts with ``prefix``."""
    r = state.redis
    names = sorted(n for n in (_s(m) for m in await r.smembers(keys.STATUS_INDEX)) if n.startswith(prefix))
    if not names:
        return {}
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(keys.component_status(n))
    out, gone = {}, []
    for n, raw in zip(names, await pipe.execute(), strict=True):
        if raw:
            out[n] = _hash(raw)
        else:
            gone.append(n)
    if gone:  # expired reports: the process stopped reporting
        await r.srem(keys.STATUS_INDEX, *gone)
    return out


async def _current_version(state: Any) -> int | None:
    v = await state.redis.get(keys.MODEL_VERSION)
    return int(v) if v is not None and _s(v).lstrip("-").isdigit() else None


def _pool_workers(state: Any) -> list[dict[str, Any]]:
    pool = getattr(state, "workers", None)
    if pool is None:
        return []
    for meth in ("status", "snapshot", "describe"):
        fn = getattr(pool, meth, None)
        if callable(fn):
            got = fn()
            break
    else:
        return []
    if isinstance(got, dict):
        got = [{"id": k, **v} if isinstance(v, dict) else {"id": k, "value": v} for k, v in got.items()]
    out = []
    for w in got or []:
        if not isinstance(w, dict):
            w = getattr(w, "__dict__", {"value": str(w)})
        out.append({k: v for k, v in w.items() if not k.startswith("_")})
    return out


async def _workers(state: Any) -> list[dict[str, Any]]:
    current = await _current_version(state)
    drained = {_s(m) for m in await state.redis.smembers(keys.WORKERS_DRAINED)}
    by_id: dict[str, dict[str, Any]] = {}
    for w in _pool_workers(state):
        wid = str(w.get("id") or w.get("worker_id") or w.get("endpoint") or w.get("identity") or len(by_id))
        by_id[wid] = {**w, "id": wid}
    for comp, st in (await _statuses(state, "worker:")).items():
        wid = comp.split(":", 1)[1]
        by_id[wid] = {**st, **by_id.get(wid, {}), "id": wid, "reported_ms": st.get("ts_ms")}
    out = []
    for wid, w in sorted(by_id.items()):
        version = w.get("version", w.get("model_version"))
        lag = (current - int(version)) if current is not None and isinstance(version, (int, float)) else None
        out.append({**w, "version": version, "lag": w.get("lag", lag),
                    "load": w.get("load", w.get("inflight", w.get("in_flight"))),
                    "drained": wid in drained or bool(w.get("drained"))})
    return out


@router.get("/workers", summary="Inference workers: version, lag behind the trainer, load, drained")
async def list_workers(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    state = _state(request)
    return {"model_version": await _current_version(state), "workers": await _workers(state)}


async def _set_drain(request: Request, worker_id: str, who: AdminPrincipal, drain: bool) -> dict[str, Any]:
    state = _state(request)
    known = {w["id"] for w in await _workers(state)}
    if worker_id not in known:
        raise HTTPException(404, f"no worker {worker_id!r}")
    if drain:
        await state.redis.sadd(keys.WORKERS_DRAINED, worker_id)
    else:
        await state.redis.srem(keys.WORKERS_DRAINED, worker_id)
    fn = getattr(getattr(state, "workers", None), "drain" if drain else "undrain", None)
    if callable(fn):
        with contextlib.suppress(Exception):
            await _maybe_await(fn(worker_id))
    await audit_action(state, who, "worker.drain" if drain else "worker.undrain", worker=worker_id)
    return {"worker": worker_id, "drained": drain}


@router.post("/workers/{worker_id}/drain", summary="Stop routing new requests to a worker",
             responses={404: _E404})
async def drain_worker(request: Request, worker_id: Annotated[str, PathParam(max_length=256)],
                       who: AdminPrincipal = operator) -> dict[str, Any]:
    return await _set_drain(request, worker_id, who, True)


@router.delete("/workers/{worker_id}/drain", summary="Route to a drained worker again", responses={404: _E404})
async def undrain_worker(request: Request, worker_id: Annotated[str, PathParam(max_length=256)],
                         who: AdminPrincipal = operator) -> dict[str, Any]:
    return await _set_drain(request, worker_id, who, False)


# ====================================================================== trainer
async def _trainer(state: Any) -> dict[str, Any]:
    r = state.redis
    status = _hash(await r.hgetall(keys.TRAINER_STATUS))
    status.update({k: v for k, v in _hash(await r.hgetall(keys.component_status("trainer"))).items()
                   if k not in status})
    updated = status.get("updated_ms", status.get("ts_ms"))
    age_s = (control.now_ms() - updated) / 1000 if isinstance(updated, (int, float)) else None
    return {**status, "paused": bool(await r.exists(keys.TRAINER_PAUSED)),
            "alive": age_s is not None and age_s < 30, "report_age_s": age_s}


@router.get("/trainer", summary="Trainer status: step, loss, samples/s, paused")
async def trainer_status(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _trainer(_state(request))


@router.post("/trainer/pause", summary="Pause training (durable until resumed)")
async def trainer_pause(request: Request, who: AdminPrincipal = operator) -> dict[str, Any]:
    state = _state(request)
    await state.redis.set(keys.TRAINER_PAUSED, json.dumps({"by": who.audit_name, "ts_ms": control.now_ms()}))
    await audit_action(state, who, "trainer.pause")
    return {"paused": True}


@router.post("/trainer/resume", summary="Resume training")
async def trainer_resume(request: Request, who: AdminPrincipal = operator) -> dict[str, Any]:
    state = _state(request)
    await state.redis.delete(keys.TRAINER_PAUSED)
    await audit_action(state, who, "trainer.resume")
    return {"paused": False}


async def _send_command(state: Any, who: AdminPrincipal, cmd: str, **args: Any) -> str:
    cid = uuid.uuid4().hex
    fields = {"id": cid, "cmd": cmd, "by": who.audit_name, "ts_ms": control.now_ms(), **args}
    await state.redis.xadd(keys.TRAINER_CONTROL, {k: str(v) for k, v in fields.items()},
                           maxlen=10_000, approximate=True)
    return cid


@router.post("/trainer/checkpoint", status_code=202, summary="Ask the trainer to checkpoint now")
async def trainer_checkpoint(request: Request, who: AdminPrincipal = operator) -> dict[str, Any]:
    state = _state(request)
    cid = await _send_command(state, who, "checkpoint")
    await audit_action(state, who, "trainer.checkpoint", command=cid)
    return {"command_id": cid, "status_url": f"/admin/trainer/commands/{cid}"}


@router.get("/trainer/commands/{command_id}", summary="Whether the trainer handled a command",
            responses={404: _E404})
async def trainer_command(request: Request, command_id: Annotated[str, PathParam(pattern=r"^[0-9a-f]{32}$")],
                          who: AdminPrincipal = viewer) -> dict[str, Any]:
    r = _state(request).redis
    ack = await r.hget(keys.TRAINER_CONTROL_ACK, command_id)
    if ack is not None:
        return {"command_id": command_id, "state": "done", "result": json.loads(ack)}
    for _id, fields in await r.xrevrange(keys.TRAINER_CONTROL, count=10_000):
        f = {_s(k): _s(v) for k, v in fields.items()}
        if f.get("id") == command_id:
            return {"command_id": command_id, "state": "pending", "cmd": f.get("cmd")}
    raise HTTPException(404, "no such command")


# ====================================================================== model versions
async def _versions(state: Any, limit: int) -> list[dict[str, Any]]:
    entries = await state.redis.xrevrange(keys.MODEL_VERSION_LOG, count=limit)
    return [{**_hash(f), "id": _s(i)} for i, f in entries]


@router.get("/models", summary="Published model versions, newest first")
async def list_models(request: Request, limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                      who: AdminPrincipal = viewer) -> dict[str, Any]:
    state = _state(request)
    return {"current": await _current_version(state), "versions": await _versions(state, limit)}


class Rollback(BaseModel):
    version: int | None = Field(default=None, ge=0, description="roll back to this published version")
    anchor: bool = Field(default=False, description="roll back to the latest full anchor instead")


@router.post("/models/rollback", status_code=202, responses={404: _E404, 422: _E422},
             summary="Roll the served model back to a version or the latest anchor; workers follow")
async def rollback(request: Request, body: Rollback, who: AdminPrincipal = admin) -> dict[str, Any]:
    state = _state(request)
    if (body.version is None) == (not body.anchor):
        raise HTTPException(422, "give exactly one of: version, anchor=true")
    versions = await _versions(state, 10_000)
    if body.version is not None:
        if not any(v.get("version") == body.version for v in versions):
            raise HTTPException(404, f"version {body.version} is not in the version log")
        target = {"to_version": body.version}
    else:
        anchors = [v for v in versions if v.get("anchor") in (1, True)]
        if not anchors:
            raise HTTPException(404, "no anchor in the version log")
        target = {"to_version": anchors[0]["version"], "anchor": 1}
    cid = await _send_command(state, who, "rollback", **target)
    await audit_action(state, who, "model.rollback", command=cid, version=target["to_version"])
    return {"command_id": cid, **target, "status_url": f"/admin/trainer/commands/{cid}"}


# ====================================================================== configuration
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
    if isinstance(obj, str) and path == "redis.url" and "@" in obj:
        scheme, _, rest = obj.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return obj


async def _config_view(state: Any) -> dict[str, Any]:
    overrides = control.read_overrides(_SyncView(await state.redis.hgetall(keys.RUNTIME_CONFIG)))
    rev = int(await state.redis.get(keys.RUNTIME_CONFIG_REV) or 0)
    effective = control.effective_config(state.config, overrides)
    return {"config": redact(effective.to_dict()), "runtime_overrides": overrides, "revision": rev,
            "runtime_sections": list(control.RUNTIME_SECTIONS)}


class _SyncView:
    """Adapts an already-fetched hash to the sync ``hgetall`` that shared.control expects."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw

    def hgetall(self, _key: str) -> dict:
        return self.raw


class ConfigPatch(BaseModel):
    """Fields to change per runtime section; validated by that section's dataclass in shared/config.py."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"compression": {"density": 0.02}, "consistency": {"sync_interval": 2}}]})
    compression: dict[str, Any] | None = None
    consistency: dict[str, Any] | None = None
    scheduling: dict[str, Any] | None = None


@router.get("/config", summary="Effective configuration (secrets redacted) and runtime overrides")
async def get_config(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    return await _config_view(_state(request))


@router.patch("/config", responses={422: _E422},
              summary="Change compression / consistency / scheduling settings at runtime")
async def patch_config(request: Request, patch: ConfigPatch, who: AdminPrincipal = admin) -> dict[str, Any]:
    state = _state(request)
    r = state.redis
    body = patch.model_dump(exclude_none=True)
    current = control.read_overrides(_SyncView(await r.hgetall(keys.RUNTIME_CONFIG)))
    try:
        merged = control.validate_runtime_patch(state.config, current, body)
    except ConfigError as exc:
        raise HTTPException(422, str(exc)) from None
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.RUNTIME_CONFIG, mapping={k: json.dumps(v) for k, v in merged.items()})
    pipe.incr(keys.RUNTIME_CONFIG_REV)
    _, rev = await pipe.execute()
    await r.publish(keys.RUNTIME_CONFIG_CHANNEL, str(rev))
    await audit_action(state, who, "config.change", change=json.dumps(body, sort_keys=True), revision=rev)
    return await _config_view(state)


@router.delete("/config/runtime", summary="Drop every runtime override (back to the config file)")
async def reset_config(request: Request, who: AdminPrincipal = admin) -> dict[str, Any]:
    state = _state(request)
    pipe = state.redis.pipeline(transaction=True)
    pipe.delete(keys.RUNTIME_CONFIG)
    pipe.incr(keys.RUNTIME_CONFIG_REV)
    _, rev = await pipe.execute()
    await state.redis.publish(keys.RUNTIME_CONFIG_CHANNEL, str(rev))
    await audit_action(state, who, "config.reset", revision=rev)
    return await _config_view(state)


# ====================================================================== delta key
@router.get("/delta-key", summary="The delta key ring's report (key id, epoch, last rotation)")
async def delta_key_status(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    r = _state(request).redis
    pending = await r.xlen(keys.DELTA_KEY_ROTATE)
    return {"key_ring": _hash(await r.hgetall(keys.DELTA_KEY_STATUS)), "rotation_requests": pending}


@router.post("/delta-key/rotate", status_code=202, summary="Rotate the delta encryption key (no downtime)")
async def delta_key_rotate(request: Request, who: AdminPrincipal = admin) -> dict[str, Any]:
    state = _state(request)
    rid = await state.redis.xadd(keys.DELTA_KEY_ROTATE, {"by": who.audit_name, "ts_ms": str(control.now_ms())},
                                 maxlen=1000, approximate=True)
    await audit_action(state, who, "delta_key.rotate", request=_s(rid))
    return {"request_id": _s(rid), "status_url": "/admin/delta-key"}


# ====================================================================== audit
def _entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


@router.get("/audit", summary="Query the audit log by principal, action and time (newest first)")
async def query_audit(request: Request,
                      principal: Annotated[str | None, Query(max_length=200)] = None,
                      action: Annotated[str | None, Query(max_length=200)] = None,
                      since_ms: Annotated[int | None, Query(ge=0, le=2**53)] = None,
                      until_ms: Annotated[int | None, Query(ge=0, le=2**53)] = None,
                      limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100,
                      who: AdminPrincipal = viewer) -> dict[str, Any]:
    r = _state(request).redis
    hi = f"{until_ms}-18446744073709551615" if until_ms is not None else "+"
    lo = f"{since_ms}-0" if since_ms is not None else "-"
    out: list[dict[str, Any]] = []
    scanned = 0
    while len(out) < limit and scanned < 100_000:
        batch = await r.xrevrange(keys.AUDIT_STREAM, max=hi, min=lo, count=500)
        if not batch:
            break
        for eid, fields in batch:
            scanned += 1
            e = {_s(k): _s(v) for k, v in fields.items()}
            if principal is not None and e.get("principal") != principal and not (
                    principal.startswith("admin:") and e.get("admin") == principal[6:]):
                continue
            if action is not None and e.get("action") != action and not (
                    action.endswith("*") and e.get("action", "").startswith(action[:-1])):
                continue
            out.append({"id": _s(eid), **e, "ts_ms": _entry_ms(_s(eid))})
            if len(out) >= limit:
                break
        last = _s(batch[-1][0])
        ms, seq = (int(x) for x in last.split("-"))
        if seq > 0:
            hi = f"{ms}-{seq - 1}"
        elif ms > 0:
            hi = f"{ms - 1}-18446744073709551615"
        else:
            break
        if len(batch) < 500:
            break
    return {"entries": out, "count": len(out)}


# ====================================================================== samples
async def _samples(state: Any) -> dict[str, Any]:
    r = state.redis
    length = await r.xlen(keys.SAMPLE_LOG)
    last_seq = await r.get(getattr(keys, "SAMPLE_SEQ", keys.SAMPLE_LOG + ":seq"))
    offset = await r.hgetall(keys.TRAINER_OFFSET) if await r.type(keys.TRAINER_OFFSET) in (b"hash", "hash") else {}
    off = _hash(offset)
    last = int(last_seq) if last_seq is not None else None
    trained_seq = off.get("seq") if isinstance(off.get("seq"), int) else None
    backlog = (last - trained_seq) if last is not None and trained_seq is not None else None
    return {"log_length": length, "last_seq": last, "trainer_offset": off, "backlog": backlog}


# ====================================================================== summary (dashboard)
async def _gateways(state: Any) -> dict[str, Any]:
    raw = await state.redis.hgetall(keys.GATEWAY_STATS)
    now = control.now_ms()
    live: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for rid, body in raw.items():
        snap = json.loads(body)
        (live if now - snap.get("ts_ms", 0) < STATS_TTL_S * 1000 else stale).append({"replica": _s(rid), **snap})
    if stale:
        await state.redis.hdel(keys.GATEWAY_STATS, *[s["replica"] for s in stale])
    p99s = [g["p99_ms"] for g in live if g.get("p99_ms") is not None]
    p50s = [g["p50_ms"] for g in live if g.get("p50_ms") is not None]
    return {"replicas": len(live), "rps": round(sum(g.get("rps", 0) for g in live), 3),
            "errors_per_s": round(sum(g.get("errors_per_s", 0) for g in live), 3),
            "requests_total": sum(g.get("requests_total", 0) for g in live),
            "p50_ms": max(p50s) if p50s else None, "p99_ms": max(p99s) if p99s else None,
            "per_replica": live}


async def _contexts(state: Any, principals_shown: int = 5, contexts_shown: int = 20) -> dict[str, Any]:
    """Global bytes and budget, principals by recency, the most recently used contexts."""
    store = getattr(state, "store", None)
    if store is None or not hasattr(store, "principals"):
        return {}
    principals = await store.principals()
    rows = []
    for p in principals[:principals_shown]:
        for info in await store.list_contexts(p):
            rows.append({"principal": p, "id": info.id, "version": info.version, "bytes": info.bytes,
                         "entries": sum(info.entries.values()), "last_used_ms": info.last_used_ms})
    rows.sort(key=lambda c: c["last_used_ms"], reverse=True)
    return {"principals": len(principals), "global_bytes": await store.global_bytes(),
            "global_budget_bytes": getattr(getattr(store, "cfg", None), "global_budget_bytes", None),
            "recent": rows[:contexts_shown]}


@router.get("/summary", summary="Everything the dashboard shows, in one call")
async def summary(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    state = _state(request)
    st = getattr(state, "admin_stats", None)
    if st is not None:
        await _publish_stats(state)
    sessions = []
    for p, sid in await _session_refs(state, None, 20, max_scan_calls=3):
        info = await _session_info(state, p, sid)
        if info is not None:
            sessions.append(info)
    delta = _hash(await state.redis.hgetall(keys.component_status("delta")))
    trainer = await _trainer(state)
    return {
        "ts_ms": control.now_ms(),
        "gateway": await _gateways(state),
        "model_version": await _current_version(state),
        "workers": await _workers(state),
        "trainer": trainer,
        "delta": delta,
        "sync": {"compression_ratio": delta.get("compression_ratio", trainer.get("compression_ratio")),
                 "sync_latency_ms": delta.get("sync_latency_ms", trainer.get("sync_latency_ms"))},
        "samples": await _samples(state),
        "sessions": {"shown": sessions},
        "contexts": await _contexts(state),
        "who": {"name": who.name, "role": who.role},
    }


# ====================================================================== unsupported methods
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "HEAD")


def _template_match(template: str, path: str) -> bool:
    pattern = "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"
    return re.match(pattern, path) is not None


@router.api_route("/{rest:path}", methods=list(_METHODS), include_in_schema=False)
async def unsupported(request: Request, rest: str) -> JSONResponse:
    """Registered last: answers what no admin route matched. 405 with the documented methods in
    ``Allow`` when the path exists (one path can span several routers), else 404."""
    allowed: set[str] = set()
    for template, ops in admin_doc(request)["paths"].items():
        if _template_match(template, request.url.path):
            allowed |= {m.upper() for m in ops}
    if not allowed:
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405,
                        headers={"Allow": ", ".join(sorted(allowed))})


# ====================================================================== lifecycle
async def _publish_stats(state: Any) -> None:
    stats: LocalStats = state.admin_stats
    stats.tick()
    snap = {**stats.snapshot(), "ts_ms": control.now_ms()}
    await state.redis.hset(keys.GATEWAY_STATS, state.admin_replica_id, json.dumps(snap))


async def _refresh_gauges(state: Any) -> None:
    """Mesh-wide gauges this replica's /metrics serves: per-worker version and lag, context bytes."""
    seen = set()
    for w in await _workers(state):
        if isinstance(w.get("version"), (int, float)):
            metrics.WORKER_VERSION.labels(w["id"]).set(w["version"])
        if isinstance(w.get("lag"), (int, float)):
            metrics.WORKER_VERSION_LAG.labels(w["id"]).set(w["lag"])
        seen.add(w["id"])
    for gauge in (metrics.WORKER_VERSION, metrics.WORKER_VERSION_LAG):
        for labels in list(getattr(gauge, "_metrics", {})):
            if labels[0] not in seen:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
    store = getattr(state, "store", None)
    if store is not None and hasattr(store, "global_bytes"):
        metrics.CONTEXT_STORED_BYTES.set(await store.global_bytes())


async def _stats_loop(state: Any, interval_s: float) -> None:
    while True:
        try:
            await _publish_stats(state)
            await _refresh_gauges(state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis down: the gateway reports 503 elsewhere; keep sampling
            log.debug("admin stats publish failed: %s", exc)
        await asyncio.sleep(interval_s)


async def startup(state: Any) -> None:
    cfg = state.config
    state.admin_keyring = AdminKeyring.from_config(cfg.gateway.admin_keys, state.redis, cfg.gateway.api_keys)
    state.admin_stats = LocalStats()
    state.admin_replica_id = getattr(state, "replica_id", None) or \
        f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    interval = getattr(getattr(cfg, "metrics", None), "status_interval_s", 1.0)
    state.admin_stats_task = asyncio.create_task(_stats_loop(state, interval), name="admin-stats")


async def shutdown(state: Any) -> None:
    task = getattr(state, "admin_stats_task", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 2.0)
    with contextlib.suppress(Exception):
        await state.redis.hdel(keys.GATEWAY_STATS, state.admin_replica_id)


