"""Who is calling: bearer API keys (or OAuth access tokens) -> principal, single-use WebSocket
tickets for clients that cannot send headers, plus the transport guards that run before any
MCP parsing (Origin/Host against DNS rebinding).

Keys come from ``gateway.api_keys`` (``LEARNMESH_API_KEYS=alice:KEY1,bob:KEY2``) and
are kept only as SHA-256 digests. With no keys and a loopback bind the gateway is
open and every caller is the principal ``local``; ``gateway.server`` refuses a
non-loopback bind without keys. In OAuth resource-server mode an HS256 JWT issued by
the configured authorization server is accepted too; the principal is its
``principal_claim`` (never ``local``, the open gateway's, nor an API key's principal), and 401 answers carry
``WWW-Authenticate: Bearer resource_metadata=...`` pointing at the RFC 9728 document.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import re
import secrets
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from shared import keys
from shared.config import GatewayConfig

if TYPE_CHECKING:
    from gateway.auth_throttle import AuthThrottle

OPEN_PRINCIPAL = "local"
# ``admin:<key name>`` is how the audit log names admin keys (gateway/admin/auth.py): no token's
# principal may pass for one. (Configured API key principals have no ':' at all.)
_PRINCIPAL_OK = re.compile(r"^(?!admin:)[A-Za-z0-9_.@:\-]{1,128}$")
PROTECTED_RESOURCE_PATH = "/.well-known/oauth-protected-resource"


def is_principal(name: object) -> bool:
    """Whether ``name`` may be a principal: what an API key's or a token's principal can be."""
    return (isinstance(name, str) and _PRINCIPAL_OK.fullmatch(name) is not None
            and not name.startswith(keys.RESERVED_PRINCIPAL_PREFIX))


# A key this long with this many different characters is taken for random (secrets.token_urlsafe(24)
# or token_hex(16), 128 bits and more), which no guessing at any speed finds. Nothing tells a random
# key from a chosen phrase of the same form: docs/gateway.md asks for random keys.
UNGUESSABLE_KEY_CHARS = 32
UNGUESSABLE_KEY_DISTINCT = 10


def is_unguessable(key: str) -> bool:
    """Whether an API key is long and varied enough to be taken for random (served from an
    address the failed-attempt throttle refuses, gateway/auth_throttle.py)."""
    return len(key) >= UNGUESSABLE_KEY_CHARS and len(set(key)) >= UNGUESSABLE_KEY_DISTINCT


class AuthError(Exception):
    """A request refused before it is served: 401 (no valid credential), 400 (an ambiguous one),
    429 (too many failed attempts, gateway/auth_throttle.py)."""

    def __init__(self, status: int, message: str, www_authenticate: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.www_authenticate = www_authenticate
        self.retry_after_s = retry_after_s

    @property
    def error(self) -> str:
        """The answer body's ``error`` (RFC 6750 names, and ours for the throttle)."""
        return {401: "unauthorized", 429: "limit_exceeded"}.get(self.status, "invalid_request")

    def headers(self) -> dict[str, str]:
        out = {"www-authenticate": self.www_authenticate} if self.www_authenticate else {}
        if self.retry_after_s is not None:
            out["retry-after"] = str(self.retry_after_s)
        return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) names this machine's
    loopback interface. Decided by parsing the address, never by its text: ``127.0.0.2`` and
    ``[::1]`` are loopback, ``127.0.0.1.rebind.attacker.example`` is a DNS name an attacker controls."""
    host = host.lower()
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8000`` -> ``[::1]``, ``a:80`` -> ``a``."""
    if host_header.startswith("["):
        return host_header.split("]", 1)[0] + "]"
    return host_header.rsplit(":", 1)[0]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, else None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Authenticator:
    """Maps an ``Authorization`` header to a principal, or raises :class:`AuthError` (401)."""

    def __init__(self, cfg: GatewayConfig, throttle: AuthThrottle) -> None:
        self._by_digest = {hashlib.sha256(k.encode()).digest(): p for p, k in cfg.api_keys.items()}
        self._unguessable_keys = {d: p for d, p in self._by_digest.items() if is_unguessable(cfg.api_keys[p])}
        self._key_principals = frozenset(cfg.api_keys)
        self._oauth = cfg.oauth if cfg.oauth.enabled else None
        self.open = not self._by_digest and self._oauth is None
        self.throttle = throttle
        self.challenge = "Bearer"
        if self._oauth is not None:
            base = self._oauth.resource.rstrip("/")
            self.challenge = f'Bearer resource_metadata="{_origin_of(base)}{PROTECTED_RESOURCE_PATH}"'

    async def authenticate(self, authorization: str | None, scope: MutableMapping[str, Any]) -> str:
        """:meth:`principal`, for a request whose ASGI ``scope`` says where it comes from: failed
        attempts are counted, and refused (429) past their counts (gateway/auth_throttle.py)."""
        token = None if self.open else bearer_token(authorization)
        if token is None:  # nothing presented: not an attempt
            return self.principal(authorization)
        try:
            self.throttle.check(scope, token)
        except AuthError:
            who = self._unguessable(token)
            if who is None:
                raise
            return who
        try:
            return self.principal(authorization)
        except AuthError as exc:
            raise await self.throttle.failed(scope, token) or exc from None

    def _unguessable(self, token: str) -> str | None:
        """The principal of ``token`` if it is a credential no one can guess: a random API key
        (:func:`is_unguessable`) or a token the authorization server signed; else None, whether
        ``token`` is valid or not. Served even from a refused address (clients behind one NAT
        share it with whoever guessed there): a guesser who sees one pass learns nothing it
        could have found by guessing, and one that could be guessed answers 429 as a wrong
        guess does, after the same work."""
        who = self._unguessable_keys.get(hashlib.sha256(token.encode()).digest())
        if who is None and self._oauth is not None:
            who = self._from_jwt(token)
        return who

    def principal(self, authorization: str | None) -> str:
        if self.open:
            return OPEN_PRINCIPAL
        if not authorization:
            raise AuthError(401, "authentication required", self.challenge)
        token = bearer_token(authorization)
        if token is None:
            raise AuthError(401, "a bearer token is required", self.challenge)
        who = self._by_digest.get(hashlib.sha256(token.encode()).digest())
        if who is None and self._oauth is not None:
            who = self._from_jwt(token)
        if who is None:
            raise AuthError(401, "invalid credentials", self.challenge + ', error="invalid_token"')
        return who

    def expires_at(self, authorization: str | None) -> float | None:
        """When the credential of an authenticated ``authorization`` stops being valid (epoch
        seconds, the leeway included): a token's ``exp``; None for an API key, which lasts. For
        what checks a credential once and then lives on: a WebSocket connection, a ticket."""
        token = bearer_token(authorization)
        if token is None or self._oauth is None or hashlib.sha256(token.encode()).digest() in self._by_digest:
            return None
        import jwt

        exp = jwt.decode(token, options={"verify_signature": False}).get("exp")  # verified by principal()
        return float(exp) + self._oauth.leeway_s if isinstance(exp, (int, float)) else None

    def _from_jwt(self, token: str) -> str | None:
        import jwt  # PyJWT; only needed in OAuth mode

        if self._oauth is None:  # OAuth not configured: no token is a JWT of ours
            return None
        try:
            claims = jwt.decode(token, self._oauth.hs256_secret, algorithms=["HS256"],
                                audience=self._oauth.audience or self._oauth.resource,
                                issuer=self._oauth.issuer, leeway=self._oauth.leeway_s,
                                options={"require": ["exp", "iss", "aud"]})
        except jwt.PyJWTError:
            return None
        who = claims.get(self._oauth.principal_claim)
        # ``local`` is the open gateway's principal, a teacher by default (``learning.teachers``) and
        # the owner of what was stored while the gateway was open: a token may not claim it. Nor an
        # API key's principal: everything of a principal is scoped by its name alone, so a token
        # naming it would be the key's holder.
        if not is_principal(who) or who == OPEN_PRINCIPAL or who in self._key_principals:
            return None
        return who

    def protected_resource_metadata(self) -> dict | None:
        """RFC 9728 document, or None when OAuth mode is off."""
        if self._oauth is None:
            return None
        return {"resource": self._oauth.resource,
                "authorization_servers": list(self._oauth.authorization_servers),
                "bearer_methods_supported": ["header"]}


class WsTickets:
    """Single-use WebSocket tickets: ``POST /mcp/ws-ticket`` (authenticated as any request) issues
    one, a client that cannot set headers presents it as ``/mcp/ws?ticket=...``.

    A ticket is ``<principal, base64url>.<32 random bytes, base64url>``; Redis holds only the
    SHA-256 of the random part, under the principal's hash tag, for ``ttl_s`` seconds, with
    when the credential it was issued for expires. Redeeming deletes the key: one handshake per
    ticket, on any replica."""

    def __init__(self, redis: aioredis.Redis, ttl_s: int) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self._take = redis.register_script(_TAKE_LUA)

    async def issue(self, principal: str, expires_at: float | None = None) -> str:
        """A ticket for ``principal``, whose connection ends at ``expires_at`` (None: never)."""
        secret = secrets.token_urlsafe(32)
        await self._redis.set(keys.ws_ticket(principal, _digest(secret)), repr(expires_at or 0.0), ex=self.ttl_s)
        return base64.urlsafe_b64encode(principal.encode()).rstrip(b"=").decode() + "." + secret

    async def redeem(self, ticket: str) -> tuple[str, float | None] | None:
        """The ticket's principal and when its credential expires, once; None for a ticket that is
        malformed, expired or used."""
        who, _, secret = ticket.partition(".")
        if not _TICKET_SECRET.fullmatch(secret) or not 0 < len(who) <= 512:
            return None
        try:
            principal = base64.urlsafe_b64decode(who + "=" * (-len(who) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        if not principal or "{" in principal or "}" in principal:
            return None
        held = await self._take(keys=[keys.ws_ticket(principal, _digest(secret))])
        if held is None:
            return None
        try:
            expires_at = float(held)
        except ValueError:  # a ticket issued before tickets held an expiry
            expires_at = 0.0
        return principal, expires_at or None


_TAKE_LUA = """
-- KEYS[1]: a ticket. Its value, deleted (GETDEL, which Redis 6.0 lacks); nil when absent.
local held = redis.call('GET', KEYS[1])
if held then redis.call('DEL', KEYS[1]) end
return held
"""
_TICKET_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme else url


class OriginGuard:
    """DNS-rebinding protection: a browser ``Origin`` must be loopback or listed in
    ``gateway.allowed_origins``; when bound to loopback, ``Host`` must name loopback too."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self._allowed = {o.rstrip("/").lower() for o in cfg.allowed_origins}
        self._check_host = is_loopback(cfg.host)
        self._allowed_hosts = {urlsplit(o).hostname for o in self._allowed if urlsplit(o).hostname}
        self._verdicts: dict[tuple[str | None, str | None], str | None] = {}  # hot path: a handful of pairs

    def check(self, origin: str | None, host: str | None) -> str | None:
        """Return None when acceptable, else a reason (the caller answers 403)."""
        key = (origin, host)
        try:
            return self._verdicts[key]
        except KeyError:
            pass
        verdict = self._check(origin, host)
        if len(self._verdicts) >= 1024:  # headers are client-chosen: keep the memo bounded
            self._verdicts.clear()
        self._verdicts[key] = verdict
        return verdict

    def _check(self, origin: str | None, host: str | None) -> str | None:
        if origin is not None and origin != "null":
            o = origin.rstrip("/").lower()
            if o not in self._allowed and not is_loopback(urlsplit(o).hostname or ""):
                return "origin not allowed"
        elif origin == "null":
            return "origin not allowed"
        if self._check_host and host:
            name = _host_name(host).lower()
            if not is_loopback(name) and name.strip("[]") not in self._allowed_hosts:
                return "host not allowed"
        return None
