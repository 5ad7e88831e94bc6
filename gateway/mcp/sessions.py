"""Legacy (2025-11-25) MCP sessions, kept in Redis so any gateway replica serves any request.

- A session id is 32 random bytes (urlsafe base64) and its keys carry the principal's
  hash tag, so an id presented by another principal is simply not found; one that does not
  have that form is not found without a Redis call.
- Idle sessions expire after ``gateway.session_idle_ttl_s``; each principal holds at most
  ``gateway.max_sessions_per_principal`` (beyond it :class:`SessionLimit` -> HTTP 503).
- Hot path: a replica caches sessions it has seen and re-checks Redis (refreshing the
  idle TTL in the same round trip) at most every ``recheck_s``. DELETE, expiry detected
  on a re-check, and log-level changes are broadcast on the control channel so every
  replica drops its copy within milliseconds.
- Events of a session's standalone SSE stream go to a capped Redis Stream (the entry id
  is the SSE event id, so ``Last-Event-ID`` replay works on any replica).
- A server->client request's answer is RPUSHed by whichever replica receives it and
  BLPOPed by the replica that waits for it.
- A session holds at most the caller's ``limits…subscriptions_per_session`` resource
  subscriptions, checked and written by one script.
"""

from __future__ import annotations

import base64
import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson
import redis.asyncio as aioredis

from gateway.mcp.types import ClientReply, ServerMessage, encode
from shared import keys
from shared.config import GatewayConfig
from shared.metrics import MCP_SESSIONS_OPEN

_CACHE_MAX = 50_000
_replies = msgspec.json.Decoder(ClientReply)

_CREATE_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[2], 'v', ARGV[5], 'caps', ARGV[6], 'lvl', '', 'lists', ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""


# KEYS: the session's subscriptions, the URI's subscribers. ARGV: uri, session id, cap (0: none),
# ttl s. 0 when the session already holds ``cap`` other URIs; subscribing twice is one subscription.
_SUBSCRIBE_LUA = """
local cap = tonumber(ARGV[3])
local held = redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1
if cap > 0 and not held and redis.call('SCARD', KEYS[1]) >= cap then
  return 0
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[4])
if held then return 2 end
return 1
"""


SUBSCRIBED, ALREADY_SUBSCRIBED = 1, 2


class SessionNotFound(Exception):
    """Unknown, expired or deleted session (HTTP 404)."""


class SessionLimit(Exception):
    """The principal already holds the maximum number of sessions (HTTP 503)."""


@dataclass
class Session:
    id: str
    principal: str
    protocol_version: str
    capabilities: dict[str, Any] = field(default_factory=dict)
    log_level: str | None = None
    checked_at: float = 0.0


def new_session_id() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")  # what new_session_id makes: 32 bytes, unpadded base64url


def is_session_id(sid: str) -> bool:
    """Whether ``sid`` has the form of a session id. A client-chosen string is checked before it
    becomes part of a Redis key: ``<id>:events`` would otherwise name another session's event
    stream (WRONGTYPE, reported as an outage)."""
    return _SESSION_ID.fullmatch(sid) is not None


class SessionRegistry:
    """Create, look up, expire and delete legacy sessions; their event logs and pending requests."""

    def __init__(self, redis: aioredis.Redis, blocking: aioredis.Redis, cfg: GatewayConfig) -> None:
        self._redis = redis
        self._blocking = blocking  # no socket timeout: XREAD BLOCK / BLPOP
        self.ttl_s = cfg.session_idle_ttl_s
        self.cap = cfg.max_sessions_per_principal
        self.events_max = cfg.sse_event_log_max
        self.recheck_s = min(5.0, self.ttl_s / 4)
        self._cache: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._create = redis.register_script(_CREATE_LUA)
        self._subscribe = redis.register_script(_SUBSCRIBE_LUA)
        self.publish_control: Callable[[dict[str, Any]], Awaitable[None]] | None = None  # set by the Gateway

    # ------------------------------------------------------------------ lifecycle
    async def create(self, principal: str, protocol_version: str, capabilities: dict[str, Any],
                     lists: dict[str, int] | None = None) -> Session:
        """A new session; ``lists``: the list revisions it starts from (gateway/mcp/list_revisions.py)."""
        sid = new_session_id()
        ok = await self._create(keys=[keys.principal_sessions(principal), keys.session(principal, sid)],
                                args=[int(time.time()), self.ttl_s, self.cap, sid, protocol_version,
                                      orjson.dumps(capabilities), orjson.dumps(lists or {})])
        if not ok:
            raise SessionLimit(principal)
        s = Session(sid, principal, protocol_version, capabilities, None, time.monotonic())
        self._remember(s)
        return s

    async def get(self, principal: str, sid: str) -> Session:
        if not is_session_id(sid):
            raise SessionNotFound(sid[:64])
        s = self._cache.get((principal, sid))
        now = time.monotonic()
        if s is not None:
            if now - s.checked_at < self.recheck_s:
                return s
            # This request re-checks; concurrent ones keep using the cached copy meanwhile
            # instead of all opening round trips (and pool connections) at once.
            claimed, s.checked_at = s.checked_at, now
        pipe = self._redis.pipeline(transaction=False)
        pipe.expire(keys.session(principal, sid), self.ttl_s)
        pipe.hgetall(keys.session(principal, sid))
        pipe.expire(keys.session_events(principal, sid), self.ttl_s)
        pipe.expire(keys.session_subscriptions(principal, sid), self.ttl_s)
        pipe.zadd(keys.principal_sessions(principal), {sid: int(time.time())}, xx=True)
        try:
            alive, fields, *_ = await pipe.execute()
        except BaseException:
            if s is not None:
                s.checked_at = claimed  # not re-checked after all: the next request tries again
            raise
        if not alive or not fields:
            if s is not None:
                self.forget(principal, sid)
                await self._broadcast_invalidate(principal, sid)
            raise SessionNotFound(sid)
        s = Session(sid, principal, fields.get(b"v", b"").decode(), orjson.loads(fields.get(b"caps", b"{}")),
                    fields.get(b"lvl", b"").decode() or None, now)
        self._remember(s)
        return s

    async def delete(self, principal: str, sid: str) -> bool:
        if not is_session_id(sid):
            return False
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(keys.session(principal, sid))
        pipe.smembers(keys.session_subscriptions(principal, sid))
        pipe.delete(keys.session_events(principal, sid), keys.session_subscriptions(principal, sid),
                    keys.session_pending(principal, sid))
        pipe.zrem(keys.principal_sessions(principal), sid)
        existed, uris, *_ = await pipe.execute()
        if uris:
            pipe = self._redis.pipeline(transaction=False)
            for uri in uris:
                pipe.srem(keys.resource_subscribers(principal, uri.decode()), sid)
            await pipe.execute()
        self.forget(principal, sid)
        await self._broadcast_invalidate(principal, sid)
        return bool(existed)

    async def set_log_level(self, session: Session, level: str) -> None:
        await self._redis.hset(keys.session(session.principal, session.id), "lvl", level)
        session.log_level = level
        await self._broadcast_invalidate(session.principal, session.id)

    # ------------------------------------------------------------------ local cache
    def _remember(self, s: Session) -> None:
        key = (s.principal, s.id)
        self._cache[key] = s
        self._cache.move_to_end(key)
        while len(self._cache) > _CACHE_MAX:
            self._cache.popitem(last=False)
        MCP_SESSIONS_OPEN.set(len(self._cache))

    def forget(self, principal: str, sid: str) -> None:
        self._cache.pop((principal, sid), None)
        MCP_SESSIONS_OPEN.set(len(self._cache))

    def forget_all(self) -> None:
        """Drop every cached session (after the control channel was lost and may have missed news)."""
        self._cache.clear()
        MCP_SESSIONS_OPEN.set(0)

    async def _broadcast_invalidate(self, principal: str, sid: str) -> None:
        if self.publish_control is not None:
            await self.publish_control({"t": "inv", "p": principal, "s": sid})

    # ------------------------------------------------------------------ standalone stream events
    async def append_event(self, principal: str, sid: str, message: ServerMessage) -> str:
        """Log a message for the session's GET stream; returns its event id."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(keys.session_events(principal, sid), {"d": encode(message)},
                  maxlen=self.events_max, approximate=True)
        pipe.expire(keys.session_events(principal, sid), self.ttl_s)
        eid, _ = await pipe.execute()
        return eid.decode() if isinstance(eid, bytes) else str(eid)

    async def last_event_id(self, principal: str, sid: str) -> str:
        last: Any = await self._redis.xrevrange(keys.session_events(principal, sid), count=1)
        return last[0][0].decode() if last else "0-0"

    async def read_events(self, principal: str, sid: str, after: str, block_ms: int) -> list[tuple[str, bytes]]:
        """Events after ``after`` (exclusive), waiting up to ``block_ms`` for the first."""
        got: Any = await self._blocking.xread({keys.session_events(principal, sid): after}, count=100, block=block_ms)
        out: list[tuple[str, bytes]] = []
        for _stream, entries in got or []:
            for eid, fields in entries:
                out.append((eid.decode() if isinstance(eid, bytes) else eid, fields[b"d"]))
        return out

    # ------------------------------------------------------------------ server -> client requests
    async def add_pending(self, principal: str, sid: str, rid: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(keys.session_pending(principal, sid), rid, "1")
        pipe.expire(keys.session_pending(principal, sid), self.ttl_s)
        await pipe.execute()

    async def post_response(self, principal: str, sid: str, rid: str, reply: ClientReply) -> bool:
        """Deliver the client's answer to whichever replica waits for it; False if nobody asked."""
        if not await self._redis.hdel(keys.session_pending(principal, sid), rid):
            return False
        key = keys.session_response(principal, sid, rid)
        pipe = self._redis.pipeline(transaction=False)
        pipe.rpush(key, encode(reply))
        pipe.expire(key, 60)
        await pipe.execute()
        return True

    async def await_response(self, principal: str, sid: str, rid: str, timeout_s: float) -> ClientReply | None:
        key = keys.session_response(principal, sid, rid)
        try:
            got = await self._blocking.blpop([key], timeout=timeout_s)  # type: ignore[misc]
        finally:
            await self._redis.hdel(keys.session_pending(principal, sid), rid)
        return _replies.decode(got[1]) if got else None

    # ------------------------------------------------------------------ resource subscriptions
    async def subscribe(self, session: Session, uri: str, cap: int = 0) -> int:
        """Subscribe the session to ``uri``: SUBSCRIBED, ALREADY_SUBSCRIBED (its TTL renewed), or
        0 (nothing written) when it already holds ``cap`` other subscriptions (0: no cap)."""
        return int(await self._subscribe(
            keys=[keys.session_subscriptions(session.principal, session.id),
                  keys.resource_subscribers(session.principal, uri)],
            args=[uri, session.id, cap, self.ttl_s]))

    async def unsubscribe(self, session: Session, uri: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.srem(keys.session_subscriptions(session.principal, session.id), uri)
        pipe.srem(keys.resource_subscribers(session.principal, uri), session.id)
        await pipe.execute()

    async def subscribers(self, principal: str, uri: str) -> list[str]:
        members: Any = await self._redis.smembers(keys.resource_subscribers(principal, uri))
        return [m.decode() for m in members]
