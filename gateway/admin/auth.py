"""Admin authentication: bearer admin keys with roles viewer < operator < admin.

Admin keys come from two places: ``gateway.admin_keys`` in the config (or
``LEARNMESH_ADMIN_KEY``), and keys created at runtime through ``POST /admin/keys``,
stored in Redis as SHA-256 digests only (``keys.ADMIN_KEYS``). Admin keys and MCP
client keys are separate sets: a token that is an MCP key never authenticates here,
and the gateway refuses to start when a configured admin key equals an MCP key.

What each role may do:
- viewer: read everything (GET routes, the dashboard summary).
- operator: act on the running mesh (terminate sessions, evict contexts, drain
  workers, pause/resume/checkpoint the trainer).
- admin: change it (admin keys, runtime configuration, model rollback, delta key rotation).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from fastapi import HTTPException, Request

from gateway.auth import bearer_token, is_unguessable
from gateway.state import gateway_of
from shared import keys, metrics
from shared.config import AdminKey

ROLES = ("viewer", "operator", "admin")
KEY_PREFIX = "lmadm_"
_NAME_OK = re.compile(r"^[A-Za-z0-9_.@\-]{1,64}$")
_GENERATED = re.compile(KEY_PREFIX + r"[A-Za-z0-9_-]{43}")  # what create() makes: 256 random bits
ADMIN_KEY_REQUIRED = "a valid admin key is required"
ADMIN_SCOPE_KEY = "learnmesh.admin"
"""Where the HTTP edge (gateway/transports/edge.py) leaves the admin key it authenticated."""
# the dashboard's files, the API document, and /admin itself (it leads to the dashboard)
_PUBLIC = re.compile(r"^/admin(?:/|/ui(?:/[^/]*)?|/openapi\.json)?$")


@dataclass(frozen=True)
class AdminPrincipal:
    name: str
    role: str
    source: str = "config"  # config | redis

    def allows(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)

    @property
    def audit_name(self) -> str:
        return f"admin:{self.name}"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyNameTaken(Exception):
    pass


class AdminKeyring:
    """Config keys (name -> (digest, role)) plus runtime keys in Redis.

    ``redis`` is a redis.asyncio client; without one only config keys exist.
    """

    def __init__(self, keys_: dict[str, tuple[bytes, str]], redis: aioredis.Redis | None = None,
                 mcp_digests: frozenset[bytes] = frozenset()) -> None:
        self._keys = keys_
        self._redis = redis
        self._mcp = mcp_digests

    @classmethod
    def from_config(cls, admin_keys: dict[str, AdminKey], redis: aioredis.Redis | None = None,
                    api_keys: dict[str, str] | None = None) -> AdminKeyring:
        """No admin key equals an MCP key: the configuration refuses that (shared/config.py)."""
        mcp = frozenset(digest(k) for k in (api_keys or {}).values())
        own: dict[str, tuple[bytes, str]] = {name: (digest(k.key), k.role) for name, k in admin_keys.items()}
        return cls(own, redis, mcp)

    def config_names(self) -> dict[str, str]:
        return {name: role for name, (_, role) in self._keys.items()}

    async def lookup(self, key: str, runtime: bool = True) -> AdminPrincipal | None:
        """The admin key ``key`` is; runtime keys (in Redis) only when ``runtime``."""
        d = digest(key)
        if d in self._mcp:
            return None
        found = None
        for name, (kd, role) in self._keys.items():
            if hmac.compare_digest(d, kd):
                found = AdminPrincipal(name, role, "config")
        if found is None and runtime and self._redis is not None:
            raw = await self._redis.hget(keys.ADMIN_KEYS, d.hex())
            if raw:
                meta = json.loads(raw)
                found = AdminPrincipal(meta["name"], meta["role"], "redis")
        return found

    async def lookup_unguessable(self, key: str) -> AdminPrincipal | None:
        """:meth:`lookup` for a key no one can guess, else None: one long and varied enough to be
        taken for random (:func:`~gateway.auth.is_unguessable`, as a random API key), among them
        every key :meth:`create` makes. Served from an address the failed-attempt throttle
        refuses, as ``/mcp`` serves a random API key (gateway/auth.py says why that is safe).
        Redis is asked only for a key of :meth:`create`'s form: runtime keys have no other."""
        if not is_unguessable(key):
            return None
        return await self.lookup(key, runtime=_GENERATED.fullmatch(key) is not None)

    # ------------------------------------------------------------ runtime keys (Redis)
    async def create(self, name: str, role: str, created_by: str) -> tuple[str, dict[str, Any]]:
        """Make a new random key; returns (plaintext, metadata). The plaintext is shown once."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if not _NAME_OK.fullmatch(name):
            raise ValueError("name must be 1-64 characters of A-Z a-z 0-9 _ . @ -")
        if name in self._keys:
            raise KeyNameTaken(name)
        plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
        d = digest(plaintext).hex()
        meta = {"name": name, "role": role, "created_ms": int(time.time() * 1000), "created_by": created_by}
        redis = self._runtime_store()
        if not await redis.hsetnx(keys.ADMIN_KEY_NAMES, name, d):
            raise KeyNameTaken(name)
        await redis.hset(keys.ADMIN_KEYS, d, json.dumps(meta))
        return plaintext, meta

    async def revoke(self, name: str) -> bool:
        redis = self._runtime_store()
        d = await redis.hget(keys.ADMIN_KEY_NAMES, name)
        if d is None:
            return False
        pipe = redis.pipeline(transaction=True)
        pipe.hdel(keys.ADMIN_KEYS, d)
        pipe.hdel(keys.ADMIN_KEY_NAMES, name)
        await pipe.execute()
        return True

    def _runtime_store(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("runtime admin keys live in Redis; this keyring has no Redis client")
        return self._redis

    async def list(self) -> list[dict[str, Any]]:
        out = [{"name": n, "role": r, "source": "config"} for n, r in sorted(self.config_names().items())]
        if self._redis is not None:
            raw = await self._redis.hgetall(keys.ADMIN_KEYS)
            metas = sorted((json.loads(v) for v in raw.values()), key=lambda m: m["name"])
            out += [{**m, "source": "redis"} for m in metas]
        return out


def admin_key_required(method: str, path: str) -> bool:
    """Whether a request needs an admin key before anything of it is read: every ``/admin`` path
    except the dashboard's static files, the OpenAPI document and ``/admin`` itself (GET/HEAD)."""
    if path != "/admin" and not path.startswith("/admin/"):
        return False
    return not (method in ("GET", "HEAD") and _PUBLIC.fullmatch(path))


async def authenticate(keyring: AdminKeyring, authorization: str | None) -> AdminPrincipal | None:
    """The admin key named by an ``Authorization: Bearer`` header, or None (counted as a 401)."""
    token = bearer_token(authorization)
    who = await keyring.lookup(token) if token is not None else None
    if who is None:
        metrics.ADMIN_DENIED.labels("401").inc()
    return who


def require_role(role: str) -> Callable[[Request], Awaitable[AdminPrincipal]]:
    """FastAPI dependency: 401 without a valid admin key, 403 if the key's role is too low."""
    if role not in ROLES:
        raise ValueError(role)

    async def dep(request: Request) -> AdminPrincipal:
        who: AdminPrincipal | None = request.scope.get(ADMIN_SCOPE_KEY)
        if who is None:
            who = await authenticate(gateway_of(request).admin_keyring, request.headers.get("authorization"))
        if who is None:
            raise HTTPException(401, ADMIN_KEY_REQUIRED, headers={"WWW-Authenticate": "Bearer"})
        if not who.allows(role):
            metrics.ADMIN_DENIED.labels("403").inc()
            raise HTTPException(403, f"role {who.role!r} may not do this (needs {role!r})")
        request.state.admin = who
        return who

    return dep
