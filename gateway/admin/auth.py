"""Admin authentication: bearer admin keys with roles viewer < operator < admin.

Admin keys and MCP client keys are separate sets: an MCP key never passes here.
Keys are compared by SHA-256 digest in constant time; the plaintext is not kept.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, Request

ROLES = ("viewer", "operator", "admin")


@dataclass(frozen=True)
class AdminPrincipal:
    name: str
    role: str

    def allows(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class AdminKeyring:
    """name -> (sha256(key), role); built from config at start."""

    def __init__(self, keys: dict[str, tuple[bytes, str]]) -> None:
        self._keys = keys

    @classmethod
    def from_config(cls, admin_keys: dict) -> AdminKeyring:
        return cls({name: (digest(k.key), k.role) for name, k in admin_keys.items()})

    def lookup(self, key: str) -> AdminPrincipal | None:
        d = digest(key)
        found = None
        for name, (kd, role) in self._keys.items():
            if hmac.compare_digest(d, kd):
                found = AdminPrincipal(name, role)
        return found


def require_role(role: str) -> Callable[[Request], AdminPrincipal]:
    """FastAPI dependency: 401 without a valid admin key, 403 if the key's role is too low."""
    if role not in ROLES:
        raise ValueError(role)

    def dep(request: Request) -> AdminPrincipal:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        keyring: AdminKeyring | None = getattr(request.app.state, "admin_keyring", None)
        who = keyring.lookup(token.strip()) if keyring and scheme.lower() == "bearer" and token else None
        if who is None:
            raise HTTPException(401, "a valid admin key is required", headers={"WWW-Authenticate": "Bearer"})
        if not who.allows(role):
            raise HTTPException(403, f"role {who.role!r} may not do this (needs {role!r})")
        return who

    return dep
