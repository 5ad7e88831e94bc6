"""Every admin router, in the order the app includes them. The fallback that answers 404/405
for what no admin route matched comes last; /admin/openapi.json documents all of them.

Roles (gateway/admin/auth.py): GET routes need ``viewer``; acting on the running mesh
(terminate, drain, pause, checkpoint, evict, a principal's limits) needs ``operator``; changing it (keys, config,
rollback, delta key rotation, who may teach) needs ``admin``. Every action is written to the audit stream.
Commands for other processes travel through Redis (shared/control.py).
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.admin import (
    audit,
    config,
    contexts,
    delta_key,
    keys,
    limits,
    meta,
    models,
    samples,
    sessions,
    summary,
    teachers,
    trainer,
    upstreams,
    workers,
)

ROUTERS: tuple[APIRouter, ...] = (
    contexts.router, samples.router, meta.router, keys.router, sessions.router, workers.router,
    trainer.router, models.router, config.router, delta_key.router, audit.router, summary.router,
    teachers.router, limits.router, upstreams.router, meta.fallback,
)
