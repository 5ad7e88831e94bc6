"""Failed authentication attempts, throttled per client address and per presented credential.

Someone guessing API keys or admin keys gets ``gateway.auth_throttle.failures_per_source``
tries per ``window_s`` from one address (an IPv6 one: from its /64, which a subscriber
usually holds whole). The try that reaches the count and every request from that address
after it are answered 429 with the Retry-After of the window's end, unchecked and uncounted:
a valid credential too when it could be guessed (a guess that hit would show). Credentials no
one can guess — a random API or admin key, a WebSocket ticket, a token the authorization server
signed — are served from a refused address all the same (``Authenticator``, gateway/auth.py;
``AdminKeyring.lookup_unguessable``; the ticket redemption in gateway/transports/websocket.py):
clients behind one NAT or proxy share an address, and one guesser among them must not lock the
others out. One credential that keeps failing (a revoked key still in a fleet of clients, a replayed token) is refused likewise from every address past
``failures_per_credential``; a credential that is valid never fails, so no one can lock
another caller out through it. A request that presents no credential (no ``Authorization``,
another scheme) is not an attempt: clients discover the OAuth challenge that way.

Failures are counted in Redis, one key with a TTL per address or credential
(``keys.auth_failures``), so every replica adds to the same counts. A replica learns that a
count is full from the answer to one of its own failures, and from then on refuses by itself
until the window ends, without a round trip; while it refuses nothing, a request that passes
costs one test of an empty table. Over N replicas an address so gets at most N - 1 failures
more than its count. While Redis cannot be reached each replica counts failures in its own
memory, with the same counts and window, so an outage (or an attacker who can slow Redis down)
never lifts the throttle: an address then gets up to N times its count over N replicas.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, RedisError

from gateway.auth import AuthError
from shared import keys, metrics
from shared.config import AuthThrottleConfig
from shared.log_throttle import ThrottledWarning

log = logging.getLogger(__name__)
Scope = Mapping[str, Any]  # an ASGI scope: where the request came from, its headers

FAILURE_LUA = """
-- KEYS[1]: a failure count. ARGV[1]: the window in ms, from the first failure.
-- Returns {failures in the window, ms until it ends}.
local n = redis.call('INCR', KEYS[1])
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {n, ttl}
"""

_REFUSED_MAX = 65536  # addresses and credentials a replica refuses at once; the oldest go first
TOO_MANY = "too many failed authentication attempts; retry later"


class AuthThrottle:
    """One replica's side of the throttle (``Gateway.auth.throttle``)."""

    def __init__(self, redis: aioredis.Redis, cfg: AuthThrottleConfig) -> None:
        self._cfg = cfg
        self._window_ms = cfg.window_s * 1000
        self._trusted = [ipaddress.ip_network(n, strict=False) for n in cfg.trusted_proxies]
        self._refused: dict[str, float] = {}  # keys.auth_failures name -> time.monotonic() it ends
        self._local: dict[str, tuple[int, float]] = {}  # the same, counted here while Redis does not answer
        self._count = redis.register_script(FAILURE_LUA)
        self._unreachable = ThrottledWarning(log)

    def check(self, scope: Scope, credential: str) -> None:
        """Raise the 429 :class:`AuthError` while the caller's address or ``credential`` is refused."""
        if not self._refused:
            return
        for key in (self._source_key(scope), _credential_key(credential)):
            until = self._refused.get(key)
            if until is None:
                continue
            left_s = until - time.monotonic()
            if left_s > 0:
                raise _too_many(left_s)
            del self._refused[key]

    async def failed(self, scope: Scope, credential: str) -> AuthError | None:
        """Count a failed attempt with ``credential``; the 429 to answer instead of 401 once the
        attempt fills a count, else None."""
        source = self.source(scope)
        worst_s = 0.0
        unreachable = False
        for key, limit, who in ((keys.auth_failures("source", source), self._cfg.failures_per_source, source),
                                (_credential_key(credential), self._cfg.failures_per_credential, "one credential")):
            if not limit:
                continue
            if not unreachable:
                try:
                    failures, ttl_ms = await self._count(keys=[key], args=[self._window_ms])
                except (RedisError, RedisClusterException, OSError):
                    unreachable = True
                    self._unreachable.warning("redis unreachable: failed authentication attempts counted by this "
                                              "replica alone (each replica allows the counts)")
            if unreachable:
                failures, ttl_ms = self._count_here(key)
            if failures >= limit:
                self._refuse(key, ttl_ms / 1000, who)
                worst_s = max(worst_s, ttl_ms / 1000)
        return _too_many(worst_s) if worst_s else None

    def _count_here(self, key: str) -> tuple[int, float]:
        """Count a failure in this replica's memory (Redis does not answer): {failures in the
        window, ms until it ends}, as :data:`FAILURE_LUA` would answer."""
        now = time.monotonic()
        failures, ends = self._local.get(key, (0, 0.0))
        if ends <= now:
            failures, ends = 0, now + self._cfg.window_s
            if key not in self._local and len(self._local) >= _REFUSED_MAX:
                for stale in [k for k, (_, end) in self._local.items() if end <= now] or [next(iter(self._local))]:
                    del self._local[stale]
        self._local[key] = (failures + 1, ends)
        return failures + 1, (ends - now) * 1000

    def _refuse(self, key: str, for_s: float, who: str) -> None:
        if key not in self._refused:
            metrics.LIMIT_EXCEEDED.labels("auth_failures").inc()
            log.warning("refusing %s for %.0f s: too many failed authentication attempts", who, for_s)
        if len(self._refused) >= _REFUSED_MAX:
            now = time.monotonic()
            for stale in [k for k, until in self._refused.items() if until <= now] or [next(iter(self._refused))]:
                del self._refused[stale]
        self._refused[key] = time.monotonic() + for_s

    def _source_key(self, scope: Scope) -> str:
        return keys.auth_failures("source", self.source(scope))

    def source(self, scope: Scope) -> str:
        """Who sent the request, as the throttle counts it: the peer's address, or with
        ``trusted_proxies`` the nearest address in ``X-Forwarded-For`` that is not one of them
        (what a trusted proxy appended; what the client wrote further left is never believed);
        an IPv6 address as its /64."""
        client = scope.get("client")
        addr = _address(client[0]) if client else None
        if addr is not None and self._trusted and self._is_trusted(addr):
            for hop in reversed(_forwarded_for(scope["headers"])):
                hop_addr = _address(hop)
                if hop_addr is None:
                    break
                addr = hop_addr
                if not self._is_trusted(addr):
                    break
        if addr is None:
            return "unknown"
        if addr.version == 6:
            return str(ipaddress.ip_network(f"{addr}/64", strict=False))
        return str(addr)

    def _is_trusted(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(addr in net for net in self._trusted)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _forwarded_for(headers: Iterable[tuple[bytes, bytes]]) -> list[str]:
    hops: list[str] = []
    for name, value in headers:
        if name == b"x-forwarded-for":
            hops += value.decode("latin-1").split(",")
    return hops


def _credential_key(credential: str) -> str:
    return keys.auth_failures("credential", hashlib.sha256(credential.encode()).hexdigest())


def _too_many(retry_after_s: float) -> AuthError:
    return AuthError(429, TOO_MANY, retry_after_s=max(1, math.ceil(retry_after_s)))
